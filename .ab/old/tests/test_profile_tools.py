"""tools/ncu_stalls.py and tools/sass_lines.py on the CPU: a PC-sampling table names each sampled
instruction by its offset in the kernel and, given the kernel's SASS with line info, by the
template lines it came from."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tools"))

import ncu_stalls  # noqa: E402

# nvdisasm --print-line-info-inline's shape: a group of //## lines where the line changes.
SASS = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/x/templates/include/kernelgen/mbarrier.cuh", line 41 inlined at "/x/flash_fwd_sm90.cuh", line 233
\t//## File "/x/templates/include/kernelgen/flash_fwd_sm90.cuh", line 233 inlined at "/x/k.cu", line 9
\t//## File "/root/.cache/kernelgen/sources/flash_attn_fwd_sm90__head_dim64__sm_90a__x.cu", line 9
        /*0010*/              @!P1 BRA `(.L_x_11) ;
        /*0020*/                   NOP ;
\t//## File "/x/templates/include/kernelgen/wgmma.cuh", line 26 inlined at "/x/flash_fwd_sm90.cuh", line 326
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""

CSV = """\
"Kernel Name","flash_attn_fwd_sm90",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_barrier (Not Issued)","stall_long_sb (Not Issued)"
"0x7f0000001000","      LDC R1, c[0x0][0x28]","1","1","0","0","0","0"
"0x7f0000001010","      @!P1 BRA 0x7f0000001100","30","30","0","30","0","30"
"0x7f0000001020","      NOP","2","2","0","0","0","0"
"0x7f0000001030","      WARPGROUP.DEPBAR.LE gsb0, 0x0","67","60","60","0","55","0"
"""


def test_source_lines_give_each_instruction_its_innermost_lines():
    where = ncu_stalls.source_lines(SASS)
    assert where[0x10] == "mbarrier.cuh:41 < flash_fwd_sm90.cuh:233"
    assert where[0x20] == where[0x10]            # no new group: the same lines
    assert where[0x30] == "wgmma.cuh:26"
    assert 0x0 not in where                       # before any line info


def test_the_table_ranks_by_samples_with_offsets_reasons_and_lines(tmp_path, capsys):
    (tmp_path / "r.csv").write_text(CSV)
    (tmp_path / "k.sass").write_text(SASS)
    assert ncu_stalls.main([str(tmp_path / "r.csv"), "--lines", str(tmp_path / "k.sass")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("4 instructions, 100 stall samples")
    assert "0x0030" in rows[1] and "WARPGROUP.DEPBAR" in rows[1] and rows[1].endswith("wgmma.cuh:26")
    assert "stall_barrier 90%" in rows[1] and rows[1].count("stall_barrier") == 1   # not twice
    assert "0x0010" in rows[2] and "stall_long_sb 100%" in rows[2]
    assert rows[2].endswith("mbarrier.cuh:41 < flash_fwd_sm90.cuh:233")


def test_sass_lines_writes_a_shipped_kernels_sass_with_template_lines():
    """Without a GPU the config is the shipped table's H200 entry for profile_fwd.py's problem."""
    run = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "sass_lines.py"),
                          "--head-dim", "64", "--seqlen", "1024"],
                         capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    if run.returncode and "nvdisasm not found" in run.stderr:
        pytest.skip("nvdisasm not installed")
    assert run.returncode == 0, run.stderr
    assert "head_dim64_dtypebf16_causal0" in run.stderr and "NVRTC" in run.stderr
    where = ncu_stalls.source_lines(run.stdout)
    assert "HGMMA" in run.stdout and any("flash_fwd_sm90.cuh" in w for w in where.values())
