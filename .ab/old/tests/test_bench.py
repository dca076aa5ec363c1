"""bench.py, bench_mods.py, bench_plot.py: FLOP and visible-pair counts, the modifiers'
FlexAttention versions against the reference, tables, the plot and the command line on CPU;
one tiny timed run of each on a GPU."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from kernelgen import bench, bench_mods, bench_plot
from kernelgen.cli import main as cli_main
from kernelgen.reference import attention_ref, causal_mask


def dense_window(seqlen_q, seqlen_k, left, right, causal):
    """The window mask element by element, from the spec's comment."""
    shift = seqlen_k - seqlen_q
    return torch.tensor([[(left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)
                          and (not causal or j <= i + shift)
                          for j in range(seqlen_k)] for i in range(seqlen_q)])


def dense_documents(ids, causal):
    """(batch, seqlen, seqlen): same document (and, causal, no later key)."""
    same = ids[:, :, None] == ids[:, None, :]
    return same & causal_mask(ids.shape[1], ids.shape[1], "cpu") if causal else same


def test_attention_flops():
    assert bench.attention_flops(2, 3, 5, 7, 64, False) == 4 * 2 * 3 * 5 * 7 * 64
    assert bench.attention_flops(2, 3, 5, 7, 64, True) == 2 * 2 * 3 * 5 * 7 * 64
    # The modifier bench's exact count agrees with the grid's on a full mask.
    assert bench_mods.masked_flops(2 * 5 * 7, 3, 64) == bench.attention_flops(2, 3, 5, 7, 64, False)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(37, 37), (20, 53), (53, 20), (1, 9), (64, 64)])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (5, 0), (3, 7), (-1, 4), (6, -1), (100, 100)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_pairs_match_a_dense_count(seqlen_q, seqlen_k, window, causal):
    expected = int(dense_window(seqlen_q, seqlen_k, *window, causal).sum())
    assert bench_mods.window_pairs(seqlen_q, seqlen_k, *window, causal) == expected


def test_plain_pairs_closed_forms():
    assert bench_mods.window_pairs(4096, 4096, -1, -1, False) == 4096 * 4096
    assert bench_mods.window_pairs(4096, 4096, -1, -1, True) == 4096 * 4097 // 2
    # Causal with seqlen_q > seqlen_k: the first rows see nothing (bottom-right alignment).
    assert bench_mods.window_pairs(10, 4, -1, -1, True) == 1 + 2 + 3 + 4


@pytest.mark.parametrize("causal", [False, True])
def test_document_pairs_match_a_dense_count(causal):
    lengths = bench_mods.document_lengths(batch=3, seqlen=97, documents=5, seed=1)
    assert all(sum(row) == 97 and len(row) == 5 and min(row) >= 1 for row in lengths)
    assert lengths[0] != lengths[1]  # each batch element has its own documents
    assert bench_mods.document_lengths(3, 97, 5, seed=1) == lengths  # reproducible
    ids = bench_mods.document_ids(lengths)
    assert ids.dtype == torch.int32 and ids.shape == (3, 97)
    expected = int(dense_documents(ids, causal).sum())
    assert bench_mods.document_pairs(lengths, causal) == expected


REFERENCE_MODS = {  # (score_mod, mask_mod) for attention_ref, written from the specs' comments
    "window": lambda case: (None, lambda b, h, i, j: dense_window(
        i.shape[2], j.shape[3], *bench_mods.WINDOW[case.causal], False)),
    "softcap": lambda case: (lambda s, *_: bench_mods.SOFTCAP * torch.tanh(s / bench_mods.SOFTCAP),
                             None),
    "alibi": lambda case: (lambda s, b, h, i, j: s - bench_mods.alibi_slopes(s.shape[1]).view(
        1, -1, 1, 1) * (i - j).abs().float(), None),
}


@pytest.mark.parametrize("mod", bench_mods.MODS)
@pytest.mark.parametrize("causal", [False, True])
def test_flex_versions_compute_the_modification(mod, causal, monkeypatch):
    """FlexAttention's score_mod and BlockMask of each case (eager, CPU) against the reference
    with the modification as the spec defines it; the case's visible-pair count against the
    reference mask."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(bench_mods, "WINDOW", {False: (17, 9), True: (23, 0)})  # shorter than N
    monkeypatch.setattr(bench_mods, "VARLEN_WINDOW", {False: (11, 6), True: (13, 0)})
    torch.manual_seed(0)
    batch, heads, seqlen, head_dim = 2, 4, 200, 64
    case = bench_mods.build_case(mod, causal, batch, heads, seqlen, head_dim, "cpu")
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim) * 3 for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's "use torch.compile" warning
        got = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             score_mod=case.score_mod, block_mask=case.block_mask).transpose(1, 2)
    if mod in ("document", "packed", "varlen", "varlen_window"):
        lengths = bench_mods.document_lengths(batch, seqlen, 2, seed=seqlen)
        ids = bench_mods.document_ids(lengths)
        score_mod, mask_mod = None, lambda b, h, i, j: (ids[:, None, :, None] == ids[:, None, None, :])
        if mod == "varlen_window":   # the same offsets: a window in global indices is the document's
            left, right = bench_mods.VARLEN_WINDOW[causal]
            same = mask_mod
            mask_mod = lambda b, h, i, j: same(b, h, i, j) & (j >= i - left) & (j <= i + right)
    else:
        score_mod, mask_mod = REFERENCE_MODS[mod](case)
    ref, _ = attention_ref(q, k, v, causal, score_mod=score_mod, mask_mod=mask_mod)
    assert (got - ref).abs().max().item() < 1e-4
    visible = torch.ones(batch, seqlen, seqlen, dtype=torch.bool)
    if causal:
        visible &= causal_mask(seqlen, seqlen, "cpu")
    if mask_mod is not None:
        b, h, i, j = (torch.arange(n).view(*[-1 if d == axis else 1 for d in range(4)])
                      for axis, n in enumerate((batch, 1, seqlen, seqlen)))
        visible = visible & mask_mod(b, h, i, j).expand(batch, 1, seqlen, seqlen)[:, 0]
    assert case.visible_pairs == int(visible.sum())
    assert case.plain_pairs == batch * (seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen)


def synthetic_doc() -> dict:
    results = []
    for direction in ("fwd", "bwd"):
        for head_dim in (64, 128):
            for causal in (False, True):
                for seqlen in (512, 1024, 4096):
                    tflops = {"kernelgen": 300.0 + seqlen / 100, "sdpa_flash": 250.0,
                              "sdpa_cudnn": 400.0, "flex": 200.0}
                    if direction == "fwd":
                        tflops["kg_sm80"] = 280.0
                    results.append({"pass": direction, "head_dim": head_dim, "causal": causal,
                                    "seqlen": seqlen, "batch": 16384 // seqlen, "heads": 2048 // head_dim,
                                    "tflops": tflops, "ms": {}})
    results[0]["errors"] = {"sdpa_cudnn": "RuntimeError: no kernel"}
    del results[0]["tflops"]["sdpa_cudnn"]
    return {"device": "NVIDIA H200", "torch": "2.13.0", "tokens": 16384,
            "systems": ["kernelgen", "kg_sm80", "sdpa_flash", "sdpa_cudnn", "flex"],
            "unavailable": {}, "results": results}


def test_summary_table():
    doc = synthetic_doc()
    lines = bench.summary(doc).splitlines()
    assert lines[0] == "summary: TFLOP/s on NVIDIA H200, ratios = kernelgen / peer"
    assert lines[1] == ("pass hd     mask    seqlen       kg  kg_sm80    flash    cudnn     flex"
                        "  kg/flash kg/cudnn  kg/flex")
    assert lines[2] == ("fwd  hd64   full       512    305.1    280.0    250.0        -    200.0"
                        "     1.22x        -    1.53x")
    assert len(lines) == 2 + len(doc["results"]) + 1
    assert lines[-1] == "  error fwd hd64 full 512 sdpa_cudnn: RuntimeError: no kernel"
    bwd = [line for line in lines if line.startswith("bwd  hd128  causal    4096")]
    assert bwd == ["bwd  hd128  causal    4096    341.0        -    250.0    400.0    200.0"
                   "     1.36x    0.85x    1.70x"]


def test_summary_of_an_old_json_takes_its_columns_from_the_rows():
    doc = {"device": "x", "results": [{"pass": "fwd", "head_dim": 128, "causal": True,
                                       "seqlen": 8192, "tflops": {"kernelgen": 500.0, "kg_sm90": 600.0}}]}
    assert bench.columns_of(doc) == ["kernelgen", "kg_sm90"]
    assert bench.summary(doc).splitlines()[1].split()[4:6] == ["kg", "kg_sm90"]


def test_mods_summary_marks_ratios_below_their_goals():
    row = {"pass": "fwd", "mod": "window", "label": "window(1024,0)", "causal": True,
           "seqlen": 4096, "density": 0.2, "tflops": {"kernelgen": 450.0, "plain": 500.0, "flex": 250.0},
           "ratios": {"kernelgen/plain": 0.9, "kernelgen/flex": 1.8}, "max_diff": 0.0078}
    slow = dict(row, ratios={"kernelgen/plain": 0.5, "kernelgen/flex": 1.2})
    skipped = {"pass": "bwd", "mod": "alibi", "label": "alibi", "causal": False, "seqlen": 8192,
               "density": 1.0, "tflops": {}, "ratios": {},
               "note": "skipped: kernelgen's modified kernel has no backward yet"}
    lines = bench_mods.mods_summary({"device": "H200", "results": [row, slow, skipped]}).splitlines()
    assert "kernelgen/plain >= 0.9" in lines[0] and "kernelgen/flex >= 1.5" in lines[0]
    assert lines[1].split() == ["pass", "modifier", "mask", "seqlen", "visible", "kernelgen",
                                "plain", "flex", "kg/plain", "kg/flex", "diff"]
    assert lines[2] == ("fwd  window(1024,0)      causal   4096   0.200    450.0    500.0    250.0"
                        "    0.90x     1.80x   7.8e-03")
    assert "0.50x*" in lines[3] and "1.20x*" in lines[3]
    assert lines[4].endswith("        -         -        -  skipped: kernelgen's modified kernel has "
                             "no backward yet")


def test_plot_from_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(synthetic_doc()))
    assert cli_main(["bench", "--plot", str(path)]) == 0
    png = tmp_path / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"saved {png}"
    assert out[-1].startswith("  error fwd hd64 full 512")  # the summary comes last


def test_plot_panels_and_one_pass_only(tmp_path):
    doc = synthetic_doc()
    assert bench_plot.panels(doc["results"]) == (["fwd", "bwd"],
                                                 [(64, False), (64, True), (128, False), (128, True)])
    doc["results"] = [r for r in doc["results"] if r["pass"] == "bwd"]
    assert bench_plot.plot_grid(doc, tmp_path / "bwd.png") == tmp_path / "bwd.png"
    assert (tmp_path / "bwd.png").stat().st_size > 1000


def test_without_matplotlib_a_note_and_no_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    assert bench.write_plot(synthetic_doc(), tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()
    assert capsys.readouterr().out == \
        "note: matplotlib is not installed (pip install kernelgen[plot]); no PNG written\n"


def test_plot_of_a_json_without_grid_results(tmp_path, capsys):
    path = tmp_path / "mods.json"
    path.write_text(json.dumps({"mods": ["window"], "results": synthetic_doc()["results"]}))
    assert bench.main(["--plot", str(path)]) == 1
    assert "holds no grid results" in capsys.readouterr().out


def test_arguments():
    opts = bench.build_parser().parse_args([])
    assert (opts.head_dims, opts.seqlens, opts.causal, opts.passes, opts.mods, opts.plot,
            opts.tokens, opts.out) == (None, None, "both", "fwd", None, None, 16384, "bench-results")
    assert bench.build_parser().parse_args(["--mods"]).mods == []
    opts = bench.build_parser().parse_args(["--mods", "window", "alibi", "--pass", "both",
                                            "--head-dims", "64", "128", "--seqlens", "4096"])
    assert (opts.mods, opts.passes, opts.head_dims, opts.seqlens) == (["window", "alibi"], "both",
                                                                      [64, 128], [4096])


def test_unknown_modifier_is_refused_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--mods", "window", "rope"])
    assert exit_info.value.code == 2
    assert "--mods: unknown modifier rope; allowed: window, softcap, alibi, document" in \
        capsys.readouterr().err


def test_help_names_the_plot_and_mods(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--plot FILE.json" in out and "--mods [NAME ...]" in out
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "--plot FILE.json: redraw the PNG" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
@pytest.mark.parametrize("times, expected", [
    ([1.0, 3.0], 2.0),                        # forward, forward + backward
    ([1.0, 0.9, 1.0, 1.5], 0.5),              # a difference below zero is timed again
    ([1.0, 1.0, 2.0, 1.9, 1.2, 1.2], None),   # never above the forward: an error, not a figure
])
def test_backward_time_is_a_positive_difference_or_an_error(times, expected, monkeypatch):
    script = iter(times)
    monkeypatch.setattr(bench, "time_ms", lambda fn: next(script))
    q = k = v = torch.randn(1, 4, 1, 8)
    if expected is None:
        with pytest.raises(RuntimeError, match="backward not measurable: .* in 3 tries"):
            bench.time_pass(lambda q, k, v: q * k * v, q, k, v, backward=True)
    else:
        assert bench.time_pass(lambda q, k, v: q * k * v, q, k, v, backward=True) == expected
    assert next(script, None) is None   # every scripted time was asked for


def test_no_gpu_nothing_to_time(capsys):
    assert cli_main(["bench", "--head-dims", "64"]) == 1
    assert capsys.readouterr().out == "kernelgen bench: no CUDA GPU here; nothing to time\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tiny_runs_on_the_gpu(tmp_path, capsys):
    args = ["--head-dims", "64", "--seqlens", "256", "--causal", "true", "--tokens", "1024",
            "--out", str(tmp_path)]
    assert bench.main([*args, "--pass", "both"]) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert {"kernelgen", "sdpa_flash", "flex"} <= set(doc["systems"])
    fwd, bwd = doc["results"]
    assert fwd["tflops"]["kernelgen"] > 0 and fwd["tflops"]["flex"] > 0, fwd.get("errors")
    assert bwd["tflops"]["kernelgen"] > 0 and "kg_sm80" not in bwd["tflops"]
    out = capsys.readouterr().out.splitlines()
    start = max(i for i, line in enumerate(out) if line.startswith("summary: "))  # printed last
    assert out[start + 2].startswith("fwd  hd64   causal     256")
    assert out[start + 3].startswith("bwd  hd64   causal     256")
    assert (tmp_path / "bench.png").is_file()

    assert bench.main([*args, "--mods", "window", "document", "--pass", "both"]) == 0
    mods = json.loads((tmp_path / "mods.json").read_text())["results"]
    forward = [row for row in mods if row["pass"] == "fwd"]
    assert len(forward) == 2 and all(set(r["tflops"]) == {"kernelgen", "plain", "flex"} for r in forward)
    assert all(r["max_diff"] < 0.05 for r in forward), [r.get("errors") for r in forward]
    backward = [row for row in mods if row["pass"] == "bwd"]   # both have gradients
    assert len(backward) == 2 and all("note" not in row for row in backward)
    assert all(row["tflops"].get("kernelgen", 0) > 0 and row["tflops"].get("flex", 0) > 0
               for row in backward), [row.get("errors") for row in backward]
