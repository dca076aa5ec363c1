"""kernelgen: generated, autotuned FlashAttention kernels.

YAML spec -> Jinja CUDA -> NVRTC cubin -> disk cache -> launch from PyTorch. Importing the package
does not import torch: the torch-facing names below load on first use, so `kernelgen build` and the
compile stages work (and start fast) on machines without torch or a GPU.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "load": "kernelgen.attention",
    "BoundKernel": "kernelgen.api",
    "flash_attn_func": "kernelgen.ops",
    "packed_ranges": "kernelgen.packed",
    "varlen_ranges": "kernelgen.packed",
    "flash_attn_varlen_func": "kernelgen.packed",
    "load_spec": "kernelgen.spec",
    "SpecError": "kernelgen.spec",
    "CompileError": "kernelgen.compile",
}

# Submodules that are also the public name: `kernelgen.tune(...)` calls the (callable) module.
_MODULES = {"tune": "kernelgen.tune"}

__all__ = ["__version__", *_LAZY, *_MODULES]


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernelgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
