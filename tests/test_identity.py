"""A run's identity (docs/recipes.md): every setting that changes the maths or the data is refused on
resume (before anything is written), every execution-only one resumes and is said, and a change
allowed on purpose is recorded with the step it took effect."""

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from helpers import class_tree, last_weights, same_weights, tiny_args, train_args
from vramfit.config import EXECUTION_ONLY, Config, execution_group, flat, maths_settings
from vramfit.errors import VramfitError
from vramfit.runtime.launch import forget
from vramfit.store import checkpoint


# Two epochs of six steps: long enough to stop, resume and change in, short enough for the suite.
ARGS = tiny_args("--epochs", "2", "--set", "data.limit_train_samples=96", "--set", "data.limit_val_samples=32")


def _snapshot(run_dir: Path) -> dict:
    """Every file of a run folder (but its lock) with a hash of its bytes."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != ".vramfit.lock"}


# One setting of each group that shapes the run: the split, augmentation, the model, the loss, the
# optimiser, the precision that runs (the data's listing: below; every setting: config.maths_settings).
MATHS_CHANGES = [
    (("--set", "data.val_fraction=0.5"), "data.val_fraction", "0.2", "0.5"),
    (("--set", "data.hflip=0.5"), "data.hflip", "0.0", "0.5"),
    (("--set", "model.drop_rate=0.2"), "model.drop_rate", "0.0", "0.2"),
    (("--set", "train.label_smoothing=0.2"), "train.label_smoothing", "0.1", "0.2"),
    (("--set", "optim.weight_decay=0.3"), "optim.weight_decay", "0.05", "0.3"),
    (("--precision", "bf16"), "train.precision", "'fp32'", "'bf16'"),
]


def test_a_changed_run_is_refused_untouched_and_the_original_command_then_resumes_bitwise(train_cli):
    args = ARGS
    ref_dir, code = train_cli(*args, run_name="ref")
    assert code == 0
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=3", run_name="x")
    assert code == 143
    before = _snapshot(run_dir)
    for change, key, old, new in MATHS_CHANGES:
        with pytest.raises(VramfitError) as e:
            train_cli(*args, *change, run_name="x")
        forget()  # each command is a new process: its own Accelerator (precision)
        msg, hint = str(e.value), e.value.hint
        assert e.value.exit_code == 2 and f"{key}: {old} -> {new}" in msg, (change, msg)
        assert "--run-name" in hint and "allow_resume_change=true" in hint, hint
        assert _snapshot(run_dir) == before, f"{change} changed the run folder"
    run_dir, code = train_cli(*args, run_name="x")  # the original command
    assert code == 0
    assert same_weights(last_weights(ref_dir), last_weights(run_dir))
    assert json.loads((run_dir / "summary.json").read_text())["resume_changes"] == []


def test_execution_only_settings_resume_and_say_what_changed(train_cli, caplog):
    caplog.set_level("INFO", logger="vramfit")
    run_dir, code = train_cli(*ARGS, "--set", "debug.signal_at_step=3", run_name="x")
    assert code == 143
    caplog.clear()
    run_dir, code = train_cli(*ARGS, *("--micro-batch", "8", "--set", "model.channels_last=true",
                                         "--set", "train.log_every_steps=5", "--set", "checkpoint.keep_last=3",
                                         "--set", "train.eval_batch=32", "--set", "hardware.safety_margin=0.1"), run_name="x")
    assert code == 0
    assert "resumed with micro_batch 8 (the checkpoint's run used None)" in caplog.text
    for said in ("model.channels_last: False -> True", "train.log_every_steps: 10 -> 5",
                 "checkpoint.keep_last: 2 -> 3", "train.eval_batch: (not set) -> 32",
                 "hardware.safety_margin: 0.05 -> 0.1", "debug.signal_at_step: 3 -> (not set)"):
        assert said in caplog.text, said
    assert json.loads((run_dir / "summary.json").read_text())["resume_changes"] == []


def test_an_allowed_change_is_recorded_with_its_step_and_the_config_of_each_stretch(train_cli):
    args = ARGS
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=3", run_name="x")
    assert code == 143
    changed = [*args, "--set", "optim.weight_decay=0.3"]
    run_dir, code = train_cli(*changed, "--set", "allow_resume_change=true", "--set", "debug.signal_at_step=8",
                              run_name="x")
    assert code == 143
    # The same changed command resumes without allow_resume_change: the change is the run's now.
    run_dir, code = train_cli(*changed, run_name="x")
    assert code == 0
    record = [{"step": 3, "settings": {"optim.weight_decay": [0.05, 0.3]}}]
    assert json.loads((run_dir / "summary.json").read_text())["resume_changes"] == record
    assert checkpoint.read_state(checkpoint.latest(run_dir / "checkpoints"))["resume_changes"] == record
    text = (run_dir / "config.yaml").read_text()
    assert text.startswith("# from step 3 (allow_resume_change; until then: config-to-step-3.yaml): "
                           "optim.weight_decay 0.05 -> 0.3\n")
    assert yaml.safe_load(text)["optim"]["weight_decay"] == 0.3
    assert yaml.safe_load((run_dir / "config-to-step-3.yaml").read_text())["optim"]["weight_decay"] == 0.05
    # The original settings are now a change in their turn.
    with pytest.raises(VramfitError, match=r"optim.weight_decay: 0.3 -> 0.05"):
        train_cli(*args, run_name="x")


def test_new_files_under_the_data_folder_are_refused_and_the_runs_own_output_is_not_data(tmp_path, train_cli):
    data = class_tree(tmp_path / "data", {"a": 8, "b": 8})
    out = data / "runs"  # the run writes inside its own data folder
    args = train_args(data, out, "--epochs", "2", "--set", "data.val_fraction=0.25")
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=2", output=out)
    assert code == 143
    class_tree(tmp_path / "more", {"a": 1})
    (tmp_path / "more" / "a" / "000.png").rename(data / "a" / "new.png")
    with pytest.raises(VramfitError, match=r"data.listing: '16 files, \w+' -> '17 files, \w+'"):
        train_cli(*args, output=out)
    (data / "a" / "new.png").unlink()
    run_dir, code = train_cli(*args, output=out)  # its checkpoints under data/runs are not data
    assert code == 0


def test_every_execution_only_entry_names_settings_that_exist():
    """A misspelt entry would leave the setting it meant in the run's identity, unsaid."""
    keys = flat(Config().model_dump(mode="json"))
    for group, entries in EXECUTION_ONLY.items():
        for entry in entries:
            assert any(k == entry or entry.endswith(".") and k.startswith(entry) for k in keys), (group, entry)
    assert execution_group("debug.simulate_oom_above") == "step" and execution_group("debug.nan_at_step") == "run"
    assert execution_group("optim.lr") is None and "optim.lr" in maths_settings(Config())


def test_a_checkpoint_that_does_not_record_its_settings_is_not_resumed_unsaid(tmp_path):
    from vramfit.store import resume
    from vramfit.train.state import TrainerState

    point = resume.ResumePoint(tmp_path / "run" / "checkpoints" / "step-3", TrainerState(global_step=3))
    cfg = Config()
    new = resume.identity(cfg, "fp32")
    with pytest.raises(VramfitError, match="does not record the settings") as e:
        resume.check(cfg, point, 1, new)
    assert "allow_resume_change=true" in e.value.hint
    allowed = cfg.model_copy(update={"allow_resume_change": True})
    notes, record = resume.check(allowed, point, 1, new)
    assert record is None and notes == []


def test_the_runs_own_output_is_not_data_however_it_is_spelt(tmp_path, monkeypatch):
    """--output inside the data folder given relative, with `./`, absolute or through a link, or the
    data folder itself (its run folders are vramfit's, never data): the listing stays the data's."""
    from vramfit.store.resume import data_identity

    monkeypatch.chdir(tmp_path)
    class_tree(tmp_path / "data", {"a": 2, "b": 2})
    before = data_identity("data")
    runs = tmp_path / "data" / "runs"
    (runs / "r" / "checkpoints").mkdir(parents=True)
    (runs / "notes.txt").write_text("not a run folder, but inside --output")
    (tmp_path / "link").symlink_to(runs)
    for skip in ("data/runs", "./data/runs", str(runs), "link", "./data/../data/runs/"):
        assert data_identity("./data", skip=Path(skip)) == before, skip
    assert data_identity("data") != before  # the negative control: not skipped
    (runs / "notes.txt").unlink()
    (runs / "r" / ".vramfit.lock").write_text("pid 1")  # a run folder, wherever it sits
    assert data_identity(str(tmp_path / "data")) == before


def test_output_equal_to_the_data_folder_resumes(tmp_path, train_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = class_tree(tmp_path / "data", {"a": 8, "b": 8})
    args = train_args("data", "./data", "--epochs", "2", "--set", "data.val_fraction=0.25")
    run_dir, code = train_cli(*args, "--set", "debug.signal_at_step=2", output="./data")
    assert code == 143
    run_dir, code = train_cli(*args, output="./data")
    assert code == 0 and run_dir.parent.resolve() == data
    assert json.loads((run_dir / "model" / "class_names.json").read_text()) == ["a", "b"]


def test_a_builtin_name_means_the_builtin_data_wherever_the_run_is_resumed(tmp_path, train_cli, monkeypatch,
                                                                           caplog):
    """Stopped where no `digits/` exists, resumed where one does: the same run (exit 0), the folder said
    and not read; `./digits` is that folder, in the data loaded and in the identity alike."""
    from vramfit.data import load_source
    from vramfit.store.resume import identity

    monkeypatch.chdir(tmp_path)
    run_dir, code = train_cli(*ARGS, "--set", "debug.signal_at_step=3", run_name="d")
    assert code == 143
    class_tree(tmp_path / "digits", {"a": 3, "b": 3})
    with caplog.at_level("INFO"):
        run_dir, code = train_cli(*ARGS, run_name="d")
    assert code == 0
    assert "--data digits is the built-in dataset; the digits here" in caplog.text
    assert "./digits" in caplog.text
    assert len(json.loads((run_dir / "model" / "class_names.json").read_text())) == 10

    local = Config.model_validate({"data": {"source": "./digits"}})
    assert load_source(local.data).class_names == ["a", "b"]
    maths = identity(local, "fp32").maths
    assert maths["data.source"] == str(tmp_path.resolve() / "digits")
    assert maths["data.listing"].startswith("6 files")
    maths = identity(Config.model_validate({"data": {"source": "digits"}}), "fp32").maths
    assert maths["data.source"] == "digits" and maths["data.listing"] is None
