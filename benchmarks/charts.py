"""The charts of RESULTS.md (matplotlib, small PNGs).  Each function draws one figure from rows."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402
from report import fit, pairs, ratios, transform_s  # noqa: E402

METRICS = ("transform", "weights", "peak RSS", "latency")
COLORS = {"transform": "#8c8c8c", "weights": "#1f77b4", "peak RSS": "#9467bd", "latency": "#ff7f0e"}
DPI = 90


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return f"charts/{path.name}"


def _short(label: str, width: int = 40) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def _plain_log_axis(axis, suffix: str = "") -> None:
    """Log scale with ticks written 0.2, 0.5, 1, 2 (not 2×10⁻¹)."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def _legend_on_top(ax, columns: int) -> None:
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncols=columns, fontsize=8, frameon=False)


def draw_ratios(rows: list[dict], path: Path, size: str = "large") -> str | None:
    """Horizontal bars: ours ÷ by hand per metric, one group per (transform, baseline) at ``size``."""
    groups = [(o, h) for o, h in pairs(rows) if o["size"] == size]
    if not groups:
        return None
    height = 0.8 / len(METRICS)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(groups) + 1.4))
    labels = []
    for i, (ours, hand) in enumerate(groups):
        r = ratios(ours, hand)
        for j, metric in enumerate(METRICS):
            value = r[metric]
            if value is not None:
                ax.barh(i + (j - 1.5) * height, value, height, color=COLORS[metric],
                        label=metric if i == 0 else None)
        labels.append(f"{ours['comparison']}\nvs {_short(hand['side'])}")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    _plain_log_axis(ax.xaxis, "×")
    ax.set_yticks(range(len(groups)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("transformdsl ÷ by hand (left of 1×: we are faster / smaller)")
    ax.set_title(f"transformdsl against the same job done by hand — {groups[0][0]['workload']} "
                 f"({groups[0][0]['params'] / 1e6:.0f} M parameters)", fontsize=10, pad=24)
    _legend_on_top(ax, 4)
    ax.grid(axis="x", which="major", alpha=0.3)
    return _save(fig, path)


def draw_reload(rows: list[dict], path: Path) -> str | None:
    """Bars per saved script on the large models: floor, load, transform again (log seconds)."""
    picked = [r for r in rows if r["side"] == "transformdsl" and r.get("status") == "ok" and r["size"] == "large"
              and isinstance(r.get("reload"), dict) and "status" not in r["reload"]]
    if not picked:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(picked) + 1.4))
    series = (("safetensors floor", lambda r: r["reload"]["floor_s"], "#bbbbbb"),
              ("transformdsl.load", lambda r: r["reload"]["load_s"], "#1f77b4"),
              ("transform again", lambda r: r["read_s"] + transform_s(r), "#d62728"))
    height = 0.8 / len(series)
    for j, (label, value, color) in enumerate(series):
        ax.barh([i + (j - 1) * height for i in range(len(picked))], [value(r) for r in picked], height,
                color=color, label=label)
    ax.set_yticks(range(len(picked)), [r["comparison"] for r in picked], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    _plain_log_axis(ax.xaxis)
    ax.set_xlabel("seconds (log scale)")
    ax.set_title(f"Reloading a transformed {picked[0]['workload']} ({picked[0]['params'] / 1e6:.0f} M parameters): "
                 "load vs reading the same bytes vs transforming again", fontsize=10, pad=24)
    _legend_on_top(ax, 3)
    ax.grid(axis="x", which="major", alpha=0.3)
    return _save(fig, path)


def draw_scaling(points: dict[str, list[dict]], path: Path) -> str | None:
    """Transform and load time against parameter count, with the straight-line fits."""
    if not points:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharex=True)
    for ax, (what, get) in zip(axes, (("transform", lambda p: p["transform_s"]),
                                      ("load (transformdsl.load)", lambda p: p["reload"]["load_s"]))):
        for name, pts in points.items():
            xs = [p["params"] / 1e6 for p in pts]
            ys = [get(p) for p in pts]
            f = fit(xs, ys)
            line = ax.plot(xs, ys, "o", label=f"{name} (R² {f['r2']:.3f})")[0]
            ends = [min(xs), max(xs)]
            ax.plot(ends, [f["intercept"] + f["slope"] * x for x in ends], "-", color=line.get_color(), alpha=0.6)
        ax.set_title(what, fontsize=10)
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Cost against model size (Flux, widths 768 to 3072), with least-squares lines", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def draw_convert(results: Path, path: Path) -> str | None:
    """Peak RSS against checkpoint size per way (``results/convert.json``, ``bench_convert.py``)."""
    import json

    if not results.exists():
        return None
    points = [p for p in json.loads(results.read_text()).get("points", []) if p.get("status") == "ok"]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for way in dict.fromkeys(p["way"] for p in points):
        pts = sorted((p for p in points if p["way"] == way), key=lambda p: p["checkpoint"])
        ax.plot([p["checkpoint"] / 2**30 for p in pts], [p["peak"] / 2**30 for p in pts], "o-", label=way)
    ax.set_xlabel("checkpoint (GiB, bf16)")
    ax.set_ylabel("peak RSS above start (GiB)")
    ax.set_title(f"Peak memory against model size ({json.loads(results.read_text()).get('script', '')})",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def draw_all(rows: list[dict], points: dict[str, list[dict]], folder: Path) -> dict[str, str]:
    """Every chart that has data; name -> path relative to the page."""
    drawn = {"ratios": draw_ratios(rows, folder / "ratios.png"),
             "ratios-medium": draw_ratios(rows, folder / "ratios-medium.png", "medium"),
             "reload": draw_reload(rows, folder / "reload.png"),
             "scaling": draw_scaling(points, folder / "scaling.png"),
             "convert": draw_convert(Path(__file__).resolve().parent / "results" / "convert.json",
                                     folder / "convert.png")}
    return {name: path for name, path in drawn.items() if path}
