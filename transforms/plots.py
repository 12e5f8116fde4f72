"""The dataset's plots as PNG bytes: label counts per slot and error rows by kind, as bar charts (matplotlib, Agg
backend, imported only when a plot is drawn). Pure functions of the counts (transforms/dataset_stats.py)."""

from __future__ import annotations

import io

MAX_BARS = 20  # values shown per slot: the most frequent; the rest are summed into one bar


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def top_counts(counts: dict[str, int], max_bars: int = MAX_BARS) -> list[tuple[str, int]]:
    """The `max_bars` largest counts (ties by value), the rest summed as '(N others)'."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown, rest = ranked[:max_bars], ranked[max_bars:]
    if rest:
        shown.append((f"({len(rest)} others)", sum(n for _, n in rest)))
    return shown


def bar_charts_png(charts: dict[str, dict[str, int]], *, title: str, xlabel: str = "images") -> bytes:
    """One horizontal bar chart per entry of `charts` ({chart title: {bar label: count}}), stacked, as PNG."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    names = list(charts) or ["(none)"]
    heights = [max(1, len(top_counts(charts.get(n, {})))) for n in names]
    fig, axes = plt.subplots(len(names), 1, figsize=(7, 1.2 + 0.28 * sum(heights) + 0.6 * len(names)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        bars = top_counts(charts.get(name, {}))
        labels = [label if len(label) <= 40 else label[:39] + "\u2026" for label, _ in bars][::-1]
        values = [n for _, n in bars][::-1]
        ax.barh(range(len(values)), values, color="#4477aa")
        ax.set_yticks(range(len(values)), labels, fontsize=8)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v}", va="center", fontsize=8)
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xlabel(xlabel, fontsize=8)
        ax.margins(x=0.15)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no 0.5 ticks
        if not values:
            ax.text(0.5, 0.5, "none", transform=ax.transAxes, ha="center", va="center")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def labels_png(labels: dict[str, dict[str, int]]) -> bytes:
    return bar_charts_png({f"slot {slot}" if slot else "(no labels)": counts for slot, counts in labels.items()},
                          title="Images per label")


def errors_png(errors_by_kind: dict[str, int]) -> bytes:
    return bar_charts_png({"error rows by kind": errors_by_kind}, title="Errors", xlabel="rows")
