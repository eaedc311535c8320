"""`train.fit: fastest`: the probe changes nothing but the execution settings, is recorded, and is
not repeated by a rerun or a resume."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_args
from safetensors.torch import load_file

FASTEST = ("--set", "train.fit=fastest", "--set", "train.fit_probe_fraction=1.0")


@pytest.fixture
def fit_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("VRAMFIT_CACHE", str(cache))
    return cache / "fit_cache.json"


def _last_weights(run_dir):
    ckpt = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    return load_file(ckpt / "model.safetensors")


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_fastest_trains_as_the_chosen_settings_given_directly(train_cli, fit_cache):
    # Two epochs: the whole run's budget (fit_probe_fraction 1.0) pays for every candidate with room
    # to spare even where a loaded machine slows the probe's later candidates.
    fast_dir, code = train_cli(*tiny_args(*FASTEST, "--epochs", "2"), run_name="fast")
    assert code == 0
    fit = _summary(fast_dir)["fit"]
    assert fit["mode"] == "fastest" and not fit["cached"] and fit["probe_seconds"] > 0
    measured = [c for c in fit["candidates"] if c["outcome"] == "measured"]
    assert len(measured) >= 3  # the budget (the whole run) pays for several
    assert all(c["images_per_second"] > 0 for c in measured)
    best = max(measured, key=lambda c: c["images_per_second"])
    assert best["images_per_second"] <= 1.0 / 0.99 * next(
        c["images_per_second"] for c in measured if c["settings"] == fit["chosen"])
    chosen = fit["chosen"]
    direct_dir, code = train_cli(*tiny_args("--epochs", "2", "--micro-batch", str(chosen["micro_batch"]), "--set",
                                            f"model.channels_last={str(chosen['channels_last']).lower()}"),
                                 run_name="direct")
    assert code == 0
    a, b = _last_weights(fast_dir), _last_weights(direct_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _summary(fast_dir)["micro_batch"] == chosen["micro_batch"]
    assert _summary(direct_dir)["fit"]["mode"] == "largest"


def test_a_resumed_run_takes_the_cached_choice(train_cli, fit_cache):
    args = tiny_args(*FASTEST, "--epochs", "2")
    cut_dir, code = train_cli(*args, "--set", "debug.signal_at_step=12", run_name="cut")
    assert code == 143 and fit_cache.is_file()
    first = _summary(cut_dir)["fit"]
    cut_dir, code = train_cli(*args, run_name="cut")  # the same command resumes
    assert code == 0
    again = _summary(cut_dir)["fit"]
    assert again["cached"] and again["probe_seconds"] == 0 and again["chosen"] == first["chosen"]


def test_a_short_run_probes_within_its_budget(train_cli, fit_cache):
    run_dir, code = train_cli(*tiny_args("--set", "train.fit=fastest", "--set", "train.fit_probe_fraction=0.1"),
                              run_name="short")
    assert code == 0
    s = _summary(run_dir)
    # 10% of a 30-step run is three steps' time; probing a candidate takes three steps (one warm-up,
    # two timed): the settings as written are measured and nothing else. Counted, not timed: a loaded
    # machine slows the probe and the run alike, but not evenly.
    # (bench/fit_sweep.py measures the probe's share of the wall time.)
    outcomes = [c["outcome"] for c in s["fit"]["candidates"]]
    assert outcomes[0] == "measured" and len(outcomes) > 1
    assert set(outcomes[1:]) <= {"not probed", "dropped by the planner"}, outcomes


def test_a_run_too_short_to_pay_for_measuring_measures_nothing_and_says_so(train_cli, fit_cache, monkeypatch,
                                                                             caplog):
    """3% of a 30-step run is less than one step: even the settings as written are not measured."""
    import logging

    from vramfit.tuning import fit

    def no_probe(*_):
        raise AssertionError("measured a run too short to pay for it")

    monkeypatch.setattr(fit, "measure", no_probe)
    with caplog.at_level(logging.INFO):
        run_dir, code = train_cli(*tiny_args("--set", "train.fit=fastest"), run_name="short")
    assert code == 0
    fit_ = _summary(run_dir)["fit"]
    assert fit_["probe_seconds"] == 0 and fit_["skipped"].startswith("not measured: 30 steps x 0.03")
    assert [c["outcome"] for c in fit_["candidates"]] == [fit.TOO_SHORT]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fit: fastest")]
    assert len(said) == 1 and "not measured" in said[0] and "training with the planned settings" in said[0], said
    assert not fit_cache.exists()  # a longer run of the same settings measures


def test_no_candidate_starts_that_would_end_past_the_budget(train_cli, fit_cache, monkeypatch):
    """A stand-in clock: the settings as written take 2 s to measure, every later candidate 5 s.
    The budget (a third of 30 one-second steps: 10 s) pays for the first two; a third, started at
    7 s, would end at 12 s were it as slow as the slowest so far, so it is not started."""
    from vramfit.tuning import fit

    now, costs = [0.0], iter([2.0] + [5.0] * 20)
    monkeypatch.setattr(fit, "clock", lambda: now[0])

    def timed(run, s, batches):
        fit.apply(run, s)
        now[0] += next(costs)
        return float(batches[0].step_samples)  # one step a second

    monkeypatch.setattr(fit, "measure", timed)
    run_dir, code = train_cli(*tiny_args("--set", "train.fit=fastest", "--set", "train.fit_probe_fraction=0.34"),
                              run_name="clocked")
    assert code == 0
    outcomes = [c["outcome"] for c in _summary(run_dir)["fit"]["candidates"]]
    assert outcomes[:2] == ["measured"] * 2 and set(outcomes[2:]) == {"not probed"}, outcomes
    assert now[0] <= 0.34 * 30 * 1.0


def test_rehearse_leaves_no_trace():
    from accelerate import Accelerator

    from vramfit.config import ModelConfig
    from vramfit.models.create import create_model
    from vramfit.train.step import TrainStep

    torch.manual_seed(0)
    model = create_model(ModelConfig(name="test_resnet"), 4, image_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = TrainStep(Accelerator(cpu=True), model, opt, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 4, (8,))
    rng = torch.get_rng_state()
    assert step.rehearse(x, y, 8)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_bad_probe_fraction_is_refused():
    from vramfit.config import build_config
    from vramfit.errors import VramfitError

    with pytest.raises(VramfitError, match="fit_probe_fraction"):
        build_config("quickstart", ["train.fit_probe_fraction=0"])
    with pytest.raises(VramfitError, match="train.fit"):
        build_config("quickstart", ["train.fit=quickest"])


def test_a_resume_keeps_a_smaller_chosen_micro_batch_without_probing(train_cli, fit_cache, monkeypatch, caplog):
    """Timing stands in here (the choice is what is tested): micro 8 of the share of 16 measures
    fastest. The checkpoint's micro-batch 8 is the fit's choice, not an out-of-memory reduction."""
    from vramfit.tuning import fit

    def timed(run, s, batches):
        fit.apply(run, s)
        return 2000.0 if s.micro_batch == 8 and not s.channels_last else 1000.0

    monkeypatch.setattr(fit, "measure", timed)
    args = tiny_args(*FASTEST, "--epochs", "2")
    ref_dir, code = train_cli(*args, run_name="ref")
    assert code == 0 and _summary(ref_dir)["fit"]["chosen"]["micro_batch"] == 8
    fit_cache.unlink()  # the resume must take the checkpoint's choice, not the cache's
    cut_dir, code = train_cli(*args, "--set", "debug.signal_at_step=12", run_name="cut")
    assert code == 143

    def no_probe(*_):
        raise AssertionError("a resume probed again")

    monkeypatch.setattr(fit, "measure", no_probe)
    caplog.clear()
    cut_dir, code = train_cli(*args, run_name="cut")
    assert code == 0
    s = _summary(cut_dir)
    assert s["fit"]["cached"] and s["micro_batch"] == 8 and s["grad_accum_steps"] == 2
    assert "out-of-memory" not in caplog.text
    a, b = _last_weights(ref_dir), _last_weights(cut_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_compile_auto_is_probed_only_where_the_budget_pays_for_compiling(train_cli, fit_cache):
    run_dir, code = train_cli(*tiny_args(*FASTEST, "--set", "train.compile=auto"), run_name="short")
    assert code == 0
    cands = _summary(run_dir)["fit"]["candidates"]
    compiled = [c for c in cands if c["settings"]["compile"]]
    assert len(compiled) == 1 and compiled[0]["outcome"].startswith("not probed (compiling needs")
    assert not _summary(run_dir)["fit"]["chosen"]["compile"]


def test_a_compilation_that_fails_leaves_the_eager_choice(train_cli, fit_cache, monkeypatch):
    from vramfit.tuning import fit

    def no_compiler(self, *a, **k):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(fit, "COMPILE_PROBE_SECONDS", float("-inf"))  # whatever the budget
    monkeypatch.setattr(torch.nn.Module, "compile", no_compiler)
    run_dir, code = train_cli(*tiny_args(*FASTEST, "--set", "train.compile=auto"), run_name="nocc")
    assert code == 0
    fit_ = _summary(run_dir)["fit"]
    compiled = [c for c in fit_["candidates"] if c["settings"]["compile"]]
    assert compiled[0]["outcome"] == "compile failed (RuntimeError: no C++ compiler found)"
    assert not fit_["chosen"]["compile"] and _summary(run_dir)["finished"]


def test_compile_auto_under_largest_is_off(train_cli, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        run_dir, code = train_cli(*tiny_args("--set", "train.compile=auto"), run_name="largest")
    assert code == 0
    assert "train.compile: auto is measured by train.fit: fastest only" in caplog.text


@pytest.mark.slow  # compiling test_resnet with inductor takes ~40 s on 2 CPU cores
def test_a_probed_compilation_trains_as_the_chosen_settings_given_directly(train_cli, fit_cache, monkeypatch):
    from vramfit.tuning import fit

    monkeypatch.setattr(fit, "COMPILE_PROBE_SECONDS", float("-inf"))  # whatever the budget
    small = ("--set", "data.limit_train_samples=64", "--set", "data.limit_val_samples=32")
    fast_dir, code = train_cli(*tiny_args(*FASTEST, *small, "--set", "train.compile=auto"), run_name="fast")
    assert code == 0
    fit_ = _summary(fast_dir)["fit"]
    compiled = [c for c in fit_["candidates"] if c["settings"]["compile"]]
    assert compiled[0]["outcome"] == "measured" and compiled[0]["images_per_second"] > 0
    chosen = fit_["chosen"]
    direct_dir, code = train_cli(*tiny_args(*small, "--micro-batch", str(chosen["micro_batch"]), "--set",
                                            f"model.channels_last={str(chosen['channels_last']).lower()}",
                                            "--set", f"train.compile={str(chosen['compile']).lower()}"),
                                 run_name="direct")
    assert code == 0
    a, b = _last_weights(fast_dir), _last_weights(direct_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_staged_run_chooses_each_phases_micro_batch_and_resumes_bitwise_in_either(
        train_cli, fit_cache, monkeypatch, test_resnet_weights):
    """Staged fine-tuning: the head-only phase keeps the whole share (no candidate measures faster),
    the whole network's phase measures micro 8 fastest when it begins and trains at it. A run cut in
    the whole network's phase resumes with its recorded choice (no probe), one cut at the end of the
    head phase chooses as the uninterrupted run did when the phase begins (from the cache); both end
    bitwise equal to the uninterrupted run. Timing stands in (the choice is what is tested)."""
    from vramfit.tuning import fit

    def timed(run, s, batches):
        fit.apply(run, s)
        return 2000.0 if run.plan.phase == "all" and s.micro_batch == 8 else 1000.0

    monkeypatch.setattr(fit, "measure", timed)
    args = tiny_args(*FASTEST, "--epochs", "2", "--set", "train.freeze_epochs=1",
                     "--set", f"model.pretrained_path={test_resnet_weights}")
    ref_dir, code = train_cli(*args, run_name="ref")
    assert code == 0
    s = _summary(ref_dir)
    head, whole = s["fit"], s["fit"]["later_phases"][0]
    assert (head["phase"], head["chosen"]["micro_batch"]) == ("head", 16)
    assert (whole["phase"], whole["chosen"]["micro_batch"], whole["cached"]) == ("all", 8, False)
    assert [c["settings"]["channels_last"] for c in whole["candidates"]] == [False] * len(whole["candidates"])
    assert [(p["name"], p["micro_batch"]) for p in s["phases"]] == [("head", 16), ("all", 8)]
    assert s["micro_batch"] == 8 and s["oom_retries"] == 0

    def no_probe(*_):
        raise AssertionError("a resume probed again")

    for name, stop_at in (("cut-in-all", 34), ("cut-at-boundary", 30)):
        monkeypatch.setattr(fit, "measure", timed)
        cut_dir, code = train_cli(*args, "--set", f"debug.signal_at_step={stop_at}", run_name=name)
        assert code == 143
        monkeypatch.setattr(fit, "measure", no_probe)
        cut_dir, code = train_cli(*args, run_name=name)
        assert code == 0, name
        again = _summary(cut_dir)
        assert again["fit"]["later_phases"][0]["chosen"]["micro_batch"] == 8, name
        assert [(p["name"], p["micro_batch"]) for p in again["phases"]] == [("head", 16), ("all", 8)], name
        a, b = _last_weights(ref_dir), _last_weights(cut_dir)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_a_signal_during_a_later_phases_probe_stops_it_and_the_run_saves(
        train_cli, fit_cache, monkeypatch, test_resnet_weights):
    """SIGTERM while the whole network's phase measures its first candidate: no further candidate is
    probed, the step runs with the best measured so far, the run saves and exits 143; the cut-short
    choice is recorded for the resume (which does not probe) and not cached."""
    import os
    import signal

    from vramfit.tuning import fit

    def timed(run, s, batches):
        fit.apply(run, s)
        if run.plan.phase == "all":
            os.kill(os.getpid(), signal.SIGTERM)  # the run's own handler: it only records the signal
        return 1000.0

    monkeypatch.setattr(fit, "measure", timed)
    args = tiny_args(*FASTEST, "--epochs", "2", "--set", "train.freeze_epochs=1",
                     "--set", f"model.pretrained_path={test_resnet_weights}")
    run_dir, code = train_cli(*args, run_name="sig")
    assert code == 143
    last = max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    assert last.name in ("step-30", "step-31")  # the step was undone between micro-batches, or it ran
    state = json.loads((last / "trainer_state.json").read_text())
    whole = state["fit"]["later_phases"][0]
    outcomes = [c["outcome"] for c in whole["candidates"]]
    assert outcomes[0] == "measured" and set(outcomes[1:]) == {"not probed (a stop signal arrived)"}, outcomes
    assert whole["chosen"]["micro_batch"] == 16
    assert len(json.loads(fit_cache.read_text())) == 1  # the head phase's choice only

    def no_probe(*_):
        raise AssertionError("a resume probed again")

    monkeypatch.setattr(fit, "measure", no_probe)
    run_dir, code = train_cli(*args, run_name="sig")
    assert code == 0 and _summary(run_dir)["fit"]["later_phases"][0]["chosen"]["micro_batch"] == 16


def _size_picks(monkeypatch, pick):
    """A card's planner picks per image size, on a CPU: `pick(size)` (the micro-batch) at the sizes
    below the full one (the full size keeps the whole share of 16)."""
    from vramfit.tuning import size_plans

    monkeypatch.setattr(size_plans, "size_pick", lambda run, phase, plan: lambda size: (pick(size), None))


def test_progressive_resizing_measures_each_fit_segment_and_resumes_bitwise(train_cli, fit_cache, monkeypatch):
    """Progressive resizing over 16-32 px with the planner (stood in) picking micro 16 up to 20 px
    and 8 at 24-28 px: three fit segments (16, 24 and 32 px), each measured as it begins on its
    own batches, the choice held at every size of its segment. A run cut inside the 24 px segment
    or before it resumes without probing what its checkpoint holds and ends bitwise equal to the
    uninterrupted run."""
    from vramfit.config import ProgressiveResize
    from vramfit.data.progressive import Schedule
    from vramfit.tuning import fit

    fastest = {16: 8, 24: 4, 32: 16}  # segment -> the micro-batch its batches measure fastest at
    seen = []

    def timed(run, s, batches):
        fit.apply(run, s)
        size = batches[0].images.shape[-1]
        seen.append(size)
        start = max(k for k in fastest if k <= size)
        return 2000.0 if s.micro_batch == fastest[start] and not s.channels_last else 1000.0

    _size_picks(monkeypatch, lambda size: 16 if size <= 20 else 8)
    monkeypatch.setattr(fit, "measure", timed)
    args = tiny_args(*FASTEST, "--epochs", "2", "--set", "data.progressive_resize=true")
    ref_dir, code = train_cli(*args, run_name="ref")
    assert code == 0
    s = _summary(ref_dir)
    segments = [(r["image_size"], r["chosen"]["micro_batch"], r["cached"])
                for r in (s["fit"], *s["fit"]["later_phases"])]
    assert segments == [(16, 8, False), (24, 4, False), (32, 16, False)]
    assert set(seen) == {16, 24, 32}  # each measured on batches at its own first size
    assert [(p["image_size"], p["micro_batch"]) for p in s["phases"]] == [(16, 8), (20, 8), (24, 4), (28, 4), (32, 16)]
    assert s["micro_batch"] == 16 and s["oom_retries"] == 0
    rows = [json.loads(line) for line in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    assert {(r["train/image_size"], r["train/micro_batch"]) for r in rows if r.get("kind") == "train"} <= \
        {(16, 8), (20, 8), (24, 4), (28, 4), (32, 16)}

    spans = Schedule(32, 60, ProgressiveResize()).spans
    begins = next(sp.first_step for sp in spans if sp.image_size == 24)  # steps done before 24 px

    # (A signal right after the last step before 24 px would cut that segment's probe short, and the
    # resume takes the cut-short choice, as for a phase: see the test below; one step earlier it does not.)
    for name, stop_at in (("cut-inside", begins + 2), ("cut-before", begins - 1)):
        fit_cache.unlink()  # what a resume does not measure comes from its checkpoint
        cut_dir, code = train_cli(*args, "--set", f"debug.signal_at_step={stop_at}", run_name=name)
        assert code == 143
        seen.clear()
        cut_dir, code = train_cli(*args, run_name=name)
        assert code == 0, name
        # Measured on resuming: the segments the cut run had not begun (32 px; 24 px too when it was
        # cut before 24 px began), never one whose choice the checkpoint holds.
        assert 32 in seen and 16 not in seen and (24 not in seen or name == "cut-before"), (name, seen)
        again = _summary(cut_dir)
        assert [(p["image_size"], p["micro_batch"]) for p in again["phases"]] == \
            [(16, 8), (20, 8), (24, 4), (28, 4), (32, 16)], name
        a, b = _last_weights(ref_dir), _last_weights(cut_dir)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_a_fit_segment_too_short_to_measure_joins_the_one_before():
    """A change of the planner's micro-batch whose steps cannot pay for measuring one candidate
    (3 steps) within the probe's share keeps the segment before's choice, capped by the planner's
    micro-batch at each size; a new phase always begins its own segment."""
    from types import SimpleNamespace

    from vramfit import batching
    from vramfit.config import ProgressiveResize
    from vramfit.data.progressive import Schedule
    from vramfit.train.build import Plan
    from vramfit.train.phases import Phase
    from vramfit.tuning import size_plans

    head, whole = Phase("head", 0, 1, ("body",)), Phase("all", 1, 2, ())
    picks = {16: 16, 20: 16, 24: 8, 28: 8, 32: 4}
    plans = {(p.name, s): Plan(batching.MicroBatch(m, 16, "auto"), "auto", 1, "no", phase=p.name, image_size=s)
             for p in (head, whole) for s, m in picks.items()}
    run = SimpleNamespace(phases=[head, whole], sizes=Schedule(32, 60, ProgressiveResize()), steps_per_epoch=30,
                          cfg=SimpleNamespace(data=SimpleNamespace(image_size=32)), fit_segments={},
                          phase_plan=lambda phase, size=None: plans[(phase.name, size or 32)])
    steps = {sp.image_size: sp.steps for sp in run.sizes.spans}
    # What the step counts below rest on: 30 steps at 16 px in the head phase, then 3 at 16 px, 4 at 20,
    # 9 at 24-28 and 14 at 32 in the whole network's.
    assert (steps[16], steps[20], steps[24] + steps[28], steps[32]) == (33, 4, 9, 14)

    run.fit_segments = size_plans.fit_segments(run, min_steps=3)
    assert run.fit_segments == {("head", 16): 16, ("all", 16): 16, ("all", 20): 16, ("all", 24): 24,
                                ("all", 28): 24, ("all", 32): 32}
    assert size_plans.segment_steps(run, whole, 24) == 9 and size_plans.segment_steps(run, head, 16) == 30
    run.fit_segments = size_plans.fit_segments(run, min_steps=12)  # 9 steps at 24-28 px join 16-20 px's
    assert [run.fit_segments[("all", s)] for s in (16, 20, 24, 28, 32)] == [16, 16, 16, 16, 32]
    assert size_plans.segment_steps(run, whole, 16) == 16
    assert size_plans.segment_sizes(run, "all", 16) == [16, 20, 24, 28]
    run.fit_segments = size_plans.fit_segments(run, min_steps=31)  # a new phase begins its own segment anyway
    assert run.fit_segments[("all", 16)] == 16 and run.fit_segments[("all", 32)] == 16

    run.fit_segments = size_plans.fit_segments(run, min_steps=12)
    size_plans.hold(run, whole, 16, 16, None)
    assert [plans[("all", s)].micro.size for s in (16, 20, 24, 28, 32)] == [16, 16, 8, 8, 4]  # capped; 32 px untouched
    size_plans.hold(run, whole, 16, 4, 123)
    assert [plans[("all", s)].micro.size for s in (16, 20, 24, 28)] == [4, 4, 4, 4]
    assert plans[("all", 16)].predicted_peak_bytes == 123 and plans[("all", 24)].micro.source == "fit: fastest"
    assert plans[("all", 24)].predicted_peak_bytes is None  # the planner's bound for its micro 8 (none here)
    assert [plans[("head", s)].micro.size for s in picks] == list(picks.values())  # the other phase's untouched
