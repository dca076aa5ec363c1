"""The PNG of a `kernelgen bench` run: TFLOP/s against seqlen, a panel per (head dim, causal) and
a row of panels per pass, a line per system. matplotlib is imported only here and only when a
plot is drawn; without it plot_grid returns None and the caller says so.
"""
from __future__ import annotations

from pathlib import Path

LABELS = {"kernelgen": "kernelgen", "kg_sm80": "kernelgen (sm80 family)",
          "sdpa_flash": "SDPA flash (FA2)", "sdpa_cudnn": "SDPA cuDNN", "flex": "FlexAttention"}


def _seqlen_label(seqlen: int) -> str:
    return f"{seqlen // 1024}k" if seqlen >= 1024 and seqlen % 1024 == 0 else str(seqlen)


def panels(results: list[dict]) -> tuple[list[str], list[tuple[int, bool]]]:
    """The passes (rows of panels) and the (head_dim, causal) pairs (columns) in a run."""
    passes = [p for p in ("fwd", "bwd") if any(r["pass"] == p for r in results)]
    passes += sorted({r["pass"] for r in results} - set(passes))
    return passes, sorted({(r["head_dim"], bool(r["causal"])) for r in results})


def plot_grid(doc: dict, path) -> Path | None:
    """Draw the results of `doc` (bench.json's content) into the PNG `path`."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no backend or global state needed
    except ImportError:
        return None
    from kernelgen.bench import columns_of

    results = doc["results"]
    passes, pairs = panels(results)
    systems = columns_of(doc)
    figure = Figure(figsize=(4.2 * len(pairs), 3.6 * len(passes)), layout="constrained")
    axes = figure.subplots(len(passes), len(pairs), squeeze=False)
    for row_axes, direction in zip(axes, passes):
        for ax, (head_dim, causal) in zip(row_axes, pairs):
            rows = sorted((r for r in results if r["pass"] == direction
                           and r["head_dim"] == head_dim and bool(r["causal"]) == causal),
                          key=lambda r: r["seqlen"])
            for index, name in enumerate(systems):
                points = [(r["seqlen"], r["tflops"][name]) for r in rows if name in r["tflops"]]
                if points:  # a system keeps its colour in every panel, run or not
                    ax.plot(*zip(*points), marker="o", color=f"C{index % 10}",
                            label=LABELS.get(name, name))
            _decorate(ax, [r["seqlen"] for r in rows],
                      f"{direction} hd{head_dim} {'causal' if causal else 'non-causal'}")
    figure.suptitle(f"{doc.get('device', '')}: torch {doc.get('torch', '?')}, bf16, "
                    f"batch x seqlen = {doc.get('tokens', 16384)}, hidden 2048")
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path


def _decorate(ax, seqlens: list[int], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("seqlen")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, alpha=0.3)
    if not seqlens:
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
        return
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [_seqlen_label(s) for s in seqlens])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    if ax.lines:
        ax.legend(fontsize="small")
