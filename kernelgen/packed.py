"""Packed documents as per-token key ranges: what specs/flash_attn_packed.yaml takes.

Several documents concatenated along the sequence, each token attending only to its own
document's tokens: with per-token document ids that is flash_attn_document's mask (any layout of
ids, a block mask to skip tiles). When the documents are packed back to back, each query's
visible keys are one contiguous run [doc_start, doc_end), and those runs move forward along the
sequence, which the kernel uses as an exact kv range: no block mask, no id loads per key.

    start, end = kernelgen.packed_ranges(doc_ids)             # self-attention over a packed batch
    start, end = kernelgen.packed_ranges(doc_q, doc_k)        # queries and keys of other lengths
    start, end = kernelgen.varlen_ranges(cu_seqlens)         # FlashAttention's varlen layout
    attn = kernelgen.load("flash_attn_packed", head_dim=128, dtype="bf16", causal=True)
    out = attn(q, k, v, doc_start=start, doc_end=end)
    out = kernelgen.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True)

A varlen call's gradients (full, or causal at the same offsets) on the Hopper backward take
flash_attn_document's kernel instead (_document_route): its sequences are documents, their
indices per token the ids, and a block mask built once per offsets tensor lists each KV tile's
query tiles, where the kv-range kernel searches for them per KV tile (PERF_NOTES §102, §104).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from numbers import Integral

import torch

from kernelgen import ops


def packed_ranges(doc_q: torch.Tensor, doc_k: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc_start, doc_end), each (batch, seqlen_q) int32 contiguous on doc_q's device: the keys
    [doc_start[b, i], doc_end[b, i]) are those whose id in doc_k equals doc_q[b, i].

    doc_q: (batch, seqlen_q) integer document ids of the queries; doc_k: (batch, seqlen_k) the
    keys' (default doc_q). Both must be non-decreasing along each sequence (documents packed back
    to back, numbered in order), or the ranges would not be an exact kv range: a ValueError names
    the argument (flash_attn_document takes ids in any layout). A query whose id no key has gets
    an empty range (its output row is zero). This checks the order on the host: one sync, so
    build the ranges once per batch, as a block mask is built.
    """
    doc_k = doc_q if doc_k is None else doc_k
    for name, ids in (("doc_q", doc_q), ("doc_k", doc_k)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"packed_ranges: {name} must be a (batch, seqlen) tensor of document "
                             f"ids, got {_describe(ids)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"packed_ranges: {name} must hold integer document ids, got {ids.dtype}")
    if doc_k.shape[0] != doc_q.shape[0] or doc_k.device != doc_q.device:
        raise ValueError(f"packed_ranges: doc_k {_describe(doc_k)} must have doc_q's batch and "
                         f"device ({_describe(doc_q)})")
    if doc_k.shape[1] >= 2**31:
        raise ValueError(f"packed_ranges: doc_k has {doc_k.shape[1]} keys; int32 ranges hold "
                         "fewer than 2^31")
    steps = torch.stack([(ids[:, 1:] < ids[:, :-1]).any() for ids in (doc_q, doc_k)]).tolist()
    for name, unordered in zip(("doc_q", "doc_k"), steps):
        if unordered:
            raise ValueError(f"packed_ranges: {name} must be non-decreasing along each sequence "
                             "(documents packed back to back, numbered in order); "
                             "flash_attn_document takes ids in any layout")
    return _ranges(doc_q, doc_k)


def ordered_ranges(doc_q: torch.Tensor, doc_k: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """packed_ranges of flash_attn_document's ids (already checked as its mod arguments) where
    both are non-decreasing along each sequence, else None (one host sync): what its
    create_block_mask keeps in the mask, so that the forward runs on the ranges
    (attention.AttentionKernel)."""
    unordered = torch.stack([(ids[:, 1:] < ids[:, :-1]).any() for ids in (doc_q, doc_k)])
    return None if unordered.any().item() else _ranges(doc_q, doc_k)


def _ranges(doc_q: torch.Tensor, doc_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keys, queries = doc_k.to(torch.int64).contiguous(), doc_q.to(torch.int64).contiguous()
    start = torch.searchsorted(keys, queries, right=False)
    end = torch.searchsorted(keys, queries, right=True)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def varlen_ranges(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None,
                  causal: bool = False, window_size: tuple[int, int] = (-1, -1)
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's varlen layout as flash_attn_packed's ranges: sequences packed into one
    of total_q tokens (q of shape (1, total_q, heads, head_dim)), sequence d holding the tokens
    cu_seqlens_q[d]:cu_seqlens_q[d + 1] and seeing the keys cu_seqlens_k[d]:cu_seqlens_k[d + 1]
    (default: the same). Returns (doc_start, doc_end), each (1, total_q) int32.

    causal=True puts each sequence's own causal mask into the ranges, aligned bottom-right as
    flash_attn_func's: query t of a sequence of len_q queries and len_k keys sees its keys 0 ..
    t + len_k - len_q (none when that is negative); run the kernel with causal=False then. (The
    kernel's own causal=True masks the packed sequence as one, key j visible to query i when
    j <= i + total_k - total_q: each sequence's causal mask only when every sequence has as many
    queries as keys.) window_size=(left, right) puts each sequence's sliding window in as well
    (as flash_attn_func's, aligned bottom-right: query t sees its keys t + len_k - len_q - left ..
    t + len_k - len_q + right; -1 leaves a side unbounded; causal makes right 0). cu_seqlens
    must be 1-D, start at 0 and never decrease (a ValueError names the argument)."""
    return _varlen(cu_seqlens_q, cu_seqlens_k, causal, window=window_size)[:2]


def _varlen(cu_seqlens_q, cu_seqlens_k, causal, own_causal=False, window=(-1, -1)):
    """varlen_ranges' (start, end), then what flash_attn_varlen_func checks as well: (total_q,
    total_k, longest_q, longest_k), all read from the GPU in one host sync, and whether the
    kernel is to run its own causal mask. own_causal: when causal and the offsets of queries and
    keys are the same (every sequence has as many queries as keys: training's case), leave the
    ranges unfolded and say so; the kernel's causal mask (key j visible to query i when j <= i)
    is then each sequence's, and its causal variant's tuned configs apply (PERF_NOTES §44).
    window: (left, right) folded into the ranges as well (only its left side when the kernel's
    causal mask stands for the right)."""
    left, right = ops.window_bounds(window)
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 \
                or cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
            raise ValueError(f"varlen_ranges: {name} must be a 1-D integer tensor of at least 2 "
                             f"offsets, got {_describe(cu)}")
    if cu_k.numel() != cu_seqlens_q.numel() or cu_k.device != cu_seqlens_q.device:
        raise ValueError(f"varlen_ranges: cu_seqlens_k {_describe(cu_k)} must hold as many "
                         f"sequences as cu_seqlens_q ({_describe(cu_seqlens_q)}), on its device")
    cu_q, cu_k = cu_seqlens_q.to(torch.int64), cu_k.to(torch.int64)
    len_q, len_k = cu_q.diff(), cu_k.diff()
    facts = torch.stack([cu_q[0], cu_k[0], (len_q < 0).any().long(), (len_k < 0).any().long(),
                         cu_q[-1], cu_k[-1], len_q.max(), len_k.max(),
                         (cu_q == cu_k).all().long()]).tolist()
    for name, first, decreases in (("cu_seqlens_q", *facts[0:3:2]), ("cu_seqlens_k", *facts[1:4:2])):
        if first != 0 or decreases:
            raise ValueError(f"varlen_ranges: {name} must start at 0 and never decrease")
    total_q = facts[4]
    tokens = torch.arange(total_q, device=cu_q.device)
    sequence = torch.searchsorted(cu_q[1:], tokens, right=True)   # each query's sequence
    start, end = cu_k[sequence], cu_k[sequence + 1]
    kernel_causal = bool(causal and own_causal and facts[8])
    if causal:
        right = 0
    if left >= 0 or (right >= 0 and not kernel_causal):
        # Each bound clamped into the sequence's keys [start, end): both stay non-decreasing
        # along the tokens (an exact kv range), and an empty range is [x, x) inside them.
        diagonal = start + tokens - cu_q[sequence] + len_k[sequence] - len_q[sequence]
        first, last = start, end
        if left >= 0:
            start = torch.minimum(torch.maximum(diagonal - left, first), last)
        if right >= 0 and not kernel_causal:
            end = torch.minimum(torch.maximum(diagonal + right + 1, start), last)
    return (start.to(torch.int32).view(1, total_q).contiguous(),
            end.to(torch.int32).view(1, total_q).contiguous(), *facts[4:8], kernel_causal)


# A model calls flash_attn_varlen_func in every layer with the same offsets: their checks (a host
# sync) and ranges (a few small kernels) are worth doing once per batch. Kept per offsets tensor
# object, with a reference to it (so its id cannot be reused) and its version counter (an
# in-place change invalidates); only for CUDA offsets, whose checks are what costs the sync. A few
# entries (micro-batches in flight) suffice; each holds two int32 per query token on the GPU.
_REMEMBERED: OrderedDict = OrderedDict()
_REMEMBER = 4


def _varlen_remembered(cu_q, cu_k, causal: bool, window: tuple[int, int]):
    """(_varlen's answer, a dict kept with it for what else is built once per offsets: the
    gradients' _Route)."""
    cu_k = cu_q if cu_k is None else cu_k
    if not (isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)
            and cu_q.is_cuda and cu_k.is_cuda):
        return _varlen(cu_q, cu_k, causal, own_causal=True, window=window), {}
    key, versions = (id(cu_q), id(cu_k), causal, window), (cu_q._version, cu_k._version)
    hit = _REMEMBERED.get(key)
    if hit is not None and hit[0] is cu_q and hit[1] is cu_k and hit[2] == versions:
        _REMEMBERED.move_to_end(key)
        return hit[3], hit[4]
    found = _varlen(cu_q, cu_k, causal, own_causal=True, window=window)
    entry = _REMEMBERED[key] = (cu_q, cu_k, versions, found, {})
    while len(_REMEMBERED) > _REMEMBER:
        _REMEMBERED.popitem(last=False)
    return found, entry[4]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, causal: bool = False,
                           softmax_scale: float | None = None, return_lse: bool = False,
                           deterministic: bool = False, window_size: tuple[int, int] = (-1, -1)):
    """FlashAttention's varlen call: sequences of different lengths packed along one token axis,
    q (total_q, heads, head_dim), k and v (total_k, heads_k, head_dim), sequence d holding the
    queries cu_seqlens_q[d]:cu_seqlens_q[d + 1] and the keys cu_seqlens_k[d]:cu_seqlens_k[d + 1].
    Each sequence attends to itself only; causal masks each one aligned bottom-right, as
    flash_attn_func does. Returns out (like q) and, with return_lse, lse (heads, total_q) in
    float32; differentiable in q, k and v. max_seqlen_q / max_seqlen_k (FlashAttention sizes its
    grid with them) are not needed here; when given they must bound the longest sequence.
    window_size=(left, right): each sequence's sliding window, as flash_attn_func's (aligned
    bottom-right within the sequence; -1: an unbounded side), folded into the same ranges.

    It runs flash_attn_packed on varlen_ranges' key ranges (causal folded into them, unless
    queries and keys have the same offsets: then its causal variant), so a sequence's tiles see
    no other sequence's keys and cost nothing for them. The offsets are
    checked on the host (a sync), once per offsets tensor: later calls with the same (unchanged)
    cu_seqlens tensors reuse the checks and ranges, so the other layers of a model, and a CUDA
    graph captured after the first call, need no sync. cu_seqlens_k=None: cu_seqlens_q's."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"flash_attn_varlen_func: {name} must be a (total_tokens, heads, "
                             f"head_dim) tensor, got {_describe(x)}")
    window = ops.window_bounds(window_size)
    found, remembered = _varlen_remembered(cu_seqlens_q, cu_seqlens_k, bool(causal), window)
    start, end, total_q, total_k, longest_q, longest_k, kernel_causal = found
    for name, x, total, longest, bound in (("q", q, total_q, longest_q, max_seqlen_q),
                                           ("k", k, total_k, longest_k, max_seqlen_k)):
        if x.shape[0] != total:
            raise ValueError(f"flash_attn_varlen_func: {name} holds {x.shape[0]} tokens but "
                             f"cu_seqlens_{name}[-1] is {total}")
        if bound is not None and not (type(bound) is int and bound >= longest) and (
                isinstance(bound, bool) or not isinstance(bound, Integral) or bound < longest):
            raise ValueError(f"flash_attn_varlen_func: max_seqlen_{name}={bound!r} must be an int "
                             f"of at least the longest sequence's {longest} tokens")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"flash_attn_varlen_func: v holds {v.shape[0]} tokens, k {k.shape[0]}")
    from kernelgen.attention import builtin_kernel

    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)   # a batch of one
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    route = None
    if wants_grad and not deterministic and window == (-1, -1) and (kernel_causal or not causal):
        ops._check_inputs(q4, k4, v4)   # before the route's mask is built on q's device
        route = _document_route(remembered, cu_seqlens_q, cu_seqlens_k, q4, k4, kernel_causal)
    if route is None:   # the kernel's call checks q4, k4 and v4 before anything launches
        if start.device != q.device:
            start, end = start.to(q.device), end.to(q.device)
        got = builtin_kernel("flash_attn_packed", q4, causal=kernel_causal)(
            q4, k4, v4, softmax_scale=softmax_scale, return_lse=True,
            deterministic=deterministic, doc_start=start, doc_end=end)
    else:   # the mask's ranges are these: its forward runs flash_attn_packed's kernel on them
        got = route.kernel(q4, k4, v4, softmax_scale=softmax_scale, return_lse=True,
                           doc_q=route.ids_q, doc_k=route.ids_k, block_mask=route.mask)
    if return_lse:
        return got[0].squeeze(0), got[1].squeeze(0)
    return got[0].squeeze(0)


@dataclass(frozen=True)
class _Route:
    """flash_attn_document (full, or causal at equal offsets) over a varlen call's sequences: each
    token's sequence index its document id (ids_q / ids_k, (1, total) int32) and the block mask
    of those ids, built once per offsets and kept with them. The ids are in order, so the mask
    holds their key ranges (which are the call's) and the kernel's forward runs
    flash_attn_packed's kernel on them (PERF_NOTES §103); its backward is the block mask's."""
    kernel: object   # attention.AttentionKernel
    ids_q: torch.Tensor
    ids_k: torch.Tensor
    mask: object     # blockmask.BlockMask


def _document_route(remembered: dict, cu_q, cu_k, q4, k4, causal: bool) -> _Route | None:
    """The route for a varlen call whose gradients are wanted (no window, not deterministic; causal
    only as the kernel's own mask, queries and keys at the same offsets), or None: taken where
    the document kernel's backward runs on the Hopper family, which is where it was measured
    (PERF_NOTES §102, §104: +15% full, +11% causal at hd128 4k). The same pairs are visible
    either way (query i sees key j when both are in one sequence, and j <= i when causal), but
    the kv-range backward finds each KV tile's query tiles by testing every query tile of the
    flattened batch (a few hundred, 32 a round), where the block mask lists them (and, full,
    launches its KV tiles shortest last: BlockMask.tile_order). The verdict is kept with the
    offsets too (whose entry is per causal already)."""
    from kernelgen import backward_sm90
    from kernelgen.attention import builtin_kernel

    key = (q4.shape[-1], ops._DTYPES[q4.dtype], q4.device)
    if key not in remembered:
        document = builtin_kernel("flash_attn_document", q4, causal=causal)
        route = None
        if backward_sm90.applies(q4.shape[-1], q4.device.index, False, k4.shape[1],
                                 document.spec, document.params):
            cu_k = cu_q if cu_k is None else cu_k
            ids_q = sequence_ids(cu_q.to(q4.device), q4.shape[1])
            ids_k = sequence_ids(cu_k.to(q4.device), k4.shape[1])
            mask = document.create_block_mask(1, q4.shape[2], q4.shape[1], k4.shape[1],
                                              doc_q=ids_q, doc_k=ids_k)
            route = _Route(document, ids_q, ids_k, mask)
        remembered[key] = route
    return remembered[key]


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, total) int32 on cu_seqlens' device: each token's sequence under the offsets (token t is
    in sequence d when cu_seqlens[d] <= t < cu_seqlens[d + 1]; empty sequences hold none), as
    flash_attn_document's per-token document ids."""
    cu = cu_seqlens.to(torch.int64)
    tokens = torch.arange(total, device=cu.device)
    ids = torch.searchsorted(cu[1:], tokens, right=True)
    return ids.to(torch.int32).view(1, total).contiguous()


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype} on {value.device}"
    return type(value).__name__
