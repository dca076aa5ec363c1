"""Block masks: which tiles of a mask_mod the attention kernels visit, given at runtime.

A mask that reads runtime data (per-token document ids, say) has no analytic kv_range: without
help the kernels evaluate it on every element of every tile. A BlockMask is what FlexAttention
calls one: for each (batch, head, query block) the ascending list of KV blocks that are
*partially* visible (the kernel evaluates the mask_mod per element there) and of those *fully*
visible (no mask_mod), and the transposed lists (per KV block: query blocks) for the backward's
main kernel, which loops over query tiles. Blocks in neither list are never loaded. A spec opts
in with `mods.block_sparse: true`; its kernels then take the lists as arguments
(spec.BLOCK_SPARSE_ARGS) and visit only the listed blocks.

Tile sizes. The kernels' tiles are tuned per problem and differ between the forward (either
family), the backward's main kernel and its dQ kernel, so a BlockMask is not built at one fixed
granularity: it holds one set of lists per tile size (block_m, block_n) it has been asked for,
built lazily on first use and kept (a handful of int32 tensors of size batch x heads x blocks^2).
The classify kernel takes the tile as a runtime argument, so one binary serves every size.

Building. `create_block_mask` runs the classify kernel (templates/block_mask.cu.j2, the spec put
onto templates/block_mask.yaml: rendered, compiled and cached like every kernel) over every
(query block, KV block) on the GPU: it evaluates the spec's mask_mod on each pair the attention
kernel would not mask anyway (pairs past the sequence ends and, causal, above the bottom-right
diagonal are left out; a kv range's promises are folded in) and writes 0 (empty), 1 (partial) or
2 (full); `compact` turns that into the lists with torch ops on the GPU (a stable sort: no host
synchronization). A mask_mod that never reads `batch` (or `head`; cexpr records the names an
expression reads) gives one set of lists for every batch element (head): that dimension is 1.

Without a block_mask, a call of a block-sparse spec builds one itself, every call: one classify
launch (a mask_mod evaluation per (query, key) pair, far less work than the attention's head_dim
multiply-adds per pair) and a few torch ops, and then takes the fast path; passing a BlockMask
built once and reused saves that. We chose this over per-element masking of every tile (also
correct, but 4x slower on document masks) so that a block-sparse kernel has one code path.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from kernelgen.spec import TEMPLATES_DIR, KernelSpec, load_spec

CLASSIFY_SPEC = TEMPLATES_DIR / "block_mask.yaml"
EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockLists:
    """The lists of one tile size, int32 on the mask's device. Forward orientation (per query
    block, for the forward kernels and the dQ kernel): kv_num / full_kv_num (B, H, q_blocks),
    kv_idx / full_kv_idx (B, H, q_blocks, kv_blocks), the first `num` entries of a row valid and
    ascending. Transposed (per KV block, for the backward's main kernel): q_num, q_idx, ...
    (B, H, kv_blocks[, q_blocks]). B, H: the mask's batch and heads (1 where it does not read
    them)."""
    block_m: int
    block_n: int
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    full_kv_num: torch.Tensor
    full_kv_idx: torch.Tensor
    q_num: torch.Tensor
    q_idx: torch.Tensor
    full_q_num: torch.Tensor
    full_q_idx: torch.Tensor


def _listed(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) per row of a boolean (..., n): the selected indices first, ascending."""
    count = selected.sum(-1, dtype=torch.int32)
    order = torch.sort((~selected).to(torch.uint8), dim=-1, stable=True).indices
    return count.contiguous(), order.to(torch.int32).contiguous()


def compact(state: torch.Tensor, block_m: int, block_n: int) -> BlockLists:
    """The lists of a classification (B, H, q_blocks, kv_blocks) of EMPTY / PARTIAL / FULL."""
    state_t = state.transpose(-1, -2)
    return BlockLists(block_m, block_n,
                      *_listed(state == PARTIAL), *_listed(state == FULL),
                      *_listed(state_t == PARTIAL), *_listed(state_t == FULL))


def combine_halves(halves: torch.Tensor, causal: bool, seqlen_q: int, seqlen_k: int,
                   block_n: int) -> torch.Tensor:
    """The classification of 128-row tiles from that of their 64-row halves (B, H, cdiv(seqlen_q,
    64), kv_blocks), the same as the classify kernel's at 128 rows: a half with no pair the kernel
    counts (no rows, or causal: every key past its rows' diagonal) is neutral; else an EMPTY half
    hides every pair, a PARTIAL one some, a FULL one none."""
    rows, kv_blocks = halves.shape[-2:]
    first_row = torch.arange(rows, device=halves.device)[:, None] * 64
    last_row = torch.clamp(first_row + 63, max=seqlen_q - 1)
    first_col = torch.arange(kv_blocks, device=halves.device)[None, :] * block_n
    counted = first_col <= last_row + (seqlen_k - seqlen_q) if causal else \
        torch.ones(rows, kv_blocks, dtype=torch.bool, device=halves.device)
    shown = (halves != EMPTY)
    hidden = counted & (halves != FULL)
    if rows % 2:   # the last tile's lower half has no rows
        shown = torch.cat([shown, torch.zeros_like(shown[..., -1:, :])], dim=-2)
        hidden = torch.cat([hidden, torch.zeros_like(hidden[..., -1:, :])], dim=-2)
    shown = shown[..., 0::2, :] | shown[..., 1::2, :]
    hidden = hidden[..., 0::2, :] | hidden[..., 1::2, :]
    state = torch.full(shown.shape, FULL, dtype=torch.uint8, device=halves.device)
    state[hidden] = PARTIAL
    state[~shown] = EMPTY
    return state


def group_for_warpgroups(halves: torch.Tensor, state: torch.Tensor, block_n: int) -> BlockLists:
    """The forward lists of 128-row tiles (`state`: combine_halves of `halves`) for the Hopper
    forward's warpgroup skips (wg_skip: its two consumer warpgroups each own 64 rows). A row's
    visiting order (the partial list, then the full list) is: the blocks one warpgroup's rows
    do not see (it skips them as its leading blocks), the partial blocks both see, the full
    blocks both see, the blocks the other warpgroup's rows do not see (its trailing blocks),
    each group ascending, the first and last groups evaluated per element. So the partial list
    holds the first two groups (kv_num counts them) and the full list the last two (full_kv_num
    counts both); the leading warpgroup is the one with more to skip (the dynamic schedule caps
    trailing skips at stages - 1). Both lists have two more columns (the rows' stride is
    shared), in kv_idx: [..., -2] the leading group's size | the leading warpgroup << 16,
    [..., -1] the trailing group's size, whose blocks need the mask_mod per element. The
    transposed lists are those of `state`."""
    rows = halves.shape[-2]
    if rows % 2:   # a lower half with no rows skips every block (nothing of it is stored)
        halves = torch.cat([halves, torch.full_like(halves[..., -1:, :], EMPTY)], dim=-2)
    partial, listed = state == PARTIAL, state != EMPTY
    # (A full block one half has no pair of, causal past its rows' diagonal, is skipped by that
    # half's warpgroup too, and so masked per element by the other: one block a tile at most.)
    skip = (listed & (halves[..., 0::2, :] == EMPTY), listed & (halves[..., 1::2, :] == EMPTY))
    counts = [s.sum(-1, dtype=torch.int32) for s in skip]
    lead_wg = counts[1] > counts[0]                                   # (B, H, q_blocks)
    leading = torch.where(lead_wg[..., None], skip[1], skip[0])
    trailing = torch.where(lead_wg[..., None], skip[0], skip[1])
    kv_blocks = state.shape[-1]
    column = torch.arange(kv_blocks, device=state.device)
    # Sort keys: the group (its place in the visiting order) then the block; 4: not listed.
    front = torch.where(leading, 0, torch.where(partial & ~trailing, 1, 4))
    back = torch.where(trailing, 3, torch.where(listed & ~partial & ~leading, 2, 4))
    ranked = [torch.sort(g * kv_blocks + column, dim=-1, stable=True).indices.to(torch.int32)
              for g in (front, back)]
    n_lead = torch.where(lead_wg, counts[1], counts[0])
    n_trail = torch.where(lead_wg, counts[0], counts[1])
    info = torch.stack([n_lead | (lead_wg.to(torch.int32) << 16), n_trail], dim=-1)
    transposed = compact(state, 128, block_n)
    return BlockLists(128, block_n,
                      (front < 4).sum(-1, dtype=torch.int32),
                      torch.cat([ranked[0], info.to(torch.int32)], dim=-1).contiguous(),
                      (back < 4).sum(-1, dtype=torch.int32),
                      torch.cat([ranked[1], torch.zeros_like(info, dtype=torch.int32)],
                                dim=-1).contiguous(),
                      transposed.q_num, transposed.q_idx, transposed.full_q_num,
                      transposed.full_q_idx)


def classify_dense(visible: torch.Tensor, causal: bool, block_m: int, block_n: int) -> torch.Tensor:
    """What the classify kernel computes, from a dense boolean mask (B, H, seqlen_q, seqlen_k) of
    the mask_mod: the CPU oracle of the tests, and the way to a BlockMask of any dense mask."""
    batch, heads, seqlen_q, seqlen_k = visible.shape
    rows = torch.arange(seqlen_q, device=visible.device)[:, None]
    cols = torch.arange(seqlen_k, device=visible.device)[None, :]
    counted = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=visible.device)
    if causal:  # pairs the kernel masks anyway are no part of the classification
        counted = cols <= rows + (seqlen_k - seqlen_q)
    q_blocks, kv_blocks = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    pad = (0, kv_blocks * block_n - seqlen_k, 0, q_blocks * block_m - seqlen_q)
    counted = torch.nn.functional.pad(counted, pad).expand(batch, heads, -1, -1)
    shown = torch.nn.functional.pad(visible.bool(), pad) & counted
    hidden = counted & ~shown
    tiles = (batch, heads, q_blocks, block_m, kv_blocks, block_n)
    any_shown = shown.reshape(tiles).any(5).any(3)
    any_hidden = hidden.reshape(tiles).any(5).any(3)
    state = torch.full(any_shown.shape, FULL, dtype=torch.uint8, device=visible.device)
    state[any_hidden] = PARTIAL
    state[~any_shown] = EMPTY
    return state


@dataclass(frozen=True)
class BlockMask:
    """A mask's block lists for one problem (spec, causal, batch, heads, seqlen_q, seqlen_k),
    reused across calls; `lists(block_m, block_n)` builds a tile size's on first use. batch /
    heads: None where the mask does not depend on them (the lists' dimension is 1 there)."""
    spec: str
    causal: bool
    batch: int | None
    heads: int | None
    seqlen_q: int
    seqlen_k: int
    device: torch.device
    # (block_m, block_n) -> classification (B, H, q_blocks, kv_blocks); None: fixed lists only.
    classify: Callable[[int, int], torch.Tensor] | None = field(default=None, compare=False,
                                                                repr=False)
    built: dict = field(default_factory=dict, compare=False, repr=False)
    # (block_m, block_n, batch, heads, heads_k, transposed, grouped) -> tile_order's answer
    orders: dict = field(default_factory=dict, compare=False, repr=False)
    # The mask as exact per-token key ranges (doc_start, doc_end), (batch, seqlen_q) int32, where
    # its spec knows them: flash_attn_document's ids packed in order (AttentionKernel's
    # create_block_mask). The Hopper forward then runs flash_attn_packed's kernel on them.
    ranges: tuple | None = field(default=None, compare=False, repr=False)

    def lists(self, block_m: int, block_n: int, grouped: bool = False) -> BlockLists:
        """grouped (block_m 128 only): the forward lists with each row's partial blocks grouped
        for the Hopper forward's warpgroup skips (group_for_warpgroups), from a classification
        of 64-row halves."""
        key = (block_m, block_n, "grouped") if grouped else (block_m, block_n)
        found = self.built.get(key)
        if found is None:
            if self.classify is None:
                raise ValueError(
                    f"block_mask has lists for block sizes {sorted(self.built)} (block_m, block_n) "
                    f"only, but the kernel's tile is {key}; build it with "
                    "create_block_mask (any tile size), or give lists for this one")
            if grouped:
                if block_m != 128:
                    raise ValueError(f"grouped block lists are for 128-row tiles (two warpgroups "
                                     f"of 64 rows), not block_m={block_m}")
                halves = self.classify(64, block_n)
                state = combine_halves(halves, self.causal, self.seqlen_q, self.seqlen_k,
                                       block_n)
                found = group_for_warpgroups(halves, state, block_n)
            else:
                found = compact(self.classify(block_m, block_n), block_m, block_n)
            self.built[key] = found
        return found

    def kernel_args(self, block_m: int, block_n: int, transposed: bool = False,
                    grouped: bool = False, order: tuple[int, int, int] | None = None) -> tuple:
        """The values of spec.BLOCK_SPARSE_ARGS for a kernel with this tile (tensors for the
        pointers, 0 for a null one); transposed: the backward main kernel's lists (per KV block);
        grouped: a Hopper forward's with wg_skip 1 (lists()); order (batch, heads, heads_k): the
        grid's launch order of its tiles (tile_order, in the same orientation), else none."""
        lists = self.lists(block_m, block_n, grouped)
        if transposed:
            tensors = (lists.q_num, lists.q_idx, lists.full_q_num, lists.full_q_idx)
        else:
            tensors = (lists.kv_num, lists.kv_idx, lists.full_kv_num, lists.full_kv_idx)
        _, heads, rows, width = tensors[1].shape
        stride_h = rows if heads > 1 else 0
        stride_b = heads * rows if tensors[1].shape[0] > 1 else 0
        tiles = 0 if order is None else self.tile_order(block_m, block_n, *order,
                                                         transposed=transposed, grouped=grouped)
        return (*tensors, stride_b, stride_h, width, tiles)

    def tile_order(self, block_m: int, block_n: int, batch: int, heads: int, heads_k: int,
                   transposed: bool = True, grouped: bool = False) -> torch.Tensor:
        """int32: the tiles of a full-attention grid of a CTA per tile, in the order its CTAs
        take them: the shortest eighth by listed blocks last, the rest in the grid's order.
        transposed: the Hopper backward's KV tiles (index (b * heads_k + h) * kv_blocks + n,
        their pairs summed over the kv head's query heads); else the Hopper forward's query
        tiles (index (b * heads + h) * q_blocks + m; heads_k is not used). The hardware starts
        each CTA when an SM frees up, so long tiles left to the last wave stretch it; a full
        sort longest-first would also spread a head's tiles over the whole run and lose their
        reuse of Q, dO and dQ (or K and V) in L2 (PERF_NOTES §99). Built once per problem and
        tile."""
        key = (block_m, block_n, batch, heads, heads_k, transposed, grouped)
        found = self.orders.get(key)
        if found is None:
            lists = self.lists(block_m, block_n, grouped)
            if transposed:
                counts = (lists.q_num + lists.full_q_num).expand(batch, heads, -1)
                counts = counts.reshape(batch, heads_k, heads // heads_k, -1).sum(2).flatten()
            else:
                counts = (lists.kv_num + lists.full_kv_num).expand(batch, heads, -1).flatten()
            n, k = counts.numel(), counts.numel() // 8
            found = torch.arange(n, device=counts.device)
            if k:   # a stable partition by sorting short * n + index (no host sync: capturable)
                short = counts <= counts.sort().values[k - 1]
                found = torch.argsort(short.to(torch.int64) * n + found)
            found = found.to(torch.int32).contiguous()
            self.orders[key] = found
        return found

    def forward_args(self, config: dict, batch: int | None = None,
                     heads: int | None = None) -> tuple:
        """kernel_args for a forward kernel's config (a dict): its tile's lists, grouped for the
        warpgroups where it has wg_skip (a kernel without the key must not get those: it would
        run their trailing group unmasked); with the problem's batch and heads, a Hopper
        forward's launch order where its grid is a CTA per tile (persistent 0) and not causal
        (tile_order; the persistent schedules order their own tiles)."""
        ordered = (batch is not None and config.get("persistent", -1) == 0 and not self.causal)
        return self.kernel_args(config["block_m"], config["block_n"],
                                grouped=bool(config.get("wg_skip", 0)),
                                order=(batch, heads, heads) if ordered else None)

    def check(self, spec: KernelSpec, causal: bool, batch: int, heads: int, seqlen_q: int,
              seqlen_k: int, device) -> None:
        """A clear error, before any launch, when this mask was built for another problem."""
        base = spec.name.split("__")[0]
        if self.spec != base:
            raise ValueError(f"block_mask was built for spec {self.spec!r}, not {base!r}")
        if self.causal != bool(causal):
            raise ValueError(f"block_mask was built with causal={self.causal}, but the kernel "
                             f"has causal={bool(causal)}")
        for name, built, given in (("batch", self.batch, batch), ("heads", self.heads, heads),
                                   ("seqlen_q", self.seqlen_q, seqlen_q),
                                   ("seqlen_k", self.seqlen_k, seqlen_k)):
            if built is not None and built != given:
                raise ValueError(f"block_mask was built for {name}={built}, but the inputs have "
                                 f"{name}={given}")
        if _resolved(self.device) != _resolved(device):
            raise ValueError(f"block_mask is on {self.device}, but q is on {device}")


def _resolved(device) -> torch.device:
    """device with its index filled in: "cuda" is the current CUDA device, so a mask built on
    "cuda" serves inputs on "cuda:0" when that is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_argument(block_mask, spec: KernelSpec) -> None:
    if not spec.mods.block_sparse:
        if block_mask is not None:
            raise TypeError(f"{spec.name} takes no block_mask: its spec has no "
                            "mods.block_sparse: true")
        return
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError("block_mask must be a kernelgen BlockMask (kernel.create_block_mask(...)),"
                        f" got {type(block_mask).__name__}")


def _reads(spec: KernelSpec) -> frozenset:
    exprs = [spec.mods.mask_mod, *(spec.mods.kv_range or ())]
    return frozenset().union(*(e.names for e in exprs if e is not None))


def create_block_mask(spec: KernelSpec, params: Mapping, batch: int, heads: int, seqlen_q: int,
                      seqlen_k: int, mask_args: Mapping, device) -> BlockMask:
    """The BlockMask of `spec`'s mask_mod for one problem, its classify kernel on `device`.
    params: the variant's (head_dim, dtype, causal, ...); mask_args: the spec's mod arguments by
    name (tensors or data pointers for `ptr`, numbers for scalars). Lists are built per tile size
    as kernels ask for them (each a classify launch on the current stream)."""
    from kernelgen import api

    device = torch.device(device)
    onto = load_spec(spec.path, onto=str(CLASSIFY_SPEC))
    reads = _reads(spec)
    mask_batch = batch if "batch" in reads else 1
    mask_heads = heads if "head" in reads else 1
    variant = {p.name: params[p.name] for p in onto.params if p.name in params}
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = api.load(onto, arch=api.pick_arch(onto, index), **variant)
    values = tuple(_pointer(mask_args[a.name]) for a in onto.mods.args)
    keep = tuple(mask_args.values())  # the tensors the closure reads stay alive with it

    def classify(block_m: int, block_n: int) -> torch.Tensor:
        assert keep is not None  # referenced so that the mod tensors outlive the mask
        state = torch.empty((mask_batch, mask_heads, -(-seqlen_q // block_m),
                             -(-seqlen_k // block_n)), dtype=torch.uint8, device=device)
        if state.numel():
            scalars = {"seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "tile_m": block_m,
                       "tile_n": block_n, "mask_batch": mask_batch, "mask_heads": mask_heads}
            kernel.launch((state.data_ptr(), seqlen_q, seqlen_k, block_m, block_n, mask_batch,
                           mask_heads, *values), kernel.grid(scalars), index,
                          api._current_stream(index))
        return state

    return BlockMask(spec.name.split("__")[0], bool(params.get("causal", False)),
                     batch if "batch" in reads else None, heads if "head" in reads else None,
                     seqlen_q, seqlen_k, device, classify)


def from_dense(spec: KernelSpec, visible: torch.Tensor, causal: bool,
               batch: int | None = None, heads: int | None = None) -> BlockMask:
    """A BlockMask of a dense boolean mask_mod (B, H, seqlen_q, seqlen_k), B and H 1 where it
    does not depend on them, classified with torch ops on its device (any tile size): for masks
    no spec expression computes, and the CPU tests."""
    _, _, seqlen_q, seqlen_k = visible.shape
    return BlockMask(spec.name.split("__")[0], bool(causal), batch, heads, seqlen_q, seqlen_k,
                     visible.device, lambda m, n: classify_dense(visible, causal, m, n))


def _pointer(value):
    return value.data_ptr() if isinstance(value, torch.Tensor) else value
