"""Attention specs with modifiers (score_mod, mask_mod: see docs/writing-specs.md) as callables.

`kernelgen.load(spec, **params)` on a spec that extends flash_attn_fwd gives an AttentionKernel:
called like flash_attn_func, with the spec's mod arguments as keywords, and differentiable in q,
k and v (the backward runs the same mods: backward.ModArgs). flash_attn_func's built-in options
(window_size, softcap, alibi_slopes) are the shipped specs of this kind.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from kernelgen import api, backward, blockmask, env, ops, tune
from kernelgen.spec import KernelSpec, load_spec

BASE_ARGS = tuple(a.name for a in load_spec(ops.FWD_SPEC).args)
DOCUMENT_SPEC, PACKED_SPEC = "flash_attn_document", "flash_attn_packed"


def is_attention_spec(spec: KernelSpec) -> bool:
    """Specs whose kernel takes the forward's arguments first (those that extend flash_attn_fwd)."""
    return tuple(a.name for a in spec.args[: len(BASE_ARGS)]) == BASE_ARGS


# How many range masks an AttentionKernel keeps (micro-batches in flight; each holds a few int32
# tensors of batch x tiles^2 per tile size asked for).
_RANGE_MASKS = 4
# How many checked call layouts an AttentionKernel keeps (_checked; cleared when full).
_CHECKS = 64


class AttentionKernel:
    """One variant of an attention spec, compiled for the GPU in hand (or `arch`)."""

    def __init__(self, spec: KernelSpec, arch: str | None = None, config=None, **params):
        self.spec, self.config = spec, config
        self.variant = spec.variant(arch=spec.archs[0], **params)  # validates the params now
        self.params = self.variant.as_dict()
        self.mod_args = spec.mods.args  # a block mask's list arguments follow them (block_mask=)
        self._mod_names = frozenset(a.name for a in self.mod_args)
        # The dtype each tensor argument's ctype reads (None: not checked), once per kernel.
        self._dtypes = tuple(_CTYPE_DTYPES.get(" ".join(a.ctype.replace("const", " ")
                                                        .replace("*", " ").split()))
                             for a in self.mod_args)
        if arch is None and torch.cuda.is_available():
            arch = api.pick_arch(spec)
        self._kernels: dict[str, api.BoundKernel] = {}
        self._range_masks: OrderedDict = OrderedDict()   # _range_mask's, per problem and ranges
        self._checks: set = set()   # _checked's keys: call layouts that passed the checks
        if arch is not None:
            self.kernel(arch)

    def __repr__(self) -> str:
        return f"AttentionKernel({self.spec.name}, {self.variant.slug})"

    def kernel(self, arch: str) -> api.BoundKernel:
        bound = self._kernels.get(arch)
        if bound is None:
            bound = self._kernels[arch] = api.load(self.spec, arch=arch, config=self.config,
                                                   **self.params)
        return bound

    def create_block_mask(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                          **mask_args) -> blockmask.BlockMask:
        """The BlockMask of this kernel's mask_mod for one problem (a spec with
        mods.block_sparse), built on the GPU of the mod tensors (else the current one); pass it
        as block_mask= to every call of that problem. mask_args: the spec's mod arguments.
        flash_attn_document's with ids packed in order (non-decreasing along each sequence; one
        host sync to tell) also keeps them as key ranges: its Hopper forward then runs
        flash_attn_packed's kernel (+6-16% at hd128 4k, +26% at hd64: PERF_NOTES §103), and
        its backward still the block mask's."""
        if not self.spec.mods.block_sparse:
            raise TypeError(f"{self.spec.name} has no mods.block_sparse: true, so its kernels "
                            "take no block mask")
        tensors = [x for x in mask_args.values() if isinstance(x, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())
        values = self._mod_values(mask_args, device, _sizes(batch, heads, seqlen_q, seqlen_k))
        named = dict(zip((a.name for a in self.mod_args), values))
        mask = blockmask.create_block_mask(self.spec, self.params, batch, heads, seqlen_q,
                                           seqlen_k, named, device)
        return dataclasses.replace(mask, ranges=self._ordered_ranges(named))

    def _ordered_ranges(self, named: dict):
        """flash_attn_document's ids (`named`: the mod arguments by name) as key ranges
        (doc_start, doc_end) where they are packed in order (one host sync), else None; None for
        every other spec."""
        if self.spec.path != load_spec(DOCUMENT_SPEC).path:
            return None
        from kernelgen import packed

        return packed.ordered_ranges(named["doc_q"], named["doc_k"])

    def __call__(self, q, k, v, softmax_scale: float | None = None, return_lse: bool = False,
                 deterministic: bool = False, block_mask: blockmask.BlockMask | None = None,
                 **mod_args):
        """out (and lse); gradients flow to q, k and v through `out` (the mod arguments get none).
        deterministic=True: bitwise reproducible gradients (dQ without atomics).
        block_mask: a spec with mods.block_sparse visits only the tiles it lists (built by
        create_block_mask for this problem); without one each call builds its own."""
        blockmask.check_argument(block_mask, self.spec)
        wants_grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
        if wants_grad:
            backward.check_differentiable(self.spec)  # before any GPU is needed: a spec's property
        values = self._checked(q, k, v, mod_args)
        scale = ops._scale(q, softmax_scale)
        if self.spec.mods.block_sparse:
            batch, seqlen_q, heads, _ = q.shape
            if block_mask is None:
                block_mask = blockmask.create_block_mask(
                    self.spec, self.params, batch, heads, seqlen_q, k.shape[1],
                    dict(zip((a.name for a in self.mod_args), values)), q.device)
            block_mask.check(self.spec, self.params.get("causal", False), batch, heads, seqlen_q,
                             k.shape[1], q.device)
        if wants_grad:
            range_mask = None if deterministic else self._range_mask(q, k, values)
            out, lse = _AttentionFunction.apply(self, scale, bool(deterministic), block_mask,
                                                range_mask, q, k, v, *values)
        else:
            out, lse = self.forward(q, k, v, scale, values, block_mask)
        return (out, lse) if return_lse else out

    def range_spec(self, head_dim: int, device: int, seqlen_k: int) -> KernelSpec | None:
        """The spec whose backward this kernel's gradients run on a block mask, or None: a kv
        range that reads tensors (flash_attn_packed's per-token bounds) where the Hopper backward
        runs, its mods put on a block mask (load_spec's block_mask=). The kv-range backward tests
        every query tile of a KV tile's batch against the ranges (a round of loads, then a
        warp-wide search per step) and evaluates the bounds per element in every tile they do not
        vouch for; the block mask lists a KV tile's query tiles, marks the fully visible ones and
        launches a full grid's tiles shortest last, as flash_attn_document's backward does
        (PERF_NOTES §102, §109). Taken with KERNELGEN_RANGE_BACKWARD=blockmask only, until it
        has run on a GPU; the default keeps the ranges."""
        mods = self.spec.mods
        if (mods.block_sparse or not mods.range_reads_memory or mods.mask_mod is None
                or env.settings().range_backward != "blockmask"):
            return None
        from kernelgen import backward_sm90

        twin = load_spec(self.spec.path, block_mask=True)
        if not backward_sm90.applies(head_dim, device, False, seqlen_k, twin, self.params):
            return None
        return twin

    def _range_mask(self, q, k, values: tuple) -> blockmask.BlockMask | None:
        """range_spec's block mask of this problem (its lists are classified, from the rows'
        bounds, when the backward asks for its tile), or None. Kept per problem and mod
        arguments (each tensor by identity and version counter, and referenced so that its id
        is not reused; an in-place change makes a new mask): a model's layers call with the same
        ranges, and classify, compact and order them once."""
        twin = self.range_spec(q.shape[-1], q.device.index, k.shape[1])
        if twin is None:
            return None
        batch, seqlen_q, heads, _ = q.shape
        key = (batch, heads, seqlen_q, k.shape[1], q.device,
               *((id(x), x._version) if isinstance(x, torch.Tensor) else x for x in values))
        found = self._range_masks.get(key)
        if found is None:
            found = (values, blockmask.create_block_mask(
                twin, self.params, batch, heads, seqlen_q, k.shape[1],
                dict(zip((a.name for a in self.mod_args), values)), q.device))
            if len(self._range_masks) >= _RANGE_MASKS:
                self._range_masks.popitem(last=False)
            self._range_masks[key] = found
        self._range_masks.move_to_end(key)
        return found[1]

    def forward(self, q, k, v, scale: float, values: tuple, block_mask=None):
        """(out, lse) on validated inputs, without autograd; values: the mod arguments in order;
        block_mask: a checked BlockMask (block-sparse specs only; one with ranges runs
        flash_attn_packed's kernel on them on the Hopper family).
        On compute capability 9.0 the mods run on the Hopper family (mods_sm90), unless this
        kernel was given a config (its keys are the mma.sync family's)."""
        device = q.device.index
        if self.config is None and ops.forward_family(device) == "sm90":
            from kernelgen import mods_sm90

            if block_mask is not None and block_mask.ranges is not None:   # the same mask
                packed = builtin_kernel(PACKED_SPEC, q, bool(self.params.get("causal", False)))
                return packed.forward(q, k, v, scale, block_mask.ranges)
            return mods_sm90.forward_sm90(self.spec, q, k, v, self.params, scale, values,
                                          block_mask=block_mask)
        q, k, v = ops._aligned(q), ops._aligned(k), ops._aligned(v)
        batch, seqlen_q, heads, head_dim = q.shape
        bound = self._tuned_kernel(api.pick_arch(self.spec, device), device,
                                   (batch, heads, k.shape[2], seqlen_q, k.shape[1]))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
        if out.numel():
            extra = _launch_values(values)
            if block_mask is not None:
                extra += _launch_values(block_mask.forward_args(bound.config.as_dict()))
            scalars = {"batch": batch, "heads": heads, "heads_k": k.shape[2],
                       "seqlen_q": seqlen_q, "seqlen_k": k.shape[1]}
            args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                    batch, heads, k.shape[2], seqlen_q, k.shape[1], scale, *extra)
            bound.launch(args, bound.grid({**scalars, **dict(zip(
                (a.name for a in self.spec.mods.members), extra))}), device,
                api._current_stream(device))
        return out, lse

    def _tuned_kernel(self, arch: str, device: int, sizes: tuple) -> api.BoundKernel:
        """The kernel to launch: this kernel's config if it was given one, else tune.lookup's
        (the tuning DB, which AttentionKernel.tune fills, then the spec's defaults)."""
        if self.config is not None:
            return self.kernel(arch)
        key = (arch, device, sizes)
        bound = self._kernels.get(key)
        if bound is None:
            variant = self.spec.variant(arch=arch, **self.params)
            config = tune.lookup(self.spec, variant, tune.Problem(*sizes), device)
            bound = api.load(self.spec, arch=arch, config=config.as_dict(), **self.params)
            if len(self._kernels) >= 256:
                self._kernels.clear()
            self._kernels[key] = bound
        return bound

    def tune(self, q, k, v, *, forward: bool = True, backward: bool | None = None,
             **mod_args) -> list:
        """Tune this kernel on the GPU for the sizes of q, k, v and these mod arguments (what it
        will run on: a mask's data decides which tiles have work), and store the choices in the
        tuning DB, where later calls find them: unless forward=False, the forward of the family
        this GPU runs (the Hopper one on compute capability 9.0) and, unless backward=False, the
        backward's main kernel if the spec is differentiable. Returns the tune.TuneResults.
        flash_attn_document's ids packed in order tune flash_attn_packed's Hopper forward on
        their ranges instead: what a call with create_block_mask's mask runs (PERF_NOTES §103)."""
        ops._check_inputs(q, k, v)
        values = self._mod_values(mod_args, q.device, _sizes_of(q, k))
        named = dict(zip((a.name for a in self.mod_args), values))
        device = q.device.index
        batch, seqlen_q, heads, _ = q.shape
        problem = tune.Problem(batch, heads, k.shape[2], seqlen_q, k.shape[1])
        specs = []   # (spec, its mod arguments by name)
        if forward and ops.forward_family(device) == "sm90":
            from kernelgen import mods_sm90

            ranges = self._ordered_ranges(named)
            if ranges is None:
                specs.append((mods_sm90.sm90_spec(self.spec), named))
            else:
                specs.append((mods_sm90.sm90_spec(load_spec(PACKED_SPEC)),
                              dict(zip(("doc_start", "doc_end"), ranges))))
        elif forward:
            specs.append((self.spec, named))
        if backward is None:   # differentiable: no score_mod, or one with its derivative
            backward = (self.spec.mods.score_mod is None
                        or self.spec.mods.score_mod_grad is not None)
        if backward:
            from kernelgen import backward as gradients   # the argument hides the module

            gradients.check_differentiable(self.spec)
            base = gradients.main_spec_name(q.shape[-1], device, False, k.shape[1], self.spec,
                                            self.params)   # the kernel its gradients will run
            on_mask = self.range_spec(q.shape[-1], device, k.shape[1]) is not None
            specs.append((load_spec(self.spec.path, onto=base, block_mask=on_mask), named))
        results = []
        for spec, mod_values in specs:
            params = {n: v for n, v in self.params.items() if n in {p.name for p in spec.params}}
            results.append(tune.tune(spec, problem, device=device, mod_values=mod_values, **params))
        return results

    def _checked(self, q, k, v, mod_args: dict) -> tuple:
        """The mod values of a call (_mod_values'), q, k and v checked with them. A call whose
        layout (shapes, strides, dtypes, devices) and mod arguments (names in order; a tensor's
        layout, a number's type and value) match one that passed skips the checks, as
        ops.checked_forward does for plain calls: they cost more than the launch on a slow host
        (PERF_NOTES §121). Everything the checks read is in the key; pointers are not, and the
        forward checks their alignment (ops._aligned) every call."""
        try:
            key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
                   k.dtype, v.dtype, q.device, k.device, v.device,
                   *(_arg_key(name, x) for name, x in mod_args.items()))
            hit = key in self._checks
        except (AttributeError, TypeError):   # not tensors, or other values: the checks say why
            key, hit = None, False
        if hit:
            return tuple(float(mod_args[a.name]) if a.type == "f32" else mod_args[a.name]
                         for a in self.mod_args)
        ops._check_inputs(q, k, v)
        if q.shape[-1] != self.params.get("head_dim", q.shape[-1]):
            raise ValueError(f"q has head_dim {q.shape[-1]} but this kernel was built for "
                             f"head_dim={self.params['head_dim']}")
        if "dtype" in self.params and ops._DTYPES[q.dtype] != self.params["dtype"]:
            raise TypeError(f"q is {q.dtype} but this kernel was built for dtype={self.params['dtype']}")
        values = self._mod_values(mod_args, q.device, _sizes_of(q, k))
        if key is not None:
            if len(self._checks) >= _CHECKS:
                self._checks.clear()
            self._checks.add(key)
        return values

    def _mod_values(self, given: dict, device, sizes: dict) -> tuple:
        """The mod arguments in the kernel's order, checked: tensors for `ptr` (on q's device,
        contiguous, of the element type the spec's ctype reads and of its declared shape in the
        problem's `sizes`), numbers else."""
        if given.keys() != self._mod_names:
            names = [a.name for a in self.mod_args]
            missing = [n for n in names if n not in given]
            extra = [n for n in given if n not in names]
            raise TypeError(f"{self.spec.name}: missing mod arguments {missing}, unexpected "
                            f"{extra}; it takes {names}")
        values = []
        for arg, wanted in zip(self.mod_args, self._dtypes):
            value = given[arg.name]
            if arg.type == "ptr":
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{arg.name} must be a tensor, got {type(value).__name__}")
                if value.device != device:
                    raise ValueError(f"{arg.name} is on {value.device} but q is on {device}")
                if not value.is_contiguous():
                    raise ValueError(f"{arg.name} must be contiguous")
                if wanted is not None and value.dtype != wanted:
                    raise TypeError(f"{arg.name} must be {wanted} (the spec reads it as "
                                    f"{arg.ctype!r}), got {value.dtype}")
                shape = tuple(sizes[size] for size in arg.shape)
                if arg.shape and tuple(value.shape) != shape:
                    raise ValueError(f"{arg.name} must have shape ({', '.join(arg.shape)}) = "
                                     f"{shape}, got {tuple(value.shape)}")
                values.append(value)
            elif arg.type == "f32":
                values.append(float(value))
            else:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"{arg.name} must be an int, got {value!r}")
                values.append(value)
        return tuple(values)


# The element types of a tensor argument's ctype that a dtype stands for (others: not checked).
_CTYPE_DTYPES = {"int": torch.int32, "int32_t": torch.int32, "float": torch.float32,
                 "long long": torch.int64, "int64_t": torch.int64}


def _sizes(batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> dict:
    return {"batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}


def _sizes_of(q, k) -> dict:
    return _sizes(q.shape[0], q.shape[2], q.shape[1], k.shape[1])


def _arg_key(name: str, x) -> tuple:
    """A mod argument's part of AttentionKernel._checked's key: a tensor's layout (never the
    tensor: the key must not keep it alive), a plain number's type and value; TypeError else."""
    if isinstance(x, torch.Tensor):
        return name, x.shape, x.stride(), x.dtype, x.device
    if type(x) in (int, float, bool):
        return name, type(x), x
    raise TypeError(f"{name}: not a key")


def _launch_values(values: tuple) -> tuple:
    return tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values)


class _AttentionFunction(torch.autograd.Function):
    """An AttentionKernel's forward, and as its backward backward.flash_attn_backward with the
    spec's mods. Saved: q, k, v, out, lse and the mod tensors (their versions are checked);
    scalars ride on ctx. The mod arguments get no gradient."""

    @staticmethod
    def forward(ctx, kernel: AttentionKernel, scale: float, deterministic: bool, block_mask,
                range_mask, q, k, v, *values):
        out, lse = kernel.forward(q, k, v, scale, values, block_mask)
        tensors = [x for x in values if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.kernel, ctx.scale, ctx.deterministic = kernel, scale, deterministic
        # Its lists for the backward's tiles are built there. range_mask: the kv range's block
        # mask (AttentionKernel.range_spec), for the backward only.
        ctx.block_mask = block_mask if range_mask is None else range_mask
        ctx.on_range_mask = range_mask is not None
        ctx.scalars = tuple(None if isinstance(x, torch.Tensor) else x for x in values)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        given = iter(tensors)
        values = tuple(next(given) if x is None else x for x in ctx.scalars)
        kernel = ctx.kernel
        spec = load_spec(kernel.spec.path, block_mask=True) if ctx.on_range_mask else kernel.spec
        mods = backward.ModArgs(spec, kernel.variant.params, values, ctx.block_mask)
        dq, dk, dv = backward.saved_backward(
            dout, q, k, v, out, lse, bool(kernel.params.get("causal", False)), ctx.scale,
            ctx.deterministic, mods=mods)
        return (None, None, None, None, None, dq, dk, dv, *(None for _ in values))


def load(spec, *, arch: str | None = None, config=None, **params):
    """`kernelgen.load`: an AttentionKernel for attention specs, else the raw BoundKernel."""
    spec = spec if isinstance(spec, KernelSpec) else load_spec(spec)
    if is_attention_spec(spec):
        return AttentionKernel(spec, arch=arch, config=config, **params)
    return api.load(spec, arch=arch, config=config, **params)


_BUILTINS: dict[tuple, AttentionKernel] = {}


def builtin_forward(q, k, v, causal, softmax_scale, return_lse, window_size, softcap,
                    alibi_slopes, deterministic=False):
    """flash_attn_func with one of its modifier options (differentiable like the spec's kernel)."""
    active = [name for name, on in (("window_size", tuple(window_size) != (-1, -1)),
                                    ("softcap", bool(softcap)),
                                    ("alibi_slopes", alibi_slopes is not None)) if on]
    if len(active) > 1:
        raise NotImplementedError(f"combining {' and '.join(active)} is not supported yet: "
                                  "write a spec with both mods (docs/writing-specs.md)")
    ops._check_inputs(q, k, v)
    name, extra = _builtin_args(active[0], q, window_size, softcap, alibi_slopes)
    return builtin_kernel(name, q, causal)(q, k, v, softmax_scale=softmax_scale,
                                           return_lse=return_lse, deterministic=deterministic,
                                           **extra)


def builtin_kernel(name: str, q, causal: bool) -> AttentionKernel:
    """The shipped spec `name`'s kernel for q's head_dim and dtype, one per process (q's other
    properties are the kernel call's to check)."""
    dtype = ops._DTYPES.get(q.dtype)
    if dtype is None:   # the kernel call's own message, before a key it cannot make
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    key = (name, q.shape[-1], dtype, bool(causal))
    kernel = _BUILTINS.get(key)
    if kernel is None:
        kernel = _BUILTINS[key] = AttentionKernel(load_spec(name), head_dim=q.shape[-1],
                                                  dtype=dtype, causal=bool(causal))
    return kernel


def _builtin_args(option, q, window_size, softcap, alibi_slopes):
    if option == "window_size":
        left, right = ops.window_bounds(window_size)
        return "flash_attn_window", {"window_left": left, "window_right": right}
    if option == "softcap":
        if not (isinstance(softcap, (int, float)) and softcap > 0):
            raise ValueError(f"softcap must be a positive number (0: off), got {softcap!r}")
        return "flash_attn_softcap", {"softcap": float(softcap)}
    batch, heads = q.shape[0], q.shape[2]
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise TypeError("alibi_slopes must be a float32 tensor of shape (heads,) or (batch, heads)")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({heads},) "
                         f"or ({batch}, {heads})")
    stride_b = 0 if alibi_slopes.dim() == 1 else heads
    return "flash_attn_alibi", {"alibi_slopes": alibi_slopes.contiguous(), "alibi_stride_b": stride_b}
