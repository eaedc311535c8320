"""`train.compile`: the model is compiled in place after the micro-batch is settled, and trains to
the same losses as without."""

import json
from types import SimpleNamespace

import pytest
import timm

from helpers import tiny_args
from vramfit.config import build_config
from vramfit.train.build import compile_model


def test_compile_is_opt_in_and_in_place():
    model = timm.create_model("test_resnet", num_classes=10)
    names = list(model.state_dict())
    off = SimpleNamespace(notes=[])
    assert compile_model(build_config(), off, model) is model and off.notes == []
    assert getattr(model, "_compiled_call_impl", None) is None
    on = SimpleNamespace(notes=[])
    assert compile_model(build_config(sets=["train.compile=true"]), on, model) is model
    # In place: same module, same state-dict names (checkpoints and resume do not change).
    assert model._compiled_call_impl is not None and list(model.state_dict()) == names
    assert any("torch.compile: on" in n for n in on.notes)


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r.get("train/loss", r.get("val/loss")), r.get("train/accuracy", r.get("val/accuracy")))
            for r in rows]


@pytest.mark.slow  # compiling test_resnet with inductor takes ~40 s on 2 CPU cores
def test_compiled_run_has_the_same_losses(train_cli):
    args = tiny_args("--set", "data.limit_train_samples=64", "--set", "data.limit_val_samples=32",
                     "--set", "train.log_every_steps=1")
    eager, code = train_cli(*args, run_name="eager")
    assert code == 0
    compiled, code = train_cli(*args, "--set", "train.compile=true", run_name="compiled")
    assert code == 0
    a, b = losses(eager), losses(compiled)
    assert [k for k, *_ in a] == [k for k, *_ in b] == ["train"] * 4 + ["eval"]
    for (_, loss_a, acc_a), (_, loss_b, acc_b) in zip(a, b):
        assert loss_b == pytest.approx(loss_a, rel=1e-4, abs=1e-6)
        assert acc_b == pytest.approx(acc_a, abs=1e-6)
