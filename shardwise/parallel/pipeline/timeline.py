"""Timeline pictures of a pipeline step: one row per stage, a box per action, idle time hatched.

Works for simulated and measured timelines alike (`simulate.Timeline`). Uses matplotlib's
object API with the Agg canvas (no pyplot, no display, no global figure state).
"""

from __future__ import annotations

from pathlib import Path

from shardwise.parallel.pipeline.schedules import Op
from shardwise.parallel.pipeline.simulate import Timeline

# Forward in blues, backward in oranges; later chunks alternate darker/lighter shades so that
# neighbouring chunks stay distinguishable.
_FORWARD = ["#3b75af", "#8ab6dc", "#1b466f", "#b9d3ea"]
_BACKWARD = ["#e1812c", "#f5b77c", "#9c4a0c", "#f9d3ae"]
_IDLE = "#ececec"
_TEXT_DARK, _TEXT_LIGHT = "#111111", "#ffffff"


def _color(op: Op, chunk: int) -> str:
    palette = _FORWARD if op is Op.FORWARD else _BACKWARD
    return palette[chunk % len(palette)]


def _text_color(fill: str) -> str:
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return _TEXT_DARK if 0.299 * r + 0.587 * g + 0.114 * b > 150 else _TEXT_LIGHT


def default_title(timeline: Timeline) -> str:
    t = timeline
    name = t.name or "schedule"
    return (f"{name}: P={t.num_stages}, M={t.num_microbatches}, V={t.virtual_stages}  |  "
            f"bubble {float(t.bubble_fraction):.1%} of stage time")


def draw_timeline(timeline: Timeline, path: str | Path | None = None, *, title: str | None = None,
                  time_unit: str = "", dpi: int = 120):
    """Draw ``timeline``; write a PNG to ``path`` when given. Returns the matplotlib Figure.

    Boxes are labelled ("F3", "B3.1") when the label fits. The hatched band behind each row spans
    the whole step, so what stays visible of it is that stage's bubble.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    t = timeline
    origin, span = float(t.start), float(t.makespan) or 1.0
    # Wide enough that the shortest box holds the longest label, within 8..24 inches; a smaller
    # font when that is not enough.
    shortest = min((float(r.end - r.start) for r in t.records if r.end > r.start), default=span)
    longest_label = max(len(str(r.action)) for r in t.records)

    def needed_width(size: float) -> float:
        return span * ((longest_label * size * 0.62 * dpi / 72 + 8) / shortest) / dpi / 0.88

    fontsize = 8.0 if needed_width(8.0) <= 24.0 or t.num_stages <= 2 else 6.5
    width_in = min(max(8.0, needed_width(fontsize)), 24.0)
    height_in = 1.35 + 0.5 * t.num_stages
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    row_h = 0.8
    ax.set_xlim(-0.005 * span, span * 1.005)
    ax.set_ylim(-0.6, t.num_stages - 0.4)
    ax.invert_yaxis()  # stage 0 on top, as the data flows downwards
    fig.subplots_adjust(left=0.07 if width_in > 12 else 0.1, right=0.98, top=1 - 0.62 / height_in,
                        bottom=0.78 / height_in)
    # Width of one time unit in pixels, to decide which labels fit in their boxes.
    axes_px = ax.get_position().width * width_in * dpi
    px_per_time = axes_px / (span * 1.01)
    char_px = fontsize * 0.62 * dpi / 72

    for stage in range(t.num_stages):
        ax.broken_barh([(0.0, span)], (stage - row_h / 2, row_h), facecolors=_IDLE, edgecolor="#bbbbbb",
                       hatch="////", linewidth=0.0)
        for r in t.stage_records(stage):
            start, dur = float(r.start) - origin, float(r.end - r.start)
            fill = _color(r.action.op, r.action.chunk)
            ax.broken_barh([(start, dur)], (stage - row_h / 2, row_h), facecolors=fill, edgecolor="white",
                           linewidth=0.6)
            label = str(r.action)
            if dur * px_per_time >= len(label) * char_px + 4:
                ax.text(start + dur / 2, stage, label, ha="center", va="center", fontsize=fontsize,
                        color=_text_color(fill))

    ax.set_yticks(range(t.num_stages))
    ax.set_yticklabels([f"stage {s}" for s in range(t.num_stages)])
    ax.set_xlabel(f"time ({time_unit})" if time_unit else "time")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title if title is not None else default_title(t), fontsize=10, loc="left")

    chunks = range(t.virtual_stages)
    handles = [Patch(facecolor=_color(Op.FORWARD, v), label=f"forward{f' chunk {v}' if t.virtual_stages > 1 else ''}")
               for v in chunks]
    handles += [Patch(facecolor=_color(Op.BACKWARD, v), label=f"backward{f' chunk {v}' if t.virtual_stages > 1 else ''}")
                for v in chunks]
    handles.append(Patch(facecolor=_IDLE, edgecolor="#bbbbbb", hatch="////", label="idle (bubble)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    if path is not None:
        fig.savefig(str(path))
    return fig
