"""Specs with mods on the CPU: extends:, checking of the C expressions before NVRTC, NVRTC's
messages pointing at the spec's line, and the shipped modifier specs compiling clean."""
import textwrap

import pytest

from kernelgen import cache, render
from kernelgen.cexpr import CExprError, check_cexpr, split_factor
from kernelgen.compile import CompileError
from kernelgen.spec import REPO_ROOT, SpecError, load_spec

MOD_SPECS = ["flash_attn_softcap", "flash_attn_window", "flash_attn_alibi", "flash_attn_document",
             "flash_attn_packed"]


def write(tmp_path, body: str, name="my_attention"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def with_f32_arg(tmp_path, arg: str, *mods: str):
    """A spec extending flash_attn_fwd whose mods have one f32 argument `arg` and the given
    lines (each `key: value`)."""
    lines = "".join(f"\n  {line}" for line in mods)
    return write(tmp_path, f"""\
name: my_attention
extends: flash_attn_fwd
mods:
  args:
    - {{name: {arg}, type: f32}}{lines}
""")


@pytest.mark.parametrize("text, match", [
    ("score * undefined_thing", "name 'undefined_thing' is not defined here"),
    ("system(score)", "function 'system' may not be used"),
    ("score; return 0", "unexpected ';'"),
    ('score + "x"', "unexpected '\"'"),
    ("(score + 1", "unbalanced '\\('"),
    ("score.x", "member access"),
])
def test_bad_expressions_are_caught_before_nvrtc(text, match):
    with pytest.raises(CExprError, match=match):
        check_cexpr(text, where="x.yaml: mods.score_mod", file="x.yaml", line=3,
                    names={"score", "q_idx"})


@pytest.mark.parametrize("score_mod, clamps", [
    ("score - slopes[batch * 4 + head] * fabsf((float)(q_idx - kv_idx))", False),  # ALiBi's kind
    ("score + table[kv_idx]", True),
    ("score + table[batch * seqlen_k + (q_idx + 1) / 2]", True),
    ("score + *(table + kv_idx)", True),      # pointer arithmetic: no subscript to look into
    ("score + table[head] * (float)q_idx", False),
])
def test_indices_are_clamped_where_a_mod_reads_memory_at_them(tmp_path, score_mod, clamps):
    """The forwards pass q_idx/kv_idx unclamped only to expressions that cannot turn them into an
    address (a padding row or column would read out of bounds)."""
    path = write(tmp_path, f"""
        name: my_attention
        extends: flash_attn_fwd
        mods:
          args:
            - {{name: table, type: ptr, ctype: "const float*"}}
            - {{name: slopes, type: ptr, ctype: "const float*"}}
          score_mod: "{score_mod}"
        """)
    assert load_spec(path).mods.clamps_indices is clamps


def test_shipped_mods_clamp_indices_only_for_per_token_tensors():
    clamps = {name: load_spec(name).mods.clamps_indices for name in MOD_SPECS}
    assert clamps == {"flash_attn_softcap": False, "flash_attn_window": False,
                      "flash_attn_alibi": False, "flash_attn_document": True,
                      "flash_attn_packed": True}
    for name, flag in (("flash_attn_document", "true"), ("flash_attn_alibi", "false")):
        spec = load_spec(name, onto="flash_attn_fwd_sm90")
        variant = spec.variant("sm_90a", head_dim=64, dtype="bf16", causal=False)
        source = render.render(spec, variant, spec.default_config(variant))
        assert f"kClampIndices = {flag};" in source.text


def test_score_mods_may_start_from_the_raw_dot_product(tmp_path):
    """qk and softmax_scale are names of score_mod and score_mod_grad, not of mask_mod."""
    body = """
        name: my_attention
        extends: flash_attn_fwd
        mods:
          {key}: "{expr}"
        """
    spec = load_spec(write(tmp_path, body.format(key="score_mod", expr="qk * (softmax_scale * 0.5f)")))
    assert {"qk", "softmax_scale"} <= spec.mods.score_mod.names
    with pytest.raises(SpecError, match="name 'qk' is not defined here"):
        load_spec(write(tmp_path, body.format(key="mask_mod", expr="qk > 0.0f"), name="masked"))


@pytest.mark.parametrize("extra, match", [
    ("exact: yes please", "kv_range.exact: expected true or false"),
    ("exactly: true", "kv_range.exactly: unknown key"),
])
def test_kv_range_exact_is_checked(tmp_path, extra, match):
    path = write(tmp_path, f"""
        name: my_attention
        extends: flash_attn_fwd
        mods:
          kv_range:
            lo: "0"
            hi: "q_last + 1"
            full_lo: "0"
            full_hi: "q_first + 1"
            {extra}
        """)
    with pytest.raises(SpecError, match=match):
        load_spec(path)


def test_an_exact_range_needs_a_mask_mod_and_reaches_the_kernel(tmp_path):
    path = write(tmp_path, """
        name: my_attention
        extends: flash_attn_fwd
        mods:
          kv_range: {lo: "0", hi: "q_last + 1", full_lo: "0", full_hi: "q_first + 1", exact: true}
        """)
    with pytest.raises(SpecError, match="an exact range stands for a mask_mod"):
        load_spec(path)
    window = load_spec("flash_attn_window", onto="flash_attn_fwd_sm90")
    assert window.mods.exact_range
    variant = window.variant("sm_90a", head_dim=64, dtype="bf16", causal=True)
    assert "kExactRange = true;" in render.render(window, variant,
                                                  window.default_config(variant)).text


@pytest.mark.parametrize("body, bound, match", [
    ('mask_mod: "kv_idx <= q_idx"', "cap", "a bound on the scores of a score_mod"),
    ('score_mod: "cap * tanh_approx(score / cap)"', "cap + q_idx", "name 'q_idx' is not defined here"),
])
def test_score_bound_is_checked(tmp_path, body, bound, match):
    """A bound needs a score_mod, and is a function of the mod args, batch and head only."""
    with pytest.raises(SpecError, match=match):
        load_spec(with_f32_arg(tmp_path, "cap", body, f'score_bound: "{bound}"'))


def test_softcap_bounds_its_scores_on_the_hopper_forward():
    """softcap's score_bound reaches the Hopper kernel; the sm80 family renders it unused."""
    softcap = load_spec("flash_attn_softcap", onto="flash_attn_fwd_sm90")
    assert softcap.mods.score_bound.text == "fabsf(softcap)"
    variant = softcap.variant("sm_90a", head_dim=128, dtype="bf16", causal=False)
    text = render.render(softcap, variant, softcap.default_config(variant)).text
    assert "kScoreBound = true;" in text and "return (fabsf(softcap));" in text
    assert load_spec("flash_attn_alibi").mods.score_bound is None


@pytest.mark.parametrize("text, split", [
    ("softcap * tanh_approx(qk * (softmax_scale / softcap))",
     ("softcap", "tanh_approx(qk * (softmax_scale / softcap))")),
    ("tanhf(score / c) * c * 2.0f", ("(c) * (2.0f)", "tanhf(score / c)")),
    ("caps[head] * tanhf(score)", ("caps[head]", "tanhf(score)")),
    ("score", None),                      # no product
    ("c * d", None),                      # no factor reads the score
    ("slopes[q_idx] * score", None),      # every factor reads an index
    ("-c * tanhf(score)", None),          # a top-level operator other than *
    ("c * score + 1.0f", None),
    ("q_idx > 3 ? c * score : score", None),
])
def test_split_factor(text, split):
    """A score_mod's uniform factor: split only at a top-level product, and only off factors that
    read no score or index (the Hopper forward takes them into its exp2's scale)."""
    expr = check_cexpr(text, where="w", file="f.yaml", line=3,
                       names={"score", "qk", "softmax_scale", "c", "d", "caps", "slopes", "head",
                              "q_idx", "kv_idx", "softcap"})
    got = split_factor(expr, ("score", "qk", "q_idx", "kv_idx"))
    assert (got and (got[0].text, got[1].text)) == split
    if got:
        assert (got[0].file, got[0].line) == ("f.yaml", 3) and got[0].names | got[1].names <= expr.names


def test_softcap_folds_its_cap_on_the_hopper_forward():
    """softcap's cap is its score_mod's uniform factor (rendered with the rest beside score_mod);
    a spec without a score_bound keeps none (only the bounded softmax folds it)."""
    softcap = load_spec("flash_attn_softcap", onto="flash_attn_fwd_sm90")
    assert [e.text for e in softcap.mods.score_factor] == [
        "softcap", "tanh_approx(qk * (softmax_scale / softcap))"]
    variant = softcap.variant("sm_90a", head_dim=128, dtype="bf16", causal=False)
    text = render.render(softcap, variant, softcap.default_config(variant)).text
    assert "kScoreFactor = true;" in text and "return (softcap);" in text
    alibi = load_spec("flash_attn_alibi", onto="flash_attn_fwd_sm90")
    assert alibi.mods.score_factor is None
    variant = alibi.variant("sm_90a", head_dim=128, dtype="bf16", causal=False)
    assert "kScoreFactor = false;" in render.render(
        alibi, variant, alibi.default_config(variant)).text


ALIBI_LIKE = 'score_mod: "score - s * fabsf((float)(q_idx - kv_idx))"'


@pytest.mark.parametrize("body, slopes, match", [
    (('mask_mod: "kv_idx <= q_idx"',), '{before: "s", after: "-s"}', "the slopes of a score_mod's bias"),
    ((ALIBI_LIKE,), '{before: "s * q_idx", after: "-s"}', "name 'q_idx' is not defined here"),
    ((ALIBI_LIKE,), '{before: "s"}', "missing required key"),
    ((ALIBI_LIKE,), '{before: "s", after: "-s", left: "s"}', "unknown key"),
    ((ALIBI_LIKE, 'score_bound: "s"'), '{before: "s", after: "-s"}', "give one of the two"),
])
def test_distance_slopes_are_checked(tmp_path, body, slopes, match):
    """Slopes describe a score_mod (so need one), are functions of the mod args, batch and head,
    name both sides, and exclude a score_bound (whose kernel takes no row max to shift)."""
    with pytest.raises(SpecError, match=match):
        load_spec(with_f32_arg(tmp_path, "s", *body, f"distance_slopes: {slopes}"))


def test_alibi_gives_its_slopes_to_the_hopper_forward():
    """ALiBi's distance_slopes reach the Hopper kernel (DistanceBias); the sm80 family renders
    them unused, and the other shipped specs have none."""
    alibi = load_spec("flash_attn_alibi", onto="flash_attn_fwd_sm90")
    before, after = alibi.mods.distance_slopes
    assert after.text == "-" + before.text == "-alibi_slopes[batch * alibi_stride_b + head]"
    variant = alibi.variant("sm_90a", head_dim=128, dtype="bf16", causal=False)
    text = render.render(alibi, variant, alibi.default_config(variant)).text
    assert "kDistanceSlopes = true;" in text and f"return ({after.text});" in text
    softcap = load_spec("flash_attn_softcap", onto="flash_attn_fwd_sm90")
    assert softcap.mods.distance_slopes is None
    variant = softcap.variant("sm_90a", head_dim=128, dtype="bf16", causal=False)
    assert "kDistanceSlopes = false;" in render.render(
        softcap, variant, softcap.default_config(variant)).text


def test_unknown_name_lists_what_may_be_used(tmp_path):
    path = write(tmp_path, """
        name: my_attention
        extends: flash_attn_fwd
        mods:
          args:
            - {name: temperature, type: f32}
          score_mod: "score / temprature"
        """)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert "my_attention.yaml: mods.score_mod" in message
    assert "'temprature'" in message and "temperature" in message and "kv_idx" in message


def test_nvrtc_error_points_at_the_spec_line(tmp_path, cache_dir):
    path = write(tmp_path, """
        name: my_attention
        extends: flash_attn_fwd
        mods:
          args:
            - {name: bias, type: f32}
          score_mod: "score + bias[head]"
        """)
    spec = load_spec(path)
    variant = spec.variant("sm_80", head_dim=64)
    source = render.render(spec, variant, spec.default_config(variant))
    with pytest.raises(CompileError) as info:
        cache.compile_cached(source, "sm_80")
    assert "my_attention.yaml(6)" in info.value.log  # line 6 of the file holds the score_mod


def test_extends_inherits_and_overrides(tmp_path):
    path = write(tmp_path, """
        name: my_attention
        extends: flash_attn_fwd
        params:
          head_dim: {values: [64, 128], default: 64}
        mods:
          args:
            - {name: scale2, type: f32}
          score_mod: "score * scale2"
          score_mod_grad: "scale2"
        """)
    spec, base = load_spec(path), load_spec("flash_attn_fwd")
    assert [p.name for p in spec.params] == [p.name for p in base.params]
    assert spec.params[0].values == (64, 128)
    assert spec.args[: len(base.args)] == base.args and spec.args[-1].name == "scale2"
    assert spec.space == base.space and spec.template == base.template
    assert spec.mods.score_mod.text == "score * scale2" and spec.mods.score_mod.line == 8
    assert spec.content_hash != base.content_hash


def test_extends_cycle_and_unknown_base(tmp_path):
    write(tmp_path, "name: a\nextends: b.yaml\n", name="a")
    write(tmp_path, "name: b\nextends: a.yaml\n", name="b")
    with pytest.raises(SpecError, match="cycle"):
        load_spec(tmp_path / "a.yaml")
    path = write(tmp_path, "name: c\nextends: no_such_spec\n", name="c")
    with pytest.raises(SpecError, match="c.yaml: extends: unknown spec 'no_such_spec'"):
        load_spec(path)


def test_kv_range_needs_all_bounds(tmp_path):
    path = write(tmp_path, """
        name: my_attention
        extends: flash_attn_fwd
        mods:
          mask_mod: "kv_idx <= q_idx"
          kv_range: {lo: "0", hi: "q_last + 1"}
        """)
    with pytest.raises(SpecError, match="kv_range.full_lo: missing required key"):
        load_spec(path)


@pytest.mark.parametrize("name", [*MOD_SPECS, str(REPO_ROOT / "examples" / "prefix_lm.yaml")])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_modifier_specs_compile_without_spills(name, arch, cache_dir):
    spec = load_spec(name)
    for variant in spec.variants([arch]):
        if variant["dtype"] != "bf16" or variant["head_dim"] not in (64, 128, 256):
            continue  # the full set is covered by `kernelgen build`; keep CI quick
        source = render.render(spec, variant, spec.default_config(variant))
        binary = cache.compile_cached(source, arch)
        assert binary.spill_stores == 0 and binary.stack_bytes == 0, source.name


@pytest.mark.parametrize("arg, match", [
    ('{name: ids, type: ptr, shape: [batch, tokens]}', "unknown size 'tokens'"),
    ('{name: cap, type: f32, shape: [batch]}', "only a tensor"),
])
def test_arg_shapes_are_checked(tmp_path, arg, match):
    path = write(tmp_path, f"""
        name: my_attention
        extends: flash_attn_fwd
        mods:
          args:
            - {arg}
          score_mod: "score"
        """)
    with pytest.raises(SpecError, match=match):
        load_spec(path)


def test_tensor_arguments_are_checked_against_ctype_and_shape():
    """AttentionKernel's check of the mod tensors (no GPU: the check before any launch)."""
    import torch

    import kernelgen
    from kernelgen.attention import _sizes

    kernel = kernelgen.load("flash_attn_document", head_dim=64, dtype="bf16")
    sizes = _sizes(batch=2, heads=4, seqlen_q=30, seqlen_k=20)
    ids_q, ids_k = torch.zeros(2, 30, dtype=torch.int32), torch.zeros(2, 20, dtype=torch.int32)
    cpu = torch.device("cpu")
    assert len(kernel._mod_values({"doc_q": ids_q, "doc_k": ids_k}, cpu, sizes)) == 2
    with pytest.raises(TypeError, match="doc_q must be torch.int32 .* got torch.int64"):
        kernel._mod_values({"doc_q": ids_q.long(), "doc_k": ids_k}, cpu, sizes)
    with pytest.raises(ValueError, match=r"doc_k must have shape \(batch, seqlen_k\) = \(2, 20\), "
                                         r"got \(2, 30\)"):
        kernel._mod_values({"doc_q": ids_q, "doc_k": ids_q}, cpu, sizes)


def test_a_checked_call_layout_skips_the_checks_and_nothing_else(monkeypatch):
    """AttentionKernel._checked (PERF_NOTES §121): a call whose layout and mod arguments match
    one that passed skips the checks; any change the checks read runs them again and fails."""
    import torch

    import kernelgen
    from kernelgen import attention, ops

    runs = []
    # No GPU here: the device checks pass as on one, the structure checks stay.
    monkeypatch.setattr(ops, "_check_inputs",
                        lambda q, k, v: (runs.append(1), ops._check_structure(q, k, v)))
    monkeypatch.setattr(attention.AttentionKernel, "forward",
                        lambda self, q, k, v, scale, values, block_mask=None: (q, values))
    kernel = kernelgen.load("flash_attn_packed", head_dim=64, dtype="bf16")
    q = torch.randn(2, 30, 4, 64, dtype=torch.bfloat16)
    kv = torch.randn(2, 20, 2, 64, dtype=torch.bfloat16)
    start, end = torch.zeros(2, 30, dtype=torch.int32), torch.full((2, 30), 20, dtype=torch.int32)
    for _ in range(3):
        values = kernel(q, kv, kv, return_lse=True, doc_start=start, doc_end=end)[1]
        assert values[0] is start and values[1] is end
    assert len(runs) == 1
    other = torch.zeros(2, 30, dtype=torch.int32)   # another tensor of the same layout
    assert kernel(q, kv, kv, return_lse=True, doc_start=other, doc_end=end)[1][0] is other
    assert len(runs) == 1
    with pytest.raises(TypeError, match="doc_start must be torch.int32"):
        kernel(q, kv, kv, doc_start=start.long(), doc_end=end)
    with pytest.raises(ValueError, match=r"doc_end must have shape \(batch, seqlen_q\)"):
        kernel(q, kv, kv, doc_start=start, doc_end=end[:, :20].contiguous())
    with pytest.raises(ValueError, match="doc_end must be contiguous"):
        kernel(q, kv, kv, doc_start=start, doc_end=torch.zeros(30, 2, dtype=torch.int32).t())
    with pytest.raises(TypeError, match="missing mod arguments"):
        kernel(q, kv, kv, doc_start=start)
    with pytest.raises(TypeError, match="built for dtype=bf16"):
        kernel(q.half(), kv.half(), kv.half(), doc_start=start, doc_end=end)
    with pytest.raises(ValueError, match="built for head_dim=64"):
        wide, wide_kv = (torch.randn(*x.shape[:3], 128, dtype=torch.bfloat16) for x in (q, kv))
        kernel(wide, wide_kv, wide_kv, doc_start=start, doc_end=end)
    assert len(runs) == 7
    # A number's type is in the key: 3 passed, 3.0 is still refused for an int argument.
    window = kernelgen.load("flash_attn_window", head_dim=64, dtype="bf16")
    kv = torch.randn(2, 30, 2, 64, dtype=torch.bfloat16)
    assert window(q, kv, kv, return_lse=True, window_left=3, window_right=0)[1] == (3, 0)
    with pytest.raises(TypeError, match="window_left must be an int"):
        window(q, kv, kv, window_left=3.0, window_right=0)
