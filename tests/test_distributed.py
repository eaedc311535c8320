"""Two CPU processes (torchrun, gloo): same maths as one process, exact eval, OOM agreement."""
import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import REPO


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes; 48 train images and 99 validation images (not a multiple of 2 processes)."""
    root = tmp_path_factory.mktemp("imgs")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 16), ("val", 33)):
        for c in range(3):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(n):
                base = torch.zeros(3, 24, 24)
                base[c] = 0.6
                x = ((base + 0.4 * torch.rand(3, 24, 24, generator=g)) * 255).byte()
                Image.fromarray(x.permute(1, 2, 0).numpy()).save(d / f"{i}.png")
    return root


def _run(folder, out, name, nproc, *extra, timeout=300):
    args = [str(REPO / "train.py"), "--data", str(folder), "--model", "test_resnet", "--image-size", "24",
            "--global-batch", "16", "--epochs", "1", "--output", str(out), "--run-name", name,
            "--set", "data.num_workers=0", "--set", "model.bn=freeze", "--set", "data.crop_pct=1.0",
            "--set", "train.log_every_steps=1", *extra]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
           if nproc > 1 else [sys.executable]) + args
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / name


def _final(run_dir):
    (ckpt,) = sorted((run_dir / "checkpoints").glob("step-*"))[-1:]
    return load_file(ckpt / "model.safetensors")


def _close(a, b, tol=1e-6):
    return max((a[k] - b[k]).abs().max().item() for k in a) <= tol


def test_two_processes_equal_one_process_and_accumulation(folder, tmp_path):
    one = _run(folder, tmp_path, "one", 1)
    two = _run(folder, tmp_path, "two", 2)
    acc = _run(folder, tmp_path, "acc", 1, "--micro-batch", "8")
    s_one, s_two, s_acc = (json.loads((d / "summary.json").read_text()) for d in (one, two, acc))
    assert (s_two["num_processes"], s_two["micro_batch"], s_two["grad_accum_steps"]) == (2, 8, 1)
    assert (s_acc["micro_batch"], s_acc["grad_accum_steps"]) == (8, 2)
    w1, w2, w3 = _final(one), _final(two), _final(acc)
    assert _close(w1, w2) and _close(w1, w3)
    # Evaluation counts exactly the 99 validation images on 2 processes (no padding duplicates).
    evals = [json.loads(l) for l in (two / "metrics.jsonl").read_text().splitlines()]
    assert [e["val_samples"] for e in evals if e["kind"] == "eval"] == [99]
    assert s_two["final_accuracy"] == pytest.approx(s_one["final_accuracy"], abs=1 / 99 + 1e-9)


def test_oom_on_one_rank_recovers_on_all(folder, tmp_path):
    """Only rank 1 'runs out of memory' above 4 samples: both ranks agree, split to 4, same weights."""
    ref = _run(folder, tmp_path, "ref", 2, "--micro-batch", "4")
    got = _run(folder, tmp_path, "oom", 2, "--set", "debug.simulate_oom_above=4", "--set", "debug.fault_rank=1")
    s = json.loads((got / "summary.json").read_text())
    assert s["micro_batch"] == 4 and s["oom_retries"] == 1
    assert _close(_final(ref), _final(got))


def test_gradient_sums_start_in_the_last_micro_batch_without_ddp(tmp_path):
    """4 micro-batches per process per step: the model is not wrapped in DDP (the step's own
    reducer sums the gradients, once, after the last micro-batch's backward has produced them),
    every gradient is summed exactly once per step, in buffers allocated once, and the result
    equals one process on the whole batch."""
    res = _probe(tmp_path)[0]
    assert res["wrapped"] == "ResNet"
    assert {i for i, _ in res["grad_reduces"]} == {4}
    assert sum(n for _, n in res["grad_reduces"]) == 3 * res["n_params"]
    assert res["buffers_reused"]
    _assert_equals_one_process(res["weights"])


def test_oom_in_the_middle_of_backward_on_one_rank(tmp_path):
    """Process 1 fails inside a backward while its first gradient buckets are already in flight
    (process 0's are all launched): neither is left waiting, both retry at micro-batch 2, and the
    weights equal one process's."""
    r0, r1 = _probe(tmp_path, "oom-in-backward")
    for r in (r0, r1):
        assert (r["oom_retries"], r["micro_batch"]) == (1, 2)
    # Process 1 had launched some of its buckets when the error struck; it launched the rest, and
    # then the retry's: more gradient sums than one per parameter per step.
    assert len(r1["launched_before_error"]) == 1 and r1["launched_before_error"][0] > 0
    assert sum(n for _, n in r1["grad_reduces"]) == 4 * r1["n_params"]
    assert r0["weights"] == r1["weights"]
    _assert_equals_one_process(r0["weights"])


def test_second_oom_inside_the_recovery_does_not_hang(folder, tmp_path):
    """Process 1 runs out of memory in a forward and once more while the failed step's gradient
    sums go out: nobody waits in a collective, both retry, and the run ends (well within 60 s)."""
    ref = _run(folder, tmp_path, "ref", 2, "--micro-batch", "4")
    got = _run(folder, tmp_path, "twice", 2, "--set", "debug.simulate_oom_above=4", "--set", "debug.fault_rank=1",
               "--set", "debug.simulate_oom_in_recovery=true", timeout=60)
    s = json.loads((got / "summary.json").read_text())
    assert s["micro_batch"] == 4 and s["oom_retries"] == 1
    assert _close(_final(ref), _final(got))


def _probe(tmp_path, *mode):
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests" / "_step_probe.py"), str(out), *mode], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"probe.json.{rank}").read_text()) for rank in (0, 1)]


def _assert_equals_one_process(weights):
    """The probe's three steps on one process over the whole 16-sample batch."""
    from accelerate import Accelerator

    from vramfit.config import ModelConfig, OptimConfig
    from vramfit.engine import TrainStep
    from vramfit.models import create_model
    from vramfit.optim import create_optimizer

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet", bn="freeze"), num_classes=5, load_weights=False)
    opt = create_optimizer(model, OptimConfig(lr=1e-3))
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    step = TrainStep(acc, model, opt, 16, label_smoothing=0.0, clip_grad_norm=None)
    for _ in range(3):
        x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 5, (16,), generator=g)
        step(x, y, 16)
    single = {k: v.sum().item() for k, v in model.state_dict().items()}
    assert single.keys() == weights.keys()
    for k in single:
        assert single[k] == pytest.approx(weights[k], abs=1e-4), k


@pytest.fixture(scope="module")
def folder_with_bad_files(folder, tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("bad") / "imgs"
    shutil.copytree(folder, root)
    (root / "train" / "class0" / "zero.png").write_bytes(b"")
    (root / "train" / "class2" / "noise.png").write_bytes(os.urandom(2000))
    return root  # 50 train images, 2 unreadable


def test_bad_files_are_counted_across_processes(folder_with_bad_files, tmp_path):
    run = _run(folder_with_bad_files, tmp_path, "bad2", 2, "--set", "data.max_bad_fraction=0.1")
    s = json.loads((run / "summary.json").read_text())
    assert s["skipped_samples"] == 2
    assert sorted(f.split(":")[0].rsplit("/", 1)[-1] for f in s["unreadable_files"]) == ["noise.png", "zero.png"]
    (ev,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert ev["skipped_samples"] == 2


def test_too_many_bad_files_stop_every_process_together(folder_with_bad_files, tmp_path):
    args = [str(REPO / "train.py"), "--data", str(folder_with_bad_files), "--model", "test_resnet",
            "--image-size", "24", "--global-batch", "16", "--epochs", "1", "--output", str(tmp_path),
            "--set", "data.num_workers=0"]  # default data.max_bad_fraction 1%: 2 of 50 is too many
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)  # a rank left waiting in a collective would hang here
    assert proc.returncode != 0
    # Both ranks reach the same verdict at the same step (torchrun adds its own failure report).
    assert proc.returncode != 0 and proc.stderr.count("2 unreadable images out of 50") == 1  # one message
    assert "zero.png" in proc.stderr and "noise.png" in proc.stderr and "scan-data" in proc.stderr
