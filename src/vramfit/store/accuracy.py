"""Top-1 / top-5 accuracy as `evaluate.Metric` subclasses shipped in the package, and the per-class
view of an evaluation (confusion matrix, per-class accuracy).

`evaluate.load("accuracy")` fetches a script from the Hub, which fails offline and on locked-down
clusters; subclassing keeps evaluate's batching/compute interface without any download.
"""

from __future__ import annotations

import datasets
import evaluate
import numpy as np
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


def confusion_matrix(predictions, labels, num_classes: int) -> np.ndarray:
    """`[true, predicted]` counts (int64, num_classes x num_classes); classes absent from both
    still get their row and column, so matrices of different splits line up."""
    from sklearn.metrics import confusion_matrix as sk_confusion_matrix

    return sk_confusion_matrix(np.asarray(labels), np.asarray(predictions), labels=list(range(num_classes)))


def per_class_accuracy(matrix: np.ndarray) -> list[float | None]:
    """Recall of each class (correct / samples of that class); None for a class without samples."""
    counts = matrix.sum(axis=1)
    return [float(matrix[i, i] / n) if n else None for i, n in enumerate(counts)]


def classification_report(logits: torch.Tensor, labels: torch.Tensor, class_names: list[str]) -> dict:
    """Top-1 / top-5, per-class accuracy and the confusion matrix of one evaluation pass.

    `logits` are [N, C] scores (any real values; only their order matters), `labels` [N] class
    indices into `class_names`."""
    num_classes = len(class_names)
    if logits.dim() != 2 or logits.shape[1] != num_classes or len(labels) != len(logits):
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not fit "
                         f"{num_classes} classes")
    topk = ClassificationMetrics(num_classes)
    topk.add(logits, labels)
    scores = topk.compute()
    preds = logits.argmax(dim=1).cpu().numpy()
    matrix = confusion_matrix(preds, labels.cpu().numpy(), num_classes)
    acc = per_class_accuracy(matrix)
    per_class = [{"class": name, "accuracy": a, "samples": int(n)}
                 for name, a, n in zip(class_names, acc, matrix.sum(axis=1))]
    present = [a for a in acc if a is not None]
    return {"top1": scores["accuracy"], "top5": scores["top5"], "samples": scores["samples"],
            "mean_class_accuracy": float(np.mean(present)) if present else float("nan"),
            "per_class": per_class, "class_names": list(class_names),
            "confusion_matrix": matrix.tolist()}


def misclassified(logits: torch.Tensor, labels: torch.Tensor, most: int) -> list[dict]:
    """The `most` most confident mistakes (highest probability given to a wrong class) first: the
    ones worth looking at (mislabelled images, confusable classes). Each: row, label, predicted,
    probability."""
    probs = logits.float().softmax(dim=1)
    conf, pred = probs.max(dim=1)
    wrong = (pred != labels).nonzero().flatten()
    order = wrong[conf[wrong].argsort(descending=True)][:most]
    return [{"row": int(i), "label": int(labels[i]), "predicted": int(pred[i]),
             "probability": float(conf[i])} for i in order]
