"""Every command of the README's "Commands" block, run in order in one fresh folder."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import REPO, class_tree, picture, save


def readme_commands() -> list[str]:
    """The lines of the README's `## Commands` bash block, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Commands\n```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def concrete(command: str, names: dict[str, str]) -> list[str]:
    """A README line as it is run here: each optional `[...]` part taken (its first alternative),
    except the ones that need what this machine has not (a Hub account, a test split), and the
    placeholders replaced by real paths."""
    def option(m: re.Match) -> str:
        inner = m.group(1).split("|")[0]
        return "" if ("push-to-hub" in inner or "--split" in inner) else inner

    line = re.sub(r"\[([^\]]*)\]", option, command)
    for placeholder, value in names.items():
        line = re.sub(rf"(?<![\w/]){re.escape(placeholder)}(?![\w])", value, line)
    return shlex.split(line)


@pytest.mark.slow
def test_every_readme_command_runs_in_order_in_a_fresh_folder(tmp_path):
    """Each exits 0, or 2 with a HINT where it needs what this machine lacks (a GPU recipe on a
    CPU): never a traceback. ~3 min on 2 cores."""
    images = class_tree(tmp_path / "photos", {"cat": 12, "dog": 12, "owl": 12}, size=(48, 40))
    photo = save(tmp_path / "photo.jpg", picture(64, 48, seed=7))
    folder = tmp_path / "folder"
    for i in range(2):
        save(folder / f"{i}.png", picture(40, 40, seed=20 + i))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", "HF_HOME": str(tmp_path / "hf")}
    names = {"PATH_320": str(tmp_path / "photos_320"), "PATH": str(images), "photo.jpg": str(photo),
             "folder/": str(folder) + "/"}
    commands = readme_commands()
    assert len(commands) >= 12 and commands[0].startswith("vramfit train --recipe quickstart")
    for i, command in enumerate(commands):
        argv = concrete(command, names)
        assert argv[0] == "vramfit", command
        proc = subprocess.run([sys.executable, "-m", "vramfit", *argv[1:]], cwd=work, env=env,
                              capture_output=True, text=True, timeout=600)
        said = proc.stdout[-1500:] + proc.stderr[-1500:]
        assert "Traceback" not in proc.stderr, f"{command}\n{said}"
        assert proc.returncode == 0 or (proc.returncode == 2 and "HINT:" in proc.stderr), \
            f"{command}: exit {proc.returncode}\n{said}"
        if i == 0:  # runs/NAME in the later commands: the run the first one trained
            (run,) = list((work / "runs").iterdir())
            names["runs/NAME"] = f"runs/{run.name}"
