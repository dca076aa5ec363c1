"""kernelgen.packed_ranges: packed documents' ids as the per-token key ranges flash_attn_packed
takes (CPU; the kernels' numerics are tests/test_mods*_gpu.py's)."""
import pytest
import torch

import kernelgen
from kernelgen import bench_mods


def mask_of(start, end, seqlen_k):
    keys = torch.arange(seqlen_k)
    return (keys >= start[:, :, None]) & (keys < end[:, :, None])


def test_ranges_are_the_ids_mask():
    ids = bench_mods.document_ids(bench_mods.document_lengths(batch=3, seqlen=97, documents=5, seed=2))
    ids[2, 40:] += 1
    ids[2, 41:] += 1   # token 40 a document of its own
    start, end = kernelgen.packed_ranges(ids)
    assert start.dtype == end.dtype == torch.int32 and start.shape == end.shape == ids.shape
    assert start.is_contiguous() and end.is_contiguous()
    assert (start[2, 40], end[2, 40]) == (40, 41)
    assert torch.equal(mask_of(start, end, 97), ids[:, :, None] == ids[:, None, :])
    # Non-decreasing along each sequence: what makes them an exact kv range.
    assert bool((start.diff(dim=1) >= 0).all() and (end.diff(dim=1) >= 0).all())


def test_queries_and_keys_of_other_lengths_and_ids_without_keys():
    doc_q = torch.tensor([[0, 0, 1, 1, 1, 3, 3], [2, 2, 2, 2, 5, 5, 6]])
    doc_k = torch.tensor([[0, 1, 1, 2, 3], [0, 2, 2, 5, 5]])
    start, end = kernelgen.packed_ranges(doc_q, doc_k)
    assert torch.equal(mask_of(start, end, 5), doc_q[:, :, None] == doc_k[:, None, :])
    assert (start[1, 6], end[1, 6]) == (5, 5)   # document 6 has no keys: an empty range


@pytest.mark.parametrize("doc_q, doc_k, match", [
    (torch.tensor([[0, 1, 0]]), None, "doc_q must be non-decreasing"),
    (torch.tensor([[0, 0, 1]]), torch.tensor([[1, 0]]), "doc_k must be non-decreasing"),
    (torch.tensor([0, 0, 1]), None, r"doc_q must be a \(batch, seqlen\) tensor"),
    (torch.tensor([[0.0, 1.0]]), None, "doc_q must hold integer document ids"),
    (torch.tensor([[0, 1]]), torch.tensor([[0], [1]]), "doc_k .* must have doc_q's batch"),
    ([[0, 1]], None, "doc_q must be a .* got list"),
])
def test_bad_ids_name_the_argument(doc_q, doc_k, match):
    with pytest.raises(ValueError, match=match):
        kernelgen.packed_ranges(doc_q, doc_k)


def test_varlen_offsets_are_the_same_ranges_as_ids():
    lengths = [5, 1, 9, 3]
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)).view(1, -1)
    start, end = kernelgen.varlen_ranges(cu)
    assert start.shape == end.shape == (1, 18) and start.dtype == torch.int32
    assert all(torch.equal(a, b) for a, b in zip((start, end), kernelgen.packed_ranges(ids)))
    # Cross-attention: sequence d's queries see its own keys, and an empty sequence has none.
    cu_k = torch.tensor([0, 2, 2, 9, 10])
    start, end = kernelgen.varlen_ranges(cu, cu_k)
    assert (start[0, :5].unique().tolist(), end[0, :5].unique().tolist()) == ([0], [2])
    assert (start[0, 5].item(), end[0, 5].item()) == (2, 2)
    assert (start[0, 17].item(), end[0, 17].item()) == (9, 10)


@pytest.mark.parametrize("cu_q, cu_k, match", [
    (torch.tensor([1, 5]), None, "cu_seqlens_q must start at 0"),
    (torch.tensor([0, 5, 3]), None, "cu_seqlens_q must start at 0 and never decrease"),
    (torch.tensor([[0, 5]]), None, "cu_seqlens_q must be a 1-D integer tensor"),
    (torch.tensor([0.0, 5.0]), None, "cu_seqlens_q must be a 1-D integer tensor"),
    (torch.tensor([0, 5]), torch.tensor([0, 2, 4]), "must hold as many sequences"),
    (torch.tensor([0, 5]), torch.tensor([0, 7, 4])[:2].flip(0), "cu_seqlens_k must start at 0"),
])
def test_bad_offsets_name_the_argument(cu_q, cu_k, match):
    with pytest.raises(ValueError, match=match):
        kernelgen.varlen_ranges(cu_q, cu_k)


def varlen_mask(cu_q, cu_k, causal, window=(-1, -1)):
    """Brute force: query i sees key j when both are in sequence d and, causal, j's position in
    d is at most i's plus len_k - len_q (bottom-right); a window bounds it on either side of
    that diagonal too."""
    left, right = window
    mask = torch.zeros(int(cu_q[-1]), int(cu_k[-1]), dtype=torch.bool)
    for d in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])
        for t in range(q1 - q0):
            diagonal = t + (k1 - k0) - (q1 - q0)
            for j in range(k1 - k0):
                mask[q0 + t, k0 + j] = ((not causal or j <= diagonal)
                                        and (left < 0 or j >= diagonal - left)
                                        and (right < 0 or j <= diagonal + right))
    return mask


def test_varlen_func_runs_the_causal_kernel_on_equal_offsets():
    """flash_attn_varlen_func's plan for causal: with the same offsets for queries and keys the
    ranges stay unfolded and the kernel's own causal mask (j <= i over the packed tokens) makes
    each sequence's; with other offsets the mask is folded into the ranges. varlen_ranges
    (public) folds either way."""
    from kernelgen.packed import _varlen

    cu = torch.tensor([0, 5, 6, 6, 15, 21])
    start, end, *_, kernel_causal = _varlen(cu, cu.clone(), True, own_causal=True)
    assert kernel_causal
    tokens = torch.arange(21)
    own = mask_of(start, end, 21)[0] & (tokens[None, :] <= tokens[:, None])
    assert torch.equal(own, varlen_mask(cu, cu, True))
    folded = kernelgen.varlen_ranges(cu, causal=True)
    assert torch.equal(mask_of(*folded, 21)[0], varlen_mask(cu, cu, True))
    assert not torch.equal(end, folded[1])
    assert not _varlen(cu, cu, False, own_causal=True)[-1]
    other = torch.tensor([0, 9, 10, 12, 14, 21])
    assert not _varlen(cu, other, True, own_causal=True)[-1]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_ranges_fold_each_sequences_causal_mask(causal):
    # Queries and keys of other lengths per sequence (more of either), an empty sequence, one of
    # a single token, a query sequence with no keys.
    cu_q = torch.tensor([0, 5, 6, 6, 15, 18, 21])
    cu_k = torch.tensor([0, 9, 10, 12, 14, 21, 21])
    start, end = kernelgen.varlen_ranges(cu_q, cu_k, causal=causal)
    assert torch.equal(mask_of(start, end, 21)[0], varlen_mask(cu_q, cu_k, causal))
    assert bool((start.diff(dim=1) >= 0).all() and (end.diff(dim=1) >= 0).all())
    assert bool((end >= start).all())
    if causal:   # sequence 3 has 9 queries and 2 keys: bottom-right, its first 7 see none
        assert end[0, 6:13].tolist() == start[0, 6:13].tolist()


@pytest.mark.parametrize("window", [(3, 0), (2, 1), (-1, 2), (0, 0), (4, -1)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_ranges_fold_each_sequences_window(causal, window):
    """A sliding window per sequence, aligned bottom-right as flash_attn_func's, over sequences
    with more queries than keys (whose first rows see none) and more keys than queries."""
    cu_q = torch.tensor([0, 5, 6, 6, 15, 18, 21])
    cu_k = torch.tensor([0, 9, 10, 12, 14, 21, 21])
    start, end = kernelgen.varlen_ranges(cu_q, cu_k, causal=causal, window_size=window)
    assert torch.equal(mask_of(start, end, 21)[0], varlen_mask(cu_q, cu_k, causal, window))
    assert bool((start.diff(dim=1) >= 0).all() and (end.diff(dim=1) >= 0).all())
    assert bool((end >= start).all())


def test_varlen_func_folds_only_the_left_side_for_its_own_causal_kernel():
    """Equal offsets, causal: the kernel's causal mask stands for the window's right side, so
    only the left one goes into the ranges (the right, unfolded, would be the sequence end)."""
    from kernelgen.packed import _varlen

    cu = torch.tensor([0, 5, 6, 6, 15, 21])
    start, end, *_, kernel_causal = _varlen(cu, cu.clone(), True, own_causal=True, window=(2, 5))
    assert kernel_causal and torch.equal(end, _varlen(cu, cu, False)[1])
    tokens = torch.arange(21)
    own = mask_of(start, end, 21)[0] & (tokens[None, :] <= tokens[:, None])
    assert torch.equal(own, varlen_mask(cu, cu, True, (2, 0)))


@pytest.mark.parametrize("window, error, match", [
    ((-2, 0), ValueError, r"window_size left must be >= -1 \(-1: unbounded\), got -2"),
    ((1, 0.5), TypeError, "window_size right must be an int"),
    ((1, True), TypeError, "window_size right must be an int"),
    (3, TypeError, "window_size must be a pair"),
])
def test_bad_windows_name_the_argument(window, error, match):
    """One check for flash_attn_func's window_size and the varlen calls' (ops.window_bounds),
    before anything runs."""
    with pytest.raises(error, match=match):
        kernelgen.varlen_ranges(torch.tensor([0, 4, 6]), window_size=window)
    with pytest.raises(error, match=match):   # before any check of the tensors
        kernelgen.flash_attn_varlen_func(torch.zeros(6, 2, 64), torch.zeros(6, 2, 64),
                                         torch.zeros(6, 2, 64), torch.tensor([0, 4, 6]),
                                         window_size=window)
    q = torch.zeros(1, 6, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        kernelgen.flash_attn_func(q, q, q, window_size=window)


@pytest.mark.parametrize("args, error, match", [
    (dict(q=torch.zeros(1, 6, 2, 64)), ValueError, r"q must be a \(total_tokens, heads, head_dim\)"),
    (dict(q=torch.zeros(7, 2, 64)), ValueError, r"q holds 7 tokens but cu_seqlens_q\[-1\] is 6"),
    (dict(k=torch.zeros(5, 2, 64)), ValueError, r"k holds 5 tokens but cu_seqlens_k\[-1\] is 6"),
    (dict(v=torch.zeros(5, 2, 64)), ValueError, "v holds 5 tokens, k 6"),
    (dict(max_seqlen_q=3), ValueError, "max_seqlen_q=3 must be an int of at least the longest .* 4"),
    (dict(max_seqlen_k=4.0), ValueError, "max_seqlen_k=4.0 must be an int"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 2])), ValueError, "cu_seqlens_q must start at 0 and never decrease"),
    (dict(q=torch.zeros(6, 2, 64)), TypeError, "q must be float16 or bfloat16, got torch.float32"),
    ({}, (RuntimeError, ValueError), "CUDA"),   # well formed: the CPU tensors (or no GPU) refused
    (dict(max_seqlen_q=torch.tensor(4).numpy()[()], max_seqlen_k=4), (RuntimeError, ValueError), "CUDA"),
])
def test_varlen_func_names_the_bad_argument(args, error, match):
    call = dict(q=torch.zeros(6, 2, 64, dtype=torch.bfloat16), k=torch.zeros(6, 2, 64, dtype=torch.bfloat16),
                v=torch.zeros(6, 2, 64, dtype=torch.bfloat16), cu_seqlens_q=torch.tensor([0, 4, 6]),
                cu_seqlens_k=torch.tensor([0, 2, 6]))
    call.update(args)
    with pytest.raises(error, match=match):
        kernelgen.flash_attn_varlen_func(**call)


@pytest.mark.parametrize("cu_k", [None, torch.tensor([0, 2, 2, 9, 10, 13])])
def test_sequence_ids_are_the_varlen_mask(cu_k):
    """The ids a varlen call's gradients give flash_attn_document (packed.sequence_ids): equal
    for query i and key j exactly where varlen's mask shows j to i (full attention, the route's
    only case), an empty sequence's and a sequence without keys' included."""
    from kernelgen.packed import sequence_ids

    cu = torch.tensor([0, 5, 6, 6, 15, 21], dtype=torch.int32)
    keys = cu if cu_k is None else cu_k
    ids_q, ids_k = sequence_ids(cu, 21), sequence_ids(keys, int(keys[-1]))
    assert ids_q.shape == (1, 21) and ids_q.dtype == torch.int32 and ids_q.is_contiguous()
    same = ids_q[0, :, None] == ids_k[0, None, :]
    assert torch.equal(same, varlen_mask(cu, keys, False))


def test_ordered_document_ids_as_ranges():
    """packed.ordered_ranges (what flash_attn_document's create_block_mask keeps): ids packed in
    order give packed_ranges' ranges; the same runs out of order (numbered backwards in one
    sequence of the batch, keys or queries) give None, where packed_ranges refuses them."""
    from kernelgen.packed import ordered_ranges

    doc_q = torch.tensor([[0, 0, 1, 1, 1, 3], [2, 2, 2, 5, 5, 5]], dtype=torch.int32)
    doc_k = torch.tensor([[0, 1, 1, 2, 3], [2, 4, 5, 5, 5]], dtype=torch.int32)
    got = ordered_ranges(doc_q, doc_k)
    assert all(torch.equal(a, b) for a, b in zip(got, kernelgen.packed_ranges(doc_q, doc_k)))
    assert torch.equal(mask_of(*got, 5), doc_q[:, :, None] == doc_k[:, None, :])
    for q, k in ((doc_q, doc_k.flip(1)), (doc_q.flip(1), doc_k)):
        with pytest.raises(ValueError, match="non-decreasing"):
            kernelgen.packed_ranges(q, k)
        assert ordered_ranges(q, k) is None


def test_document_kernel_finds_its_ranges():
    """AttentionKernel._ordered_ranges, what create_block_mask keeps and tune() tunes on:
    flash_attn_document's ids in order as their key ranges, None out of order and for any other
    spec."""
    doc_q = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]], dtype=torch.int32)
    document = kernelgen.load("flash_attn_document", head_dim=64, dtype="bf16")
    got = document._ordered_ranges({"doc_q": doc_q, "doc_k": doc_q})
    assert torch.equal(mask_of(*got, 5), doc_q[:, :, None] == doc_q[:, None, :])
    assert document._ordered_ranges({"doc_q": doc_q.flip(1), "doc_k": doc_q}) is None
    window = kernelgen.load("flash_attn_window", head_dim=64, dtype="bf16")
    assert window._ordered_ranges({"window_left": 3, "window_right": 0}) is None
