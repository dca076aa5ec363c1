"""`kernelgen bench --mods`: the shipped modifier specs on the GPU, each timed three ways:

  kernelgen  the modified kernel: flash_attn_func(window_size= | softcap= | alibi_slopes=), or
             kernelgen.load("flash_attn_document", ...) called with per-token document ids and
             its BlockMask (kernel.create_block_mask), built once per case outside the timed
             region as flex's is (the ids are in order, so the mask keeps them as key ranges
             and the forward runs on those: PERF_NOTES §103); packed: the same documents given
             to flash_attn_packed as per-token key ranges (kernelgen.packed_ranges, built once
             outside the timing);
             varlen: the same documents as FlashAttention's varlen call
             (kernelgen.flash_attn_varlen_func, the batch flattened, one offset per document);
             varlen_window: that call with a sliding window inside each document
  plain      kernelgen's unmodified kernel (flash_attn_func) on the same shape and causal mode
  flex       FlexAttention with the same modification: window and documents as BlockMasks, built
             once per case outside the timed region; softcap and ALiBi as score_mods (with the
             causal BlockMask when causal)

Defaults: hd128 bf16, batch x seqlen = 16k tokens, 16 heads, seqlen 4096 and 8192, causal both.
The modifications: window (1024, 1024) when non-causal (a symmetric local window) and (1024, 0)
when causal (Mistral's sliding window; the causal mask already bounds the right side); softcap
30 (Gemma 2); ALiBi with the paper's slopes 2^(-8 (h + 1) / heads); documents: seqlen / 1024
documents per sequence (at least 2) of random lengths (cut points from a fixed seed, different
for each batch element) packed back to back, causal within a document when causal;
varlen_window: those documents with a window of (256, 256), causal (256, 0), within each.

TFLOP/s count only visible work: 4 * head_dim * heads * visible (q, kv) pairs, summed over the
batch and counted exactly (closed forms; tests/test_bench.py checks them against dense masks).
The plain kernel is counted the same way (causal: N (N + 1) / 2 pairs, not N^2 / 2). Ratios:
kernelgen/plain, goal >= 0.90 (a modifier costs at most 10% per useful FLOP), and kernelgen/flex,
goal >= 1.5. `diff` is the largest |kernelgen - flex| of the outputs, a check that both compute
the same modification. Backward rows run only where kernelgen's modified kernel has a backward
(every shipped modifier has one; a user's spec without score_mod_grad is skipped with a note).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kernelgen.bench import (causal_block_mask, flex_bshd, measure_each, record_error,
                             time_pass)

MODS = ("window", "softcap", "alibi", "document", "packed", "varlen", "varlen_window")
WINDOW = {False: (1024, 1024), True: (1024, 0)}  # by causal
VARLEN_WINDOW = {False: (256, 256), True: (256, 0)}  # by causal; inside documents of ~1024
SOFTCAP = 30.0
HIDDEN = 2048  # heads = HIDDEN / head_dim, as in the grid
GOALS = {"kernelgen/plain": 0.90, "kernelgen/flex": 1.5}
SYSTEMS = ("kernelgen", "plain", "flex")


# --- exact counts of the visible (q, kv) pairs ---

def window_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int, causal: bool) -> int:
    """Pairs visible under window_size=(left, right) (negative: unbounded side), bottom-right
    aligned like the causal mask, intersected with it when causal. (-1, -1): the plain mask."""
    rows = torch.arange(seqlen_q, dtype=torch.int64)
    diagonal = rows + (seqlen_k - seqlen_q)
    lo = (diagonal - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    hi = diagonal + right if right >= 0 else torch.full_like(rows, seqlen_k - 1)
    if causal:
        hi = torch.minimum(hi, diagonal)
    return int((hi.clamp(max=seqlen_k - 1) - lo + 1).clamp(min=0).sum())


def document_pairs(lengths: list[list[int]], causal: bool,
                   window: tuple[int, int] = (-1, -1)) -> int:
    """Pairs visible when each sequence packs documents of `lengths` back to back (queries and
    keys alike) and a token sees only its own document (and, causal, no later token; with
    `window`, only keys in its window inside the document)."""
    return sum(window_pairs(n, n, *window, causal) for row in lengths for n in row)


def masked_flops(visible_pairs: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of the visible work: QK^T and PV, 2 * head_dim each per pair and head."""
    return 4.0 * visible_pairs * heads * head_dim


def document_lengths(batch: int, seqlen: int, documents: int, seed: int) -> list[list[int]]:
    """`documents` random lengths summing to seqlen, for each batch element."""
    generator = torch.Generator().manual_seed(seed)
    documents = max(1, min(documents, seqlen))
    lengths = []
    for _ in range(batch):
        cuts = sorted((torch.randperm(seqlen - 1, generator=generator)[: documents - 1] + 1).tolist())
        edges = [0, *cuts, seqlen]
        lengths.append([end - start for start, end in zip(edges, edges[1:])])
    return lengths


def document_ids(lengths: list[list[int]]) -> torch.Tensor:
    """(batch, seqlen) int32: the index of each token's document."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row), dtype=torch.int32),
                                                torch.tensor(row)) for row in lengths])


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


# --- FlexAttention's versions of the modifications (the semantics of the specs' comments) ---

def window_mask_mod(left: int, right: int, offset: int, causal: bool):
    def window(b, h, q_idx, kv_idx):
        diagonal = q_idx + offset
        visible = kv_idx <= diagonal if causal else kv_idx >= 0
        if left >= 0:
            visible = visible & (kv_idx >= diagonal - left)
        if right >= 0:
            visible = visible & (kv_idx <= diagonal + right)
        return visible
    return window


def document_mask_mod(ids: torch.Tensor, causal: bool):
    def document(b, h, q_idx, kv_idx):
        same = ids[b, q_idx] == ids[b, kv_idx]
        return same & (kv_idx <= q_idx) if causal else same
    return document


def softcap_score_mod(cap: float):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


def alibi_score_mod(slopes: torch.Tensor, offset: int):
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx).abs()
    return alibi


@dataclass(frozen=True)
class Case:
    """One modification on one shape: kernelgen's call and FlexAttention's mods for it."""
    mod: str
    label: str
    causal: bool
    visible_pairs: int           # summed over the batch, per head
    plain_pairs: int             # the same for the unmodified kernel
    kernelgen: Callable          # (q, k, v) -> out
    score_mod: Callable | None
    block_mask: object | None


def build_case(mod: str, causal: bool, batch: int, heads: int, seqlen: int, head_dim: int,
               device) -> Case:
    """Everything a case needs before timing: masks, slopes, document ids (on `device`)."""
    import kernelgen
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    plain = batch * window_pairs(seqlen, seqlen, -1, -1, causal)
    causal_mask = causal_block_mask(seqlen, seqlen, device) if causal else None
    if mod == "window":
        left, right = WINDOW[causal]
        mask = create_block_mask(window_mask_mod(left, right, 0, causal), None, None, seqlen,
                                 seqlen, device=device)
        return Case(mod, f"window({left},{right})", causal,
                    batch * window_pairs(seqlen, seqlen, left, right, causal), plain,
                    lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=causal,
                                                              window_size=(left, right)),
                    None, mask)
    if mod == "softcap":
        return Case(mod, f"softcap({SOFTCAP:g})", causal, plain, plain,
                    lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=causal,
                                                              softcap=SOFTCAP),
                    softcap_score_mod(SOFTCAP), causal_mask)
    if mod == "alibi":
        slopes = alibi_slopes(heads).to(device)
        return Case(mod, "alibi", causal, plain, plain,
                    lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=causal,
                                                              alibi_slopes=slopes),
                    alibi_score_mod(slopes, 0), causal_mask)
    if mod in ("document", "packed", "varlen", "varlen_window"):   # the same documents
        lengths = document_lengths(batch, seqlen, max(2, seqlen // 1024), seed=seqlen)
        ids = document_ids(lengths).to(device)
        window = VARLEN_WINDOW[causal] if mod == "varlen_window" else (-1, -1)
        mask_mod = document_mask_mod(ids, causal)
        if mod == "varlen_window":   # a token's window inside its document (same offsets)
            mask_mod = and_masks(mask_mod, window_mask_mod(*window, 0, causal))
        mask = create_block_mask(mask_mod, batch, None, seqlen, seqlen, device=device)
        pairs = document_pairs(lengths, causal, window)
        if mod in ("varlen", "varlen_window"):
            flat = [n for row in lengths for n in row]
            offsets = torch.tensor([0, *itertools.accumulate(flat)], dtype=torch.int32,
                                   device=device)

            def varlen(q, k, v):
                q3, k3, v3 = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
                return kernelgen.flash_attn_varlen_func(
                    q3, k3, v3, offsets, offsets, max(flat), max(flat), causal=causal,
                    window_size=window).view(q.shape)
            label = f"varlen(x{len(flat)})" if mod == "varlen" else \
                f"varlen(x{len(flat)},{window[0]},{window[1]})"
            return Case(mod, label, causal, pairs, plain, varlen, None, mask)
        if mod == "packed":
            start, end = kernelgen.packed_ranges(ids)
            kernel = kernelgen.load("flash_attn_packed", head_dim=head_dim, dtype="bf16",
                                    causal=causal)
            return Case(mod, f"packed(x{len(lengths[0])})", causal, pairs, plain,
                        lambda q, k, v: kernel(q, k, v, doc_start=start, doc_end=end), None, mask)
        kernel = kernelgen.load("flash_attn_document", head_dim=head_dim, dtype="bf16",
                                causal=causal)
        # kernelgen's BlockMask, built once here (outside the timing) where a GPU runs the case;
        # the CPU tests build the case for flex's side only.
        ours = (kernel.create_block_mask(batch, heads, seqlen, seqlen, doc_q=ids, doc_k=ids)
                if torch.device(device).type == "cuda" else None)
        return Case(mod, f"document(x{len(lengths[0])})", causal, pairs, plain,
                    lambda q, k, v: kernel(q, k, v, doc_q=ids, doc_k=ids, block_mask=ours),
                    None, mask)
    raise ValueError(f"unknown modifier {mod!r}; allowed: {', '.join(MODS)}")


# --- measuring ---

def _missing_backward(call, q, k, v) -> str | None:
    q = q.detach().requires_grad_()
    try:
        call(q, k, v).float().sum().backward()
    except NotImplementedError as exc:
        return str(exc)
    return None


def measure(direction: str, head_dim: int, mod: str, causal: bool, seqlen: int, tokens: int,
            plain_ms: dict) -> dict:
    """One row. plain_ms memoizes the plain kernel's time per (pass, head_dim, seqlen, causal):
    the same for every modifier."""
    import kernelgen

    batch, heads = max(1, tokens // seqlen), max(1, HIDDEN // head_dim)
    row = {"pass": direction, "mod": mod, "label": mod, "causal": causal, "seqlen": seqlen,
           "batch": batch, "heads": heads, "head_dim": head_dim, "tflops": {}, "ms": {},
           "ratios": {}}
    backward = direction == "bwd"
    try:
        case = build_case(mod, causal, batch, heads, seqlen, head_dim, "cuda")
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        missing = _missing_backward(case.kernelgen, q, k, v) if backward else None
    except Exception as exc:
        record_error(row, "setup", exc)
        return row
    row.update(label=case.label, visible_pairs=case.visible_pairs,
               density=case.visible_pairs / (batch * seqlen * seqlen))
    if missing:
        row["note"] = "skipped: kernelgen's modified kernel has no backward yet"
        return row
    calls = {"kernelgen": case.kernelgen,
             "plain": lambda q, k, v: kernelgen.flash_attn_func(q, k, v, causal=causal),
             "flex": lambda q, k, v: flex_bshd(q, k, v, case.score_mod, case.block_mask)}
    pairs = {"kernelgen": case.visible_pairs, "plain": case.plain_pairs, "flex": case.visible_pairs}
    for name, call in calls.items():
        key = (direction, head_dim, seqlen, causal)
        try:
            ms = plain_ms[key] if name == "plain" and key in plain_ms else \
                time_pass(call, q, k, v, backward)
        except Exception as exc:
            record_error(row, name, exc)
            continue
        if name == "plain":
            plain_ms[key] = ms
        row["ms"][name] = ms
        flops = masked_flops(pairs[name], heads, head_dim) * (2.5 if backward else 1.0)
        row["tflops"][name] = flops / ms / 1e9
    t = row["tflops"]
    for ratio in GOALS:
        ours, peer = ratio.split("/")
        if ours in t and peer in t:
            row["ratios"][ratio] = t[ours] / t[peer]
    if not backward:
        try:
            with torch.no_grad():
                diff = (calls["kernelgen"](q, k, v).float() - calls["flex"](q, k, v).float())
            row["max_diff"] = diff.abs().max().item()
        except Exception as exc:
            record_error(row, "diff", exc)
    return row


# --- tables ---

def _ratio_cell(row: dict, ratio: str) -> str:
    value = row["ratios"].get(ratio)
    if value is None:
        return f"{'-':>9}"
    return f"{value:7.2f}x" + ("*" if value < GOALS[ratio] else " ")


def format_mod_row(row: dict) -> str:
    t = row["tflops"]
    cells = " ".join(f"{t[s]:8.1f}" if s in t else f"{'-':>8}" for s in SYSTEMS)
    density = f"{row['density']:7.3f}" if "density" in row else f"{'-':>7}"
    diff = f"{row['max_diff']:8.1e}" if "max_diff" in row else f"{'-':>8}"
    line = (f"{row['pass']:4} {row['label']:19} {'causal' if row['causal'] else 'full':6} "
            f"{row['seqlen']:>6} {density} {cells} {_ratio_cell(row, 'kernelgen/plain')} "
            f"{_ratio_cell(row, 'kernelgen/flex')} {diff}")
    return line + (f"  {row['note']}" if "note" in row else "")


def mod_header() -> str:
    return (f"{'pass':4} {'modifier':19} {'mask':6} {'seqlen':>6} {'visible':>7} "
            + " ".join(f"{s:>8}" for s in SYSTEMS) + f" {'kg/plain':>9} {'kg/flex':>9} {'diff':>8}")


def mods_summary(doc: dict) -> str:
    goals = ", ".join(f"{name} >= {goal}" for name, goal in GOALS.items())
    lines = [f"modifier summary: TFLOP/s of visible work on {doc.get('device', '?')}; "
             f"goals {goals} (* below)", mod_header()]
    lines += [format_mod_row(row) for row in doc["results"]]
    for row in doc["results"]:
        for name, error in (row.get("errors") or {}).items():
            lines.append(f"  error {row['pass']} {row['label']} "
                         f"{'causal' if row['causal'] else 'full'} {row['seqlen']} {name}: "
                         f"{error[:120]}")
    return "\n".join(lines)


def run(names, head_dims, seqlens, causals, passes, tokens, json_path: Path) -> int:
    names = list(names) or list(MODS)
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; modifiers, bf16, TFLOP/s of visible work")
    print(mod_header())
    plain_ms: dict = {}
    results = measure_each((passes, head_dims, names, causals, seqlens),
                           lambda *point: measure(*point, tokens, plain_ms), format_mod_row)
    doc = {"device": device, "torch": torch.__version__, "tokens": tokens, "goals": GOALS,
           "mods": names, "systems": list(SYSTEMS), "results": results}
    json_path.write_text(json.dumps(doc, indent=1))
    print(f"saved {json_path}")
    print(mods_summary(doc))
    return 0
