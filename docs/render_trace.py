"""Draw a cudafut trace (``cudafut.trace("trace.json")``) as a PNG timeline.

From the repository root, without a GPU (needs matplotlib)::

    python docs/render_trace.py docs/trace-pipeline.json            # writes docs/trace-pipeline.png
    python docs/render_trace.py trace.json -o out.png --from 2 --to 30

One row per track, as Perfetto shows them: the host's threads, each waiter
under its thread (spins, sleeps, wake-ups), the awaits (one lane each while
they overlap), and each GPU stream. Ranges are bars, instants ticks, flows
arrows: black for ``then()`` parent to child, orange from GPU work to the
wake-up that saw it done. It reads the Chrome trace-event JSON any cudafut
trace is written in, and nothing else: it is a picture for the docs, not a
viewer (open the file in https://ui.perfetto.dev for that).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: Bar colours by event category (the ``cat`` cudafut writes).
COLOURS = {
    "gpu": "#4c72b0",
    "then": "#55a868",
    "submit": "#55a868",
    "callback": "#8cc084",
    "future": "#9a9a9a",
    "wait": "#e6c229",
    "await": "#e6c229",
}
WAITER_COLOURS = {"spin": "#d1495b", "spin (lone await)": "#d1495b", "sleep": "#a6cee3", "wake-up": "#f28e2b"}
FLOW_COLOURS = {"then": "#222222", "wake-up": "#f28e2b"}

Track = tuple[int, int]


def load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise SystemExit(f"{path}: not a trace-event JSON document (no traceEvents)")
    return doc


class Layout:
    """Which row each event goes to, in Perfetto's order."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.names: dict[Track, str] = {}
        self.process: dict[int, str] = {}
        sort_process: dict[int, int] = {}
        sort_thread: dict[Track, int] = {}
        for e in events:
            if e["ph"] != "M":
                continue
            args = e.get("args", {})
            if e["name"] == "process_name":
                self.process[e["pid"]] = args["name"]
            elif e["name"] == "process_sort_index":
                sort_process[e["pid"]] = args["sort_index"]
            elif e["name"] == "thread_name":
                self.names[(e["pid"], e["tid"])] = args["name"]
            elif e["name"] == "thread_sort_index":
                sort_thread[(e["pid"], e["tid"])] = args["sort_index"]
        # Awaits overlap: each gets a lane of its thread's "awaits" rows.
        self.lanes: dict[Any, int] = {}
        lane_ends: dict[Track, list[float]] = {}
        begins = {e["id"]: e for e in events if e["ph"] == "b"}
        ends = {e["id"]: e for e in events if e["ph"] == "e"}
        self.awaits: list[tuple[dict[str, Any], float]] = []
        for key, b in sorted(begins.items(), key=lambda kv: kv[1]["ts"]):
            end = ends.get(key, b)["ts"]
            track = (b["pid"], b["tid"])
            used = lane_ends.setdefault(track, [])
            lane = next((i for i, t in enumerate(used) if t <= b["ts"]), len(used))
            if lane == len(used):
                used.append(end)
            else:
                used[lane] = end
            self.lanes[key] = lane
            self.awaits.append((b, end))
        tracks: set[Track] = {
            (e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "i", "s", "f") and "tid" in e
        }
        rows: list[tuple[tuple[int, int, int], str, Any]] = []
        for track in tracks:
            pid, tid = track
            name = self.names.get(track, f"{pid}:{tid}")
            if pid >= 100:
                name = f"{self.process.get(pid, pid)} · {name}"
            order = (sort_process.get(pid, pid), sort_thread.get(track, tid), 0)
            rows.append((order, name, track))
        for track, used in lane_ends.items():
            thread = self.names.get(track, str(track[1]))
            order = (sort_process.get(track[0], track[0]), sort_thread.get(track, track[1]), 5)
            for lane in range(len(used)):
                rows.append(
                    ((*order[:2], 5 + lane), f"awaits ({thread})" if lane == 0 else "", (track, lane))
                )
        rows.sort(key=lambda r: r[0])
        self.labels = [name for _order, name, _key in rows]
        self.row = {key: i for i, (_order, _name, key) in enumerate(rows)}

    def of(self, event: dict[str, Any]) -> int:
        return self.row[(event["pid"], event["tid"])]


def render(doc: dict[str, Any], out: Path, start_ms: float | None, end_ms: float | None, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    events: list[dict[str, Any]] = doc["traceEvents"]
    layout = Layout(events)
    height = max(3.0, 0.42 * len(layout.labels) + 1.4)
    fig, ax = plt.subplots(figsize=(16, height))

    def shown(t0: float, t1: float) -> bool:
        return (start_ms is None or t1 >= start_ms) and (end_ms is None or t0 <= end_ms)

    for e in events:
        if e["ph"] == "X":
            t0, dur = e["ts"] / 1e3, e["dur"] / 1e3
            if not shown(t0, t0 + dur):
                continue
            row = layout.of(e)
            colour = (
                WAITER_COLOURS.get(e["name"]) if e["cat"] == "waiter" else COLOURS.get(e["cat"], "#777777")
            )
            ax.barh(row, max(dur, 0.002), left=t0, height=0.7, color=colour, edgecolor="black", linewidth=0.3)
            label = e["name"] if e["cat"] != "waiter" or e["name"] == "wake-up" else ""
            span = (end_ms or float("inf")) - (start_ms or 0.0)
            if label and dur > 0.05 * min(span, _extent(events)):
                ax.text(t0 + dur / 2, row, label, ha="center", va="center", fontsize=7, clip_on=True)
        elif e["ph"] == "i":
            t = e["ts"] / 1e3
            if shown(t, t):
                marker = "|" if e["cat"] != "gpu" else "v"
                ax.plot([t], [layout.of(e)], marker=marker, color="#333333", markersize=8, linestyle="none")
    for b, end in layout.awaits:
        t0, t1 = b["ts"] / 1e3, end / 1e3
        if shown(t0, t1):
            row = layout.row[((b["pid"], b["tid"]), layout.lanes[b["id"]])]
            ax.barh(
                row,
                max(t1 - t0, 0.002),
                left=t0,
                height=0.6,
                color=COLOURS["await"],
                edgecolor="black",
                linewidth=0.3,
            )
            fid = b.get("args", {}).get("future")
            span = (end_ms or float("inf")) - (start_ms or 0.0)
            if t1 - t0 > 0.05 * min(span, _extent(events)):
                ax.text(
                    (t0 + t1) / 2, row, f"await #{fid}", ha="center", va="center", fontsize=7, clip_on=True
                )
    starts = {(e["cat"], e["id"]): e for e in events if e["ph"] == "s"}
    for e in events:
        if e["ph"] != "f":
            continue
        s = starts.get((e["cat"], e["id"]))
        if s is None:
            continue
        a, b = (s["ts"] / 1e3, layout.of(s)), (e["ts"] / 1e3, layout.of(e))
        if not (shown(a[0], a[0]) or shown(b[0], b[0])):
            continue
        colour = FLOW_COLOURS.get(e["cat"], "#555555")
        arrow = FancyArrowPatch(
            a, b, arrowstyle="-|>", mutation_scale=9, color=colour, linewidth=0.9, shrinkA=0, shrinkB=0
        )
        ax.add_patch(arrow)
    ax.set_yticks(range(len(layout.labels)))
    ax.set_yticklabels(layout.labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the trace started")
    if start_ms is not None or end_ms is not None:
        ax.set_xlim(
            start_ms if start_ms is not None else ax.get_xlim()[0],
            end_ms if end_ms is not None else ax.get_xlim()[1],
        )
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(title, fontsize=10)
    handles = [
        matplotlib.patches.Patch(color=COLOURS["gpu"], label="GPU work of a future"),
        matplotlib.patches.Patch(color=COLOURS["then"], label="then()/submit() fn (host)"),
        matplotlib.patches.Patch(color=COLOURS["future"], label="set_result() and what it ran"),
        matplotlib.patches.Patch(color=COLOURS["await"], label="await / result()"),
        matplotlib.patches.Patch(color=WAITER_COLOURS["spin"], label="waiter spins"),
        matplotlib.patches.Patch(color=WAITER_COLOURS["sleep"], label="waiter sleeps"),
        matplotlib.patches.Patch(color=WAITER_COLOURS["wake-up"], label="wake-up (saw work done)"),
        matplotlib.lines.Line2D([], [], color=FLOW_COLOURS["then"], label="then(): parent → child"),
        matplotlib.lines.Line2D([], [], color=FLOW_COLOURS["wake-up"], label="GPU done → seen by"),
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08 * 12 / height),
        ncol=5,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _extent(events: list[dict[str, Any]]) -> float:
    times = [e["ts"] / 1e3 for e in events if e["ph"] != "M"]
    return (max(times) - min(times)) if times else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/render_trace.py", description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a trace JSON that cudafut.trace() wrote")
    parser.add_argument(
        "-o", "--out", type=Path, default=None, help="the PNG (default: the trace's name, .png)"
    )
    parser.add_argument("--from", dest="start", type=float, default=None, help="first ms shown")
    parser.add_argument("--to", dest="end", type=float, default=None, help="last ms shown")
    parser.add_argument("--title", default=None, help="the picture's title")
    args = parser.parse_args(argv)
    doc = load(args.trace)
    other = doc.get("otherData", {})
    title = args.title or (
        f"{args.trace.name}: {other.get('futures', '?')} futures, cudafut {other.get('cudafut', '?')}, "
        f"{other.get('started', '')}"
    )
    out = render(doc, args.out or args.trace.with_suffix(".png"), args.start, args.end, title)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
