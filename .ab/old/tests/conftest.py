"""Fixtures shared by every test module."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

# The tests run from a plain checkout too, without `pip install -e .`.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kernelgen import env  # noqa: E402  (needs the path above)

_SWITCHES = ("KERNELGEN_NO_COMPILE", "KERNELGEN_ALWAYS_COMPILE", "KERNELGEN_DUMP_SOURCES",
             "KERNELGEN_DEBUG", "KERNELGEN_AUTOTUNE")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty cache directory for this test, with every KERNELGEN_* switch off."""
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    for name in _SWITCHES:
        monkeypatch.delenv(name, raising=False)
    env.reload_settings()
    yield tmp_path / "cache"
    monkeypatch.undo()
    env.reload_settings()


# A small spec that uses every part of the schema; tests mutate a copy to provoke each error.
TOY_SPEC = {
    "name": "toy",
    "description": "A toy kernel for the loader and renderer tests.",
    "entry": "toy_kernel",
    "archs": ["sm_80", "sm_86"],
    "params": {
        "width": {"values": [32, 64, 256], "default": 64},
        "flavor": {"values": ["plain", "spicy"]},
        "fast": {"values": [False, True], "default": False},
    },
    "args": [
        {"name": "x", "type": "ptr", "ctype": "float*"},
        {"name": "n", "type": "i32"},
        {"name": "scale", "type": "f32"},
    ],
    "derived": {"tile": "block * 2", "smem": "tile * width * 4"},
    "tune": {
        "space": {"block": [16, 32, 64], "warps": [4, 8]},
        "constraints": ["smem <= max_smem", "block <= width", "block % warps == 0"],
        "defaults": [
            {"when": "width == 64", "config": {"block": 64, "warps": 8}},
            {"when": "fast", "config": {"block": 32, "warps": 8}},
        ],
    },
    "launch": {"grid": ["cdiv(n, block)", "1", "1"], "block": ["warps * 32", 1, 1],
               "smem": "smem"},
}

TOY_TEMPLATE = """\
// toy: x[i] *= scale, {{ width }} wide.
{% if fast %}
#define TOY_FAST 1
{% endif %}
extern "C" __global__ void {{ entry }}({{ signature }}) {
    constexpr int kBlock = {{ block }}, kSmem = {{ smem }};  // {{ flavor }} {{ arch }}
}
"""


@pytest.fixture
def write_spec(tmp_path):
    """write_spec(mutate=None, template=TOY_TEMPLATE, text=None) -> path of tmp_path/toy.yaml.

    `mutate(doc)` edits a deep copy of TOY_SPEC; `text` replaces the YAML outright; `template=None`
    writes no template beside the spec.
    """
    def write(mutate=None, template=TOY_TEMPLATE, text=None):
        doc = copy.deepcopy(TOY_SPEC)
        if mutate is not None:
            mutate(doc)
        path = tmp_path / "toy.yaml"
        path.write_text(text if text is not None else yaml.safe_dump(doc, sort_keys=False))
        if template is not None:
            (tmp_path / "toy.cu.j2").write_text(template)
        return path

    return write
