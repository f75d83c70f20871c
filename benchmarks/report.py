"""Turn a benchmark JSON into a Markdown table and PNG plots.

``python -m benchmarks.report results/bench-h200.json`` redraws them from a
committed JSON without a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TARGETS = {
    "await p50 / floor (work <= 200 us)": "<= 1.25",
    "CPU/wall awaiting 2 ms and 20 ms": "<= 0.05",
    "10k awaits: host us per future": "<= 5",
    "10k awaits: longest loop stall ms": "<= 2",
    "create + set us": "<= 2",
    "then() us per link": "<= 10",
    "pipeline: cudafut / hand-written": ">= 0.95",
    "pipeline: cudafut / serial": ">= 2.5",
}


def _fmt(v: Any, digits: int = 2) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(res: dict[str, Any]) -> str:
    meta = res["meta"]
    lines = [
        f"# cudafut benchmark: {meta['gpu']}",
        "",
        f"cudafut {meta['cudafut']}, CuPy {meta['cupy']}, NVIDIA driver {meta.get('nvidia_driver')}, "
        f"Python {meta['python']}, {meta['cpu_count']} CPUs, {meta['date']}. Policy: `{meta['policy']}`.",
        "",
    ]
    wake = res.get("wake")
    if wake:
        lines += [
            "## 1-3. Launch a kernel of exact duration, learn that it finished",
            "",
            "p50 (p99) extra wall time over the same run's floor, launch + `stream.synchronize()`, "
            "in µs; ratio of p50s; CPU/wall while waiting.",
            "",
        ]
        works = list(wake)
        header = "| strategy | " + " | ".join(f"{w} ms" for w in works) + " |"
        lines += [header, "|---" * (len(works) + 1) + "|"]
        names = list(wake[works[0]])
        for name in names:
            cells = []
            for w in works:
                q = wake[w].get(name, {})
                if "error" in q:
                    cells.append("n/a")
                elif name.startswith("floor"):
                    cells.append(f"{q['p50_us']:.1f} µs (p99 {q['p99_us']:.1f}), cpu {q['cpu_per_wall']:.2f}")
                else:
                    cells.append(
                        f"{q['extra_p50_us']:+.1f} ({q['extra_p99_us']:+.0f}), "
                        f"{q['ratio_p50']:.2f}x, cpu {q['cpu_per_wall']:.2f}"
                    )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        errors = {n: q["error"] for w in works for n, q in wake[w].items() if "error" in q}
        for n, e in errors.items():
            lines.append(f"\n{n}: not measured ({e}).")
        lines.append("")
    many = res.get("many_awaits")
    if many:
        lines += [
            f"## 4. {many['n']:,} concurrent awaits over {many['streams']} streams",
            "",
            "Every await is pending at once (the streams run a long kernel first) and they complete "
            "in bulk. Host CPU per future, and the longest gap between ticks of a 0.5 ms heartbeat "
            "task; with Python's cyclic garbage collector on (default) and off.",
            "",
            "| | host CPU µs / future | same, gc off | longest stall, ms | same, gc off |",
            "|---|---|---|---|---|",
        ]
        for name in ("plain asyncio futures (baseline)", "cudafut await"):
            m = many[name]
            lines.append(
                f"| {name} | {m['host_cpu_us_per_future']:.2f} "
                f"| {m.get('host_cpu_us_per_future_gc_off', 0):.2f} "
                f"| {m['max_heartbeat_stall_ms']:.2f} | {m['max_heartbeat_stall_ms_gc_off']:.2f} |"
            )
        lines.append("")
    host = res.get("host")
    if host:
        lines += ["## 5. Host costs", "", "| operation | µs |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in host.items()]
        lines.append("")
    for label, pipe in (res.get("pipeline") or {}).items():
        lines += [
            f"## 6. Pipeline, {label} chunks: copy in, compute, copy out",
            "",
            f"{pipe['chunks']} chunks of {pipe['chunk_mb']:.0f} MB; compute calibrated to one copy "
            f"({pipe['copy_in_ms']:.2f} ms).",
            "",
            "| variant | chunks/s | host enqueue µs / chunk |",
            "|---|---|---|",
        ]
        for k, v in pipe.items():
            if isinstance(v, dict) and "chunks_per_s" in v:
                lines.append(f"| {k} | {v['chunks_per_s']:.0f} | {v['host_enqueue_us_per_chunk']:.0f} |")
        lines += [
            "",
            f"cudafut / hand-written: {pipe['cudafut / hand-written']:.3f}; cudafut / serial: "
            f"{pipe['cudafut / serial']:.2f}; hand-written / serial: {pipe['hand-written / serial']:.2f}; "
            "cudafut / hand-written with a stream per chunk: "
            f"{pipe['cudafut / hand-written per chunk']:.3f}.",
            "",
        ]
    return "\n".join(lines)


def plots(res: dict[str, Any], out: Path, stem: str) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - plots are optional
        return []
    written = []
    wake = res.get("wake")
    if wake:
        works = list(wake)
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
        for name in wake[works[0]]:
            if name.startswith("floor"):
                continue
            xs, ys, cs = [], [], []
            for w in works:
                q = wake[w].get(name, {})
                if "extra_p50_us" in q:
                    xs.append(max(float(w), 0.01))
                    ys.append(max(q["extra_p50_us"], 0.5))
                    cs.append(q["cpu_per_wall"])
            if xs:
                style = "-o" if name.startswith("cudafut") else "--s"
                ax.plot(xs, ys, style, label=name)
                bx.plot(xs, cs, style, label=name)
        for a in (ax, bx):
            a.set_xscale("log")
            a.set_xlabel("GPU work, ms (0 plotted at 0.01)")
            a.grid(True, which="both", alpha=0.3)
        ax.set_yscale("log")
        ax.set_ylabel("extra wake-up latency over stream.synchronize(), p50, µs")
        bx.set_ylabel("CPU / wall while waiting")
        bx.axhline(0.05, color="grey", lw=0.8)
        ax.legend(fontsize=7)
        fig.suptitle(f"Wake-up latency and CPU against work duration ({res['meta']['gpu']})")
        fig.tight_layout()
        path = out / f"{stem}-wake.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    pipes = list((res.get("pipeline") or {}).values())
    if pipes and pipes[0].get("timelines_ms"):
        tls = pipes[0]["timelines_ms"]
        fig, axes = plt.subplots(len(tls), 1, figsize=(13, 2.2 + 1.2 * len(tls)), sharex=True)
        colors = {"copy in": "tab:blue", "compute": "tab:orange", "copy out": "tab:green"}
        for ax, (name, events) in zip(list(axes), tls.items(), strict=True):
            streams = sorted({e[2] for e in events})
            for stage, _i, ptr, a, b in events:
                ax.barh(streams.index(ptr), b - a, left=a, color=colors[stage], height=0.8)
            ax.set_yticks(range(len(streams)), [f"stream {k}" for k in range(len(streams))], fontsize=7)
            ax.set_title(name, fontsize=9)
        axes[-1].set_xlabel("ms")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        fig.legend(handles, list(colors), loc="upper right")
        fig.tight_layout()
        path = out / f"{stem}-pipeline.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_report(res: dict[str, Any], out: Path, stem: str) -> list[Path]:
    md = out / f"{stem}.md"
    md.write_text(markdown(res))
    return [md, *plots(res, out, stem)]


if __name__ == "__main__":
    path = Path(sys.argv[1])
    data = json.loads(path.read_text())
    for p in write_report(data, path.parent, path.stem):
        print(p)
