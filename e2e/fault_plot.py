"""One timeline PNG per fault: every request as a bar from its start to its end (green succeeded, red
failed), the fault's moments as vertical lines, and below it step lines of what the system reported
(replicas, condition states, health) over the same clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from e2e.load import RequestRecord

Series = Mapping[str, Sequence[tuple[float, float]]]  # name -> [(t, value)], drawn as steps


def plot_fault(path: Path, title: str, records: Sequence[RequestRecord], marks: Sequence[tuple[float, str]],
               panels: Sequence[tuple[str, Series]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1 + len(panels), 1, figsize=(11, 3.2 + 2.2 * len(panels)), sharex=True,
                             gridspec_kw={"height_ratios": [2.2] + [1] * len(panels)}, squeeze=False)
    axes = axes[:, 0]
    ordered = sorted(records, key=lambda r: r.start)
    for i, r in enumerate(ordered):
        axes[0].plot([r.start, r.end], [i, i], color="tab:green" if r.ok else "tab:red",
                     linewidth=1.6 if not r.ok else 0.8, solid_capstyle="butt")
    ok = sum(r.ok for r in ordered)
    axes[0].set_ylabel("request (by start)")
    axes[0].set_title(f"{len(ordered)} requests: {ok} succeeded (green), {len(ordered) - ok} failed or refused (red)",
                      fontsize=10)
    for ax, (ylabel, series) in zip(axes[1:], panels, strict=True):
        for name, points in series.items():
            if points:
                ax.step([t for t, _ in points], [v for _, v in points], where="post", label=name)
        ax.set_ylabel(ylabel)
        ax.legend(loc="upper left", fontsize=8)
    for ax in axes:
        for t, _ in marks:
            ax.axvline(t, color="black", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    top = axes[0].get_ylim()[1]
    for t, label in marks:
        axes[0].annotate(label, (t, top), xytext=(3, -12), textcoords="offset points", fontsize=8,
                         rotation=0, va="top")
    axes[-1].set_xlabel("time (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
