"""The Hopper forward family (spec flash_attn_fwd_sm90: TMA, mbarriers, wgmma).

`flash_attn_func` runs it on compute capability 9.0 (kernelgen.ops.forward_family); this module
holds what only this family needs, the tensor maps, and an explicit entry point that takes a
config. The kernel takes the sm80 family's arguments plus four tensor maps (kernelgen/tma.py: Q,
K, V, and O for the configs that store it by TMA) whose layouts a launch plan keeps; per call only
the addresses change (tma.encode); then the dynamic schedule's tile counter (counter_address).
"""
from __future__ import annotations

import threading

import torch

from kernelgen import ops, tma

SPEC = ops.FAMILIES["sm90"]
_EMPTY_MAP = bytes(tma.MAP_BYTES)  # for an empty K/V, or an O the kernel does not store by TMA
O_STORE_ROWS = 64                  # one consumer warpgroup's rows: a TMA store's box


def q_box(env) -> tuple[int, int | None]:
    """(rows, panels) of one TMA box of Q for a config's environment: the whole tile, or with
    q_split one consumer warpgroup's rows one panel at a time (its rows are not contiguous in
    the tile's [panel][block_m] layout)."""
    return (O_STORE_ROWS, 1) if env.get("q_split") else (env["block_m"], None)


def kv_box_panels(env) -> int | None:
    """Panels of one TMA box of K or V: the whole tile's (None), or with a cluster each CTA's
    share, which it multicasts to the others (panels are contiguous in the tile's layout)."""
    cluster = env.get("cluster", 1)
    return None if cluster == 1 else env["head_dim"] // (env["swizzle"] // 2) // cluster


def tensor_maps(kernel, q, k, v) -> tuple:
    """The map layouts of Q, K, V and O for `kernel`'s tiles (Q's boxes by q_box); O's only
    where the config stores it by TMA (q_buffers 2 or 3), for the output every caller makes
    (torch.empty(q.shape): contiguous); all-zero maps where unused, and all four when K/V are
    empty (no CTA loads or stores then)."""
    if not k.shape[1]:
        return (_EMPTY_MAP,) * 4
    env = kernel.spec.environment(kernel.variant, kernel.config)
    dtype, swizzle = kernel.variant["dtype"], env["swizzle"]
    q_rows, q_panels = q_box(env)
    kv_panels = kv_box_panels(env)
    maps = (tma.attention_map(q.shape, q.stride(), dtype, q_rows, swizzle, q_panels),
            *(tma.attention_map(t.shape, t.stride(), dtype, env["block_n"], swizzle, kv_panels)
              for t in (k, v)))
    if env.get("q_buffers", 1) == 1:
        return maps + (_EMPTY_MAP,)
    batch, seqlen, heads, head_dim = q.shape
    contiguous = (seqlen * heads * head_dim, heads * head_dim, head_dim, 1)
    return maps + (tma.attention_map(q.shape, contiguous, dtype, O_STORE_ROWS, swizzle, panels=1),)


def encode_maps(layouts: tuple, q, k, v, o) -> tuple:
    """The 128-byte maps of `tensor_maps`' layouts at q, k, v and o's addresses (per call: only
    the address changes, which tma.encode patches in)."""
    return tuple(m if isinstance(m, bytes) else tma.encode(m, t.data_ptr())
                 for m, t in zip(layouts, (q, k, v, o)))


def counter_words(config, q_shape) -> int:
    """int32s of the dynamic schedule's counter for a config and query shape (batch, seqlen_q,
    heads, ...): the claims (with kDefer a 64-bit word), two counts and an entry per tile."""
    batch, seqlen_q, heads = q_shape[:3]
    return 4 + batch * heads * -(-seqlen_q // config["block_m"])


# Zeroed counter words for eager launches, handed out once each from one buffer per (device,
# stream): a launch takes the next `counter_words` words (rounded to 16 bytes) instead of a
# torch.zeros of its own, whose allocation and memset kernel cost ~13 us of host time per call
# and a ~1.5 us kernel on the stream (PERF_NOTES §43, §44, §76). Words are never handed out
# twice; a full buffer is dropped for a fresh zeroed one, and the caching allocator reuses the
# old one only on its stream, after the launches that read it. Launches on another stream take
# another buffer (never one word shared by concurrent launches); a captured CUDA graph gets a
# fresh counter per launch (tile_counter), its memset a node of the graph, so that replays on
# any stream never share one.
_POOLS: dict[tuple[int, int], list] = {}   # (device, stream) -> [buffer, next free word]
POOL_WORDS = 1 << 18                         # 1 MiB of int32 words per buffer (at least)
_MAX_POOLS = 64
_POOL_LOCK = threading.Lock()


def counter_address(kernel, q, stream: int) -> tuple[int, object]:
    """(device address of a zeroed counter for one launch of `kernel` on query `q` on `stream`,
    the tensor to keep alive until the launch is enqueued or None): 0 for configs without the
    dynamic schedule; from the (device, stream)'s buffer, or while a graph is captured a fresh
    tensor (tile_counter)."""
    if kernel.config["persistent"] != 2:
        return 0, None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        counter = tile_counter(kernel, q)
        return counter.data_ptr(), counter
    words = -(-counter_words(kernel.config, q.shape) // 4) * 4   # 16-byte aligned slices
    key = (q.device.index, stream)
    with _POOL_LOCK:
        pool = _POOLS.get(key)
        if pool is None or pool[1] + words > pool[0].numel():
            if pool is None and len(_POOLS) >= _MAX_POOLS:
                _POOLS.clear()
            # Made on the current stream (the launch's), like the launch that reads it.
            pool = _POOLS[key] = [torch.zeros(max(POOL_WORDS, 4 * words), dtype=torch.int32,
                                              device=q.device), 0]
        address = pool[0].data_ptr() + 4 * pool[1]
        pool[1] += words
    return address, None


def tile_counter(kernel, q):
    """A fresh claim counter for one launch of `kernel` (persistent 2) on query `q` (batch,
    seqlen_q, heads, head_dim): zero int32s on q's device, made on the current stream like the
    launch that follows, counter_words long (the deferred tiles' list is only used by non-causal
    kv-range and block-mask kernels, but it is one memset either way). What a launch captured in
    a CUDA graph takes (counter_address), so that replays never share one: a kernel that reset
    a shared counter itself would race with a concurrent one. None for the other configs."""
    if kernel.config["persistent"] != 2:
        return None
    return torch.zeros(counter_words(kernel.config, q.shape), dtype=torch.int32, device=q.device)


def flash_attn_forward_sm90(q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                            config=None):
    """Exact attention on the Hopper kernels; same contract as `flash_attn_func(..., return_lse=
    True)` without autograd: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
    heads_k, head_dim), causal aligned bottom-right. Returns (out like q, lse (batch, heads,
    seqlen_q) float32 in natural log; -inf and a zero output row where a query sees no key).
    `config`: a mapping of the spec's tune keys (block_m, block_n, stages, schedule, persistent,
    q_buffers; q_buffers may be left out: 1) instead of the tuned or default one."""
    ops._check_inputs(q, k, v)
    return ops.flash_attn_forward(q, k, v, bool(causal), ops._scale(q, softmax_scale),
                                  family="sm90", config=None if config is None else dict(config))
