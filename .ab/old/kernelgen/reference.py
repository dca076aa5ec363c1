"""Reference attention in PyTorch: the test oracle and the tuner's validator.

Same conventions as the kernels: (batch, seqlen, heads, head_dim) layout, GQA by fewer k/v heads,
causal aligned bottom-right (query i sees keys j <= i + seqlen_k - seqlen_q), rows that see no key
give O = 0 and LSE = -inf. `upcast=True` computes in float32 (the reference); `upcast=False` in
the input dtype, which measures how much error plain PyTorch makes at that precision.
"""
from __future__ import annotations

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """True where query i may attend to key j (bottom-right aligned)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True, score_mod=None,
                  mask_mod=None):
    """Returns (out in q's dtype, lse in float32 of shape (batch, heads, seqlen_q)).

    score_mod(scores, b, h, i, j) and mask_mod(b, h, i, j) mirror a spec's mods: scores are the
    scaled (batch, heads, seqlen_q, seqlen_k) logits and b, h, i, j broadcastable index tensors;
    mask_mod returns True where a key is visible."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    if heads != heads_k:
        k = k.repeat_interleave(heads // heads_k, dim=2)
        v = v.repeat_interleave(heads // heads_k, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if score_mod is not None or mask_mod is not None:
        b, h, i, j = _indices(batch, heads, seqlen_q, seqlen_k, q.device)
        if score_mod is not None:
            scores = score_mod(scores.float(), b, h, i, j).to(scores.dtype)
        if mask_mod is not None:
            scores = scores.masked_fill(~mask_mod(b, h, i, j), float("-inf"))
    if causal:
        scores = scores.masked_fill(~causal_mask(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key: softmax of all -inf
    # The kernels round P to the input dtype before P.V; so does the reference.
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype if upcast else dtype), v)
    return out.to(dtype), lse


def _indices(batch, heads, seqlen_q, seqlen_k, device):
    return (torch.arange(batch, device=device).view(-1, 1, 1, 1),
            torch.arange(heads, device=device).view(1, -1, 1, 1),
            torch.arange(seqlen_q, device=device).view(1, 1, -1, 1),
            torch.arange(seqlen_k, device=device).view(1, 1, 1, -1))


def rounding_allowance(out_ref: torch.Tensor) -> float:
    """Twice the rounding noise of the output dtype at the output's magnitude (FlashAttention's rule)."""
    return 2.0 * (out_ref + 0.3 - 0.3 - out_ref).abs().max().item()


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
