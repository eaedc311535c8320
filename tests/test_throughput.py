"""bench/throughput.py runs on a CPU and prints the table docs/benchmarks.md records."""

import importlib.util
import json
import re

import torch

from helpers import REPO


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_throughput", REPO / "bench" / "throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_bench_prints_a_ratio(capsys, tmp_path):
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        # One thread: on a shared 2-core machine two threads wait on each other far longer than
        # the few steps take (the figures are not checked here, only that they are measured).
        bench.main(["--quick", "--steps", "2", "--warmup", "1", "--repeats", "2", "--threads", "1",
                    "--json", str(tmp_path / "t.json")])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "vramfit step vs plain Accelerate + timm loop" in out
    assert bench.COLUMNS in out
    row = re.search(r"^test_resnet\s+fp32\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+\.\d\d)x$", out, re.M)
    assert row, out
    plain, ours, ratio = map(float, row.groups())
    assert plain > 0 and ours > 0 and abs(ratio - ours / plain) < 0.01
    assert re.search(r"^ratio = vramfit / plain \(target >= 0\.98x\): (ok|MISSED)$", out, re.M)
    saved = json.loads((tmp_path / "t.json").read_text())["results"]
    assert [(r["model"], r["precision"]) for r in saved] == [("test_resnet", "fp32")]
