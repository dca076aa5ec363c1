"""Block masks without a GPU: the spec key, the lists' construction (classify_dense and compact
on CPU tensors), the arguments a kernel gets, the errors for a mask of the wrong problem (raised
before any launch), and the classify kernel compiling clean for every variant."""
from __future__ import annotations

import itertools

import pytest
import torch

from kernelgen import blockmask, cache, render
from kernelgen.spec import BLOCK_SPARSE_ARGS, SpecError, load_spec

SPEC = "flash_attn_document"


def write(tmp_path, body: str):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nextends: flash_attn_fwd\n" + body)
    return path


def test_block_sparse_adds_the_list_arguments_after_the_mod_args():
    spec = load_spec(SPEC)
    names = [a.name for a in spec.args]
    assert names[-10:] == ["doc_q", "doc_k", *(a.name for a in BLOCK_SPARSE_ARGS)]
    assert spec.mods.block_sparse and [a.name for a in spec.mods.args] == ["doc_q", "doc_k"]
    assert "batch" in spec.mods.mask_mod.names and "head" not in spec.mods.mask_mod.names
    # The classify kernel reads the mask, not the lists; the backward's kernels take them.
    assert not load_spec(SPEC, onto=str(blockmask.CLASSIFY_SPEC)).mods.block_args
    assert load_spec(SPEC, onto="flash_attn_bwd").mods.block_sparse


def test_block_sparse_needs_a_mask_mod_and_a_boolean(tmp_path):
    with pytest.raises(SpecError, match="mods.block_sparse: a block mask classifies a mask_mod"):
        load_spec(write(tmp_path, "mods:\n  score_mod: \"score\"\n  block_sparse: true\n"))
    with pytest.raises(SpecError, match="mods.block_sparse: expected true or false"):
        load_spec(write(tmp_path, "mods:\n  mask_mod: \"true\"\n  block_sparse: 1\n"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1000), (1000, 700), (700, 1000), (60, 90),
                                                (190, 190)])
def test_lists_grouped_for_the_warpgroups(causal, seqlen_q, seqlen_k):
    """wg_skip's lists: the 128-row classification from 64-row halves equals the direct one;
    a row's visiting order (partial list, then full list) lists the same blocks as the plain
    lists, evaluates the mask_mod on exactly the partial ones (the first kv_num and the last
    trailing-group ones), and puts every listed block a warpgroup's rows do not see in its
    group: the leading one for the leading warpgroup, the trailing one for the other."""
    from kernelgen.bench_mods import document_ids, document_lengths

    ids = document_ids(document_lengths(2, max(seqlen_q, seqlen_k), 6, seed=3))
    doc_q, doc_k = ids[:, -seqlen_q:], ids[:, -seqlen_k:]
    same = (doc_q[:, :, None] == doc_k[:, None, :])[:, None]
    skips = 0
    for block_n in (64, 80, 128):
        halves = blockmask.classify_dense(same, causal, 64, block_n)
        assert torch.equal(blockmask.combine_halves(halves, causal, seqlen_q, seqlen_k, block_n),
                           blockmask.classify_dense(same, causal, 128, block_n))
        mask = blockmask.from_dense(load_spec(SPEC), same, causal, batch=2)
        plain, grouped = mask.lists(128, block_n), mask.lists(128, block_n, grouped=True)
        assert torch.equal(grouped.q_idx, plain.q_idx)
        width = plain.kv_idx.shape[-1]
        assert grouped.kv_idx.shape[-1] == grouped.full_kv_idx.shape[-1] == width + 2
        for b, qb in itertools.product(range(2), range(plain.kv_num.shape[2])):
            n_partial, n_full = plain.kv_num[b, 0, qb], plain.full_kv_num[b, 0, qb]
            partial = set(plain.kv_idx[b, 0, qb, :n_partial].tolist())
            full = set(plain.full_kv_idx[b, 0, qb, :n_full].tolist())
            front, back = grouped.kv_num[b, 0, qb], grouped.full_kv_num[b, 0, qb]
            order = (grouped.kv_idx[b, 0, qb, :front].tolist()
                     + grouped.full_kv_idx[b, 0, qb, :back].tolist())
            info = grouped.kv_idx[b, 0, qb, width:].tolist()
            lead, lead_wg, trail = info[0] & 0xFFFF, info[0] >> 16, info[1]
            assert sorted(order) == sorted(partial | full)
            masked = {block for i, block in enumerate(order) if i < front or i >= len(order) - trail}
            groups = {*order[:lead], *order[len(order) - trail:]}   # full blocks in them, causal
            assert partial <= masked and masked - partial <= groups
            for wg in (0, 1):
                if 2 * qb + wg >= halves.shape[2]:
                    continue
                unseen = {j for j in order if halves[b, 0, 2 * qb + wg, j] == blockmask.EMPTY}
                mine = order[:lead] if wg == lead_wg else order[len(order) - trail:]
                assert unseen == set(mine) and len(mine) == len(unseen)
            skips += lead + trail
    assert skips > 0


def test_classify_dense_and_compact():
    # Documents [0, 5), [5, 12), [12, 16) in 4 x 4 tiles; causal hides what is above the diagonal.
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4])
    visible = (docs[:, :, None] == docs[:, None, :])[:, None]
    state = blockmask.classify_dense(visible, False, 4, 4)
    assert state[0, 0].tolist() == [[2, 1, 0, 0], [1, 1, 1, 0], [0, 1, 2, 0], [0, 0, 0, 2]]
    causal = blockmask.classify_dense(visible, True, 4, 4)
    assert causal[0, 0].tolist() == [[2, 0, 0, 0], [1, 1, 0, 0], [0, 1, 2, 0], [0, 0, 0, 2]]
    lists = blockmask.compact(state, 4, 4)
    assert lists.kv_num[0, 0].tolist() == [1, 3, 1, 0]
    assert lists.full_kv_num[0, 0].tolist() == [1, 0, 1, 1]
    assert lists.kv_idx[0, 0, 1, :3].tolist() == [0, 1, 2]
    assert lists.full_kv_idx[0, 0, 3, :1].tolist() == [3]
    assert lists.q_num[0, 0].tolist() == [1, 3, 1, 0]      # per KV block: partial query blocks
    assert lists.q_idx[0, 0, 1, :3].tolist() == [0, 1, 2]
    assert lists.full_q_idx[0, 0, 2, :1].tolist() == [2]
    assert all(t.dtype == torch.int32 and t.is_contiguous()
               for t in (lists.kv_num, lists.kv_idx, lists.q_num, lists.full_q_idx))


def test_tail_tiles_count_only_pairs_inside_the_sequences():
    # 6 x 6 all visible: the 4 x 4 tail tiles are full (their padding is not hidden).
    state = blockmask.classify_dense(torch.ones(1, 1, 6, 6, dtype=torch.bool), False, 4, 4)
    assert state.tolist() == [[[[2, 2], [2, 2]]]]


def test_kernel_args_strides_by_batch_and_head():
    spec = load_spec(SPEC)
    per_batch = blockmask.from_dense(spec, torch.rand(3, 1, 40, 50) > 0.5, False, batch=3)
    *tensors, stride_b, stride_h, width, order = per_batch.kernel_args(16, 32)
    assert tensors[1].shape == (3, 1, 3, 2) and (stride_b, stride_h, width, order) == (3, 0, 2, 0)
    *_, stride_b, stride_h, width, order = per_batch.kernel_args(16, 32, transposed=True)
    assert (stride_b, stride_h, width, order) == (2, 0, 3, 0)
    shared = blockmask.from_dense(spec, torch.rand(1, 1, 40, 50) > 0.5, False)
    assert shared.kernel_args(16, 32)[4:] == (0, 0, 2, 0)   # no launch order: null
    # One set of lists per tile size, built once.
    assert per_batch.lists(16, 32) is per_batch.lists(16, 32)
    assert per_batch.lists(32, 32) is not per_batch.lists(16, 32)
    # A forward config's lists: grouped for the warpgroups exactly where it has wg_skip.
    tall = blockmask.from_dense(spec, torch.rand(1, 1, 300, 200) > 0.5, False)
    config = {"block_m": 128, "block_n": 64}
    for wg_skip, grouped in ((0, False), (1, True)):
        got = tall.forward_args({**config, "wg_skip": wg_skip})
        want = tall.kernel_args(128, 64, grouped=grouped)
        assert all(a is b for a, b in zip(got[:4], want[:4])) and got[4:] == want[4:]
    assert tall.forward_args(config)[1] is tall.kernel_args(128, 64)[1]   # (sm80: no wg_skip)
    assert tall.forward_args({**config, "wg_skip": 1})[1].shape[-1] == 4 + 2


def test_tile_order_puts_the_shortest_eighth_last_and_keeps_the_grid_order_otherwise():
    # Documents of 30, 70, 170 and 50 tokens (batch 0) and 200, 120 (batch 1); heads broadcast,
    # GQA 4:2, so a kv head's count is twice its column's listed query blocks.
    spec = load_spec(SPEC)
    ids = torch.tensor([[0] * 30 + [1] * 70 + [2] * 170 + [3] * 50,
                        [0] * 200 + [1] * 120])
    mask = blockmask.from_dense(spec, (ids[:, :, None] == ids[:, None, :])[:, None], False,
                                batch=2)
    order = mask.tile_order(16, 32, batch=2, heads=4, heads_k=2)
    assert order.dtype == torch.int32 and order.is_contiguous()
    state = mask.classify(16, 32)                                   # (2, 1, 20, 10)
    column = (state != blockmask.EMPTY).sum(2)                      # (2, 1, 10)
    counts = (2 * column).expand(2, 2, 10).flatten().tolist()       # (batch, kv head, block)
    assert sorted(order.tolist()) == list(range(40))
    threshold = sorted(counts)[40 // 8 - 1]
    short = [t for t in range(40) if counts[t] <= threshold]
    assert 5 <= len(short) < 40
    assert order.tolist() == [t for t in range(40) if t not in short] + short
    assert mask.tile_order(16, 32, batch=2, heads=4, heads_k=2) is order   # built once
    assert mask.kernel_args(16, 32, transposed=True, order=(2, 4, 2))[-1] is order
    # The Hopper forward's query tiles (index (b * heads + h) * q_blocks + m): listed KV blocks.
    forward = mask.tile_order(16, 32, 2, 3, 3, transposed=False).tolist()
    row = (state != blockmask.EMPTY).sum(3)                         # (2, 1, 20)
    counts = row.expand(2, 3, 20).flatten().tolist()
    threshold = sorted(counts)[120 // 8 - 1]
    short = [t for t in range(120) if counts[t] <= threshold]
    assert forward == [t for t in range(120) if t not in short] + short and 15 <= len(short) < 120
    config = {"block_m": 16, "block_n": 32, "persistent": 0}
    assert mask.forward_args(config, 2, 3)[-1].tolist() == forward
    assert mask.forward_args(config)[-1] == 0                       # no problem given
    assert mask.forward_args({**config, "persistent": 2}, 2, 3)[-1] == 0
    # Fewer than eight tiles: the grid's own order.
    small = blockmask.from_dense(spec, torch.ones(1, 1, 40, 50, dtype=torch.bool), False)
    assert small.tile_order(16, 32, 1, 2, 2).tolist() == [0, 1, 2, 3]


def test_a_mask_of_another_problem_is_refused_naming_the_argument():
    spec = load_spec(SPEC)
    mask = blockmask.from_dense(spec, torch.ones(2, 1, 40, 50, dtype=torch.bool), False, batch=2)
    cpu = torch.device("cpu")
    mask.check(spec, False, 2, 8, 40, 50, cpu)   # heads: the mask does not depend on them
    for args, match in [((spec, True, 2, 8, 40, 50, cpu), "causal"),
                        ((spec, False, 3, 8, 40, 50, cpu), "batch=2, but the inputs have batch=3"),
                        ((spec, False, 2, 8, 41, 50, cpu), "seqlen_q=40"),
                        ((spec, False, 2, 8, 40, 49, cpu), "seqlen_k=50"),
                        ((spec, False, 2, 8, 40, 50, torch.device("cuda", 0)), "on cpu"),
                        ((load_spec("flash_attn_window"), False, 2, 8, 40, 50, cpu), "spec")]:
        with pytest.raises(ValueError, match=match) as info:
            mask.check(*args)
        assert "block_mask" in str(info.value)
    fixed = blockmask.BlockMask(SPEC, False, 2, None, 40, 50, cpu,
                                built={(16, 32): mask.lists(16, 32)})
    assert fixed.kernel_args(16, 32)[4:] == (3, 0, 2, 0)
    with pytest.raises(ValueError, match=r"block_mask has lists for block sizes \[\(16, 32\)\]"):
        fixed.kernel_args(64, 64)


def test_block_mask_argument_checks():
    spec = load_spec(SPEC)
    blockmask.check_argument(None, spec)
    with pytest.raises(TypeError, match="block_mask must be a kernelgen BlockMask"):
        blockmask.check_argument(torch.zeros(3), spec)
    with pytest.raises(TypeError, match="takes no block_mask"):
        blockmask.check_argument(object(), load_spec("flash_attn_window"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_classify_kernel_compiles_clean(arch, cache_dir):
    for name in (SPEC, "flash_attn_window"):
        spec = load_spec(name, onto=str(blockmask.CLASSIFY_SPEC))
        for causal in (False, True):
            variant = spec.variant(arch, head_dim=128, dtype="bf16", causal=causal)
            binary = cache.compile_cached(
                render.render(spec, variant, spec.default_config(variant)), arch)
            assert binary.spill_stores == 0 and binary.stack_bytes == 0
