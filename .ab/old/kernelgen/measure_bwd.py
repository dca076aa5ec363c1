"""The GPU side of tuning the backward's main kernel (spec flash_attn_bwd): the inputs of one
problem, the correctness check of a config against float32 gradients, and what is timed.

A candidate is a config of the main kernel. A timed run is everything one backward call launches
with it (backward._run on buffers allocated once): prep, main, and the cast of the fp32 dQ
accumulator to the input dtype. Prep is in the run because it zeroes that accumulator, which the
main kernel's atomics (or TMA reduce-adds) add into: a run without it would add onto the previous
run's dQ. Prep and the cast do not depend on the main config, so they shift every candidate by
the same time, and the total is what a training step pays.

The check poisons D, the accumulator and the gradients (NaN), runs the candidate once, requires
every element of dq, dk and dv to be finite (an element never written stays NaN), and compares
slices with float32 gradients by FlashAttention's rule, as tests/test_backward.py does:
max|g - g_ref| <= 2 max|g_low - g_ref| + rounding allowance + 1e-4, where g_low is the same
computation in the input dtype (the 1e-4: with one visible key dS is exactly 0 in exact math but
rounding noise in the kernel). The slices: the first and last (batch, kv head) pairs with all
query heads of their GQA group and the full sequences, because dK and dV of a kv head sum over
every query row of its group, so nothing smaller is a problem of its own. The reference runs over
chunks of whole query rows (softmax and D are per row; dK and dV accumulate across chunks), so a
16k x 16k problem holds a few chunk x seqlen_k matrices instead of an autograd graph of the whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernelgen import api, backward, ops
from kernelgen.measure import AttentionCandidate
from kernelgen.reference import attention_ref, max_error, rounding_allowance
from kernelgen.search import Check
from kernelgen.spec import load_spec
from kernelgen.tune import Problem, TuneError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_PARAMS = ("head_dim", "dtype", "causal")
_SM90_MAPS = ("tmap_q", "tmap_k", "tmap_v", "tmap_do", "tmap_dq")  # flash_attn_bwd_sm90's last
# What the check allows beyond the rule (see the module docstring).
ZERO_DS_ALLOWANCE = 1e-4
# Elements of the reference's (group, chunk, seqlen_k) score matrices: a few of them are live at
# once, 256 MB each in float32.
CHUNK_ELEMENTS = 1 << 26


def feeds(spec) -> bool:
    """Whether this module makes the inputs of `spec`: flash_attn_bwd's args (the Hopper main
    kernel's add five tensor maps, which backward._run appends) and params."""
    names = tuple(a.name for a in load_spec(backward.MAIN_SPEC).args)
    return (tuple(a.name for a in spec.args) in (names, names + _SM90_MAPS)
            and {p.name for p in spec.params} == set(_PARAMS))


@dataclass(frozen=True)
class _Slice:
    batch: int
    kv_head: int
    refs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # dq (seqlen_q, group, d), dk, dv (seqlen_k, d)
    bounds: tuple[float, float, float]


class Workload:
    """The inputs of one backward problem, the buffers a run writes, and the reference on slices.

    device: a CUDA index; "cpu" serves the CPU tests of the check (out and lse then come from the
    float32 reference instead of kernelgen's forward, which needs a GPU)."""

    def __init__(self, spec, variant, problem: Problem, device: int | str, seed: int = 0):
        self._check_spec(spec)
        if min(problem.as_dict().values()) < 1 or problem.heads % problem.heads_k:
            raise TuneError(f"cannot tune for {problem}: every size must be at least 1 and heads a "
                            "multiple of heads_k")
        self.device, self.causal = device, bool(variant["causal"])
        dtype, head_dim = _DTYPES[variant["dtype"]], variant["head_dim"]
        place = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        generator = torch.Generator(device=place).manual_seed(seed)
        queries, keys = (problem.seqlen_q, problem.heads), (problem.seqlen_k, problem.heads_k)
        self.q, self.k, self.v, self.dout = (
            torch.randn(problem.batch, seqlen, heads, head_dim, device=place, dtype=dtype,
                        generator=generator) for seqlen, heads in (queries, keys, keys, queries))
        self.scale = 1.0 / math.sqrt(head_dim)
        if place.type == "cuda":
            self.out, self.lse = ops.flash_attn_forward(self.q, self.k, self.v, self.causal, self.scale)
        else:
            self.out, self.lse = attention_ref(self.q, self.k, self.v, self.causal, self.scale)
        self.buffers = backward._buffers(self.q, self.k, deterministic=False)
        self.slices = [self._reference(b, h) for b, h in
                       sorted({(0, 0), (problem.batch - 1, problem.heads_k - 1)})]

    def _check_spec(self, spec) -> None:
        if not feeds(spec):
            raise TuneError(f"kernelgen tune makes backward inputs for specs with the args and "
                            f"params of {backward.MAIN_SPEC}; {spec.name} has args "
                            f"{[a.name for a in spec.args]} and params {[p.name for p in spec.params]}")

    def _reference(self, b: int, kv_head: int) -> _Slice:
        group = self.q.shape[2] // self.k.shape[2]
        heads = slice(kv_head * group, (kv_head + 1) * group)
        inputs = (self.q[b, :, heads], self.k[b, :, kv_head], self.v[b, :, kv_head],
                  self.dout[b, :, heads])
        refs = reference_grads(*inputs, self.causal, self.scale, torch.float32)
        lows = reference_grads(*inputs, self.causal, self.scale, self.q.dtype)
        bounds = tuple(2 * max_error(low, ref) + rounding_allowance(ref) + ZERO_DS_ALLOWANCE
                       for low, ref in zip(lows, refs))
        return _Slice(b, kv_head, refs, bounds)

    def launcher(self, kernel: api.BoundKernel):
        """fn() that runs one backward with `kernel` as the main kernel, into self.buffers."""
        prep = backward.prep_kernel(self.device, kernel.variant["dtype"])
        kernels = backward._Kernels(prep, kernel, None)
        launch = backward._launcher(self.device)
        args = (self.dout, self.q, self.k, self.v, self.out, self.lse, self.scale)
        return lambda: backward._run(kernels, launch, *args, buffers=self.buffers)

    def check(self, launch) -> Check:
        b = self.buffers
        for t in (b.dsum, b.dq_accum, b.dq, b.dk, b.dv):
            t.fill_(float("nan"))
        launch()
        if self.q.is_cuda:
            torch.cuda.synchronize(self.device)
        for name, grad in (("dq", b.dq), ("dk", b.dk), ("dv", b.dv)):
            if not bool(torch.isfinite(grad).all()):
                return Check(False, math.nan, 0.0, f"{name} is not finite everywhere (NaN: an "
                                                   "element left unwritten)")
        group = self.q.shape[2] // self.k.shape[2]
        empty = max(0, self.q.shape[1] - self.k.shape[1]) if self.causal else 0
        worst, worst_bound = 0.0, 0.0
        for s in self.slices:
            got = (b.dq[s.batch, :, s.kv_head * group:(s.kv_head + 1) * group],
                   b.dk[s.batch, :, s.kv_head], b.dv[s.batch, :, s.kv_head])
            where = f"batch {s.batch}, kv head {s.kv_head}"
            for name, g, ref, bound in zip(("dq", "dk", "dv"), got, s.refs, s.bounds):
                error = max_error(g, ref)
                if not error <= bound:
                    return Check(False, error, bound, f"{name} max error {error:.3g} > {bound:.3g} at {where}")
                if error / max(bound, 1e-30) >= worst / max(worst_bound, 1e-30):
                    worst, worst_bound = error, bound
            if empty and bool(got[0][:empty].any()):   # causal rows that see no key
                return Check(False, worst, worst_bound, f"dq is not 0 in the first {empty} rows "
                                                        f"(they see no key) at {where}")
        return Check(True, worst, worst_bound)


# The forward's candidate knows only Workload.launcher and Workload.check: the same class serves.
Candidate = AttentionCandidate


def reference_grads(q, k, v, dout, causal: bool, scale: float, dtype: torch.dtype):
    """(dq, dk, dv) of attention for one (batch, kv head): q, dout (seqlen_q, group, d), k, v
    (seqlen_k, d); causal aligned bottom-right. dtype float32 gives the reference; the input dtype
    gives what PyTorch computes in it (autograd through reference.attention_ref with
    upcast=False): every product rounded to it, sums over rows accumulated in float32 as a
    16-bit GEMM does. Results in q's dtype."""
    seqlen_q, group, head_dim = q.shape
    seqlen_k = k.shape[0]
    shift = seqlen_k - seqlen_q   # query i sees keys j <= i + shift

    def rounded(x):
        return x.to(dtype).float()

    qt, dot = (rounded(x.transpose(0, 1)) for x in (q, dout))   # (group, seqlen_q, d)
    kf, vf = rounded(k), rounded(v)
    dq = torch.zeros(group, seqlen_q, head_dim, device=q.device)
    dk = torch.zeros(seqlen_k, head_dim, device=q.device)
    dv = torch.zeros(seqlen_k, head_dim, device=q.device)
    chunk = max(16, CHUNK_ELEMENTS // max(1, group * seqlen_k))
    for r0 in range(0, seqlen_q, chunk):
        r1 = min(seqlen_q, r0 + chunk)
        keys = min(seqlen_k, r1 + shift) if causal else seqlen_k   # no later key is visible
        if keys <= 0:
            continue   # no row of the chunk sees a key: dq stays 0, nothing reaches dk, dv
        qs = rounded(qt[:, r0:r1] * scale)
        scores = rounded(qs @ kf[:keys].T)   # (group, rows, keys)
        if causal:
            rows = torch.arange(r0, r1, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(keys, device=q.device)[None, :] > rows + shift,
                                        float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = rounded(torch.nan_to_num(torch.exp(scores - lse), nan=0.0))   # no key: 0
        dprobs = rounded(dot[:, r0:r1] @ vf[:keys].T)
        delta = (dprobs * probs).sum(dim=-1, keepdim=True)   # softmax backward: rowsum(dP * P)
        dscores = rounded((dprobs - delta) * probs)
        dq[:, r0:r1] = rounded(rounded(dscores @ kf[:keys]) * scale)
        dk[:keys] += (dscores.transpose(1, 2) @ qs).sum(dim=0)   # qs carries the scale
        dv[:keys] += (probs.transpose(1, 2) @ dot[:, r0:r1]).sum(dim=0)
    return dq.transpose(0, 1).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
