"""Recipes, accelerate configs, precedence, strictness and the batch arithmetic."""
from pathlib import Path

import pytest
import yaml

from vramfit.batching import grad_accum_steps, per_process_batch
from vramfit.config import PACKAGE_RECIPES, Config, build_config
from vramfit.errors import VramfitError

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(PACKAGE_RECIPES.glob("*.yaml"))
ACCEL = sorted((REPO / "accel_configs").glob("*.yaml"))


def test_recipes_and_configs_exist():
    names = {p.stem for p in RECIPES}
    assert {"quickstart", "rtx3060"} <= names
    assert {"cpu", "single_gpu", "multi_gpu"} <= {p.stem for p in ACCEL}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_parses_and_has_header(path):
    cfg = build_config(str(path))
    assert isinstance(cfg, Config)
    head = path.read_text().splitlines()[:6]
    assert any("launch" in line.lower() or "accelerate" in line.lower() for line in head), \
        "a recipe's header comment names its launch command"
    # A recipe states only what differs from the defaults.
    defaults = Config().model_dump(mode="json")
    raw = yaml.safe_load(path.read_text())
    for section, values in raw.items():
        if isinstance(values, dict):
            for k, v in values.items():
                if (section, k) in {("model", "name"), ("data", "source"), ("train", "global_batch")}:
                    continue  # what a recipe trains, on what data, at what batch: always stated
                assert defaults[section][k] != (list(v) if isinstance(v, tuple) else v), \
                    f"{path.stem}: {section}.{k} repeats the default"


@pytest.mark.parametrize("path", ACCEL, ids=lambda p: p.stem)
def test_every_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 1
    assert cfg.mixed_precision == "no"  # precision belongs to the recipe


def _header_command(path) -> list[str]:
    """The `accelerate launch --config_file ...` command a config's header comment shows, with its
    continuation lines, as arguments after `accelerate launch` (PATH and the address kept as written)."""
    import shlex

    lines = [line.lstrip("# ").rstrip() for line in path.read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith(f"accelerate launch --config_file {path.parent.name}/"))
    text = ""
    for line in lines[start:]:
        text += " " + line.rstrip("\\")
        if not line.endswith("\\"):
            break
    return shlex.split(text)[2:]


# What each shipped config must launch: processes in all, machines, the launcher, FSDP2 or not.
LAUNCHES = {"cpu": (1, 1, "simple", False), "single_gpu": (1, 1, "simple", False),
            "multi_gpu": (8, 1, "torchrun", False), "multi_node": (16, 2, "torchrun", False),
            "fsdp": (8, 1, "torchrun", True)}


@pytest.mark.parametrize("path", ACCEL, ids=lambda p: p.stem)
def test_every_accelerate_config_launches_what_its_header_says(path, monkeypatch):
    """The header's own command through Accelerate's launcher arguments (what `accelerate launch`
    would start: processes, machines, the environment the script gets), and the train arguments it
    passes through vramfit's config. Only cpu.yaml can run here: test_train launches it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    from vramfit.cli import parser

    monkeypatch.chdir(REPO)
    args = launch_command_parser().parse_args(_header_command(path))
    args, _, _ = _validate_launch_command(args)
    processes, machines, launcher, fsdp = LAUNCHES[path.stem]
    assert (args.num_processes, args.num_machines) == (processes, machines)
    if launcher == "simple":
        assert not (args.multi_gpu or args.use_fsdp)
        cmd, env = prepare_simple_launcher_cmd_env(args)
        assert cmd[1] == "train.py" and env["ACCELERATE_USE_CPU"] == str(path.stem == "cpu")
    else:
        env = prepare_multi_gpu_env(args)
        assert int(args.nproc_per_node) == processes // machines and int(getattr(args, "nnodes", None) or 1) == machines
        if machines > 1:  # every machine meets the first one's address, as the header shows it
            assert args.rdzv_endpoint.endswith(":29500") and args.node_rank == 0
        assert (env.get("ACCELERATE_USE_FSDP") == "true", env.get("FSDP_VERSION")) == \
            ((True, "2") if fsdp else (False, None))
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"  # the recipe's train.precision decides
    ns = parser().parse_args(["train", *args.training_script_args])
    assert build_config(getattr(ns, "recipe")).recipe  # the recipe it names is shipped


def test_by_name_or_path_and_precedence(tmp_path):
    cfg = build_config("quickstart")
    assert cfg.data.source == "digits" and cfg.model.name == "resnet18"
    cfg = build_config(str(PACKAGE_RECIPES / "quickstart.yaml"), sets=["optim.lr=0.5", "train.epochs=3"],
                       flags={"optim.lr": 0.25})
    assert cfg.optim.lr == 0.25  # flag beats --set
    assert cfg.train.epochs == 3  # --set beats recipe
    assert cfg.train.label_smoothing == 0.0  # recipe beats default
    assert cfg.optim.name == "adamw"  # default


def test_unknown_key_names_closest():
    with pytest.raises(VramfitError) as e:
        build_config("quickstart", sets=["train.global_bacth=32"])
    assert "train.global_bacth" in str(e.value) and "train.global_batch" in str(e.value)
    with pytest.raises(VramfitError) as e:
        build_config(None, sets=["optimizer.lr=1"])
    assert "optim" in str(e.value)


def test_unknown_recipe_suggests():
    with pytest.raises(VramfitError) as e:
        build_config("rtx306")
    assert "rtx3060" in str(e.value)


def test_bad_values_are_explained():
    with pytest.raises(VramfitError) as e:
        build_config(None, sets=["train.precision=fp8"])
    assert "train.precision" in str(e.value)


def test_batch_arithmetic():
    assert grad_accum_steps(128, 16) == 8
    assert grad_accum_steps(16, 16) == 1
    assert grad_accum_steps(64, 12) == 6  # need not divide: 11 + 11 + 11 + 11 + 10 + 10
    assert per_process_batch(128, 8) == 16
    with pytest.raises(VramfitError) as e:
        per_process_batch(30, 4)
    assert "28" in str(e.value) and "32" in str(e.value)


def test_config_yaml_roundtrip():
    cfg = build_config("rtx3060")
    again = Config.model_validate(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize("given", ["fp32", "no", "32"])
def test_fp32_is_one_precision_by_any_name(given):
    """`--precision fp32` is what Accelerate calls `no`; either way the config, the run name and
    Accelerate agree (YAML reads a bare `no` as false: that is fp32 too)."""
    from vramfit.cli import parser
    from vramfit.runtime.precision import planned, resolve

    cfg = build_config("quickstart", sets=[f"train.precision={given}"])
    from vramfit.store.runfolder import RunPaths

    assert cfg.train.precision == "fp32" and "-fp32-" in RunPaths.of(cfg, resolve(cfg.train.precision, "cpu").name).name
    assert resolve(cfg.train.precision, "cpu").accelerate == "no" and planned("bf16").accelerate == "bf16"
    if given != "32":
        ns = parser().parse_args(["train", "--precision", given])
        assert build_config(None, flags={"train.precision": vars(ns)["train.precision"]}).train.precision == "fp32"
    with pytest.raises(VramfitError, match="train.precision"):
        build_config(None, sets=["train.precision=fp64"])


@pytest.mark.parametrize("argv, said", [
    (["train", "--set", "data.num_workers=-1"], "data.num_workers takes `auto` or a whole number from 0 to 64"),
    (["train", "--set", "data.image_size=100000"], "less than or equal to 2048"),
    (["train", "--run-name", "../../x"], "must be one folder name"),
    (["train", "--micro-batch", "0"], "--micro-batch 0: it takes a whole number >= 1"),
    (["train", "--epochs", "0"], "--epochs: 0 is out of range"),
    (["predict", "--run", "r", "--batch-size", "0", "a.png"], "--batch-size: 0 is out of range"),
    (["predict", "--run", "r", "--top-k", "0", "a.png"], "--top-k: 0 is out of range"),
    (["eval", "--run", "r", "--batch-size", "-3"], "--batch-size: -3 is out of range"),
    (["plan", "--recipe", "quickstart", "--memory-gib", "0"], "--memory-gib: 0 is out of range: it takes a number > 0"),
    (["plan", "--recipe", "quickstart", "--num-processes", "0"], "--num-processes: 0 is out of range"),
    (["plan", "--recipe", "quickstart", "--num-classes", "0"], "--num-classes: 0 is out of range"),
    (["lr-find", "--recipe", "quickstart", "--steps", "0"], "--steps: 0 is out of range: it takes a whole number >= 10"),
    (["lr-find", "--recipe", "quickstart", "--start-lr", "1", "--end-lr", "0.1"], "is not above --start-lr"),
    (["prepare", "--data", "d", "--output", "o", "--quality", "101"], "--quality: 101 is out of range"),
])
def test_every_number_is_checked_with_its_range_before_use(argv, said, capsys, tmp_path, monkeypatch):
    """Bad numbers are a usage error naming the range (exit 2), before any data, model or tensor."""
    from vramfit.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and said in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_a_run_name_is_one_folder_name():
    from vramfit.config import build_config

    for bad in ("..", ".", "a/b", " "):
        with pytest.raises(VramfitError, match="must be one folder name"):
            build_config(None, [], {"run_name": bad})
    assert build_config(None, [], {"run_name": "résumé-2"}).run_name == "résumé-2"


def test_non_ascii_names_print_on_an_ascii_terminal(monkeypatch, tmp_path):
    """LC_ALL=C: stderr is ASCII. A class, path or message with `é` prints escaped, never a
    UnicodeEncodeError traceback in place of the message."""
    import io
    import sys

    from vramfit.cli import main

    raw = io.BytesIO()
    ascii_err = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stderr", ascii_err)
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(tmp_path / "café"), "--output", str(tmp_path / "runs")])
    ascii_err.flush()
    text = raw.getvalue().decode("ascii")
    assert e.value.code == 2 and "caf\\xe9" in text and "HINT:" in text


def test_default_run_names_of_the_readmes_commands_never_collide(tmp_path):
    """The README's training commands, run one after another into one --output, each get their
    own folder; the same command gets the same folder again (so it resumes), and a setting that
    only changes how the run executes (the micro-batch, checkpointing) keeps it."""
    from vramfit.store.runfolder import RunPaths

    photos = str(tmp_path / "photos")
    commands = [("quickstart", [], {}), ("quickstart", [], {"train.epochs": 1}),
                ("quickstart", [], {"data.source": photos}),
                ("rtx3060", [], {"data.source": photos}),
                ("rtx3060", [], {"data.source": photos, "model.name": "efficientnet_b0"}),
                ("rtx3060", ["optim.lr=3e-4", "data.image_size=192"], {"data.source": photos})]
    names = [RunPaths.of(build_config(*c), "bf16").name for c in commands]
    assert len(set(names)) == len(names), names
    assert names[1].endswith("-epochs1") and names[2].endswith("-photos") and "-lr0.0003" in names[5]
    assert names == [RunPaths.of(build_config(*c), "bf16").name for c in commands]  # same command, same run
    execution_only = build_config("quickstart", ["train.micro_batch=8", "model.grad_checkpointing=true",
                                                 "data.num_workers=0", "checkpoint.every_steps=5"])
    assert RunPaths.of(execution_only, "bf16").name == names[0]
    many = build_config("quickstart", ["optim.lr=3e-4", "optim.weight_decay=0.01", "model.drop_rate=0.1",
                                       "data.hflip=0.25", "train.label_smoothing=0.2"])
    long = RunPaths.of(many, "bf16").name
    assert long.startswith(names[0] + "-cfg") and len(long) < len(names[0]) + 16  # a short hash, not a list


def test_every_command_has_a_description_examples_and_help_on_every_flag():
    import argparse

    from vramfit.cli import parser

    (commands,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in commands.choices.items():
        assert p.description and "examples:" in p.epilog and f"vramfit {name}" in p.epilog, name
        missing = [a.dest for a in p._actions if not a.help and not isinstance(a, argparse._HelpAction)]
        assert not missing, (name, missing)
    assert "recipes: " in commands.choices["train"].epilog and "quickstart" in commands.choices["train"].epilog


@pytest.mark.parametrize("argv, said", [
    (["--set", "optim.lr=[1"], "`--set optim.lr=[1`: the value `[1` is not valid YAML"),
    (["--set", "data.source=: :"], "is not valid YAML"),
    (["--set", "model.name=@x"], "is not valid YAML"),
    (["--recipe", "latin1.yaml"], "latin1.yaml is not UTF-8 text"),
    (["--recipe", "list.yaml"], "list.yaml must be a mapping of sections, got list"),
    (["--set", "train=3", "--set", "train.epochs=2"], "`train` was given a value (3)"),
    (["--set", "optim.lr.x=1"], "`optim.lr` is a value, not a section"),
    (["--set", "data.image_size.w=1"], "`data.image_size` is a value, not a section"),
])
def test_malformed_input_is_named_with_a_hint(argv, said, tmp_path, monkeypatch, capsys):
    """Through the real command line: exit 2, the file or key named, a HINT, never a traceback."""
    from vramfit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes("train:\n  epochs: 2  # caf\xe9\n".encode("latin-1"))
    (tmp_path / "list.yaml").write_text("- train\n- optim\n")
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and said in err and " HINT: " in err and "Traceback" not in err


@pytest.mark.parametrize("env, said", [
    ({"WORLD_SIZE": "2"}, "half set: WORLD_SIZE=2, but not RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
    ({"RANK": "1"}, "half set: RANK=1, but not WORLD_SIZE"),
    ({"LOCAL_RANK": "0"}, "half set: LOCAL_RANK=0, but not RANK, WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}, "but not MASTER_ADDR"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "RANK=2 is not below WORLD_SIZE=2"),
])
def test_half_set_launch_variables_are_named(env, said, tmp_path, monkeypatch, capsys):
    """Before Accelerate reads them (its ValueError traceback, or a silent wait)."""
    from helpers import tiny_args
    from vramfit.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main(["train", *tiny_args(), "--output", str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())  # the paragraph as one line, wherever it wrapped
    assert e.value.code == 2 and said in err and "HINT: " in err and "torchrun --nproc_per_node 2" in err
    assert "Traceback" not in err and not any(tmp_path.iterdir())


def test_train_takes_pretrained_and_workers_flags_above_set_and_recipe():
    from vramfit.cli import parser, resolve_config

    def config(*argv):
        ns = parser().parse_args(["train", "--recipe", "rtx3060", *argv])
        flags = {k: v for k, v in vars(ns).items() if "." in k and v is not None}
        return resolve_config(ns.recipe, ns.sets, flags)

    recipe = config()
    assert recipe.model.pretrained is True  # the recipe's
    cfg = config("--no-pretrained", "--workers", "3", "--set", "model.pretrained=true",
                 "--set", "data.num_workers=1")
    assert (cfg.model.pretrained, cfg.data.num_workers) == (False, 3)  # flags beat --set
    assert config("--pretrained", "--set", "model.pretrained=false").model.pretrained is True
    assert config("--workers", "0").data.num_workers == 0
    assert config("--workers", "auto").data.num_workers == "auto"
    for bad in ("65", "-1", "many"):
        with pytest.raises(SystemExit) as e:
            parser().parse_args(["train", "--workers", bad])
        assert e.value.code == 2


@pytest.mark.parametrize("argv, cause, fix", [
    (["--run-name", "r" * 256],
     "run_name is 256 bytes long (256 characters); a folder name holds at most 255 bytes",
     "HINT: give a --run-name of at most 255 bytes"),
    (["--set", "train.epochs=0"], "`train.epochs`: Input should be greater than or equal to 1 (got 0)",
     "HINT: give train.epochs a value of at least 1, e.g. --set train.epochs=10 (the default)"),
    (["--set", "model.drop_rate=1"], "`model.drop_rate`: Input should be less than 1",
     "HINT: give model.drop_rate a value below 1.0, e.g. --set model.drop_rate=0.0 (the default)"),
    (["--set", "train.precision=fp8"], "(got 'fp8')",
     "HINT: give train.precision one of 'auto', 'fp32', 'bf16' or 'fp16', e.g. --set train.precision=auto"),
    (["--set", "optim.lr=fast"], "`optim.lr`: Input should be a valid number",
     "HINT: give optim.lr a number, e.g. --set optim.lr=0.001 (the default)"),
    (["--set", "train.micro_batch=big"], "(got 'big')",
     "HINT: give train.micro_batch a whole number or one of 'auto'"),
    (["--set", "data.progressive_resize.delay_fraction=0.9"],
     "delay_fraction + finetune_fraction is 1.1, over 1",
     "HINT: lower one of them so that the two add up to 1 at most"),
    (["--set", "data.num_workers=99"], "takes `auto` or a whole number from 0 to 64, not 99",
     "HINT: e.g. --workers auto"),
])
def test_each_refused_value_says_its_own_limit_and_fix(argv, cause, fix, capsys, tmp_path, monkeypatch):
    """A value a check refuses names what was wrong and the limit, and its HINT how to fix that
    value (never only the generic pointer to the docs)."""
    from vramfit.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["train", "--output", str(tmp_path / "runs"), *argv])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2 and cause in err and fix in err and "Traceback" not in err, err[-2000:]
    assert "see docs/recipes.md for the keys" not in err
    assert list(tmp_path.iterdir()) == []
