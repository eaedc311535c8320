"""bench/gpu_check.sh, the runbook of the lent GPU machine, run for real with stand-in stages.

That machine is lent for minutes: a runbook that overruns its budget, loses its figures to the
8 files that come back, or runs a stage after its setup failed wastes them. Here its stage table
(`--plan`) is checked against its budget, and its runner is driven with stand-in commands
(STAGE_CMD_<name>) in place of the benches: no download, no training.
"""

import json
import os
import subprocess
import sys
import tarfile

from helpers import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"
ORDER = ["setup", "planner", "recipe", "throughput", "fit", "progressive"]


def runbook(tmp_path, *args, **env):
    full = {**os.environ, "PY": sys.executable, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"),
            **{k: str(v) for k, v in env.items()}}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=60)


def plan(tmp_path, *args, **env) -> tuple[list[tuple[str, int, int]], str]:
    done = runbook(tmp_path, "--plan", *args, **env)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("stage ")]
    return [(r[1], int(r[3]), int(r[5])) for r in rows], done.stdout


def test_the_stages_run_in_the_order_of_their_value_and_fit_the_budget(tmp_path):
    for mode, budget in (((), 480), (("--rehearse",), 300)):
        stages, text = plan(tmp_path, *mode, BUDGET_S=budget)
        assert [name for name, _, _ in stages] == ORDER
        assert all(0 < low <= cap for _, low, cap in stages), stages
        # What the wrap-up keeps back (results.json, the tar, timeout's grace) is not the stages'.
        assert sum(low for _, low, _ in stages) <= budget - 10, (mode, stages)
        assert text.rstrip().endswith("fits"), text
    stages, _ = plan(tmp_path, ONLY="fit,planner")
    assert [name for name, _, _ in stages] == ["setup", "planner", "fit"]  # setup always, the order kept


def out_files(out):
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(out).parts) <= 3 for p in files), files
    return sorted(p.name for p in files)


def test_a_stage_cut_off_keeps_what_it_printed_and_one_that_cannot_fit_is_skipped(tmp_path):
    figure = 'mkdir -p "$FIG" && echo "{\\"peak\\": $STAGE_S}" > "$FIG/planner.json" && echo "peak measured"'
    done = runbook(
        tmp_path, BUDGET_S=22, ONLY="planner,recipe,throughput,fit",
        CAP_setup="1:1", CAP_planner="2:3", CAP_recipe="1:1", CAP_throughput="20:20", CAP_fit="1:2",
        STAGE_CMD_setup="true", STAGE_CMD_planner=figure, STAGE_CMD_recipe="echo first half; sleep 10",
        STAGE_CMD_throughput="echo never", STAGE_CMD_fit="echo fit ran")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    assert out_files(out) == ["logs.tar.gz", "results.json", "results.txt"]
    text = (out / "results.txt").read_text()
    heads = [line for line in text.splitlines() if line.startswith("== ")]
    assert [h.split(":")[0][3:] for h in heads[:-1]] == ["setup", "planner", "recipe", "throughput", "fit"]
    assert "peak measured" in text and "first half" in text and "fit ran" in text
    assert "recipe: cut off by its cap (exit 124)" in text
    # 22 s less the wrap-up's 10 and what ran before leaves under the 20 s throughput needs: said,
    # not run, and the later stage still gets its turn.
    assert "throughput: skipped: needs 20 s" in text and "never" not in text
    results = json.loads((out / "results.json").read_text())
    by_name = {s["stage"]: s for s in results["stages"]}
    assert by_name["planner"]["figures"] == {"planner.json": {"peak": 3}}  # granted its cap, 3 s
    assert by_name["recipe"]["exit_code"] == 124 and by_name["throughput"]["exit_code"] is None
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"logs/planner.txt", "logs/recipe.log", "stages.tsv"} <= set(tar.getnames())


def test_a_failed_setup_stops_the_runbook_at_once_and_a_crash_fails_it(tmp_path):
    done = runbook(tmp_path, BUDGET_S=100, STAGE_CMD_setup="echo 'vramfit.config: No module named pydantic'; exit 1",
                   STAGE_CMD_planner="echo ran")
    assert done.returncode == 3
    text = (tmp_path / "out" / "results.txt").read_text()
    assert "No module named pydantic" in text and "planner" not in text

    crash = "echo 'Traceback (most recent call last):' >&2; exit 1"
    done = runbook(tmp_path, BUDGET_S=100, ONLY="planner,recipe", CAP_planner="1:5", CAP_recipe="1:5",
                   STAGE_CMD_setup="true", STAGE_CMD_planner=crash, STAGE_CMD_recipe="exit 1")
    assert done.returncode == 1
    text = (tmp_path / "out" / "results.txt").read_text()
    assert "planner: failed (a traceback)" in text and "recipe: ran, a target missed" in text
    assert out_files(tmp_path / "out") == ["logs.tar.gz", "results.json", "results.txt"]


def test_the_sized_stages_train_more_with_more_time():
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "bench"))
    for stage in ("fit", "progressive"):
        sizes = [gpu_check.train_samples(stage, s) for s in (30, 80, 120, 600)]
        assert sizes == sorted(sizes) and sizes[0] == 256 and sizes[-1] == 2048, (stage, sizes)
        assert all(n % 128 == 0 for n in sizes)
