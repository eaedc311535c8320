"""The Python side of bench/gpu_check.sh: what it needs to know before and after its stages.

    python bench/gpu_check.py setup WHEELS_DIR      # versions, the wheels' needs, every vramfit module imported
    python bench/gpu_check.py size STAGE SECONDS    # --train-samples for the fit or progressive stage
    python bench/gpu_check.py chooser-epochs SAMPLES # the fit stage's chooser: enough steps to measure
    python bench/gpu_check.py collect WORK OUT      # OUT/results.json from every stage's figures
    python bench/gpu_check.py target THROUGHPUT_JSON  # ResNet50 bf16 images/s against the H200 target

`setup` exits 1 when a module does not import: every later stage would fail the same way, so the
runbook stops at once and the device minutes are not spent on tracebacks.
"""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
import sys
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# The benches the stages run, imported as the stages import them (by name, from bench/).
STAGE_BENCHES = ["memory_check", "recipe_run", "throughput", "fit_sweep", "progressive"]
VERSIONS = ["torch", "torchvision", "timm", "accelerate", "pydantic", "pydantic_core", "typing_extensions",
            "datasets", "evaluate", "huggingface_hub", "fsspec", "pyarrow", "numpy", "PIL"]
# Sizing the stages that fill the time left (estimates for one H100 before it was measured: a
# run's fixed cost -- config, the planner's trace, model, loader start, the probe, evaluation of 256
# images -- and ResNet50 at 224 px in bf16 fed by the digits loader with RandAugment on 15 workers,
# which likely bounds it rather than the GPU).
RUN_OVERHEAD_S = 8.0
IMAGES_PER_S = 1200.0
# stage -> (runs, epochs in all, seconds beside the runs): fit_sweep's 7 candidates of one epoch and
# the chooser of `chooser_epochs` (7 at 2,048 samples); progressive's fixed and progressive runs of 4
# epochs and its step-cost ceiling.
SIZING = {"fit": (8, 14, 0.0), "progressive": (2, 8, 15.0)}
RECIPE_GLOBAL_BATCH = 128  # the rtx3060 recipe's


def versions() -> None:
    import importlib.metadata as md

    print(f"python {sys.version.split()[0]} at {sys.executable}")
    for name in VERSIONS:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            print(f"{name}: not importable ({e})")
            continue
        version = getattr(module, "__version__", None) or md.version(name)
        where = Path(module.__file__).parent
        print(f"{name} {version} from {where.parent if module.__name__ == where.name else where}")
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"cuda {torch.version.cuda}, cudnn {torch.backends.cudnn.version()}, {p.name}, "
              f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
    else:
        print(f"no CUDA device (torch built with CUDA {torch.version.cuda})")


def unmet_needs(wheels: Path) -> list[str]:
    """What the carried wheels require that the machine's packages do not satisfy (pip's --no-deps
    install does not check): one line each, for the record."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lines = []
    for wheel in sorted(wheels.glob("*.whl")):
        name = wheel.name.split("-")[0]
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                found = md.version(canonicalize_name(req.name))
            except md.PackageNotFoundError:
                lines.append(f"{name} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(found, prereleases=True):
                lines.append(f"{name} needs {req}: found {found}")
    return lines


def modules() -> list[str]:
    import vramfit

    found = [m.name for m in pkgutil.walk_packages(vramfit.__path__, "vramfit.")]
    return ["vramfit", *sorted(n for n in found if n != "vramfit.__main__")]  # __main__ runs the CLI


def import_all() -> list[str]:
    """Every vramfit module and the benches the stages run, imported here; the failures, each with
    its last traceback line."""
    sys.path.insert(0, str(BENCH))
    failed = []
    for name in [*modules(), *STAGE_BENCHES]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- any failure to import is what this check reports
            failed.append(f"{name}: {traceback.format_exc().strip().splitlines()[-1]}")
    return failed


def setup(wheels: str) -> int:
    versions()
    for line in unmet_needs(Path(wheels)):
        print(f"warning: {line}")
    failed = import_all()
    print(f"imports: {len(modules()) - sum(f.startswith('vramfit') for f in failed)} of {len(modules())} "
          f"vramfit modules, {len(STAGE_BENCHES)} benches" + (f"; FAILED {len(failed)}:" if failed else ": ok"))
    for line in failed:
        print(f"  {line}")
    return 1 if failed else 0


def train_samples(stage: str, seconds: float) -> int:
    """The most digits (a multiple of the rtx3060 recipe's global batch, 128, within 256..2048) that
    `stage` trains in three quarters of `seconds` at the estimated rate; the rest is slack."""
    runs, epochs, extra = SIZING[stage]
    per_epoch_s = (0.75 * seconds - runs * RUN_OVERHEAD_S - extra) / epochs
    return max(256, min(2048, int(per_epoch_s * IMAGES_PER_S) // 128 * 128))


def collect(work: str, out: str) -> int:
    """results.json: each stage's record (stages.tsv) and every JSON file it wrote."""
    work_dir = Path(work)
    stages = []
    for line in (work_dir / "stages.tsv").read_text().splitlines():
        name, status, code, seconds, granted = line.split("\t")
        figures = {}
        for f in sorted((work_dir / "figures" / name).glob("*.json")):
            try:
                figures[f.name] = json.loads(f.read_text())
            except ValueError:
                figures[f.name] = "not JSON: cut off while it was written"
        stages.append({"stage": name, "status": status, "exit_code": int(code) if code else None,
                       "seconds": int(seconds) if seconds else None, "granted_s": int(granted) if granted else None,
                       "figures": figures})
    meta = json.loads((work_dir / "meta.json").read_text()) if (work_dir / "meta.json").is_file() else {}
    Path(out, "results.json").write_text(json.dumps({**meta, "stages": stages}, indent=1))
    return 0


def target(path: str) -> int:
    """The absolute target holds for one H200 only; another card prints its figure for the record."""
    for r in json.loads(Path(path).read_text())["results"]:
        if r["model"] == "resnet50" and r["precision"] == "bf16":
            h200 = "H200" in r["device"]
            verdict = (" (target >= 3000 on one H200: " + ("ok)" if r["vramfit"] >= 3000 else "MISSED)")) if h200 else ""
            print(f"resnet50 bf16 on {r['device']}: {r['vramfit']:.0f} images/s{verdict}")
    return 0


def chooser_epochs(samples: int) -> int:
    """Epochs of `samples` the chooser trains so that its run pays for measuring (the package's own
    rule, tuning.fit.min_segment_steps: a shorter run measures nothing, and the stage would show
    the planner's pick as the chooser's)."""
    from vramfit.config import build_config
    from vramfit.tuning.fit import min_segment_steps

    steps = min_segment_steps(build_config("rtx3060"))
    return max(1, math.ceil(steps / max(1, samples // RECIPE_GLOBAL_BATCH)))


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "setup":
        return setup(*rest)
    if command == "size":
        print(train_samples(rest[0], float(rest[1])))
        return 0
    if command == "chooser-epochs":
        print(chooser_epochs(int(rest[0])))
        return 0
    if command == "collect":
        return collect(*rest)
    if command == "target":
        return target(*rest)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
