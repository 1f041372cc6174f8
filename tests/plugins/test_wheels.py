"""What `pip install grpo-agent-env-X` does for a user: every distribution of the repo (core,
each env, each plugin) builds an sdist, the sdist builds a wheel, and the wheels (not the
editable installs) installed into a fresh virtual environment are found by `grpo-agent env
list` there.

Offline and fast: sdists and wheels are built with the venv's setuptools (no build isolation),
and the fresh venv reuses this venv's site-packages for third-party dependencies through a
.pth line placed after its own (so the wheels' copies of our distributions come first).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SOURCES = [ROOT, *sorted(p.parent for p in ROOT.glob("envs/*/pyproject.toml")),
           *sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml"))]
# Copied into the build folder; never build outputs, caches or the checkout's other folders.
CORE_FILES = ["pyproject.toml", "README.md", "core"]
IGNORE = shutil.ignore_patterns("*.egg-info", "__pycache__", "build", "dist", "tests", "*.pyc")

WHERE = """
import importlib.metadata as md, json, grpo_agent
print(json.dumps({"grpo_agent": grpo_agent.__file__,
                  "entry_points": {ep.name: [ep.dist.name, str(ep.dist.locate_file(""))]
                                   for ep in md.entry_points(group="grpo_agent")}}))
"""


def run(*args, cwd=None, timeout=300) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def build(source: Path, work: Path, wheels: Path) -> Path:
    """sdist from a clean copy of `source`, then the wheel from the unpacked sdist; the sdist."""
    copy = work / "src" / source.name
    if source == ROOT:
        copy.mkdir(parents=True)
        for name in CORE_FILES:
            (shutil.copytree(ROOT / name, copy / name, ignore=IGNORE) if (ROOT / name).is_dir()
             else shutil.copy(ROOT / name, copy / name))
    else:
        shutil.copytree(source, copy, ignore=IGNORE)
    sdists = work / "sdist"
    name = run(sys.executable, "-c", f"from setuptools import build_meta as b; print(b.build_sdist({str(sdists)!r}))",
               cwd=copy).split()[-1]
    with tarfile.open(sdists / name) as archive:
        archive.extractall(work / "unpacked", filter="data")
    unpacked = work / "unpacked" / name.removesuffix(".tar.gz")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(unpacked))
    return sdists / name


def test_every_distribution_builds_and_its_wheels_install_into_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    sdists = [build(source, tmp_path / source.name, wheels) for source in SOURCES]
    built = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(built) == len(SOURCES) and all(sdist.is_file() for sdist in sdists), built
    assert {w.split("-")[0] for w in built} == {wheel_name(source) for source in SOURCES}, built

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    site = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    # Third-party dependencies from this venv, after the new venv's own site-packages.
    (site / "zz_reuse_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
        *map(str, wheels.glob("*.whl")))

    where = json.loads(run(str(python), "-c", WHERE, cwd=tmp_path))
    assert Path(where["grpo_agent"]).is_relative_to(site), where
    env_dists = {s.name for s in SOURCES if s.parent.name == "envs"}
    for entry, (dist, location) in where["entry_points"].items():
        assert Path(location).resolve().is_relative_to(site.resolve()), (entry, dist, location)
    assert env_dists <= {dist.replace("_", "-") for dist, _ in where["entry_points"].values()}, where

    listing = run(str(venv / "bin" / "grpo-agent"), "env", "list", cwd=tmp_path)
    for dist in env_dists:
        assert f"[{dist}]" in listing, listing
    for name in ("counter-v1", "math-v1", "coding-v1"):
        assert name in listing, listing


def wheel_name(source: Path) -> str:
    """The wheel file's name prefix of a distribution (dashes become underscores)."""
    import tomllib

    return tomllib.loads((source / "pyproject.toml").read_text())["project"]["name"].replace("-", "_")
