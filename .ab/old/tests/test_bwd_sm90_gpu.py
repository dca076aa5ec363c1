"""The Hopper backward main kernel (flash_attn_bwd_sm90) on the GPU: which main kernel
flash_attn_backward runs, and dQ, dK, dV against the float32 reference by FlashAttention's rule
(test_backward.check: poisoned outputs, rows that see no key) over its head dims, causal or not,
fp16 and bf16, ragged and unequal sequence lengths, GQA 4:1 and MQA, and strided inputs."""
import pytest
import torch

from kernelgen import backward, backward_sm90, env
from test_backward import check, make

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs a compute capability 9.0 GPU (H100/H200)")]

DTYPES = [torch.float16, torch.bfloat16]
# (seqlen_q, seqlen_k): single rows, ragged tails, seqlen_q > seqlen_k (causal rows that see no
# key), seqlen_q < seqlen_k (causal KV tiles no query sees), a few full tiles.
SEQLENS = [(1, 1), (63, 65), (128, 128), (1, 700), (700, 1), (200, 517), (517, 200), (1024, 1024)]
# (batch, heads, heads_k): no grouping, GQA 4:1, MQA.
LAYOUTS = [(2, 4, 4), (1, 8, 2), (2, 6, 1)]


@pytest.fixture(autouse=True)
def short_sequences_too(monkeypatch):
    """These shapes are short on purpose: lift backward_sm90's seqlen rule, so that they run the
    Hopper kernel (test_dispatch checks the rule)."""
    monkeypatch.setattr(backward_sm90, "SHORT_SEQLEN_K", 0)
    backward._KERNELS.clear()
    yield
    backward._KERNELS.clear()


def main_kernel(head_dim, deterministic=False, seqlen=64):
    """The main kernel flash_attn_backward would launch for a small problem on device 0."""
    backward._KERNELS.clear()
    kernels = backward._kernels(head_dim, "bf16", False, 0, deterministic, (1, 2, 2, seqlen, seqlen))
    backward._KERNELS.clear()
    return kernels.main.spec.name


def test_short_sequences_keep_the_mma_sync_kernel(monkeypatch):
    monkeypatch.setattr(backward_sm90, "SHORT_SEQLEN_K", 512)
    assert main_kernel(128, seqlen=512) == backward.MAIN_SPEC
    assert main_kernel(128, seqlen=513) == backward_sm90.SPEC


def test_dispatch(monkeypatch):
    assert main_kernel(128) == backward_sm90.SPEC
    assert main_kernel(64) == backward_sm90.SPEC
    assert main_kernel(96) == backward_sm90.SPEC
    assert main_kernel(256) == backward.MAIN_SPEC         # no sm90 variant
    assert main_kernel(128, deterministic=True) == backward.MAIN_SPEC
    monkeypatch.setenv("KERNELGEN_BACKWARD", "sm80")
    env.reload_settings()
    try:
        assert main_kernel(128) == backward.MAIN_SPEC
    finally:
        monkeypatch.undo()
        env.reload_settings()


@pytest.mark.parametrize("head_dim", backward_sm90.head_dims())
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gradients(head_dim, dtype, causal, seqlens):
    index = SEQLENS.index(seqlens) + (1 if causal else 0) + head_dim // 32
    batch, heads, heads_k = LAYOUTS[index % len(LAYOUTS)]
    seqlen_q, seqlen_k = seqlens
    torch.manual_seed(index)
    q = make(batch, seqlen_q, heads, head_dim, dtype)
    k, v = make(batch, seqlen_k, heads_k, head_dim, dtype), make(batch, seqlen_k, heads_k, head_dim, dtype)
    assert main_kernel(head_dim) == backward_sm90.SPEC
    check(q, k, v, causal)


@pytest.mark.parametrize("head_dim", backward_sm90.head_dims())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs(head_dim, causal):
    """q, k, v sliced out of a packed qkv tensor, dout heads-major; heads every other one."""
    torch.manual_seed(head_dim)
    qkv = torch.randn(2, 300, 3, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, 37:, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = torch.randn(2, 4, 263, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    check(q, k, v, causal, dout=dout)
    wide = torch.randn(2, 200, 8, head_dim, device="cuda", dtype=torch.float16)
    check(wide[:, :, 1::2], wide[:, :150, ::2], wide[:, 50:, 4:], causal)


def test_long_sequence_gqa():
    """Many query tiles per KV tile and many KV tiles: the ring wraps often, atomics contend."""
    torch.manual_seed(7)
    q = make(1, 4096, 8, 128, torch.bfloat16)
    k, v = make(1, 4096, 2, 128, torch.bfloat16), make(1, 4096, 2, 128, torch.bfloat16)
    check(q, k, v, True)
