"""Top-1 / top-5 accuracy as `evaluate.Metric` subclasses shipped in the package.

`evaluate.load("accuracy")` fetches a script from the Hub, which fails offline and on locked-down
clusters; subclassing keeps evaluate's batching/compute interface without any download.
"""

from __future__ import annotations

import datasets
import evaluate
import torch


class TopKAccuracy(evaluate.Metric):
    """Fraction of samples whose reference is among the top-k predicted classes."""

    def __init__(self, k: int = 1, **kwargs):
        self.k = k
        super().__init__(keep_in_memory=True, **kwargs)

    def _info(self):
        return evaluate.MetricInfo(
            description="top-k accuracy over class scores",
            citation="",
            inputs_description="predictions: top-k class indices per sample; references: class index",
            features=datasets.Features({
                "predictions": datasets.Sequence(datasets.Value("int64")),
                "references": datasets.Value("int64"),
            }),
        )

    def _compute(self, predictions, references):
        if not references:
            return {f"top{self.k}": float("nan")}
        hits = sum(int(r in p[: self.k]) for p, r in zip(predictions, references))
        return {f"top{self.k}": hits / len(references)}


class ClassificationMetrics:
    """Accumulates logits' top-k predictions; `compute()` returns accuracy (top1), top5 and count."""

    def __init__(self, num_classes: int):
        self.ks = (1, min(5, num_classes))
        self.metrics = {k: TopKAccuracy(k=k) for k in set(self.ks)}
        self.count = 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        top = logits.topk(max(self.ks), dim=1).indices.cpu().tolist()
        refs = labels.cpu().tolist()
        for m in self.metrics.values():
            m.add_batch(predictions=top, references=refs)
        self.count += len(refs)

    def compute(self) -> dict:
        out = {}
        for k, m in self.metrics.items():
            out.update(m.compute())
        res = {"accuracy": out["top1"], "top5": out[f"top{self.ks[1]}"], "samples": self.count}
        self.count = 0
        return res
