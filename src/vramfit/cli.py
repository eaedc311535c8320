"""Command line: `vramfit train | plan | eval | predict | export | compare | scan-data | prepare`."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from .errors import VramfitError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", metavar="NAME", help="a shipped recipe (see the list below), a path to a YAML "
                                                    "recipe, or `auto` (the one that fits this GPU)")
    p.add_argument("--model", dest="model.name", metavar="NAME", help="any timm model name, e.g. efficientnet_b0 (plan: several, comma-separated, "
                        "compares them by memory)")
    p.add_argument("--data", dest="data.source", metavar="SOURCE",
                   help="`digits` (built in), an image folder, a saved dataset, parquet, or a Hub id")
    p.add_argument("--image-size", dest="data.image_size", type=bounded(int, 8, 2048), metavar="PX",
                   help="training and evaluation image size in pixels")
    p.add_argument("--global-batch", dest="train.global_batch", type=COUNT, metavar="N",
                   help="samples per optimizer step across all processes")
    p.add_argument("--micro-batch", dest="train.micro_batch", type=_micro, metavar="N|auto",
                   help="samples per forward/backward on one process, or `auto`")
    p.add_argument("--precision", dest="train.precision", choices=["auto", "fp32", "no", "bf16", "fp16"],
                   help="fp32 (`no` is the same), bf16 or fp16 autocast; auto: bf16 where the GPU has it, "
                        "else fp16; fp32 on a CPU")
    p.add_argument("--grad-checkpointing", dest="model.grad_checkpointing",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in backward: less memory, ~20-30%% slower, same maths")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.lr=3e-4 (repeatable)")


def bounded(cast, low=None, high=None, *, above: bool = False):
    """An argparse type: `cast` of the text, in [low, high] (or (low, high] with `above`); out of
    range it is a usage error that says the range (exit 2), never a value torch meets later."""
    kind = "a whole number" if cast is int else "a number"
    where = " and ".join(([f"> {low}" if above else f">= {low}"] if low is not None else [])
                         + ([f"<= {high}"] if high is not None else []))

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes {kind}, not {text!r}") from None
        if low is not None and (value <= low if above else value < low) or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} is out of range: it takes {kind} {where}")
        return value

    parse.__name__ = cast.__name__
    return parse


COUNT = bounded(int, 1)  # a number of things: at least one
POSITIVE = bounded(float, 0.0, above=True)


TRAIN_DESCRIPTION = """Train an image classifier that fits the GPU: the micro-batch is planned for the card
and an out-of-memory step is retried smaller with the same maths; re-running the same command
resumes the run exactly."""


EXAMPLES = {  # each command's --help ends with these
    "train": [
        "vramfit train --recipe quickstart                      # the built-in digits, on a CPU in a minute",
        "vramfit train --recipe rtx3060 --data ~/photos          # ResNet50 on a 12 GB card",
        "vramfit train --recipe rtx3060 --data ~/photos --model efficientnet_b0   # a lighter backbone",
        "accelerate launch --config_file accel_configs/multi_gpu.yaml train.py --recipe multi_gpu_8x --data ~/photos",
    ],
    "eval": [
        "vramfit eval --run runs/NAME                       # the run's own validation split",
        'vramfit eval --run runs/NAME --split test          # a held-out split of the same data',
        'vramfit eval --run runs/NAME --data ~/more-photos  # other labelled data, same classes',
    ],
    "predict": [
        'vramfit predict --run runs/NAME photo.jpg folder/   # top-5 labels of each image',
        'vramfit predict --run runs/NAME folder/ --csv > labels.csv',
    ],
    "export": [
        'vramfit export --run runs/NAME --format onnx --format torchscript',
        'vramfit export --run runs/NAME --push-to-hub user/my-classifier --private',
    ],
    "plan": [
        'vramfit plan --recipe rtx3060                        # memory of the recipe on its card',
        'vramfit plan --recipe rtx3060 --model efficientnet_b0 --precision bf16 --json',
        'vramfit plan --recipe rtx3060 --model resnet50,efficientnet_b0,resnet34   # backbones by memory',
        'vramfit plan --recipe multi_gpu_8x --num-processes 8 --memory-gib 80',
    ],
    "scan-data": [
        'vramfit scan-data --data ~/photos   # every unreadable image, before training (exit 1 if any)',
    ],
    "compare": [
        'vramfit compare runs/                               # every run under runs/',
        'vramfit compare runs/a runs/b --plot compare.png --csv runs.csv',
        'vramfit compare runs/ --wide                        # every column, full run names',
    ],
    "prepare": [
        'vramfit prepare --data ~/photos --output ~/photos-320   # resized once; train with --data ~/photos-320',
    ],
    "doctor": [
        'vramfit doctor                              # versions, GPUs, the recipe that fits this card',
        'vramfit doctor --recipe rtx3060 --data ~/photos',
        'vramfit doctor --diff runs/NAME              # what differs from the machine the run came from',
    ],
    "lr-find": [
        'vramfit lr-find --recipe rtx3060 --data ~/photos --plot lr.png',
    ],
}


def _command(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose --help has a description and ends with its examples."""
    return sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                          epilog=_examples(EXAMPLES[name]), formatter_class=argparse.RawDescriptionHelpFormatter)


def _examples(lines: list[str]) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _train_epilog() -> str:
    from .config import recipe_dirs

    names = sorted({p.stem for d in recipe_dirs() for p in d.glob("*.yaml")})
    return "recipes: " + ", ".join(names) + "\n\n" + _examples(EXAMPLES["train"])


def _micro(v: str):
    if v == "auto":
        return v
    try:
        value = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--micro-batch takes a whole number or `auto`, not {v!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--micro-batch {v}: it takes a whole number >= 1, or `auto`")
    return value


def _workers(v: str):
    """`--workers`: `auto` or 0..64 (the range data.num_workers takes), as a usage error otherwise."""
    return v if v == "auto" else bounded(int, 0, 64)(v)


def _add_model_commands(sub) -> None:
    """The commands that use a trained run's model: eval, predict, export."""
    ev = _command(sub, "eval", "evaluate a run's model: top-1/top-5, per class, confusion matrix")
    ev.add_argument("--run", required=True, help="run folder (runs/<run_name>)")
    ev.add_argument("--data", help="another labelled source with the same classes (default: the run's)")
    ev.add_argument("--split", help="a named split of the source, e.g. test (default: the run's validation split)")
    ev.add_argument("--batch-size", type=COUNT, default=64, metavar="N", help="images per forward (default 64)")

    pd = _command(sub, "predict", "top-k labels of images with a run's model")
    pd.add_argument("--run", required=True, help="run folder (runs/<run_name>)")
    pd.add_argument("images", nargs="+", metavar="IMAGE_OR_FOLDER", help="image files, or folders of them")
    pd.add_argument("--top-k", type=COUNT, default=5, metavar="K", help="labels per image (default 5)")
    pd.add_argument("--batch-size", type=COUNT, default=64, metavar="N", help="images per forward (default 64)")
    fmt = pd.add_mutually_exclusive_group()
    fmt.add_argument("--json", dest="fmt", action="store_const", const="json", help="print JSON")
    fmt.add_argument("--csv", dest="fmt", action="store_const", const="csv", help="print CSV")

    ex = _command(sub, "export", "a run's model as ONNX / TorchScript / safetensors with a model card")
    ex.add_argument("--run", required=True, help="run folder (runs/<run_name>)")
    ex.add_argument("--format", action="append", default=[], choices=["onnx", "torchscript", "safetensors"],
                    help="repeatable")
    ex.add_argument("--output", help="folder for the files (default: RUN/export)")
    ex.add_argument("--push-to-hub", metavar="REPO", help="push to the Hugging Face Hub in timm's format (user/name)")
    ex.add_argument("--private", action="store_true", help="with --push-to-hub: a private repository")


def parser() -> argparse.ArgumentParser:
    import vramfit

    ap = argparse.ArgumentParser(prog="vramfit", description="Train image classifiers that fit your GPU.")
    ap.add_argument("--version", action="version", version=f"vramfit {vramfit.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train, evaluate and save a run", description=TRAIN_DESCRIPTION,
                       epilog=_train_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(t)
    t.add_argument("--output", metavar="DIR", help="folder that holds run folders (default runs/)")
    t.add_argument("--run-name", dest="run_name", metavar="NAME",
                   help="the run folder's name under --output (default: named from the settings)")
    t.add_argument("--epochs", dest="train.epochs", type=COUNT, metavar="N", help="epochs to train")
    t.add_argument("--lr", dest="optim.lr", type=POSITIVE, metavar="LR",
                   help="learning rate at the recipe's base batch (scaled to --global-batch)")
    t.add_argument("--seed", dest="train.seed", type=bounded(int, 0), metavar="N",
                   help="seed of the weights, sample order and augmentation")
    t.add_argument("--pretrained", dest="model.pretrained", action=argparse.BooleanOptionalAction,
                   default=None, help="start from the Hub's pretrained weights, or from random ones "
                                      "(offline: --no-pretrained)")
    t.add_argument("--workers", dest="data.num_workers", type=_workers, metavar="N|auto",
                   help="data loader worker processes (0: load in the training process; auto: sized to "
                        "the cores)")
    t.add_argument("--tracker", dest="tracking.tracker", metavar="NAMES",
                   help="none, wandb, tensorboard, or both: wandb,tensorboard")
    t.add_argument("--resume", metavar="auto|never|PATH",
                   help="`auto` (default: continue this run if it has a checkpoint), `never`, or a "
                        "checkpoint folder")

    pl = _command(sub, "plan", "predict device memory for a recipe, without a GPU")
    _common(pl)
    pl.add_argument("--memory-gib", type=POSITIVE, help="device memory to fit into (default: the recipe's card)")
    pl.add_argument("--num-processes", type=COUNT, default=None,
                    help="processes (GPUs) sharing the global batch (default: the recipe's hardware.gpus)")
    pl.add_argument("--num-classes", type=bounded(int, 2), default=None,
                    help="classes of the head (default: 1000; the built-in digits: 10)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    sd = _command(sub, "scan-data", "check every image of a dataset before training")
    sd.add_argument("--data", required=True, metavar="SOURCE", help="the images to check (any --data source)")
    sd.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="data settings, e.g. --set data.image_column=img (repeatable)")

    cm = _command(sub, "compare", "summaries of several runs side by side")
    cm.add_argument("runs", nargs="+", help="run folders, or an output folder such as runs/")
    cm.add_argument("--sort", default="best_accuracy", help="summary.json key to sort by (descending)")
    cm.add_argument("--json", action="store_true", help="print the runs as JSON")
    cm.add_argument("--plot", metavar="PNG", help="write accuracy vs wall time, peak memory and throughput "
                    "(a folder: compare.png in it)")
    cm.add_argument("--csv", metavar="FILE",
                    help="write the table as CSV (raw numbers; a folder: runs.csv in it)")
    cm.add_argument("--wide", action="store_true",
                    help="every column and full run names (the default table fits 120 columns)")

    _add_model_commands(sub)

    _add_prepare_command(sub)

    dr = _command(sub, "doctor", "this machine: versions, GPUs, the recipe that fits; checks a recipe and data")
    dr.add_argument("--recipe", help="plan this recipe for this card (`auto`: the one that fits)")
    dr.add_argument("--data", dest="data.source", help="check that these images come out at the recipe's size")
    dr.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key of the recipe (repeatable)")
    dr.add_argument("--json", action="store_true", help="print the report as JSON")
    dr.add_argument("--diff", metavar="RUN_DIR", help="what differs from the machine a run came from")

    _add_lr_find(sub)
    return ap


def _add_lr_find(sub) -> None:
    lf = _command(sub, "lr-find", "LR range test on the recipe's model and data: suggests an LR, plots it")
    _common(lf)
    lf.add_argument("--steps", type=bounded(int, 10), default=100,
                    help="optimizer steps of the sweep at most (default 100, at least 10)")
    lf.add_argument("--start-lr", type=POSITIVE, default=1e-7, metavar="LR", help="first LR of the sweep (default 1e-7)")
    lf.add_argument("--end-lr", type=POSITIVE, default=10.0, metavar="LR", help="last LR of the sweep (default 10)")
    lf.add_argument("--output", metavar="DIR", help="the folder of run folders the plot goes in by default "
                                                   "(default runs/)")
    lf.add_argument("--plot", help="where the plot goes (PNG; default OUTPUT/RUN_NAME.lr_find.png, beside "
                                   "the run folder these settings train into; a folder: lr_find.png in it)")


def _flags(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if "." in k and v is not None}


def train_config(args: list[str]):
    """The config of `vramfit train ARGS` (what follows `train`; `train.py ARGS` is the same)."""
    return _config(parser().parse_args(["train", *args]))


def _config(ns):
    flags = _flags(ns)
    for k in ("output", "run_name", "resume"):
        if getattr(ns, k, None) is not None:
            flags[k] = getattr(ns, k)
    return resolve_config(getattr(ns, "recipe", None), ns.sets, flags)


def resolve_config(recipe: str | None = None, sets: list[str] | None = None, flags: dict | None = None):
    """`config.build_config`, with `--recipe auto` first resolved here (the recipe for this
    machine's card, with its overrides: vramfit.commands.doctor), so that the config layer never looks at
    the hardware."""
    from .config import build_config

    if recipe == "auto":
        from .commands.doctor import resolve_auto

        recipe, sets = resolve_auto(list(sets or []))
    return build_config(recipe, sets, flags)


def _model_list(value: str | None) -> list[str]:
    """`--model a,b,c` (plan compares backbones): the names, in order, each once."""
    if value is None or "," not in value:
        return [value] if value else []
    names = [n.strip() for n in value.split(",")]
    if any(not n for n in names) or len(set(names)) != len(names):
        raise VramfitError(f"--model {value!r}: give distinct model names separated by commas",
                           hint="e.g. --model resnet50,efficientnet_b0,resnet34")
    return names


def _starting():
    """A run's first line, before torch, timm and accelerate load (seconds on a busy machine), with
    the console's logging set up here so that it shows in a job log too (the launch keeps it: a
    second basicConfig changes nothing). Main process only: RANK is set by the launchers."""
    import logging

    from .train.progress import stage

    main = _env_int("RANK", _env_int("LOCAL_RANK", 0)) == 0
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(message)s", stream=sys.stderr)
    return stage("vramfit train: starting (importing torch, timm and accelerate)", main=main)


def _add_prepare_command(sub) -> None:
    pr = _command(sub, "prepare", "pre-resize a dataset once into a compact Arrow dataset")
    pr.add_argument("--data", required=True, metavar="SOURCE", help="the dataset to resize (any --data source)")
    pr.add_argument("--output", required=True, metavar="DIR", help="where the resized Arrow dataset goes")
    pr.add_argument("--format", choices=("arrow", "webdataset"), default="arrow",
                    help="arrow: a resized dataset (save_to_disk); webdataset: tar shards of the images as "
                         "stored, with index.json, to train from streamed")
    pr.add_argument("--shard-mb", type=bounded(float, 1), default=128, metavar="MB",
                    help="webdataset: largest shard (default 128)")
    pr.add_argument("--shard-samples", type=bounded(int, 1), default=None, metavar="N",
                    help="webdataset: most samples a shard (default: by --shard-mb only)")
    pr.add_argument("--max-side", type=bounded(int, 16), default=320, metavar="PX",
                    help="longest side after resizing (default 320)")
    pr.add_argument("--quality", type=bounded(int, 1, 100), default=90, metavar="Q",
                    help="JPEG quality of the stored images, 1-100 (default 90)")
    pr.add_argument("--workers", type=COUNT, default=None, metavar="N",
                    help="decoding processes (default: one per CPU)")
    pr.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="data settings, e.g. --set data.label_column=fine_label (repeatable)")


def run(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if ns.command in ("train", "eval", "predict", "scan-data", "prepare", "lr-find", "doctor"):
        _writable_caches(ns)
    if ns.command == "train":
        _train(ns)
        return 0
    if ns.command == "plan":
        from .planner import run_plan

        cfgs = []
        for name in _model_list(getattr(ns, "model.name", None)) or [None]:
            setattr(ns, "model.name", name)
            cfgs.append(_config(ns))
        cfg = cfgs[0]
        classes = ns.num_classes or (10 if cfg.data.source == "digits" else 1000)
        if len(cfgs) > 1:
            from .planner.lineup import run_lineup

            run_lineup(cfgs, classes, num_processes=ns.num_processes or cfg.hardware.gpus,
                       memory_gib=ns.memory_gib, as_json=ns.json)
            return 0
        run_plan(cfg, classes, num_processes=ns.num_processes or cfg.hardware.gpus, memory_gib=ns.memory_gib,
                 micro_batch=cfg.train.micro_batch if isinstance(cfg.train.micro_batch, int) else None,
                 as_json=ns.json)
        return 0
    if ns.command == "scan-data":
        from .commands.scan_data import scan_data

        return scan_data(_data_config(ns))
    if ns.command == "compare":
        from .commands.compare import compare

        compare(ns.runs, ns.sort, ns.json, plot_path=ns.plot, csv_path=ns.csv, wide=ns.wide)
        return 0
    if ns.command == "eval":
        from .commands.eval import evaluate_run

        evaluate_run(ns.run, ns.data, ns.split, batch_size=ns.batch_size)
        return 0
    if ns.command == "predict":
        from .commands.predict import predict

        predict(ns.run, ns.images, k=ns.top_k, fmt=ns.fmt or "table", batch_size=ns.batch_size)
        return 0
    if ns.command == "export":
        from .commands.export import export_run

        export_run(ns.run, ns.format, ns.output, push_to_hub=ns.push_to_hub, private=ns.private)
        return 0
    if ns.command == "prepare":
        from .commands.prepare import prepare

        if ns.format == "webdataset":
            from .commands.prepare import prepare_shards

            prepare_shards(_data_config(ns), ns.output, ns.shard_mb, ns.shard_samples or 0)
        else:
            prepare(_data_config(ns), ns.output, ns.max_side, ns.quality, ns.workers)
        return 0
    if ns.command == "doctor":
        from .commands.doctor import doctor

        data = getattr(ns, "data.source")
        rep = doctor(_config(ns) if ns.recipe or data else None, with_data=bool(data), run_dir=ns.diff,
                     as_json=ns.json)
        return 0 if rep.get("data", {}).get("ok", True) else 1
    if ns.command == "lr-find":
        from .commands.lr_find import lr_find

        if ns.end_lr <= ns.start_lr:
            raise VramfitError(f"--end-lr {ns.end_lr:g} is not above --start-lr {ns.start_lr:g}: the sweep "
                               "raises the LR from the start to the end.", hint="e.g. --start-lr 1e-7 --end-lr 10")
        lr_find(_config(ns), ns.steps, ns.start_lr, ns.end_lr, ns.plot)
        return 0
    return 2


def _train(ns) -> None:
    from .runtime.signals import stops_setup

    with stops_setup():  # until the first step: a stop signal ends it at once, saying so
        with _starting():
            from .train.run import train

        train(_config(ns))


def _writable_caches(ns) -> None:
    """Caches under a read-only or full HOME move to a writable folder (caches.redirect_unwritable):
    under the training output for `train`, a per-user temporary folder otherwise."""
    from pathlib import Path

    from .store.caches import redirect_unwritable

    base = Path(getattr(ns, "output", None) or "runs") if ns.command == "train" else None
    for note in redirect_unwritable(base):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"vramfit: note: {note}", file=sys.stderr)


def _data_config(ns):
    from .config import build_config

    return build_config(None, ns.sets, {"data.source": ns.data}).data


def main(argv: list[str] | None = None) -> None:
    from .runtime.openmp import shorten_spin
    from .runtime.signals import StoppedInSetup

    shorten_spin()  # the process's entry, before anything imports torch (runtime/openmp.py)
    argv = sys.argv[1:] if argv is None else argv
    for stream in (sys.stdout, sys.stderr):  # a class named in any script prints under LC_ALL=C too
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower() not in ("utf-8", "utf8"):
            stream.reconfigure(errors="backslashreplace")
    try:
        code = run(argv)
        sys.stdout.flush()  # a closed pipe is found here, not in the exit's own flush (exit 120)
    except BrokenPipeError:
        if not _reader_gone():
            raise
        sys.exit(128 + 13)  # as `cat` into `head` ends (SIGPIPE): the reader took what it wanted
    except VramfitError as e:
        if _prints_here(e):
            _print_error(e)
        _close_process_group()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("\nvramfit: interrupted", file=sys.stderr)
        sys.exit(130)
    except StoppedInSetup as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"\nvramfit: {textwrap.fill(str(e), width=100)}", file=sys.stderr)
        _close_process_group()
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - another process's failure and a storage fault become a line here
        from .runtime.collectives import ProcessFailed
        from .runtime.storage import escaped_fault, full_stdout

        told = escaped_fault(e, near=full_stdout(), what="the standard output")
        if told is not None:  # a library's own writer (TensorBoard's) hit a full disk or a removed folder
            _print_error(told)
        elif not isinstance(e, ProcessFailed):
            raise
        elif os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"\nvramfit: error: {e}; its message is printed by that process.", file=sys.stderr)
        _close_process_group()
        sys.exit(2)
    sys.exit(code)


def _reader_gone() -> bool:
    """Standard output (or error) is a pipe whose reader closed it (`vramfit predict ... | head -1`):
    pointed at /dev/null, so that the exit's flush of what is left cannot fail again. Python's own
    advice for SIGPIPE (docs.python.org/3/library/signal.html#note-on-sigpipe), rather than
    SIGPIPE's default action, which would also end the process on a socket's closed peer."""
    import select

    gone = []
    for fd in (1, 2):
        try:
            poll = select.poll()
            poll.register(fd, select.POLLOUT)
            if any(ev & select.POLLERR for _, ev in poll.poll(0)):  # a pipe without a reader
                gone.append(fd)
        except (OSError, ValueError):
            continue
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in gone:
        os.dup2(null, fd)
    os.close(null)
    return bool(gone)


def _close_process_group() -> None:
    """Every process reached the same error (see collectives.agreed): close the process group
    before exiting, or its threads abort the interpreter on the way out (SIGABRT, not our code)."""
    import contextlib

    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _prints_here(e: VramfitError) -> bool:
    """One message per machine, not per process. An error every process reaches (config, data and
    model checks are deterministic; OOM, NaN and bad-file stops are agreed) is printed by the
    machine's first process; one that only some processes hit (`failed_ranks`, see
    collectives.agreed) by the first of those on each machine, so it is never lost."""
    local = _env_int("LOCAL_RANK", 0)
    failed = getattr(e, "failed_ranks", None)
    if not failed:
        return local == 0
    rank = _env_int("RANK", 0)
    first_here = rank - local
    size = _env_int("LOCAL_WORLD_SIZE", 1)
    return rank == min(r for r in failed if first_here <= r < first_here + size)


def _env_int(name: str, default: int) -> int:
    """A launch variable as a number; the default where it is not one (the error says so)."""
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip().isdigit() else default


def _print_error(e: VramfitError) -> None:
    # Paths and names are never split (at a hyphen or mid-word): they are copied from here.
    msg = e.message if "\n" in e.message else textwrap.fill(
        e.message, width=100, replace_whitespace=False, break_on_hyphens=False, break_long_words=False)
    print(f"\nvramfit: error: {msg}", file=sys.stderr)
    if e.hint:
        print(f"HINT: {e.hint}", file=sys.stderr)


if __name__ == "__main__":
    main()
