"""Random Hopper-forward configs on random ragged shapes, plain and with each shipped modifier, on
the CPU emulator (tests/emulator), each checked against the float32 reference by the GPU tests'
rule (test_sm90_emulated.check). The emulated tests pin the cases that reach each code path; this
walks the rest of the tune space, which a tuner or a caller's explicit config may pick. With
--pass bwd, the Hopper backward instead (test_bwd_sm90_emulated.check: its gradients against
autograd's), whose space is small: there the shapes and modifiers vary, packed's varlen ranges
(windows, unequal offsets) both on its ranges and on their block mask (PERF_NOTES §109):

    PYTHONPATH=. python tools/emu_fuzz.py --seed 1 --cases 200 [--pass bwd] [--mods plain ...]

Each case prints one line, `ok` or `FAIL` with everything needed to rerun it (the seed alone
reproduces the whole run). About 5-10 s a case. Clusters (cluster 2) are left out: the emulator
runs one CTA at a time and has no distributed shared memory.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "emulator")]

import torch  # noqa: E402
import test_bwd_sm90_emulated as emulated_bwd  # noqa: E402
import test_sm90_emulated as emulated  # noqa: E402
from test_mods_sm90_emulated import documents, onto, window_mask  # noqa: E402
from test_packed import mask_of  # noqa: E402

from kernelgen import backward_sm90, blockmask  # noqa: E402
from kernelgen.packed import _varlen, packed_ranges  # noqa: E402
from kernelgen.spec import load_spec  # noqa: E402

MODS = ("plain", "window", "softcap", "alibi", "packed", "document")


def sample_config(spec, variant, rng: random.Random):
    """A valid config: each key random (or, 40% of the time, the default's, so that rarely
    valid combinations still come up), cluster 1."""
    default = spec.default_config(variant).as_dict()
    for _ in range(5000):
        values = {key: rng.choice(choices) if rng.random() < 0.6 else default.get(key, choices[0])
                  for key, choices in spec.space}
        values["cluster"] = 1
        config = spec.parse_config(values)
        if not spec.violations(variant, config):
            return config
    return None


def document_ids(batch: int, seqlen_q: int, seqlen_k: int, rng: random.Random):
    """Random per-token document ids of queries and keys, and which pairs share one:
    (doc_q, doc_k, visible (batch, 1, seqlen_q, seqlen_k))."""
    doc_q = documents(batch, seqlen_q, rng.choice([1, 3]))
    doc_k = documents(batch, seqlen_k, rng.choice([1, 4]))
    return doc_q, doc_k, (doc_q[:, :, None] == doc_k[:, None, :])[:, None]


def modification(mod, spec, config, shape, causal, rng: random.Random):
    """(what it is, check()'s keyword arguments, scale of q and k) for one modifier, or None where
    the shape cannot hold it."""
    batch, seqlen_q, seqlen_k, heads, _ = shape
    if mod == "window":
        left, right = rng.choice([-1, 0, 5, 40, 130]), rng.choice([-1, 0, 3, 30, 200])
        return (left, right), dict(mod_args={"window_left": left, "window_right": right},
                                   mask_mod=window_mask(left, right, seqlen_q, seqlen_k)), 1.0
    if mod == "softcap":
        cap = rng.choice([2.0, 6.0, 45.0, -2.0])   # inside and past the score bound, negative
        return cap, dict(mod_args={"softcap": cap},
                         score_mod=lambda s, *_: cap * torch.tanh(s / cap)), (3.0 if abs(cap) < 40 else 12.0)
    if mod == "alibi":
        per_batch = rng.random() < 0.5
        slopes = torch.rand((batch, heads) if per_batch else (heads,)) * 0.5
        s4 = slopes.view(batch if per_batch else 1, heads, 1, 1)
        shift = seqlen_k - seqlen_q
        return per_batch, dict(mod_args={"alibi_slopes": slopes,
                                         "alibi_stride_b": heads if per_batch else 0},
                               score_mod=lambda s, b, h, i, j: s - s4 * (i + shift - j).abs().float()), 1.0
    if mod == "packed":
        if seqlen_q < 4:
            return None
        start, end = packed_ranges(documents(batch, seqlen_q, rng.choice([1, 3, 6])))
        visible = mask_of(start, end, seqlen_k)[:, None]
        return "ids", dict(mod_args={"doc_start": start, "doc_end": end},
                           mask_mod=lambda *_: visible), 1.0
    if mod == "document":
        if seqlen_q < 4 or seqlen_k < 4:
            return None
        doc_q, doc_k, same = document_ids(batch, seqlen_q, seqlen_k, rng)
        # As the library hands them: grouped for wg_skip, in launch order for a CTA per tile.
        lists = blockmask.from_dense(spec, same, causal, batch=batch).forward_args(
            config.as_dict(), batch, heads)
        names = (a.name for a in spec.mods.block_args)
        return "ids", dict(mod_args={"doc_q": doc_q, "doc_k": doc_k, **dict(zip(names, lists))},
                           mask_mod=lambda *_: same), 1.0
    return None, {}, 1.0


def one_case(number: int, rng: random.Random, mods) -> str:
    mod = rng.choice(mods)
    head_dims = [64, 128] if mod in ("packed", "document") else [64, 96, 128, 192, 256]
    head_dim, dtype = rng.choice(head_dims), rng.choice([torch.bfloat16, torch.float16])
    causal = rng.random() < 0.5
    spec = emulated.SPEC if mod == "plain" else onto("flash_attn_" + mod)
    variant = spec.variant(head_dim=head_dim, dtype=emulated.NAMES[dtype], causal=causal)
    config = sample_config(spec, variant, rng)
    if config is None:
        return f"skip {number}: no valid config drawn for {mod} hd{head_dim} causal={causal}"
    heads_k = rng.choice([1, 2])
    seqlen_q = rng.choice([1, 17, 64, 127, 200, 300, 333, 520])
    seqlen_k = seqlen_q if mod == "packed" else rng.choice([1, 33, 64, 130, 200, 301, 430])
    shape = (rng.choice([1, 2]), seqlen_q, seqlen_k, heads_k * rng.choice([1, 2]), heads_k)
    lazy, seed = rng.random() < 0.5, rng.randrange(1 << 20)
    torch.manual_seed(seed)
    found = modification(mod, spec, config, shape, causal, rng)
    if found is None:
        return f"skip {number}: {mod} needs longer sequences than {shape}"
    what, kwargs, scale = found
    batch, _, _, heads, _ = shape
    q = emulated.make(batch, seqlen_q, heads, head_dim, dtype) * scale
    k = emulated.make(batch, seqlen_k, heads_k, head_dim, dtype) * scale
    v = emulated.make(batch, seqlen_k, heads_k, head_dim, dtype)
    case = (f"{number} {mod} {what} hd{head_dim} {emulated.NAMES[dtype]} causal={causal} "
            f"shape={shape} lazy={lazy} config={config.as_dict()}")
    began = time.time()
    try:
        emulated.check(q, k, v, causal, config=config.as_dict(), seed=seqlen_k, lazy=lazy,
                       spec=spec, **kwargs)
    except Exception as error:   # noqa: BLE001 - every failure is a finding to print
        return f"FAIL {case} :: {type(error).__name__}: {str(error)[:400]!r}"
    return f"ok {time.time() - began:5.1f}s {case}"


def varlen_packed(rng: random.Random):
    """flash_attn_packed's ranges for random varlen sequences and a window, as
    flash_attn_varlen_func makes them: (start, end, seqlen_q, seqlen_k, the kernel's own causal,
    the visible pairs (1, 1, seqlen_q, seqlen_k)), or None for sequences with no tokens."""
    causal = rng.random() < 0.5
    lengths_q = [rng.choice([0, 1, 5, 30, 64, 70, 100, 150]) for _ in range(rng.randint(1, 6))]
    same = causal and rng.random() < 0.6     # training's case: the kernel's causal mask
    lengths_k = lengths_q if same else [rng.choice([0, 1, 9, 40, 64, 128, 140]) for _ in lengths_q]
    if not sum(lengths_q) or not sum(lengths_k):
        return None
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    window = (rng.choice([-1, 0, 20, 60]), -1 if causal else rng.choice([-1, 0, 15, 50]))
    start, end, *_, kernel_causal = _varlen(cu_q, cu_k, causal, True, window)
    seqlen_q, seqlen_k = int(cu_q[-1]), int(cu_k[-1])
    visible = mask_of(start, end, seqlen_k)[0]
    if kernel_causal:
        visible &= torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)
    return start, end, seqlen_q, seqlen_k, kernel_causal, visible[None, None], (lengths_q, window)


def one_backward_case(number: int, rng: random.Random, mods) -> str:
    mod = rng.choice(mods)
    # (head dim 96 runs the masks' backward on flash_attn_bwd: their specs exclude it here)
    head_dims = [64, 128] if mod in ("packed", "document", "window") else [64, 96, 128]
    head_dim, dtype = rng.choice(head_dims), rng.choice([torch.bfloat16, torch.float16])
    causal = rng.random() < 0.5
    heads_k = rng.choice([1, 2])
    shape = (rng.choice([1, 2]), rng.choice([1, 17, 64, 100, 130, 200, 300]),
             rng.choice([1, 40, 64, 128, 150, 200, 260]), heads_k * rng.choice([1, 2]), heads_k)
    config = {"block_m": 64, "block_n": 128, "stages": rng.choice([2, 3])}
    lazy, seed, scale = rng.random() < 0.5, rng.randrange(1 << 20), 1.0
    torch.manual_seed(seed)
    kwargs, what = {}, None
    if mod == "packed":
        found = varlen_packed(rng)
        if found is None:
            return f"skip {number}: empty sequences"
        start, end, seqlen_q, seqlen_k, causal, visible, what = found
        shape = (1, seqlen_q, seqlen_k, *shape[3:])
        on_mask = rng.random() < 0.5
        kwargs = dict(mods="flash_attn_packed", mod_values=(start, end), on_mask=on_mask,
                      mask_mod=lambda *_: visible)
        if on_mask:   # the classify kernel, emulated, at each tile the mask is asked for
            twin = load_spec("flash_attn_packed", block_mask=True)
            kwargs["block_mask"] = blockmask.BlockMask(
                twin.name, causal, 1, None, seqlen_q, seqlen_k, torch.device("cpu"),
                lambda m, n: emulated_bwd.classified_ranges(start, end, causal, seqlen_k, (m, n)))
        what = (*what, "on its block mask" if on_mask else "on its ranges")
    elif mod == "document":   # the backward takes the mask itself (its transposed lists)
        if min(shape[1:3]) < 4:
            return f"skip {number}: document needs longer sequences than {shape}"
        doc_q, doc_k, same = document_ids(*shape[:3], rng)
        kwargs = dict(mods="flash_attn_document", mod_values=(doc_q, doc_k),
                      mask_mod=lambda *_: same,
                      block_mask=blockmask.from_dense(load_spec("flash_attn_document"), same,
                                                      causal, batch=shape[0]))
    elif mod != "plain":      # the forward's modification, its mod_args as positional values
        what, forward_kwargs, scale = modification(mod, None, config, shape, causal, rng)
        kwargs = {key: value for key, value in forward_kwargs.items() if key != "mod_args"}
        kwargs.update(mods="flash_attn_" + mod,
                      mod_values=tuple(forward_kwargs["mod_args"].values()))
    main = (load_spec(backward_sm90.SPEC) if mod == "plain"
            else load_spec(kwargs["mods"], onto=backward_sm90.SPEC))
    variant = main.variant("sm_90a", head_dim=head_dim, dtype=emulated.NAMES[dtype], causal=causal)
    if main.violations(variant, main.parse_config(config)):   # the library runs flash_attn_bwd
        return f"skip {number}: {mod} hd{head_dim} causal={causal} is not a Hopper backward variant"
    q, k, v, dout = emulated_bwd.qkv_dout(*shape, head_dim, dtype, scale=scale)
    case = (f"{number} bwd {mod} {what} hd{head_dim} {emulated.NAMES[dtype]} causal={causal} "
            f"shape={shape} lazy={lazy} config={config}")
    began = time.time()
    try:
        emulated_bwd.check(q, k, v, dout, causal, config, lazy, **kwargs)
    except Exception as error:   # noqa: BLE001 - every failure is a finding to print
        return f"FAIL {case} :: {type(error).__name__}: {str(error)[:400]!r}"
    return f"ok {time.time() - began:5.1f}s {case}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--mods", nargs="+", choices=MODS, default=list(MODS))
    parser.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    case = one_case if args.which == "fwd" else one_backward_case
    failures = 0
    for number in range(args.cases):
        line = case(number, rng, args.mods)
        failures += line.startswith("FAIL")
        print(line, flush=True)
    print(f"{failures} failed of {args.cases}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
