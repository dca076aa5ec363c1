"""GPU numerics of the Hopper forward (kernelgen.hopper, spec flash_attn_fwd_sm90) on an sm_90 GPU.

The oracle is test_attention.py's `check` (float32 reference, FlashAttention's rule, LSE, rows that
see no key, NaN-poisoned outputs); it calls `kernelgen.flash_attn_func`, which the fixture below
points at the explicit sm90 call (taking a config). flash_attn_func itself runs these kernels on
compute capability 9.0: test_attention.py covers that path, and the mma.sync family on this GPU
when run with KERNELGEN_FORWARD=sm80."""
import pytest
import torch

from kernelgen.reference import attention_ref, max_error, rounding_allowance
import test_attention
from test_attention import check, make
# Collected here too, so they run on the sm90 kernels (the fixture below).
from test_attention import test_softmax_scale_and_large_values, test_strided_inputs  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                       reason="the sm_90a kernels run on Hopper (compute capability 9.0) only"),
]

# test_attention.py's grid without its two largest problems (4096 x 4096, 1000 x 4096): tails of
# every kind, seqlen_q != seqlen_k both ways (bottom-right causal leaves rows with no key when
# seqlen_q > seqlen_k), GQA ratios 1, 2, 8.
SEQLENS = [s for s in test_attention.SEQLENS if s[0] * s[1] < 1000 * 4096]


def forward(q, k, v, causal, softmax_scale=None, config=None):
    from kernelgen.hopper import flash_attn_forward_sm90

    return flash_attn_forward_sm90(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   config=config)


def route_check_to_sm90(monkeypatch, config=None):
    import kernelgen

    def flash_attn_func(q, k, v, causal=False, softmax_scale=None, return_lse=False):
        out, lse = forward(q, k, v, causal, softmax_scale, config)
        return (out, lse) if return_lse else out

    monkeypatch.setattr(kernelgen, "flash_attn_func", flash_attn_func)


@pytest.fixture(autouse=True)
def sm90_behind_check(monkeypatch):
    route_check_to_sm90(monkeypatch)


@pytest.mark.parametrize("head_dim", test_attention.HEAD_DIMS)
@pytest.mark.parametrize("dtype", test_attention.DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: f"{s[0]}x{s[1]}")
def test_forward(head_dim, dtype, causal, seqlens):
    test_attention.test_forward(head_dim, dtype, causal, seqlens)


# Each schedule and the tile shapes no default uses, on their own: a failure names the schedule.
CONFIGS = [
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 0, "persistent": 0}),  # plain
    (96, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 0, "persistent": 0}),
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 0, "persistent": 0}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 0}),  # overlap
    (64, {"block_m": 128, "block_n": 64, "stages": 3, "schedule": 1, "persistent": 0}),    # 3 stages
    (128, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 0}),  # overlap + pingpong
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 2, "persistent": 0}),
    (64, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 0}),    # 3 consumer warpgroups
    (96, {"block_m": 192, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 0}),
    # Persistent: a CTA per SM looping over tiles (causal: longest first, empty tiles in the mix).
    (128, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 3, "schedule": 1, "persistent": 1}),
    (64, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1}),
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 0, "persistent": 1}),
    # Two Q buffers and the TMA-store epilogue (q_buffers 2): 2 and 3 consumer warpgroups, 128B
    # and 64B swizzle (hd96: three panels), 2 and 3 stages, both overlapped schedules.
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2}),
    (128, {"block_m": 128, "block_n": 160, "stages": 2, "schedule": 1, "persistent": 1, "q_buffers": 2}),
    (128, {"block_m": 128, "block_n": 96, "stages": 3, "schedule": 2, "persistent": 1, "q_buffers": 2}),
    (64, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2}),
    (96, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 1, "q_buffers": 2}),
    (192, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 1, "q_buffers": 2}),
    # Three Q buffers (tile t+2's Q in tile t-1's buffer): static and dynamic, both overlapped
    # schedules, 2 and 3 consumers, 64B swizzle.
    (64, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_buffers": 3}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 3}),
    (96, {"block_m": 192, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 3}),
    # Dynamic (persistent 2): tiles claimed from the counter by 132 CTAs at once, each schedule,
    # 2 and 3 consumers, one and two Q buffers.
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2}),
    (128, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 1, "persistent": 2}),
    (64, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2}),
    (96, {"block_m": 128, "block_n": 128, "stages": 3, "schedule": 0, "persistent": 2}),
    (256, {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 1, "persistent": 2}),
    # sum_mma (the row sums from the P V wgmma, head_dim 64): the shipped kinds of config, each
    # schedule, a CTA per tile and persistent, 2 and 3 consumers.
    (64, {"block_m": 192, "block_n": 144, "stages": 2, "schedule": 0, "persistent": 0, "sum_mma": 1}),
    (64, {"block_m": 192, "block_n": 112, "stages": 3, "schedule": 2, "persistent": 1, "q_buffers": 2,
          "sum_mma": 1}),
    (64, {"block_m": 128, "block_n": 176, "stages": 3, "schedule": 1, "persistent": 2, "q_buffers": 2,
          "sum_mma": 1}),
    # rescale 1 (O rescaled in the next QK^T's shadow, the last block's alpha in the tail): each
    # overlapped schedule, a CTA per tile and persistent (tiles of one block rescale O = 0).
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 0, "rescale": 1}),
    (256, {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 1, "rescale": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2,
           "rescale": 1}),
    # q_split (each warpgroup's rows of Q on their own barriers; rows wholly past seqlen_q not
    # loaded): persistent static and dynamic, a CTA per tile, 2 and 3 consumers.
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 2, "persistent": 1, "rescale": 1,
           "q_split": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_split": 1}),
    (64, {"block_m": 192, "block_n": 96, "stages": 2, "schedule": 2, "persistent": 0, "q_split": 1}),
    # carry_qk (each tile's first QK^T in the previous tile's last turn, a dummy after the CTA's
    # last tile; causal with empty tiles on the 1000 x 17 shape): static and dynamic, both
    # overlapped schedules, 128B and 64B swizzle.
    (64, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 1, "q_buffers": 2,
          "carry_qk": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2,
           "carry_qk": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_buffers": 2,
           "carry_qk": 1}),
    (96, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2,
          "carry_qk": 1}),
    # q_prefetch (the next tile's Q into L2 before the wait for the one Q buffer): static with
    # q_split (a box per warpgroup and panel), dynamic without.
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 2, "persistent": 1, "rescale": 1,
           "q_split": 1, "q_prefetch": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2,
           "q_prefetch": 1}),
    # pv_wait (each block's V waited for at the end of its softmax, so that the softmax runs
    # beside the previous P V): the hd128 long-sequence tiles (with a cluster: CLUSTER_CONFIGS),
    # dynamic pingpong with two Q buffers, 3 consumers with the row sums by wgmma, hd256 with
    # the early rescale, and with carry_qk.
    (128, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 0,
           "pv_wait": 1}),
    (128, {"block_m": 128, "block_n": 160, "stages": 2, "schedule": 2, "persistent": 2,
           "q_buffers": 2, "pv_wait": 1}),
    (64, {"block_m": 192, "block_n": 112, "stages": 3, "schedule": 2, "persistent": 2, "q_buffers": 2,
          "sum_mma": 1, "pv_wait": 1}),
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 0, "rescale": 1,
           "pv_wait": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_buffers": 2,
           "carry_qk": 1, "pv_wait": 1}),
]
# carry_qk with half_diag (causal only): the carried S is the whole diagonal block's.
CAUSAL_CONFIGS = [
    (64, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_buffers": 3,
          "half_diag": 1}),
    (64, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_buffers": 2,
          "half_diag": 1, "carry_qk": 1}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 2,
           "half_diag": 1, "carry_qk": 1}),
]


@pytest.mark.parametrize("head_dim, config", CONFIGS,
                         ids=[f"hd{d}-{'_'.join(f'{k}{v}' for k, v in c.items())}" for d, c in CONFIGS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_schedules_and_tiles(monkeypatch, head_dim, config, causal):
    check_config(monkeypatch, head_dim, config, causal, torch.bfloat16)


@pytest.mark.parametrize("head_dim, config", CAUSAL_CONFIGS,
                         ids=[f"hd{d}-{'_'.join(f'{k}{v}' for k, v in c.items())}"
                              for d, c in CAUSAL_CONFIGS])
def test_causal_only_configs(monkeypatch, head_dim, config):
    check_config(monkeypatch, head_dim, config, True, torch.bfloat16)


def check_config(monkeypatch, head_dim, config, causal, dtype):
    """One config on three ragged shapes: one query row, keys of 17, and GQA with tails."""
    route_check_to_sm90(monkeypatch, config)
    torch.manual_seed(head_dim + config["block_n"])
    for (seqlen_q, seqlen_k), (batch, heads, heads_k) in (((1, 1000), (1, 4, 2)),
                                                         ((1000, 17), (2, 2, 1)),
                                                         ((333, 1517), (1, 2, 2))):
        q = make(batch, seqlen_q, heads, head_dim, dtype)
        k = make(batch, seqlen_k, heads_k, head_dim, dtype)
        v = make(batch, seqlen_k, heads_k, head_dim, dtype)
        check(q, k, v, causal)


# Persistent configs on a problem of many tiles per CTA (check_config's shapes give each of
# the 132 CTAs one tile at most): 4 x 16 heads x 8 query tiles of a 1000-row sequence, ragged,
# GQA 4, so every Q buffer is handed back and reloaded several times (causal: tiles of one to
# eight blocks, the short ones where a third buffer matters).
MANY_TILES_CONFIGS = [
    (64, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 1, "persistent": 2, "q_buffers": 3}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1, "q_buffers": 3}),
    (96, {"block_m": 192, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 3}),
    (128, {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2}),
]


@pytest.mark.parametrize("head_dim, config", MANY_TILES_CONFIGS,
                         ids=[f"hd{d}-{'_'.join(f'{k}{v}' for k, v in c.items())}"
                              for d, c in MANY_TILES_CONFIGS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_many_tiles_per_cta(monkeypatch, head_dim, config, causal):
    route_check_to_sm90(monkeypatch, config)
    torch.manual_seed(head_dim + config.get("q_buffers", 1))
    q = make(4, 1000, 16, head_dim, torch.bfloat16)
    k, v = (make(4, 1000, 4, head_dim, torch.bfloat16) for _ in range(2))
    check(q, k, v, causal)


# Clusters of two CTAs sharing K and V by multicast (non-causal only): the shapes give one query
# tile and three (odd: the cluster's second CTA lies past seqlen_q, loads its half of K and V for
# the first and stores nothing), eight, GQA and 17 keys (one partial block); 128B swizzle with one
# and two panels per CTA, each overlapped schedule, 2 and 3 stages, q_split.
CLUSTER_CONFIGS = [
    (128, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 0, "cluster": 2}),
    (128, {"block_m": 128, "block_n": 128, "stages": 3, "schedule": 1, "persistent": 0, "cluster": 2}),
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 0, "rescale": 1,
           "cluster": 2}),
    (256, {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 2, "persistent": 0, "q_split": 1,
           "cluster": 2}),
    (128, {"block_m": 128, "block_n": 176, "stages": 2, "schedule": 2, "persistent": 0, "cluster": 2,
           "pv_wait": 1}),
]


@pytest.mark.parametrize("head_dim, config", CLUSTER_CONFIGS,
                         ids=[f"hd{d}-{'_'.join(f'{k}{v}' for k, v in c.items())}"
                              for d, c in CLUSTER_CONFIGS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_clusters(monkeypatch, head_dim, config, dtype):
    check_config(monkeypatch, head_dim, config, False, dtype)


def test_a_cluster_over_long_keys(monkeypatch):
    """64 KV blocks through a two-stage ring shared by the two CTAs, five query tiles (the last
    cluster's second CTA past seqlen_q), three runs: a slot handed back too early shows here."""
    route_check_to_sm90(monkeypatch, CLUSTER_CONFIGS[1][1] | {"stages": 2})
    torch.manual_seed(7)
    q = make(2, 600, 4, 128, torch.bfloat16)
    k, v = make(2, 8192, 2, 128, torch.bfloat16), make(2, 8192, 2, 128, torch.bfloat16)
    for _ in range(3):
        check(q, k, v, False)


def test_a_cluster_config_refuses_causal():
    from kernelgen.hopper import flash_attn_forward_sm90
    from kernelgen.spec import SpecError

    q = make(1, 64, 2, 128, torch.bfloat16)
    with pytest.raises(SpecError, match="cluster == 1 or"):
        flash_attn_forward_sm90(q, q, q, True, config=dict(CLUSTER_CONFIGS[0][1]))


# Every kernel of the shipped tuning table (what flash_attn_func runs on an H200 at the tuned
# shapes), on ragged shapes: a tune or a template change that breaks one config fails here.
from test_sm90 import _shipped_forward_configs  # noqa: E402

TUNED = [(v, c) for s, v, c in _shipped_forward_configs() if s.name == "flash_attn_fwd_sm90"]


@pytest.mark.parametrize("variant, config", TUNED, ids=[f"{v.slug}-{c.slug}" for v, c in TUNED])
def test_shipped_tuned_configs(monkeypatch, variant, config):
    params = variant.as_dict()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[params["dtype"]]
    check_config(monkeypatch, params["head_dim"], config.as_dict(), params["causal"], dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_strided_inputs_64b_swizzle(causal):
    test_strided_inputs(96, causal)  # head_dim 96: the 32-column panels


def test_misaligned_view_is_copied_first():
    """A view whose start is not 16-byte aligned cannot be a TMA source: it is made contiguous."""
    torch.manual_seed(1)
    flat = torch.randn(2 * 129 * 4 * 64 + 4, device="cuda", dtype=torch.bfloat16)
    q = flat[4:].view(2, 129, 4, 64)
    assert q.data_ptr() % 16 != 0
    check(q, q, q, False)


def test_gqa_ratios():
    torch.manual_seed(2)
    for heads, heads_k in ((8, 1), (8, 2), (6, 3)):
        q = make(2, 333, heads, 128, torch.bfloat16)
        k = make(2, 517, heads_k, 128, torch.bfloat16)
        v = make(2, 517, heads_k, 128, torch.bfloat16)
        check(q, k, v, False)
        check(q, k, v, True)


def test_fully_masked_rows_and_empty_keys():
    torch.manual_seed(3)
    # Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key, whole query
    # tiles among them (they take the no-work path), others mixed with visible rows.
    q = make(1, 700, 2, 64, torch.float16)
    k = make(1, 90, 2, 64, torch.float16)
    _, lse_ref = attention_ref(q, k, k, True)
    assert (~torch.isfinite(lse_ref)).sum() == 2 * (700 - 90)
    check(q, k, k, True)
    # No keys at all: every row is empty.
    empty = make(1, 0, 2, 64, torch.float16)
    out, lse = forward(q, empty, empty, False)
    torch.cuda.synchronize()
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_dynamic_counters_across_streams_and_graphs(monkeypatch):
    """The dynamic schedule's counters (hopper.counter_address): eager launches take words of
    their stream's pooled buffer (more launches than one buffer holds, on two streams at once),
    a captured graph a fresh counter per launch, replayed on a third stream while eager
    launches run; every output equal bit for bit to the first (a tile is one CTA's whatever the
    claims), each stream's words from a buffer of its own."""
    from kernelgen import hopper

    monkeypatch.setattr(hopper, "_POOLS", {})
    monkeypatch.setattr(hopper, "POOL_WORDS", 1024)   # buffers of 15 launches here
    config = {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 2,
              "q_buffers": 2}
    torch.manual_seed(11)
    q, k, v = (make(2, 1000, 4, 64, torch.bfloat16) for _ in range(3))
    want, _ = forward(q, k, v, True, config=config)
    torch.cuda.synchronize()   # the inputs and `want` are the default stream's
    words = hopper.counter_words(config, q.shape)
    calls = 6 * (hopper.POOL_WORDS // words) + 5   # past three buffers on each stream
    streams = [torch.cuda.Stream() for _ in range(3)]
    outs = []
    for i in range(calls):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(forward(q, k, v, True, config=config)[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(streams[2]):
        forward(q, k, v, True, config=config)   # warm-up before capture
        with torch.cuda.graph(graph, stream=streams[2]):
            captured = [forward(q, k, v, True, config=config)[0] for _ in range(3)]
        replays = []
        for _ in range(2):
            graph.replay()
            replays.append([o.clone() for o in captured])
    for i in range(8):
        with torch.cuda.stream(streams[i % 2]):
            outs.append(forward(q, k, v, True, config=config)[0])
    torch.cuda.synchronize()
    assert all(torch.equal(o, want) for o in outs)
    assert all(torch.equal(o, want) for r in replays for o in r)
    pools = [hopper._POOLS[(q.device.index, s.cuda_stream)] for s in streams[:2]]
    assert all(0 < pool[1] <= pool[0].numel() for pool in pools)
    assert pools[0][0].data_ptr() != pools[1][0].data_ptr()


def test_agrees_with_the_sm80_family():
    """Same inputs through flash_attn_func (mma.sync) and the Hopper kernels: both within the
    rule of the reference, and close to each other."""
    from kernelgen.ops import flash_attn_forward

    torch.manual_seed(4)
    q, k, v = (make(2, 1024, 4, 128, torch.bfloat16) for _ in range(3))
    out_80, lse_80 = flash_attn_forward(q, k, v, True, 128 ** -0.5, family="sm80")
    out_90, lse_90 = forward(q, k, v, True)
    torch.cuda.synchronize()
    assert (lse_80 - lse_90).abs().max().item() < 2e-3
    assert max_error(out_80, out_90) <= 2 * rounding_allowance(out_80) + 1e-2


def test_repeated_call_compiles_encodes_and_loads_nothing(monkeypatch):
    from kernelgen import cache, launch, tma

    q = make(1, 300, 2, 128, torch.bfloat16)
    forward(q, q, q, False)

    def fail(*args, **kwargs):
        raise AssertionError("a repeated call compiled, loaded or encoded a tensor map")

    monkeypatch.setattr(cache, "compile_cached", fail)
    monkeypatch.setattr(launch.Kernel, "_load", fail)
    monkeypatch.setattr(tma, "_encode", fail)
    forward(q, q, q, False)
    torch.cuda.synchronize()


def test_flash_attn_func_runs_the_hopper_family_here(monkeypatch):
    """Dispatch on compute capability 9.0, and per call only the addresses change: once a layout's
    map has been seen at two addresses, a third is patched in without cuTensorMapEncodeTiled."""
    from kernelgen import ops, tma

    monkeypatch.setattr(ops, "FORCED_FAMILY", None)
    monkeypatch.setattr(ops, "_PLANS", {})
    tensors = [make(1, 257, 2, 64, torch.bfloat16) for _ in range(3)]
    for t in tensors[:2]:
        ops.flash_attn_func(t, t, t)
    plan = next(iter(ops._PLANS.values()))
    assert plan.kernel.spec.name == "flash_attn_fwd_sm90" and len(plan.maps) == 4
    assert tma._PATCHABLE is True, "this driver's tensor maps do not keep the address in word 0"

    def fail(*args, **kwargs):
        raise AssertionError("a known layout at a new address was encoded again")

    monkeypatch.setattr(tma, "_encode", fail)
    check(tensors[2], tensors[2], tensors[2], False)


Q_BUFFERS_2 = {"block_m": 128, "block_n": 128, "stages": 2, "schedule": 2, "persistent": 1,
               "q_buffers": 2}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tma_store_leaves_rows_past_seqlen_alone(causal):
    """The TMA store clips at O's extent: with O a view into a NaN-filled buffer whose rows past
    seqlen_q (of every batch, and past the last) are guards, the ragged last tiles' padding rows
    reach none of them, and every row of O is written."""
    from kernelgen import api, hopper, ops, tma

    torch.manual_seed(6)
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim = 3, 201, 333, 4, 2, 128
    q = make(batch, seqlen_q, heads, head_dim, torch.bfloat16)
    k, v = (make(batch, seqlen_k, heads_k, head_dim, torch.bfloat16) for _ in range(2))
    big = torch.full((batch + 1, 256, heads, head_dim), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    out = big[:batch, :seqlen_q]
    lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda")
    scale = head_dim ** -0.5
    plan = ops._plan(q, k, v, causal, scale, "sm90", Q_BUFFERS_2)
    o_map = tma.attention_map(out.shape, out.stride(), "bf16", hopper.O_STORE_ROWS, 128, panels=1)
    maps = hopper.encode_maps(plan.maps[:3] + (o_map,), q, k, v, out)
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            batch, heads, heads_k, seqlen_q, seqlen_k, scale, *maps, 0)   # 0: no tile counter
    plan.kernel.launch(args, plan.grid, plan.device, api._current_stream(plan.device))
    torch.cuda.synchronize()
    assert big[:, seqlen_q:].isnan().all() and big[batch:].isnan().all(), "a guard row was written"
    assert not out.isnan().any(), "a row of O was not written"
    out_ref, lse_ref = attention_ref(q, k, v, causal, upcast=True)
    out_pt, _ = attention_ref(q, k, v, causal, upcast=False)
    assert max_error(out, out_ref) <= 2 * max_error(out_pt, out_ref) + rounding_allowance(out_ref)
    assert (lse - lse_ref).abs().max().item() < 2e-3


def test_errors_name_the_argument():
    from kernelgen.hopper import flash_attn_forward_sm90

    q = make(1, 16, 2, 64, torch.bfloat16)
    with pytest.raises(TypeError, match="k has dtype"):
        flash_attn_forward_sm90(q, q.half(), q)
    with pytest.raises(ValueError, match="head_dim 80 is not supported"):
        x = make(1, 16, 2, 80, torch.bfloat16)
        flash_attn_forward_sm90(x, x, x)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash_attn_forward_sm90(q, q, q, softmax_scale=-1.0)
