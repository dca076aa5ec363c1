"""Look inside a CUBIN: SASS text and instruction counts, with nvdisasm/cuobjdump from the pip wheels.

Tests use it to check what ptxas made of a template: tensor-core instructions present (HMMA on the
mma.sync path, HGMMA for wgmma), no local-memory traffic (LDL/STL), setmaxnreg emitted (USETMAXREG).
"""
from __future__ import annotations

import collections
import functools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# An instruction line: "/*00a0*/   @!P0 HMMA.16816.F32.BF16 R4, R4, R2, RZ ;" -> "HMMA"
_INSTRUCTION_RE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)")


class ToolNotFound(RuntimeError):
    pass


@functools.cache
def tool(name: str) -> Path:
    """Path of a CUDA binary utility: cuda.pathfinder, then the wheel's bin dir, then PATH."""
    try:
        import cuda.pathfinder

        found = cuda.pathfinder.find_nvidia_binary_utility(name)
        if found:
            return Path(found)
    except (ImportError, AttributeError, RuntimeError):   # older cuda-pathfinder lacks the function
        pass
    for site in map(Path, sys.path):
        candidate = site / "nvidia" / "cu13" / "bin" / name
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ToolNotFound(f"{name} not found: pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump")


def _run_on_cubin(arguments: list[str], cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([*arguments, file.name], check=True, capture_output=True, text=True).stdout


def sass(cubin: bytes) -> str:
    """Disassembly of every code section of the cubin."""
    return _run_on_cubin([str(tool("nvdisasm")), "--print-code"], cubin)


def resource_usage(cubin: bytes) -> str:
    """cuobjdump's per-function REG/STACK/SHARED/LOCAL summary (a cross-check of the ptxas log)."""
    return _run_on_cubin([str(tool("cuobjdump")), "--dump-resource-usage"], cubin)


def mnemonics(sass_text: str) -> collections.Counter:
    """How often each opcode (without modifiers) occurs."""
    return collections.Counter(_INSTRUCTION_RE.findall(sass_text))


def count(sass_text: str, mnemonic: str) -> int:
    return mnemonics(sass_text)[mnemonic]


# "WARPGROUP.DEPBAR.LE gsb0, 0x1": wait until at most one wgmma group of the warp runs.
_WGMMA_WAIT_RE = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")


def exps_beside_wgmma(sass_text: str) -> int:
    """The most MUFU.EX2 that follow, in the listing's order, a wait that leaves one wgmma group
    running and come before the next wait: in the Hopper forward's overlapped schedules, the
    softmax's exp2s that run while the previous block's P V does (PERF_NOTES §79)."""
    most, counting = 0, None
    for line in sass_text.splitlines():
        wait = _WGMMA_WAIT_RE.search(line)
        if wait:
            if counting is not None:
                most = max(most, counting)
            counting = 0 if int(wait.group(1), 16) == 1 else None
        elif counting is not None and "MUFU.EX2" in line:
            counting += 1
    return max(most, counting or 0)


def has_local_memory(sass_text: str) -> bool:
    """Local loads/stores: spills or a stack-resident array, either way off-chip traffic."""
    found = mnemonics(sass_text)
    return found["LDL"] + found["STL"] > 0
