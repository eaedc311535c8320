"""OOM recovery through the real CLI (simulated limit), the auto micro-batch search, memory figures."""
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import StandInCard, tiny_args
from vramfit.errors import VramfitError
from vramfit.store import checkpoint
from vramfit.tuning.probe import cached, search, store


def _weights(run_dir):
    return load_file(checkpoint.list_steps(run_dir / "checkpoints")[-1][1] / "model.safetensors")


def test_simulated_oom_recovers_to_micro_8_with_same_weights(train_cli):
    base = tiny_args("--global-batch", "32", "--set", "model.bn=freeze", "--set", "train.log_every_steps=1")
    ref, code = train_cli(*base, "--micro-batch", "8", run_name="ref")
    assert code == 0
    got, code = train_cli(*base, "--set", "debug.simulate_oom_above=8", run_name="oom")
    assert code == 0
    s = json.loads((got / "summary.json").read_text())
    assert s["micro_batch"] == 8 and s["grad_accum_steps"] == 4 and s["oom_retries"] == 2
    assert [c["to"] for c in s["micro_batch_changes"]] == [16, 8]
    a, b = _weights(ref), _weights(got)
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-6
    rows = [json.loads(l) for l in (got / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert train_rows[0]["train/oom_retries"] == 2 and train_rows[0]["train/micro_batch"] == 8
    assert all(r["memory/host_rss_bytes"] > 0 for r in train_rows)
    # Evaluation has its own micro-batching: the same limit shrinks it instead of failing.
    assert [r["val/samples"] for r in rows if r["kind"] == "eval"] == [120]


@pytest.mark.parametrize("bn, smallest", [("train", 2), ("freeze", 1)])
def test_oom_at_the_smallest_micro_batch_stops_with_the_plan(train_cli, bn, smallest):
    """The smallest micro-batch is the model's: 2 with train-mode BatchNorm, 1 with it frozen."""
    with pytest.raises(VramfitError) as e:
        train_cli(*tiny_args("--set", "debug.simulate_oom_above=0", "--set", f"model.bn={bn}"), run_name="never")
    msg = str(e.value)
    assert e.value.exit_code == 3 and f"even at micro-batch {smallest}" in msg
    assert "parameters" in msg and "activations" in msg  # the plan's breakdown
    assert "HINT" in msg and "vramfit plan" in msg


def test_search_finds_the_largest_fitting_micro_batch_with_few_probes():
    budget = 1000
    probed = []

    def peak(m):  # 34+ samples "run out of memory"; m samples need 30 * m bytes
        probed.append(m)
        return m * 30 if m <= 33 else None

    assert search(64, 8, budget, peak)[0] == 32  # plan too cautious: walk up (33 is not a split of 64)
    assert search(64, 64, budget, peak)[0] == 32  # plan too bold: walk down
    assert search(100, 16, budget, peak)[0] == 25  # 4 x 25; 3 x 34 runs out: not a divisor search
    probed.clear()
    micro, trace = search(99, 20, budget, peak)
    assert micro == 33 and len(trace) <= 6  # 3 x 33, found from 20 in a few probes
    assert [t["micro_batch"] for t in trace] == probed and len(set(probed)) == len(probed)  # each once
    assert all(t["fits"] == (t["micro_batch"] <= 33) for t in trace)
    assert search(48, 16, 500, peak)[0] == 16  # 30 x 17 > 500
    with pytest.raises(RuntimeError):
        search(8, 8, 10, peak)


def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path))
    assert cached("k") is None
    store("k", 24)
    store("j", 8)
    assert cached("k") == 24 and cached("j") == 8


def test_auto_on_cpu_runs_the_whole_share(train_cli):
    run_dir, code = train_cli(*tiny_args("--micro-batch", "auto", "--set", "debug.signal_at_step=2"), run_name="auto")
    assert code == 143
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["micro_batch"] == 16 and "without a device" in plan["micro_batch_source"]
    assert plan["predicted_peak_bytes"] > 0 and plan["estimate"]["params_bytes"] > 0


def test_auto_plans_for_the_memory_other_processes_leave(tmp_path, monkeypatch, caplog):
    """A 12 GiB card where another process holds 10 GiB: `auto` plans for what is left and says why."""
    from vramfit.config import Config
    from vramfit.tuning.probe import auto_micro_batch

    monkeypatch.setenv("VRAMFIT_CACHE", str(tmp_path))
    card = StandInCard(monkeypatch, 12 * 2**30, name="Fake 12GB")
    cfg = Config.model_validate({"model": {"name": "resnet18"}, "train": {"precision": "bf16"},
                                 "data": {"image_size": 224}, "hardware": {"memory_gib": 12}})
    alone = auto_micro_batch(cfg, 10, 128, device=torch.device("cuda", 0))
    assert "other processes" not in caplog.text
    card.others, card.name = 10 * 2**30, "Fake 12GB, shared"  # another cache key: a fresh pick
    shared = auto_micro_batch(cfg, 10, 128, device=torch.device("cuda", 0))
    assert shared["budget_bytes"] < 2.5 * 2**30 < 9 * 2**30 < alone["budget_bytes"]
    assert shared["micro_batch"] < alone["micro_batch"]
    assert "other processes hold about 10.0 GiB" in caplog.text


def test_every_pick_on_a_card_is_made_against_one_budget(monkeypatch):
    """The card's total, the recipe's card, the allocator's cap and what other processes leave each
    bind the budget when smallest; the fit's candidates and each progressive size's pick are made
    against the very budget the start's micro-batch was (a recipe for a 12 GB card on a larger one,
    an allocator capped to a smaller card: the fit must not probe a micro-batch the start ruled out)."""
    from types import SimpleNamespace

    from vramfit.batching import MicroBatch
    from vramfit.config import Config
    from vramfit.planner import reported_total_bytes
    from vramfit.tuning import fit, size_plans
    from vramfit.tuning.probe import card_budget_bytes

    gib, total = 2**30, 80 * 2**30
    card = StandInCard(monkeypatch, total)
    device = torch.device("cuda", 0)

    def budget(memory_gib=None, margin=0.1):
        cfg = Config.model_validate({"model": {"name": "resnet18"},
                                     "hardware": {"memory_gib": memory_gib, "safety_margin": margin}})
        return cfg, card_budget_bytes(cfg, device)

    assert budget()[1] == int(total * 0.9)                                      # the card itself
    assert budget(12)[1] == int(reported_total_bytes(12) * 0.9)                 # the recipe's card
    card.fraction = 0.1
    assert budget(12)[1] == int(total * 0.1 * 0.9) < int(reported_total_bytes(12) * 0.9)  # the allocator's cap
    card.others = 75 * gib
    assert budget(12)[1] == int(5 * gib * 0.9)                                  # what others leave
    card.fraction, card.others = 1.0, 0

    cfg, expected = budget(12)
    run = SimpleNamespace(cfg=cfg, class_names=list("0123456789"),
                          launch=SimpleNamespace(device_type="cuda", acc=SimpleNamespace(device=device),
                                                 precision=SimpleNamespace(accelerate="bf16"), world=1))
    assert fit.card_budget(run) == expected
    cand = SimpleNamespace(predicted_peak_bytes=expected + 1)
    assert not fit.fits(run, cand) and fit.fits(run, SimpleNamespace(predicted_peak_bytes=expected))
    seen = {}
    monkeypatch.setattr(size_plans, "planner_pick", lambda *a: seen.setdefault("budget", a[3]))
    phase = SimpleNamespace(config=lambda c: c)
    plan = SimpleNamespace(micro=MicroBatch(size=32, per_process_batch=64, source="auto: planner"))
    size_plans.size_pick(run, phase, plan)
    assert seen["budget"] == expected


def test_resume_continues_at_the_micro_batch_the_run_came_down_to(train_cli):
    """Interrupted after out-of-memory errors took it from 32 to 8: the resumed run starts at 8 (no
    new errors), as the uninterrupted run would have gone on."""
    base = tiny_args("--global-batch", "32", "--set", "model.bn=freeze", "--set", "train.log_every_steps=1",
                     "--set", "debug.simulate_oom_above=8")
    run_dir, code = train_cli(*base, "--set", "debug.signal_at_step=3", run_name="cut")
    assert code == 143
    run_dir, code = train_cli(*base, run_name="cut")
    assert code == 0
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["micro_batch"] == 8 and s["oom_retries"] == 2 and s["micro_batch_changes"] == []
    ref, code = train_cli(*base, run_name="ref")
    assert code == 0
    a, b = _weights(ref), _weights(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_a_card_the_budget_is_the_recipes_card_by_the_same_rule():
    """tuning.probe.card_budget_bytes is every run's budget: on a CPU launch it is the recipe's card less
    the margin, taken where `vramfit plan` takes it (planner.budget_bytes_for)."""
    from vramfit.config import Config
    from vramfit.planner import budget_bytes_for, reported_total_bytes
    from vramfit.tuning.probe import card_budget_bytes

    cfg = Config.model_validate({"hardware": {"memory_gib": 12, "safety_margin": 0.1}})
    assert card_budget_bytes(cfg, torch.device("cpu")) == budget_bytes_for(cfg) == int(reported_total_bytes(12) * 0.9)
    assert card_budget_bytes(Config(), None) is None
