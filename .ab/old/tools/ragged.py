"""Ragged shapes for compute-sanitizer memcheck: every head dim, both masks, lengths that are not
tile multiples, GQA; forward, backward (through autograd) and the modifier specs. Exits non-zero
if any output is wrong.
    python tools/ragged.py [--mask-mods [HEAD_DIM ...] | --clusters]
--mask-mods: only the mask_mod specs (window, document, packed; forward and gradient) at the head dims
given (default all): the short run for a change to how the kernels evaluate a mask_mod.
--clusters: only the Hopper forward's clusters (CLUSTER, and its 3-stage pingpong sibling).
--causal-keys: only the Hopper forward's causal grid_order and half_diag configs (ORDERED, HALF).
--carry: only the Hopper forward's carry_qk and q_prefetch configs (CARRY, PREFETCH: static and
dynamic, both masks).
--wg-skip: only the Hopper forward's document masks with wg_skip (WG_SKIP: grouped block lists,
each warpgroup skipping the blocks its 64 rows do not see).
--q-buffers: only the Hopper forward's three-Q-buffer configs (Q_BUFFERS_3), on the ragged shapes
and on one of many tiles per CTA."""
import argparse

import torch

import kernelgen
from kernelgen.reference import attention_ref, max_error, rounding_allowance

bad = 0
# The Hopper forward's dynamic schedule (persistent 2: tiles claimed from a counter) on every
# shape too, where the GPU has it; the tuned configs of these small shapes rarely pick it.
HOPPER = torch.cuda.get_device_capability() == (9, 0)
if HOPPER:
    from kernelgen.hopper import flash_attn_forward_sm90
DYNAMIC = {"block_m": 128, "block_n": 64, "stages": 2, "schedule": 2, "persistent": 2, "q_buffers": 2}
DYNAMIC_WIDE = {**DYNAMIC, "schedule": 1, "q_buffers": 1}   # head dims 192/256: registers, smem
# Clusters of two CTAs (K and V multicast), non-causal at head dims 128 and 256: odd tile counts
# put the second CTA of a cluster past seqlen_q.
CLUSTER = {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 0, "cluster": 2}
# Causal only: a CTA per tile taking its tile in the dynamic schedule's order (grid_order), and
# the diagonal block's half-width S and P V (half_diag), square and narrow tiles.
ORDERED = {"block_m": 128, "block_n": 80, "stages": 2, "schedule": 1, "persistent": 0,
           "q_buffers": 1, "grid_order": 1}
HALF = {**DYNAMIC, "block_n": 128, "half_diag": 1}
HALF_WIDE = {**DYNAMIC_WIDE, "block_n": 80, "half_diag": 1}
# Each tile's first QK^T issued in the previous tile's last turn (carry_qk), a dummy after a
# CTA's last tile: static pingpong and dynamic overlap, square tiles (causal needs them).
CARRY = ({**DYNAMIC, "block_n": 128, "persistent": 1, "carry_qk": 1},
         {**DYNAMIC, "block_n": 128, "schedule": 1, "carry_qk": 1})
CARRY_HALF = {**CARRY[1], "half_diag": 1}   # causal: the carried S is the whole diagonal block's
# The next tile's Q into L2 before the wait for the one Q buffer (q_prefetch): split and whole.
PREFETCH = ({**DYNAMIC_WIDE, "persistent": 1, "q_split": 1, "q_prefetch": 1},
            {**DYNAMIC_WIDE, "q_prefetch": 1})
# Each block's V waited for at the end of its softmax (pv_wait): dynamic pingpong with causal
# skips, and a CTA per tile with the early rescale.
PV_WAIT = ({**DYNAMIC, "pv_wait": 1}, {**DYNAMIC_WIDE, "persistent": 0, "rescale": 1, "pv_wait": 1})
# Block masks' lists grouped for the two warpgroups (wg_skip): dynamic overlap, static pingpong
# with three stages.
WG_SKIP = ({**DYNAMIC, "schedule": 1, "wg_skip": 1},
           {**DYNAMIC, "persistent": 1, "q_buffers": 1, "stages": 3, "wg_skip": 1})

# Three Q buffers (tile t+2's Q in tile t-1's buffer): dynamic overlap, static pingpong, three
# consumers; head dims up to 128 (wider Q tiles leave no room for three).
Q_BUFFERS_3 = ({**DYNAMIC, "block_n": 128, "schedule": 1, "q_buffers": 3},
               {**DYNAMIC, "persistent": 1, "q_buffers": 3},
               {**DYNAMIC, "block_m": 192, "q_buffers": 3})


def within_rule(out, ref, pt):
    """FlashAttention's rule: at most twice PyTorch's error in the input dtype, plus rounding."""
    return max_error(out, ref) <= 2 * max_error(pt, ref) + rounding_allowance(ref)


def report(ok, *what):
    global bad
    if not ok:
        bad += 1
        print("WRONG", *what)


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mask-mods", type=int, nargs="*", metavar="HEAD_DIM",
                    help="only the window, document and packed specs, at these head dims (none: all)")
parser.add_argument("--clusters", action="store_true",
                    help="only the Hopper forward's cluster configs (head dims 128 and 256)")
parser.add_argument("--causal-keys", action="store_true",
                    help="only the Hopper forward's grid_order and half_diag configs (causal)")
parser.add_argument("--wg-skip", action="store_true",
                    help="only the Hopper forward's document masks with wg_skip")
parser.add_argument("--q-buffers", action="store_true",
                    help="only the Hopper forward's three-Q-buffer configs")
parser.add_argument("--carry", action="store_true",
                    help="only the Hopper forward's carry_qk, q_prefetch and pv_wait configs")
opts = parser.parse_args()
MASK_MODS = opts.mask_mods


def ragged_problems(head_dim, causal):
    """The short runs' shapes (a ring that wraps among them: 390 x 2100), GQA 2: (q, k, v, the
    float32 reference, PyTorch's fp16 result, seqlen_q, seqlen_k) each."""
    for seqlen_q, seqlen_k in ((1, 1), (17, 33), (130, 77), (77, 130), (390, 2100)):
        q, k, v = (torch.randn(2, n, h, head_dim, device="cuda", dtype=torch.float16)
                   for n, h in ((seqlen_q, 4), (seqlen_k, 2), (seqlen_k, 2)))
        ref, _ = attention_ref(q, k, v, causal)
        pt, _ = attention_ref(q, k, v, causal, upcast=False)
        yield q, k, v, ref, pt, seqlen_q, seqlen_k


def check_clusters():
    """Both cluster configs on the ragged shapes."""
    pingpong = {**CLUSTER, "block_n": 128, "stages": 3, "schedule": 2}
    for head_dim in (128, 256):
        for q, k, v, ref, pt, seqlen_q, seqlen_k in ragged_problems(head_dim, False):
            for config in (CLUSTER, pingpong) if head_dim == 128 else (CLUSTER,):
                out, _ = flash_attn_forward_sm90(q, k, v, False, config=config)
                report(within_rule(out, ref, pt), "fwd cluster", head_dim, config, seqlen_q,
                       seqlen_k)


def check_documents_dynamic():
    """Packed documents (flash_attn_packed, non-causal) on the dynamic schedule with more tiles
    than SMs, so that the claims run and short tiles are deferred to the global list
    (TileSchedule::kDefer); a ragged length, so the last tile's padding rows read the bounds."""
    from kernelgen import mods_sm90
    torch.manual_seed(5)
    for head_dim in (64, 128):
        batch, seqlen, heads = 2, 4100, 8          # 2 x 8 x 33 = 528 tiles of 128 rows
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda",
                               dtype=torch.float16) for _ in range(3))
        # Documents of ~300 tokens on average, their lengths geometric: tiles of unequal work.
        ids = (torch.rand(batch, seqlen, device="cuda") < 1 / 300).cumsum(1).to(torch.int32)
        start, end = kernelgen.packed_ranges(ids, ids)
        kernel = kernelgen.load("flash_attn_packed", head_dim=head_dim, dtype="fp16")
        same = lambda b, h, i, j: ids[b, i] == ids[b, j]
        ref, _ = attention_ref(q, k, v, mask_mod=same)
        pt, _ = attention_ref(q, k, v, mask_mod=same, upcast=False)
        # kv_align 1: blocks from each tile's first key, so the last one runs past the range.
        for config in (DYNAMIC, {**DYNAMIC, "kv_align": 1}):
            out, _ = mods_sm90.forward_sm90(kernel.spec, q, k, v, kernel.params,
                                            1 / head_dim ** 0.5, (start, end), config=config)
            report(within_rule(out, ref, pt), "packed dynamic", head_dim, config, seqlen)


def check_causal_keys(head_dim, q, k, v, ref, pt, seqlen_q, seqlen_k):
    """grid_order and half_diag (causal configs only) on one ragged shape."""
    for config in (ORDERED, HALF if head_dim <= 128 else HALF_WIDE):
        out, _ = flash_attn_forward_sm90(q, k, v, True, config=config)
        report(within_rule(out, ref, pt), "fwd causal keys", head_dim, config, seqlen_q, seqlen_k)


def short_run(name, check):
    """Only `check` (on a Hopper GPU), then the verdict."""
    if HOPPER:
        check()
    torch.cuda.synchronize()
    print(f"ragged {name}: {bad} wrong" + ("" if HOPPER else " (no Hopper GPU: nothing ran)"))
    raise SystemExit(1 if bad else 0)


def check_all_causal_keys():
    for head_dim in (64, 96, 128, 192, 256):
        for problem in ragged_problems(head_dim, True):
            check_causal_keys(head_dim, *problem)


def carry_cases():
    """(head_dim, causal, configs) of --carry: the carry_qk configs at head dims 64-128 (with
    half_diag when causal), hd192 non-causal with 64-key blocks (two Q buffers leave no room for
    square tiles there; hd256: for none), the q_prefetch configs at hd96 and hd256 and the
    pv_wait configs at hd128 and hd256 (the first with 64-key blocks: warpgroup 0 skips)."""
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            yield head_dim, causal, CARRY + ((CARRY_HALF,) if causal else ())
    yield 192, False, tuple({**c, "block_n": 64} for c in CARRY)
    for head_dim in (96, 256):
        for causal in (False, True):
            yield head_dim, causal, PREFETCH
    for causal in (False, True):
        yield 128, causal, PV_WAIT
        yield 256, causal, PV_WAIT[1:]


def check_carry():
    for head_dim, causal, configs in carry_cases():
        for q, k, v, ref, pt, seqlen_q, seqlen_k in ragged_problems(head_dim, causal):
            for config in configs:
                out, _ = flash_attn_forward_sm90(q, k, v, causal, config=config)
                report(within_rule(out, ref, pt), "fwd", head_dim, causal, config, seqlen_q,
                       seqlen_k)


def check_wg_skip():
    """Documents of 29 tokens (so every tile has boundaries inside it) and of 40-70 (a few
    blocks a warpgroup skips whole), queries the last seqlen_q tokens, on ragged shapes."""
    from kernelgen.mods_sm90 import forward_sm90

    wide = ({**DYNAMIC_WIDE, "wg_skip": 1},)   # hd256: one Q buffer, the overlap schedule
    for head_dim, configs in ((64, WG_SKIP), (128, WG_SKIP), (256, wide)):
        for causal in (False, True):
            params = {"head_dim": head_dim, "dtype": "bf16", "causal": causal}
            for seqlen_q, seqlen_k in ((17, 33), (130, 77), (77, 130), (300, 310), (700, 530)):
                for size in (29, 57):
                    docs = (torch.arange(seqlen_k, device="cuda", dtype=torch.int32) // size)
                    docs = docs.repeat(2, 1).contiguous()
                    doc_q = (docs[:, -seqlen_q:] if seqlen_q <= seqlen_k else
                             torch.arange(seqlen_q, device="cuda", dtype=torch.int32)
                             .div(size, rounding_mode="floor").repeat(2, 1)).contiguous()
                    q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.bfloat16)
                    k, v = (torch.randn(2, seqlen_k, 4, head_dim, device="cuda",
                                        dtype=torch.bfloat16) for _ in range(2))
                    same = (doc_q[:, :, None] == docs[:, None, :])[:, None]
                    ref, _ = attention_ref(q, k, v, causal, upcast=True, mask_mod=lambda *_: same)
                    pt, _ = attention_ref(q, k, v, causal, upcast=False, mask_mod=lambda *_: same)
                    for config in configs:
                        out, _ = forward_sm90("flash_attn_document", q, k, v, params,
                                              head_dim ** -0.5,
                                              (doc_q.data_ptr(), docs.data_ptr()), config=config)
                        report(within_rule(out, ref, pt), "document wg_skip", head_dim, causal,
                               config, seqlen_q, seqlen_k, size)


def check_q_buffers():
    """Q_BUFFERS_3 on the ragged shapes (a CTA has a tile or two there) and on 4 x 1000 tokens
    x 16 heads (GQA 4; 256 to 384 tiles over the SMs: each buffer handed back and reloaded)."""
    many = (4, 1000, 16, 4)
    for head_dim in (64, 96, 128):
        for causal in (False, True):
            torch.manual_seed(head_dim)
            batch, seqlen, heads, heads_k = many
            q, k, v = (torch.randn(batch, seqlen, h, head_dim, device="cuda", dtype=torch.float16)
                       for h in (heads, heads_k, heads_k))
            big = (q, k, v, attention_ref(q, k, v, causal)[0],
                   attention_ref(q, k, v, causal, upcast=False)[0], seqlen, seqlen)
            for q, k, v, ref, pt, seqlen_q, seqlen_k in (*ragged_problems(head_dim, causal), big):
                for config in Q_BUFFERS_3:
                    out, _ = flash_attn_forward_sm90(q, k, v, causal, config=config)
                    report(within_rule(out, ref, pt), "fwd q_buffers 3", head_dim, causal,
                           config, seqlen_q, seqlen_k)


if opts.q_buffers:
    short_run("q_buffers", check_q_buffers)
if opts.wg_skip:
    short_run("wg_skip", check_wg_skip)
if opts.causal_keys:
    short_run("causal keys", check_all_causal_keys)
if opts.carry:
    short_run("carry", check_carry)
if opts.clusters:
    short_run("clusters", check_clusters)
for head_dim in MASK_MODS or (64, 96, 128, 192, 256):
    for causal in (False, True):
        for seqlen_q, seqlen_k in ((1, 1), (17, 33), (130, 77), (77, 130)):
            q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.float16)
            k = torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.float16)
            v = torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.float16)
            if MASK_MODS is None:  # the plain kernels
                out = kernelgen.flash_attn_func(q, k, v, causal=causal)
                ref, _ = attention_ref(q, k, v, causal)
                pt, _ = attention_ref(q, k, v, causal, upcast=False)
                report(within_rule(out, ref, pt), "fwd", head_dim, causal, seqlen_q, seqlen_k)
                if HOPPER:
                    config = DYNAMIC if head_dim <= 128 else DYNAMIC_WIDE
                    out, _ = flash_attn_forward_sm90(q, k, v, causal, config=config)
                    report(within_rule(out, ref, pt), "fwd dynamic", head_dim, causal, seqlen_q,
                           seqlen_k)
                    if causal:
                        check_causal_keys(head_dim, q, k, v, ref, pt, seqlen_q, seqlen_k)
                    if head_dim in (128, 256) and not causal:
                        out, _ = flash_attn_forward_sm90(q, k, v, causal, config=CLUSTER)
                        report(within_rule(out, ref, pt), "fwd cluster", head_dim, seqlen_q,
                               seqlen_k)
                if head_dim in (64, 96, 128):   # the Hopper backward's head dims on an H200
                    for t in (q, k, v):
                        t.requires_grad_()
                    grads = torch.autograd.grad(kernelgen.flash_attn_func(q, k, v, causal=causal),
                                                (q, k, v), torch.ones_like(q))
                    report(all(torch.isfinite(g).all() for g in grads), "bwd", head_dim, causal,
                           seqlen_q, seqlen_k)
            x = q.detach()
            kernelgen.flash_attn_func(x, k.detach(), v.detach(), causal=causal, window_size=(5, 3))
            if MASK_MODS is None:  # the score_mod specs
                kernelgen.flash_attn_func(x, k.detach(), v.detach(), causal=causal, softcap=4.0)
                # ALiBi's forward passes the mods unclamped indices (it reads no per-token tensor).
                slopes = torch.rand(4, device="cuda", dtype=torch.float32)
                kernelgen.flash_attn_func(x, k.detach(), v.detach(), causal=causal,
                                          alibi_slopes=slopes)
            if head_dim in (64, 96, 128):   # the window's gradient: the kv-range walk of pairs
                xw = x.clone().requires_grad_()
                out = kernelgen.flash_attn_func(xw, k.detach(), v.detach(), causal=causal,
                                                window_size=(5, 3))
                grad, = torch.autograd.grad(out, xw, torch.ones_like(out))
                report(bool(torch.isfinite(grad).all()), "window bwd", head_dim, causal,
                       seqlen_q, seqlen_k)
            # A block-sparse spec (document ids; its classify kernel and block lists), with the
            # gradient through the modifier backward.
            docs = (torch.arange(seqlen_k, device="cuda", dtype=torch.int32) // 29).repeat(2, 1)
            doc_q = docs[:, -seqlen_q:].contiguous() if seqlen_q <= seqlen_k else \
                torch.zeros(2, seqlen_q, device="cuda", dtype=torch.int32)
            packed = kernelgen.load("flash_attn_document", head_dim=head_dim, dtype="fp16",
                                    causal=causal)
            xq = x.clone().requires_grad_()
            out = packed(xq, k.detach(), v.detach(), doc_q=doc_q, doc_k=docs.contiguous())
            (grad,) = torch.autograd.grad(out, xq, torch.ones_like(out))
            report(bool(torch.isfinite(out).all() and torch.isfinite(grad).all()), "document",
                   head_dim, causal, seqlen_q, seqlen_k)
            # The same documents as key ranges (flash_attn_packed: an exact kv range read from
            # per-token tensors, which the padding rows of a ragged tile must not read past).
            start, end = kernelgen.packed_ranges(doc_q, docs)
            ranged = kernelgen.load("flash_attn_packed", head_dim=head_dim, dtype="fp16",
                                    causal=causal)
            xq = x.clone().requires_grad_()
            out = ranged(xq, k.detach(), v.detach(), doc_start=start, doc_end=end)
            (grad,) = torch.autograd.grad(out, xq, torch.ones_like(out))
            report(bool(torch.isfinite(out).all() and torch.isfinite(grad).all()), "packed",
                   head_dim, causal, seqlen_q, seqlen_k)
if HOPPER and MASK_MODS is None:
    check_documents_dynamic()
torch.cuda.synchronize()
print(f"ragged: {bad} wrong")
raise SystemExit(1 if bad else 0)
