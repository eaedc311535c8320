"""Two CPU processes (torchrun, gloo): same maths as one process, exact eval, OOM agreement."""
import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import REPO


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


def _run(folder, out, name, nproc, *extra, timeout=300, expect=0):
    """A run on `nproc` processes under torchrun, or on one process in this one; 1 torch thread each.
    Colour jitter runs on the device as on a GPU: a sample's jitter must not depend on the process
    count either."""
    args = ["--data", str(folder), "--model", "test_resnet", "--image-size", "24",
            "--global-batch", "16", "--epochs", "1", "--output", str(out), "--run-name", name,
            "--set", "data.num_workers=0", "--set", "model.bn=freeze", "--set", "data.crop_pct=1.0",
            "--set", "train.log_every_steps=1", "--set", "data.color_jitter_on=device", *extra]
    if nproc == 1:
        return _run_here(args, expect, out / name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO / "train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if expect:  # torchrun exits 1 and names each worker's own exit code
        assert proc.returncode == 1 and f"exitcode  : {expect} " in proc.stderr, proc.stderr[-4000:]
        return proc
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / name


def _run_here(args, expect, run_dir):
    from vramfit.cli import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = run(["train", *args])
    except SystemExit as e:
        code = e.code
    finally:
        torch.set_num_threads(threads)
    assert code == expect
    return run_dir


def _final(run_dir):
    (ckpt,) = sorted((run_dir / "checkpoints").glob("step-*"))[-1:]
    return load_file(ckpt / "model.safetensors")


def _close(a, b, tol=1e-6):
    return max((a[k] - b[k]).abs().max().item() for k in a) <= tol


@pytest.fixture(scope="module")
def micro_4(folder, tmp_path_factory):
    """2 processes at micro-batch 4 (2 micro-batches each per step): compared with one process
    below, and what the out-of-memory runs must end as."""
    return _run(folder, tmp_path_factory.mktemp("ref"), "ref", 2, "--micro-batch", "4")


def test_two_processes_equal_one_process_and_accumulation(folder, tmp_path, micro_4):
    one = _run(folder, tmp_path, "one", 1)
    two = micro_4
    acc = _run(folder, tmp_path, "acc", 1, "--micro-batch", "8")
    s_one, s_two, s_acc = (json.loads((d / "summary.json").read_text()) for d in (one, two, acc))
    assert (s_two["num_processes"], s_two["micro_batch"], s_two["grad_accum_steps"]) == (2, 4, 2)
    assert (s_acc["micro_batch"], s_acc["grad_accum_steps"]) == (8, 2)
    w1, w2, w3 = _final(one), _final(two), _final(acc)
    assert _close(w1, w2) and _close(w1, w3)
    # Evaluation counts exactly the 99 validation images on 2 processes (no padding duplicates).
    evals = [json.loads(l) for l in (two / "metrics.jsonl").read_text().splitlines()]
    assert [e["val/samples"] for e in evals if e["kind"] == "eval"] == [99]
    assert s_two["final_accuracy"] == pytest.approx(s_one["final_accuracy"], abs=1 / 99 + 1e-9)


def test_oom_on_one_rank_recovers_on_all(folder, tmp_path, micro_4):
    """Only rank 1 'runs out of memory' above 4 samples: both ranks agree, split to 4, same weights."""
    ref = micro_4
    got = _run(folder, tmp_path, "oom", 2, "--set", "debug.simulate_oom_above=4", "--set", "debug.fault_rank=1")
    s = json.loads((got / "summary.json").read_text())
    assert s["micro_batch"] == 4 and s["oom_retries"] == 1
    assert _close(_final(ref), _final(got))


def test_fastest_fit_is_probed_and_agreed_on_by_every_process(folder, tmp_path, micro_4, monkeypatch):
    """Both processes probe the same candidates; rank 1 alone 'runs out of memory' above 4 samples,
    so the settings as written (the whole share of 8) fail on every process and a split wins."""
    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path / "cache"))
    got = _run(folder, tmp_path, "fit", 2, "--set", "train.fit=fastest", "--set", "train.fit_probe_fraction=1.0",
               "--set", "debug.simulate_oom_above=4", "--set", "debug.fault_rank=1")
    s = json.loads((got / "summary.json").read_text())
    fit = s["fit"]
    assert fit["candidates"][0]["outcome"] == "out of memory" and fit["chosen"]["micro_batch"] <= 4
    assert sum(c["outcome"] == "measured" for c in fit["candidates"]) >= 1
    assert s["micro_batch"] == fit["chosen"]["micro_batch"] and s["oom_retries"] == 0
    if fit["chosen"] == {"micro_batch": 4, "channels_last": False, "grad_checkpointing": False}:
        assert _close(_final(micro_4), _final(got))


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


def test_second_oom_inside_the_recovery_does_not_hang(folder, tmp_path, micro_4):
    """Process 1 runs out of memory in a forward and once more while the failed step's gradient
    sums go out: nobody waits in a collective, both retry, and the run ends (well within 60 s)."""
    ref = micro_4
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


def _one_process(batches):
    """What tests/_step_probe.py and tests/_fsdp_probe.py train (the same model, optimizer and
    batches), on one process, each batch whole: the losses and every weight's sum."""
    from accelerate import Accelerator

    from vramfit.config import ModelConfig, OptimConfig
    from vramfit.models.create import create_model
    from vramfit.train.optim import create_optimizer
    from vramfit.train.step import TrainStep

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet", bn="freeze"), num_classes=5, load_weights=False)
    opt = create_optimizer(model, OptimConfig(lr=1e-3))
    model, opt = acc.prepare(model, opt)
    step = TrainStep(acc, model, opt, 16, label_smoothing=0.0, clip_grad_norm=None)
    g = torch.Generator().manual_seed(1)
    losses = []
    for n in batches:
        x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 5, (n,), generator=g)
        losses.append(step(x, y, n).loss)
    return losses, {k: v.sum().item() for k, v in model.state_dict().items()}


def _assert_same_weights(single, weights):
    assert single.keys() == weights.keys()
    for k in single:
        assert single[k] == pytest.approx(weights[k], abs=1e-4), k


def _assert_equals_one_process(weights):
    """The step probe's three steps on one process over the whole 16-sample batch."""
    _assert_same_weights(_one_process([16, 16, 16])[1], weights)


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
    assert ev["epoch/skipped_samples"] == 2


def test_too_many_bad_files_stop_every_process_together(folder_with_bad_files, tmp_path):
    args = [str(REPO / "train.py"), "--data", str(folder_with_bad_files), "--model", "test_resnet",
            "--image-size", "24", "--global-batch", "16", "--epochs", "1", "--output", str(tmp_path),
            "--set", "data.num_workers=0"]  # default data.max_bad_fraction 1%: 2 of 50 is too many
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)  # a rank left waiting in a collective would hang here
    # Both ranks reach the same verdict at the same step (torchrun adds its own failure report).
    assert proc.returncode != 0 and proc.stderr.count("2 unreadable images out of 50") == 1  # one message
    assert "zero.png" in proc.stderr and "noise.png" in proc.stderr and "scan-data" in proc.stderr


def test_fsdp2_step_equals_one_process(tmp_path):
    """The FSDP path on 2 CPU processes (torch's fully_shard): gradient sync only on the last
    micro-batch, equal forward counts (a process with no sample joins with weightless forwards),
    the same losses and, gathered into a full state dict, the same weights as one process."""
    out = tmp_path / "fsdp.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests" / "_fsdp_probe.py"), str(out)], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["fsdp"] and res["syncs"] == [False, False, True] * 3 + [True]
    losses, single = _one_process([16, 16, 16, 3])
    assert res["losses"] == pytest.approx(losses, rel=1e-5)
    _assert_same_weights(single, res["weights"])


@pytest.mark.slow  # over 15 s; CI runs the slow selection as well
def test_ema_and_batchnorm_statistics_are_one_model_and_resume_exactly(folder, tmp_path):
    """Train-mode BatchNorm and an EMA on 2 processes: each process's statistics follow its own
    batches, so they are averaged (live and EMA alike) before every evaluation, and each process's
    own are kept in the checkpoint: a run interrupted mid-epoch and resumed ends bitwise equal to
    one that was not, in its weights, its EMA and its exported model."""
    args = ("--epochs", "2", "--set", "model.bn=train", "--set", "model.ema_decay=0.9")
    ref = _run(folder, tmp_path, "ref", 2, *args)
    _run(folder, tmp_path, "cut", 2, *args, "--set", "debug.signal_at_step=4", expect=143)
    cut = _run(folder, tmp_path, "cut", 2, *args)
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_file(sorted((d / "checkpoints").glob("step-*"))[-1] / name) for d in (ref, cut))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (load_file(d / "model" / "model.safetensors") for d in (ref, cut))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ema = load_file(sorted((ref / "checkpoints").glob("step-*"))[-1] / "ema.safetensors")
    assert any(k.endswith("running_mean") for k in ema) and all(torch.equal(ema[k], b[k]) for k in b)


@pytest.mark.slow  # over 15 s; CI runs the slow selection as well
def test_resuming_with_more_processes_than_the_checkpoint(folder, tmp_path):
    """A 1-process checkpoint resumed on 2 processes: refused with a printed error on its own, and
    with allow_resume_change it continues (same sample order, fresh per-process random streams)."""
    _run(folder, tmp_path, "grow", 1, "--epochs", "2", "--set", "debug.signal_at_step=2", expect=143)
    proc = _run(folder, tmp_path, "grow", 2, "--epochs", "2", expect=2)
    assert "written by 1 process(es), this run has 2" in proc.stderr and "HINT:" in proc.stderr
    assert proc.stderr.count("vramfit: error:") == 1  # once per machine, no traceback from vramfit itself
    assert "src/vramfit" not in proc.stderr  # torchrun's own report follows, but no frame of ours
    grown = _run(folder, tmp_path, "grow", 2, "--epochs", "2", "--set", "allow_resume_change=true")
    s = json.loads((grown / "summary.json").read_text())
    assert s["num_processes"] == 2 and s["global_step"] == 6 and s["finished"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # over 15 s; CI runs the slow selection as well
def test_two_machines_over_loopback_equal_two_processes_on_one(folder, tmp_path, micro_4):
    """Two `torchrun` invocations with one process each and a c10d rendezvous on 127.0.0.1 (what
    accel_configs/multi_node.yaml and scripts/slurm_multi_node.sbatch set up on two machines) write
    one run folder and end with the weights of one torchrun with two processes."""
    args = ["--data", str(folder), "--model", "test_resnet", "--image-size", "24",
            "--global-batch", "16", "--epochs", "1", "--output", str(tmp_path), "--run-name", "nodes",
            "--micro-batch", "4", "--set", "data.num_workers=0", "--set", "model.bn=freeze",
            "--set", "data.crop_pct=1.0", "--set", "train.log_every_steps=1",
            "--set", "data.color_jitter_on=device"]
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(rank), "--rdzv_backend", "c10d", "--rdzv_id", "loopback",
                               "--rdzv_endpoint", f"127.0.0.1:{port}", str(REPO / "train.py"), *args],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(err[-3000:] for _, err in outs)
    summary = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    assert (summary["num_processes"], summary["micro_batch"], summary["grad_accum_steps"]) == (2, 4, 2)
    assert _close(_final(tmp_path / "nodes"), _final(micro_4))


@pytest.mark.slow
def test_a_worker_killed_under_torchrun_max_restarts_resumes_to_the_same_weights(folder, tmp_path):
    """An elastic job (`torchrun --max-restarts 1`) loses a worker mid-run (SIGKILL on rank 1 after
    step 5, the first attempt only): torchrun restarts both, the new round resumes from the step-4
    checkpoint and ends with the weights and record of an uninterrupted run."""
    extra = ["--epochs", "3", "--micro-batch", "4", "--set", "checkpoint.every_steps=2"]
    ref = _run(folder, tmp_path, "ref", 2, *extra)
    args = ["--data", str(folder), "--model", "test_resnet", "--image-size", "24", "--global-batch", "16",
            "--output", str(tmp_path), "--run-name", "elastic", "--set", "data.num_workers=0",
            "--set", "model.bn=freeze", "--set", "data.crop_pct=1.0", "--set", "train.log_every_steps=1",
            "--set", "data.color_jitter_on=device", *extra,
            "--set", "debug.kill_at_step=5", "--set", "debug.fault_rank=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", str(REPO / "train.py"), *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resum" in proc.stderr.lower()  # the second round continued from the checkpoint
    assert _close(_final(tmp_path / "elastic"), _final(ref), tol=0.0)
    steps = [json.loads(line)["step"] for line in (tmp_path / "elastic" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 9  # no step twice in the record


@pytest.mark.slow  # two trainings and a 3 s stagger: CI runs it with the slow tests
def test_two_processes_launched_by_hand_and_a_second_later_equal_torchrun(folder, tmp_path, micro_4):
    """RANK, WORLD_SIZE, ... set by hand (as a script or `srun` does), rank 1 started 3 s after rank
    0: rank 0 says whom it waits for, the group forms, and the run ends as torchrun's."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["train", "--data", str(folder), "--model", "test_resnet", "--image-size", "24",
            "--global-batch", "16", "--epochs", "1", "--output", str(tmp_path), "--run-name", "byhand",
            "--set", "data.num_workers=0",
            "--set", "model.bn=freeze", "--set", "data.crop_pct=1.0", "--set", "train.log_every_steps=1",
            "--set", "data.color_jitter_on=device", "--micro-batch", "4"]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "vramfit.cli", *args], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        time.sleep(3)
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    assert f"waiting for 1 of 2 processes at 127.0.0.1:{port} (rank 0 here)" in errs[0]
    assert _close(_final(micro_4), _final(tmp_path / "byhand"))


def test_the_run_folder_removed_under_two_processes_ends_both_with_the_message(tmp_path):
    """`rm -rf` of the run folder while 2 processes train: the main process, which writes the record,
    meets it; the other learns it at the next step's vote instead of waiting in it. Both exit 2
    (or torchrun stops the other once the main process has ended), the message once, no traceback
    of ours, no hang (bounded by the timeout)."""
    from helpers import remove_tree, tiny_args, wait_for_lines

    args = [str(REPO / "train.py"), *tiny_args("--epochs", "3", "--set", "train.log_every_steps=1"),
            "--output", str(tmp_path), "--run-name", "gone"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lines(tmp_path / "gone" / "metrics.jsonl", 3)
        remove_tree(tmp_path / "gone")
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    flat = " ".join(err.split())
    # torchrun exits 1 and names each worker's own exit code: 2, though where process 0 ends first
    # torchrun may stop process 1 (SIGTERM) before it has ended by itself, on a loaded machine
    stopped_by_torchrun = "Sending process" in err and "closing signal SIGTERM" in err
    exits = (1, 2) if stopped_by_torchrun else (2,)
    assert proc.returncode == 1 and err.count("exitcode  : 2 ") in exits, err[-4000:]
    assert flat.count("was removed while the run was writing it") == 1 and "HINT:" in flat
    assert "src/vramfit" not in err and "[rank1]" not in err  # torchrun's report follows, no frame of ours
    assert not (tmp_path / "gone").exists()
