"""``ortcapture bench``'s arms and what it makes of their timings: statistics, speedups, overhead, table, plot.

Pooled statistics, speedups, ortcapture's overhead against raw capture (blocks and call-by-call), the table and the
plot. The method is described in :mod:`ortcapture.cli.bench`.
"""
from __future__ import annotations

import os

#: arm id -> table label; the order is the order of the table, the plot and the JSON.
ARMS = {
    "plain": "plain run(numpy)",
    "iobinding": "IOBinding, no graph",
    "raw_capture": "raw ORT capture (IOBinding)",
    "captured_ortvalue": "CapturedGraph.run(OrtValue)",
    "captured_numpy": "CapturedGraph.run(numpy)",
    "captured_pinned": "run(host_inputs, copy_outputs='pinned')",
    "captured_overlap": "run_many(numpy), copies=2, per request",
}
CAPTURE_ARMS = ("raw_capture", "captured_ortvalue", "captured_numpy", "captured_pinned", "captured_overlap")


def _stats(per_process: list[dict]) -> dict:
    """Pooled stats per arm, per-process p50s, speedups and overhead ratios."""
    import numpy as np

    from ortcapture.cli import timing

    stats = {}
    for arm in [a for a in ARMS if all(a in w["samples_us"] for w in per_process)]:  # older workers: fewer arms
        runs = [np.asarray(w["samples_us"][arm], dtype=np.float64) for w in per_process]
        s = timing.summary(np.concatenate(runs))
        p50s = [float(np.percentile(r, 50)) for r in runs]
        s["p50_per_process_us"] = p50s
        s["p50_spread_us"] = [min(p50s), max(p50s)]
        stats[arm] = s
    p = {arm: s["p50_us"] for arm, s in stats.items()}
    per_proc = [
        stats["captured_ortvalue"]["p50_per_process_us"][i] / stats["raw_capture"]["p50_per_process_us"][i]
        for i in range(len(per_process))
    ]
    speedup = {
        **({"pinned_vs_numpy": p["captured_numpy"] / p["captured_pinned"]} if "captured_pinned" in p else {}),
        **({"overlap_vs_numpy": p["captured_numpy"] / p["captured_overlap"]} if "captured_overlap" in p else {}),
        "captured_vs_iobinding": p["iobinding"] / p["captured_ortvalue"],
        "captured_numpy_vs_plain": p["plain"] / p["captured_numpy"],
        "captured_vs_plain": p["plain"] / p["captured_ortvalue"],
        "raw_capture_vs_iobinding": p["iobinding"] / p["raw_capture"],
    }
    overhead = {
        "ortcapture_over_raw": p["captured_ortvalue"] / p["raw_capture"],
        "ortcapture_minus_raw_us": p["captured_ortvalue"] - p["raw_capture"],
        "ortcapture_over_raw_per_process": per_proc,
        "ortcapture_over_raw_min": stats["captured_ortvalue"]["min_us"] / stats["raw_capture"]["min_us"],
    }
    if all("paired_us" in w for w in per_process):  # call-by-call alternation (workers of this version)
        a = np.concatenate([np.asarray(w["paired_us"]["raw_capture"], np.float64) for w in per_process])
        b = np.concatenate([np.asarray(w["paired_us"]["captured_ortvalue"], np.float64) for w in per_process])
        overhead["paired"] = {
            "raw_p50_us": float(np.median(a)), "ortcapture_p50_us": float(np.median(b)),
            "ortcapture_over_raw": float(np.median(b) / np.median(a)),
            # per-pair differences, both call orders weighted alike (timing.paired_extra), per process
            "ortcapture_minus_raw_per_process_us": [
                timing.paired_extra(w["paired_us"]["raw_capture"], w["paired_us"]["captured_ortvalue"])
                for w in per_process],
        }
        overhead["paired"]["ortcapture_minus_raw_us"] = float(
            np.median(overhead["paired"]["ortcapture_minus_raw_per_process_us"]))
    return {"stats": stats, "speedup": speedup, "overhead": overhead}


def batch_label(batch: int | None) -> str:
    """``"batch 8"``, or ``"fixed shapes"`` for a model without a dynamic first dim (``batch`` None)."""
    return "fixed shapes" if batch is None else f"batch {batch}"


def _label(arm: str, capture: bool) -> str:
    return ARMS[arm] + ("" if capture or arm not in CAPTURE_ARMS else " [capture off]")


def _print_batch(entry: dict, procs: int, iters: int, capture: bool) -> None:
    shapes_ = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in entry["shapes"].items())
    print(f"\n{batch_label(entry['batch'])} ({shapes_}): {procs} process(es) x {iters} calls per arm, graph capture "
          f"{'on' if capture else 'OFF'}")
    stats = entry["stats"]
    base, iob = stats["plain"]["p50_us"], stats["iobinding"]["p50_us"]
    unit, div = ("ms", 1e3) if max(s["p90_us"] for s in stats.values()) >= 1e5 else ("µs", 1.0)
    print(f"  {'arm':<42}{'p50 ' + unit:>10}{'p90 ' + unit:>10}{'min ' + unit:>10}{'p50 per proc ' + unit:>22}"
          f"{'vs plain':>10}{'vs IOBind':>11}")
    for arm, s in stats.items():
        lo, hi = (x / div for x in s["p50_spread_us"])
        print(f"  {_label(arm, capture):<42}{s['p50_us'] / div:>10.1f}{s['p90_us'] / div:>10.1f}"
              f"{s['min_us'] / div:>10.1f}{f'{lo:.1f}-{hi:.1f}':>22}{base / s['p50_us']:>9.2f}x"
              f"{iob / s['p50_us']:>10.2f}x")
    sp, ov = entry["speedup"], entry["overhead"]
    print(f"  captured vs IOBinding without graph: {sp['captured_vs_iobinding']:.2f}x; captured(numpy) vs plain "
          f"run: {sp['captured_numpy_vs_plain']:.2f}x; raw capture vs IOBinding: {sp['raw_capture_vs_iobinding']:.2f}x")
    if "captured_pinned" in stats and "captured_overlap" in stats:
        dev = stats["captured_ortvalue"]["p50_us"]
        print(f"  host I/O over CapturedGraph.run(OrtValue): host_inputs + pinned views "
              f"{stats['captured_pinned']['p50_us'] / dev:.2f}x, numpy {stats['captured_numpy']['p50_us'] / dev:.2f}x;"
              f" run_many throughput {100 * dev / stats['captured_overlap']['p50_us']:.0f}% of it")
    per = ", ".join(f"{r:.3f}" for r in ov["ortcapture_over_raw_per_process"])
    print(f"  ortcapture / raw capture (p50): {ov['ortcapture_over_raw']:.3f}x "
          f"({ov['ortcapture_minus_raw_us']:+.1f} µs);"
          f" per process {per}")
    pa = ov.get("paired")
    if pa:
        each = ", ".join(f"{d:+.1f}" for d in pa["ortcapture_minus_raw_per_process_us"])
        print(f"  ortcapture / raw capture, call-by-call alternation (p50): {pa['ortcapture_over_raw']:.3f}x; "
              f"extra per call {pa['ortcapture_minus_raw_us']:+.1f} µs (median of the processes: {each})")
    bad = {a: d for a, d in entry["max_abs_diff"].items() if d > entry["tolerance"]}
    if bad:
        print(f"  MISMATCH against the uncaptured run (tolerance {entry['tolerance']:.3g}): {bad}")


def plot(result: dict, path: str) -> None:
    """Draw ``result``'s latency distributions (a violin and a box per arm, p50 labelled, per-process p50s as
    dots), one panel per batch size, into the PNG ``path`` (matplotlib's Agg canvas, no global backend change)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    batches = result["batches"]
    capture = result["graph_capture"]
    arms = [a for a in ARMS if a in batches[0]["samples_us"]]
    colors = {"plain": "#9e9e9e", "iobinding": "#616161", "raw_capture": "#1f77b4", "captured_ortvalue": "#ff7f0e",
              "captured_numpy": "#ffbb78", "captured_pinned": "#2ca02c", "captured_overlap": "#98df8a"}
    fig = Figure(figsize=(11, 4.2 * len(batches)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(batches), 1, squeeze=False)[:, 0]
    for ax, entry in zip(axes, batches):
        unit, div = ("ms", 1e3) if max(s["p90_us"] for s in entry["stats"].values()) >= 1e4 else ("µs", 1.0)
        data = [np.concatenate([np.asarray(r, dtype=np.float64) for r in entry["samples_us"][a]]) / div
                for a in arms]
        pos = np.arange(1, len(arms) + 1)
        usable = [i for i, d in enumerate(data) if d.size > 1 and np.ptp(d) > 0]
        if usable:
            try:
                parts = ax.violinplot([data[i] for i in usable], positions=pos[usable], widths=0.8,
                                      showextrema=False)
                for i, body in zip(usable, parts["bodies"]):
                    body.set_facecolor(colors[arms[i]])
                    body.set_alpha(0.35)
            except Exception:  # noqa: BLE001 - a degenerate distribution: the box plot still shows it
                pass
        ax.boxplot(data, positions=pos, widths=0.18, showfliers=False, whis=(5, 95),
                   medianprops={"color": "black", "linewidth": 2})
        for i, arm in enumerate(arms):
            s = entry["stats"][arm]
            p50s = [x / div for x in s["p50_per_process_us"]]
            ax.scatter([pos[i]] * len(p50s), p50s, marker="D", s=14, color=colors[arm], edgecolor="black",
                       linewidth=0.5, zorder=3)
            ax.annotate(f"p50 {s['p50_us'] / div:.4g} {unit}", (pos[i] + 0.12, s["p50_us"] / div), fontsize=8,
                        va="center")
        ax.set_xticks(pos)
        ax.set_xticklabels([_label(a, capture).replace(" (", "\n(").replace(" [", "\n[") for a in arms], fontsize=8)
        lo = min(float(d.min()) for d in data)
        hi = max(float(np.percentile(d, 95)) for d in data) * 1.15  # rare stalls would flatten everything else
        top = max(float(d.max()) for d in data)
        ax.set_ylim(max(0.0, lo - 0.08 * (min(hi, top) - lo)), min(hi, top + 0.05 * (top - lo)))
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.set_ylabel(f"latency per call ({unit})" + (";\naxis cut at 1.15x the largest p95" if top > hi else ""))
        sp, ov = entry["speedup"], entry["overhead"]
        shapes_ = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in entry["shapes"].items())
        ax.set_title(f"{batch_label(entry['batch'])} ({shapes_}) — captured vs IOBinding {sp['captured_vs_iobinding']:.2f}x,"
                     f" ortcapture/raw {ov['ortcapture_over_raw']:.3f}x", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    settings = [f"sync: {result.get('sync', 'readback')}"]
    if result.get("provider_options"):
        settings.append(f"EP options {result['provider_options']}")
    if result.get("intra_op_threads") is not None:
        settings.append(f"intra_op_num_threads={result['intra_op_threads']}")
    if result.get("session_config"):
        settings.append(f"session config {result['session_config']}")
    if result.get("pin_thread"):
        settings.append("calling thread pinned")
    import textwrap

    fig.suptitle(f"ortcapture bench: {os.path.basename(result['model'])} on {result['provider']} "
                 f"(onnxruntime {result['ort']}), graph capture {'on' if capture else 'off'}, "
                 f"{result['procs']} processes x {result['iters']} calls; box 5-95 %, diamonds: per-process p50\n"
                 + "\n".join(textwrap.wrap(", ".join(settings), 150)), fontsize=10)
    fig.savefig(path, dpi=110)
