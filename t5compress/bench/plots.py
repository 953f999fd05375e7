"""The report's PNGs (matplotlib, Agg): latency vs accuracy with the Pareto front, sizes, latency vs batch size.

The accuracy axis is exact match on --data; without --data there are no references, so it is the greedy agreement
with the first variant (on the generated texts), and the axis says so.
"""

from __future__ import annotations

from pathlib import Path

from t5compress.bench.compare import cell_of, valid

COLORS = {"ours": "tab:blue", "baseline": "tab:gray", "peer": "tab:orange"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reference_cell(r: dict) -> tuple[int, int, int]:
    """The cell the Pareto plot uses: the first thread count, the smallest batch, greedy (else the first beam)."""
    s = r["settings"]
    return s["threads"][0], min(s["batch_sizes"]), 1 if 1 in s["beams"] else s["beams"][0]


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Names of the points no other point beats on both latency (lower) and accuracy (higher)."""
    front = []
    for name, ms, acc in points:
        if not any((m <= ms and a >= acc) and (m < ms or a > acc) for _, m, a in points):
            front.append(name)
    return front


def accuracy_axis(r: dict) -> tuple[str, str]:
    """(key in entry['accuracy'], axis label)."""
    if r["inputs"]["source"] != "generated sentences":
        return "exact_match", "exact match % on the eval data"
    return "agreement", f"greedy agreement with {r['first']} (no --data: generated texts)"


def write_plots(r: dict, out: Path) -> list[str]:
    plt = _plt()
    files = []
    for name, fn in (("pareto.png", _pareto), ("sizes.png", _sizes), ("latency_vs_batch.png", _batch)):
        fig = fn(r, plt)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def _pareto(r: dict, plt):
    key, label = accuracy_axis(r)
    cell = reference_cell(r)
    points = []
    for e in r["entries"]:
        c, acc = cell_of(e, cell), e.get("accuracy", {}).get(key)
        if valid(c) and acc is not None:
            points.append((e["name"], c["p50_ms"], 100 * acc if key == "agreement" else acc))
    front = set(pareto_front(points))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    owner = {e["name"]: e["owner"] for e in r["entries"]}
    for i, (name, ms, acc) in enumerate(sorted(points, key=lambda p: p[1])):
        ax.scatter(ms, acc, s=70 if name in front else 35, color=COLORS[owner[name]],
                   edgecolors="black" if name in front else "none", zorder=3)
        ax.annotate(name, (ms, acc), textcoords="offset points", xytext=(5, 4 + 10 * (i % 3)), fontsize=8)
    line = sorted((ms, acc) for name, ms, acc in points if name in front)
    if line:
        ax.plot([x for x, _ in line], [y for _, y in line], "--", color="black", lw=1, label="Pareto front")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel(f"p50 ms per call ({cell[0]} thread, batch {cell[1]}, "
                  f"{'greedy' if cell[2] == 1 else f'beam {cell[2]}'}, {r['settings']['output_tokens']} tokens)")
    ax.set_ylabel("agreement %" if key == "agreement" else "exact match %")
    ax.margins(x=0.08, y=0.25)  # room for the labels inside the axes, clear of the title
    ax.set_title(f"Latency vs accuracy: {label} (ringed: the Pareto front)", fontsize=9)
    ax.grid(alpha=0.3)
    return fig


def _sizes(r: dict, plt):
    entries = [e for e in r["entries"] if e["size_bytes"] is not None]  # a Triton URL has no files here
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(entries) + 1.5))
    names = [e["name"] for e in entries][::-1]
    mb = [e["size_bytes"] / 1e6 for e in entries][::-1]
    ax.barh(names, mb, color=[COLORS[e["owner"]] for e in entries][::-1])
    for y, v in enumerate(mb):
        ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    ax.set_xlabel("MB on disk (the model files each engine loads)")
    ax.set_title("Size on disk", fontsize=9)
    return fig


def _batch(r: dict, plt):
    s = r["settings"]
    threads, beams = s["threads"][0], (1 if 1 in s["beams"] else s["beams"][0])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for e in r["entries"]:
        pts = [(b, cell_of(e, (threads, b, beams))) for b in s["batch_sizes"]]
        pts = [(b, c["p50_ms"]) for b, c in pts if valid(c)]
        if pts:
            style = {"ours": "o-", "baseline": "s:", "peer": "^--"}[e["owner"]]
            ax.plot([b for b, _ in pts], [m for _, m in pts], style, label=e["name"], alpha=0.9)
    ax.set_xlabel("batch size")
    ax.set_ylabel("p50 ms per call")
    ax.set_xticks(s["batch_sizes"])
    ax.set_title(f"Latency vs batch size: ours solid, peers dashed, PyTorch dotted\n{threads} thread, "
                 f"{'greedy' if beams == 1 else f'beam {beams}'}, {s['output_tokens']} tokens out", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig
