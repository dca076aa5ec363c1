"""spec.py: loading the shipped spec, every validation error, variants and default configs."""
from __future__ import annotations

import os

import pytest

from kernelgen.spec import ARCHS, Config, SpecError, Variant, load_spec, shipped_specs


@pytest.fixture(scope="module")
def fwd():
    return load_spec("flash_attn_fwd")


# ---- the shipped spec --------------------------------------------------------------------------

def test_shipped_spec_loads(fwd):
    assert "flash_attn_fwd" in shipped_specs()
    assert fwd.name == fwd.entry == "flash_attn_fwd"
    assert fwd.archs == ("sm_80", "sm_86", "sm_89", "sm_90")
    assert [p.name for p in fwd.params] == ["head_dim", "dtype", "causal"]
    assert fwd.params[2].values == (False, True) and fwd.params[2].default is False
    assert [name for name, _ in fwd.space] == ["block_m", "block_n", "warps", "stages", "grid_order"]
    assert fwd.template.name == "flash_attn_fwd.cu.j2" and fwd.template.parent.name == "templates"
    assert len(fwd.content_hash) == 64
    arg = {a.name: a for a in fwd.args}
    assert (arg["q"].ctype, arg["q_stride_b"].ctype, arg["batch"].ctype,
            arg["softmax_scale"].ctype) == ("const elem_t*", "long long", "int", "float")


def test_load_by_path_is_the_same_spec(fwd):
    assert load_spec(fwd.path) is fwd
    assert load_spec(str(fwd.path)) is fwd


def test_unknown_shipped_name_lists_the_shipped_ones():
    with pytest.raises(SpecError, match="unknown spec 'flash_atn'.*allowed: .*flash_attn_fwd"):
        load_spec("flash_atn")
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec("does/not/exist.yaml")


@pytest.mark.parametrize("arch", list(ARCHS)[:4])
def test_twenty_variants_per_arch(fwd, arch):
    variants = fwd.variants([arch])
    assert len(variants) == len(set(variants)) == 5 * 2 * 2
    assert {v.arch for v in variants} == {arch}
    assert len(fwd.variants()) == 20 * len(fwd.archs)


def test_default_config_is_valid_on_every_arch(fwd):
    for variant in fwd.variants():
        config = fwd.default_config(variant)
        assert fwd.violations(variant, config) == [], (variant, config)
        env = fwd.environment(variant, config)
        assert env["smem_bytes"] <= ARCHS[variant.arch].max_smem


def test_large_head_dim_falls_back_to_what_fits_sm86(fwd):
    variant = fwd.variant("sm_86", head_dim=256)
    rule_config = fwd.defaults[-1][1]  # the `when: true` rule: too much smem for sm_86
    assert fwd.violations(variant, rule_config) == ["smem_bytes <= max_smem"]
    config = fwd.default_config(variant)
    assert fwd.environment(variant, config)["smem_bytes"] <= 101376
    assert config == fwd.valid_configs(variant)[0]
    # On sm_80 the same rule fits, so it is taken.
    assert fwd.default_config(fwd.variant("sm_80", head_dim=256)) == rule_config


def test_environment_keeps_param_types(fwd):
    variant = fwd.variant("sm_90", head_dim=64, dtype="fp16", causal=True)
    env = fwd.environment(variant, fwd.default_config(variant))
    assert env["causal"] is True and env["dtype"] == "fp16" and env["head_dim"] == 64
    assert env["arch_number"] == 90 and env["max_smem"] == 232448
    assert env["rows_per_warp"] == env["block_m"] // env["warps"]
    assert list(env)[:3] == ["head_dim", "dtype", "causal"]


def test_slugs(fwd):
    variant = fwd.variant(head_dim=128, dtype="bf16", causal=False)
    assert variant.slug == "head_dim128_dtypebf16_causal0"
    assert variant["dtype"] == "bf16" and variant.as_dict()["causal"] is False
    config = fwd.parse_config({"stages": 2, "warps": 4, "block_n": 64, "block_m": 128, "grid_order": 0})
    assert config.slug == "block_m128_block_n64_warps4_stages2_grid_order0"
    assert config["warps"] == 4 and config == Config((("block_m", 128), ("block_n", 64),
                                                      ("warps", 4), ("stages", 2), ("grid_order", 0)))


def test_variant_defaults_and_arch(fwd):
    variant = fwd.variant()
    assert variant == Variant("flash_attn_fwd", "sm_80",
                              (("head_dim", 128), ("dtype", "bf16"), ("causal", False)))
    assert fwd.variant("sm_89").arch == "sm_89"


@pytest.mark.parametrize("call, fragment", [
    (dict(head_dim=100),
     "params.head_dim: value 100 is not allowed; allowed: 64, 96, 128, 192, 256"),
    (dict(headdim=128), "params: unknown param 'headdim'; allowed: head_dim, dtype, causal"),
    (dict(dtype="bf17"), "params.dtype: value 'bf17' is not allowed; allowed: fp16, bf16"),
    (dict(causal=1), "params.causal: value 1 is not allowed; allowed: false, true"),
    (dict(head_dim=True), "params.head_dim: value True is not allowed"),
    (dict(arch="sm_90a"), "archs: arch 'sm_90a' is not one of this spec's archs"),
])
def test_variant_rejects(fwd, call, fragment):
    with pytest.raises(SpecError) as info:
        fwd.variant(**call)
    assert "flash_attn_fwd.yaml" in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("values, fragment", [
    ({"block_m": 128, "block_n": 64, "warps": 4}, "config.stages: missing"),
    ({"block_m": 128, "block_n": 64, "warps": 4, "stages": 2, "x": 1}, "config.x: not a key"),
    ({"block_m": 100, "block_n": 64, "warps": 4, "stages": 2}, "config.block_m: an integer (100)"),
    ({"block_m": 128, "block_n": 64, "warps": 4, "stages": True}, "config.stages: a boolean"),
])
def test_parse_config_rejects(fwd, values, fragment):
    with pytest.raises(SpecError, match="allowed|missing") as info:
        fwd.parse_config(values)
    assert fragment in str(info.value)


# ---- the toy spec: default rules and caching --------------------------------------------------

def test_toy_defaults_follow_rule_order(write_spec):
    spec = load_spec(write_spec())
    assert spec.template == write_spec().parent / "toy.cu.j2"  # beside a user's spec

    def pick(**params):
        return spec.default_config(spec.variant(**params)).as_dict()

    assert pick(width=64, fast=True) == {"block": 64, "warps": 8}   # first rule wins
    assert pick(width=32, fast=True) == {"block": 32, "warps": 8}   # first rule's `when` fails
    assert pick(width=32) == {"block": 16, "warps": 4}              # no rule: first valid config


def test_tune_skip_leaves_valid_configs_out_of_the_search(write_spec):
    def skip_one(doc):
        doc["tune"]["skip"] = ["block == 32 and warps == 8"]
    spec = load_spec(write_spec(skip_one))
    variant = spec.variant(width=32)
    skipped = spec.parse_config({"block": 32, "warps": 8})
    assert skipped in spec.valid_configs(variant) and not spec.violations(variant, skipped)
    assert skipped not in spec.tuned_configs(variant)
    assert len(spec.tuned_configs(variant)) == len(spec.valid_configs(variant)) - 1
    assert load_spec(write_spec()).tuned_configs(variant) == spec.valid_configs(variant)
    with pytest.raises(SpecError, match=r"tune\.skip\[0\].*unknown name 'blocks'"):
        load_spec(write_spec(lambda doc: doc["tune"].update(skip=["blocks == 64"])))


def test_toy_default_rule_that_does_not_fit_the_arch_is_skipped(write_spec):
    def widen_first_rule(doc):
        doc["tune"]["defaults"][0]["when"] = "width >= 64"
    spec = load_spec(write_spec(widen_first_rule))

    def pick(arch, **params):
        return spec.default_config(spec.variant(arch, width=256, **params)).as_dict()

    # The first rule's block=64 needs 128*256*4 = 128 KiB of smem: fits sm_80, not sm_86.
    assert pick("sm_80", fast=True) == {"block": 64, "warps": 8}
    assert pick("sm_86", fast=True) == {"block": 32, "warps": 8}   # the next rule
    assert pick("sm_86", fast=False) == {"block": 16, "warps": 4}  # no rule: first valid config


def test_no_config_fits(write_spec):
    spec = load_spec(write_spec(lambda d: d["tune"]["constraints"].append("block > 1000")))
    with pytest.raises(SpecError, match=r"toy.yaml: tune: no config of the tune space fits "
                                        r"width64_flavorplain_fast0 on sm_80 \(max_smem "
                                        r"166912\); constraints: .*; block > 1000"):
        spec.default_config(spec.variant())


def test_cache_reloads_on_change(write_spec):
    path = write_spec()
    first = load_spec(path)
    assert load_spec(path) is first
    path.write_text(path.read_text().replace("A toy kernel", "A changed toy kernel"))
    second = load_spec(path)
    assert second.description.startswith("A changed") and second.content_hash != first.content_hash
    template = second.template
    template.write_text(template.read_text() + "// more\n")
    os.utime(template, ns=(0, 0))  # even an older mtime counts: the key is a stamp, not an age
    assert load_spec(path).content_hash != second.content_hash


# ---- every validation error names the file, the key and what is allowed ---------------------

def _set(*keys, value):
    def mutate(doc):
        target = doc
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


def _delete(*keys):
    def mutate(doc):
        target = doc
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return mutate


BAD = {
    "unknown top key": (_set("extend", value="x"), "extend: unknown key; allowed: name, entry"),
    "unknown base spec": (_set("extends", value="nonexistent_spec"),
                          "extends: unknown spec 'nonexistent_spec'"),
    "unknown nested key": (_set("params", "width", "choices", value=[1]),
                           "params.width.choices: unknown key; allowed: values, default"),
    "unknown launch key": (_set("launch", "cluster", value=[1, 1, 1]), "launch.cluster: unknown"),
    "missing top key": (_delete("entry"), "entry: missing required key"),
    "missing nested key": (_delete("launch", "grid"), "launch.grid: missing required key"),
    "missing space": (_delete("tune", "space"), "tune.space: missing required key"),
    "wrong type": (_set("archs", value="sm_80"), "archs: expected a list, got a string"),
    "params not mapping": (_set("params", value=[1]), "params: expected a mapping, got a list"),
    "bool where int": (_set("tune", "space", "block", value=[16, True]),
                       "tune.space.block[1]: expected an integer, got a boolean (true)"),
    "string where int": (_set("tune", "space", "warps", value=["4"]),
                         "tune.space.warps[0]: expected an integer, got a string"),
    "default not in values": (_set("params", "width", "default", value=48),
                              "params.width.default: an integer (48) is not among the "
                              "values; allowed: 32, 64, 256"),
    "bool default for int": (_set("params", "fast", "default", value=0),
                             "params.fast.default: an integer (0) is not among the values; "
                             "allowed: false, true"),
    "empty values": (_set("params", "width", "values", value=[]),
                     "params.width.values: empty list"),
    "empty space": (_set("tune", "space", "block", value=[]), "tune.space.block: empty list"),
    "duplicate value": (_set("tune", "space", "block", value=[16, 16]),
                        "tune.space.block[1]: value 16 is given twice"),
    "mixed value types": (_set("params", "width", "values", value=[32, "wide"]),
                          "params.width.values[1]: a string (wide) mixed with an integer"),
    "float value": (_set("params", "width", "values", value=[0.5]),
                    "params.width.values[0]: a number (0.5) is not a param value; "
                    "allowed: integers"),
    "duplicate arg": (lambda d: d["args"].append({"name": "n", "type": "i64"}),
                      "args[3].name: 'n' is already defined at args[1].name"),
    "arg type": (_set("args", 1, "type", value="int"),
                 "args[1].type: unknown arg type 'int'; allowed: ptr, i32, i64, f32"),
    "arg name": (_set("args", 0, "name", value="x-ptr"), "args[0].name: expected an identifier"),
    "arg shadows param": (_set("args", 0, "name", value="width"),
                          "args[0].name: 'width' is already defined at params.width"),
    "bad arch": (_set("archs", value=["sm_80", "sm_75"]),
                 "archs[1]: unknown arch 'sm_75'; allowed: sm_80, sm_86, sm_89, sm_90, sm_90a"),
    "bad name": (_set("name", value="toy-kernel"), "name: expected an identifier"),
    "bad expression": (_set("tune", "constraints", 0, value="smem <="),
                       "tune.constraints[0]: syntax error in 'smem <='"),
    "forbidden call": (_set("derived", "tile", value="__import__('os').getpid()"),
                       "derived.tile: call of"),
    "attribute": (_set("launch", "smem", value="smem.real"), "launch.smem: attribute not allowed"),
    "unknown name": (_set("tune", "constraints", 1, value="blok <= width"),
                     "tune.constraints[1]: unknown name 'blok' in 'blok <= width'; allowed: "
                     "arch_number, block, block_sparse, fast, flavor, kv_blocks_vary, kv_ranged,"
                     " max_smem, smem, tile, warps, width"),
    "derived uses a later one": (_set("derived", "tile", value="smem // 4"),
                                 "derived.tile: unknown name 'smem'"),
    "launch uses a pointer": (_set("launch", "grid", 0, value="x"),
                              "launch.grid[0]: unknown name 'x'"),
    "constraint uses an arg": (_set("tune", "constraints", 0, value="n > 0"),
                               "tune.constraints[0]: unknown name 'n'"),
    "derived shadows param": (_set("derived", "width", value="1"),
                              "derived.width: 'width' is already defined at params.width"),
    "space shadows param": (_set("tune", "space", "width", value=[1]),
                            "tune.space.width: 'width' is already defined at params.width"),
    "reserved name": (_set("params", "max", value={"values": [1]}),
                      "params.max: 'max' is a reserved name"),
    "context name": (_set("derived", "arch", value="1"), "derived.arch: 'arch' is a reserved name"),
    "default config extra key": (_set("tune", "defaults", 0, "config", "stages", value=2),
                                 "tune.defaults[0].config.stages: not a key of the tune space; "
                                 "allowed: block, warps"),
    "default config missing key": (_set("tune", "defaults", 1, "config", value={"block": 32}),
                                   "tune.defaults[1].config.warps: missing"),
    "default config bad value": (_set("tune", "defaults", 0, "config", "block", value=48),
                                 "tune.defaults[0].config.block: an integer (48) is not in the "
                                 "tune space; allowed: 16, 32, 64"),
    "default rule key": (_set("tune", "defaults", 0, "if", value="true"),
                         "tune.defaults[0].if: unknown key; allowed: config, when"),
    "grid of 2": (_set("launch", "grid", value=["1", "1"]),
                  "launch.grid: expected a list of 3 expressions (x, y, z), got 2"),
    "block not list": (_set("launch", "block", value="warps * 32"),
                       "launch.block: expected a list, got a string"),
    "yaml bool expression": (_set("tune", "defaults", 0, "when", value=True),
                             "tune.defaults[0].when: expected an expression in a string, "
                             "got a boolean"),
}


@pytest.mark.parametrize("mutate, fragment", BAD.values(), ids=BAD.keys())
def test_validation_errors(write_spec, mutate, fragment):
    path = write_spec(mutate)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert fragment in message, message


@pytest.mark.parametrize("text, fragment", [
    ("name: a\nname: b\n", "line 2: key 'name' is given twice"),
    ("name: [a\n", "line 2"),
    ("- just\n- a list\n", "<top level>: expected a mapping, got a list"),
    ("", "<top level>: expected a mapping, got nothing (null)"),
])
def test_yaml_level_errors(write_spec, text, fragment):
    path = write_spec(text=text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: ") and fragment in str(info.value)


def test_a_mods_spec_put_onto_another_base():
    """The same modifiers on the backward or the Hopper forward: that base's args, space and
    template, the child's mods (expressions still pointing at its file and lines), no child tune."""
    from kernelgen.spec import load_spec

    softcap = load_spec("flash_attn_softcap")
    onto = load_spec("flash_attn_softcap", onto="flash_attn_fwd_sm90")
    base = load_spec("flash_attn_fwd_sm90")
    assert onto.name == "flash_attn_softcap__flash_attn_fwd_sm90" and onto.entry == base.entry
    assert [a.name for a in onto.args] == [a.name for a in base.args] + ["softcap"]
    assert onto.space == base.space and onto.defaults == base.defaults
    assert onto.template == base.template
    assert onto.mods.score_mod == softcap.mods.score_mod   # same text, file and line
    assert onto.content_hash not in (softcap.content_hash, base.content_hash)
    assert load_spec("flash_attn_softcap", onto="flash_attn_fwd_sm90") is onto   # cached
    with pytest.raises(SpecError, match="only a spec that extends another"):
        load_spec("flash_attn_fwd", onto="flash_attn_bwd")


def test_a_mods_spec_put_on_a_block_mask():
    """load_spec(block_mask=True): the mods with block_sparse on (the block mask's list arguments
    after the mod arguments), named `<spec>_bm` with a hash of its own, where the file's mods are
    not block-sparse already; load_named resolves the names the tuning DB keeps."""
    from kernelgen.spec import BLOCK_SPARSE_ARGS, load_named

    packed = load_spec("flash_attn_packed", onto="flash_attn_bwd_sm90")
    on_mask = load_spec("flash_attn_packed", onto="flash_attn_bwd_sm90", block_mask=True)
    assert on_mask.name == "flash_attn_packed_bm__flash_attn_bwd_sm90"
    assert on_mask.mods.block_sparse and on_mask.mods.kv_range == packed.mods.kv_range
    assert [a.name for a in on_mask.args] == ([a.name for a in packed.args]
                                              + [a.name for a in BLOCK_SPARSE_ARGS])
    assert on_mask.content_hash != packed.content_hash
    assert load_named(on_mask.name) is on_mask and load_named(packed.name) is packed
    assert load_named("flash_attn_packed_bm").name == "flash_attn_packed_bm"
    document = load_spec("flash_attn_document", onto="flash_attn_bwd_sm90")
    same = load_spec("flash_attn_document", onto="flash_attn_bwd_sm90", block_mask=True)
    assert same.name == document.name and same.content_hash == document.content_hash
    with pytest.raises(SpecError, match="only a spec with a mods.mask_mod"):
        load_spec("flash_attn_softcap", block_mask=True)
    with pytest.raises(SpecError, match="only a spec that extends another"):
        load_spec("flash_attn_fwd", block_mask=True)
    with pytest.raises(SpecError, match="unknown spec 'no_such_spec'"):
        load_named("no_such_spec_bm")
    with pytest.raises(SpecError, match="only a spec with a mods.mask_mod"):
        load_named("flash_attn_softcap_bm__flash_attn_bwd_sm90")
