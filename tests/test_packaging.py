"""The package as users get it: a wheel built from this repository holds the recipes, and
`--recipe NAME` finds them from any folder."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vramfit.config import PACKAGE_RECIPES

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of a copy of the sources (building in place would leave build/ in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp / "dist")], check=True, capture_output=True)
    return next((tmp / "dist").glob("vramfit-*.whl"))


def test_the_wheel_holds_every_recipe(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.name for p in PACKAGE_RECIPES.glob("*.yaml"))
    assert "quickstart.yaml" in shipped and "rtx3090.yaml" in shipped
    assert all(f"vramfit/recipes/{n}" in names for n in shipped)


def _installed(wheel: Path, tmp_path: Path) -> dict:
    """The wheel installed into its own folder, first on the path (ahead of the checkout)."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    return {**os.environ, "PYTHONPATH": str(target)}


def test_an_installed_wheel_plans_a_recipe_from_another_folder(wheel, tmp_path):
    env = _installed(wheel, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import sys, vramfit; from vramfit.cli import run; "
            "assert vramfit.__file__.startswith(sys.argv[1]), vramfit.__file__; "
            "run(['plan', '--recipe', 'quickstart', '--json'])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout[out.stdout.index("{"):])
    assert plan["model"] == "resnet18" and plan["image_size"] == 32


@pytest.mark.slow
def test_an_installed_wheel_trains_the_quickstart_from_another_folder(wheel, tmp_path):
    env = _installed(wheel, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "vramfit.cli", "train", "--recipe", "quickstart", "--epochs", "1",
         "--set", "data.limit_train_samples=256", "--set", "data.limit_val_samples=64",
         "--set", "data.num_workers=0", "--output", "runs", "--run-name", "wheel"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((elsewhere / "runs" / "wheel" / "summary.json").read_text())
    assert summary["epochs"] == 1 and summary["global_step"] > 0


def test_constraints_pin_every_dependency_within_its_range():
    """constraints.txt (and environment.yml, which installs with it) pins what pyproject asks for."""
    import tomllib

    import yaml
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pinned = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(dep)
        assert canonicalize_name(req.name) in pinned, f"{req.name} is not in constraints.txt"
        assert req.specifier.contains(pinned[canonicalize_name(req.name)], prereleases=True), dep
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-c constraints.txt" in pip and any(p.startswith("-e .") for p in pip)
