"""One timeline PNG per fault: every request as a bar from its start to its end (green succeeded, red
failed or refused), the fault's moments as numbered vertical lines, and below it step lines of what
the system reported (replicas, condition states, health) over the same clock. Lines of one panel are
drawn a little apart (a few hundredths) so equal values do not hide each other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from e2e.load import RequestRecord

Series = Mapping[str, Sequence[tuple[float, float]]]  # name -> [(t, value)], drawn as steps
APART = 0.04


def plot_fault(path: Path, title: str, records: Sequence[RequestRecord], marks: Sequence[tuple[float, str]],
               panels: Sequence[tuple[str, Series]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finished = sorted((r for r in records if r.end > r.start), key=lambda r: r.start)
    rows = ([("requests", None)] if finished else []) + list(panels)
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.4 + 2.3 * len(rows)), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [2.2 if s is None else 1 for _, s in rows]})
    axes = axes[:, 0]
    for ax, (ylabel, series) in zip(axes, rows, strict=True):
        if series is None:
            for i, r in enumerate(finished):
                ax.plot([r.start, r.end], [i, i], color="tab:green" if r.ok else "tab:red",
                        linewidth=2.0 if not r.ok else 0.8, solid_capstyle="butt")
            ok = sum(r.ok for r in finished)
            ax.set_ylabel("request (by start)")
            ax.set_title(f"{len(finished)} requests: {ok} succeeded (green), {len(finished) - ok} failed or "
                         "refused (red)", fontsize=10)
            continue
        for i, (name, points) in enumerate(series.items()):
            if points:
                ax.step([t for t, _ in points], [v + i * APART for _, v in points], where="post", label=name)
        ax.set_ylabel(ylabel)
        ax.legend(loc="center left", fontsize=8, bbox_to_anchor=(1.0, 0.5))
    for ax in axes:
        for t, _ in marks:
            ax.axvline(t, color="black", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    for n, (t, _) in enumerate(marks, 1):
        axes[0].annotate(str(n), (t, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                         textcoords="offset points", fontsize=9, fontweight="bold")
    legend = "   ".join(f"{n}: {label} ({t:.1f} s)" for n, (t, label) in enumerate(marks, 1))
    axes[-1].set_xlabel(f"time (s)\n{legend}")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
