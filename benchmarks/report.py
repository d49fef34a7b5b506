"""RESULTS.md and the charts, from the rows :mod:`measure` returned.  Nothing here is typed by
hand except words: every figure comes from a row."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

from baselines import UNCHANGED_LABEL
from common import header, table
from comparisons import BY_NAME, COMPARISONS
from measure import ORIGINAL, OURS

HERE = Path(__file__).resolve().parent
MB = 1e6
#: Ratios (ours / by hand) above these are "behind".  Latency and peak RSS get a margin: they are
#: measured in different processes on a shared 2-core machine; bytes are exact.
LIMITS = {"latency": 1.05, "weights": 1.005, "peak RSS": 1.10, "transform": 1.5}

#: Why we are behind a baseline where we are: (comparison, words in the baseline's label, metric,
#: explanation).  Shown only when the run measured that gap.  Words only: the figures are in the tables.
ATOMIC = ("`transform()` is atomic: every replaced layer stays referenced by the undo log until the whole "
          "script has succeeded.  Originals memory-mapped from the checkpoint (these jobs read bf16 checkpoints) "
          "give their pages back as they are replaced, the file holding them for a rollback; diffusers' layerwise "
          "casting (and torchao's `quantize_`) leave the replaced weights' pages mapped, and peak RSS counts those "
          "clean file pages.  Originals in the process's own memory stay resident up to the undo budget and wait "
          "in a temporary file past it; `undo=\"memory\"` keeps them all resident.")
SCALED_FP8 = ("Ours computes one scale per output channel before casting (as torchao's weight-only float8 "
              "does), so that small weights keep their precision instead of falling into float8's subnormal "
              "range; diffusers casts the weights as they are.  That is one more pass over each weight (its "
              "largest magnitudes) and a division before the same cast (benchmarks/results/fp8_scale.md); "
              "`scale=none` is diffusers' plain cast.  A one-off cost, which reloading skips (below).")
TENSOR_FP8 = ("One scale for each weight still reads the whole weight for its largest magnitude, then divides "
              "it before the cast (benchmarks/results/fp8_scale.md); `scale=none` is diffusers' plain cast.")
PLAIN_FP8 = ("The same plain cast as diffusers: what is left is planning and the undo log's bookkeeping (giving "
             "back the replaced weights' pages), a fixed cost per layer.")
NOTES: list[tuple[str, str, str, str]] = [
    ("fp8 storage", "", "peak RSS", ATOMIC),
    ("fp8 storage undo=memory", "", "peak RSS", ATOMIC),
    ("fp8 storage scale=tensor", "layerwise", "transform", TENSOR_FP8),
    ("fp8 storage scale=none", "layerwise", "transform", PLAIN_FP8),
    ("fp8 storage undo=memory", "layerwise", "transform", SCALED_FP8),
    ("fuse qkv + fp8 storage", "", "peak RSS", ATOMIC),
    ("fp8 storage", "layerwise", "transform", SCALED_FP8),
    ("fuse qkv + fp8 storage", "layerwise", "transform", SCALED_FP8),
    ("quantize int8", "W8A16", "latency",
     "Not the same algorithm: `quantize int8` is bitsandbytes' LLM.int8, which also quantizes every call's "
     "activations to int8; torchao's weight-only int8 keeps them in float, which on this CPU is faster at "
     "some widths (and more accurate: error column).  Against the same algorithm done by hand "
     "(bitsandbytes) we are at parity.  `quantize int8 weight_only=true` is torchao's scheme: its rows "
     "(comparison `quantize int8 weight_only`) and issue 15's targets above compare it."),
    ("quantize int8", "", "transform",
     "Our layer quantizes exactly as bitsandbytes' `Int8Params` does (through an fp16 copy of each weight); "
     "torchao quantizes from float32 directly.  At this width the fixed cost of planning also weighs."),
    ("quantize nf4 compute=bfloat16", "Linear4bit", "latency",
     "bitsandbytes' repacked bf16 kernel (which a stock `Linear4bit` switches to on CPUs with AVX512-BF16) "
     "against ours, which dequantizes to bf16 and runs torch's bf16 matmul: the repacking is lossy and changes "
     "what a save writes (spec.md, \"Quantized layers compute the same on every CPU\")."),
    ("quantize nf4", "", "weights",
     "Measured after the first call: a stock `Linear4bit` on a CPU with AVX512-BF16 has repacked itself by "
     "then, its block scales (absmax) in bf16; ours keeps them in float32 (before any call the bytes are "
     "equal)."),
    ("quantize nf4 compute=bfloat16", "", "weights",
     "Measured after the first call: a stock `Linear4bit` on a CPU with AVX512-BF16 has repacked itself by "
     "then, its block scales (absmax) in bf16; ours keeps them in float32 (before any call the bytes are "
     "equal)."),
    ("quantize nf4", "Linear4bit", "latency",
     "On CPUs with AVX512-BF16 a stock `Linear4bit` repacks its weight in place at the first call and then "
     "multiplies with bitsandbytes' bf16 kernel whatever its compute dtype; ours keeps the layer as quantized "
     "and computes in the dtype asked for (float32 by default), because the repacking is lossy (absmax to "
     "bf16), changes what a save writes and fails for out_features not a multiple of 32 (spec.md, "
     "\"Quantized layers compute the same on every CPU\").  `compute=bfloat16` is the fast choice there; "
     "the plan's device note says so."),
    # After the specific notes: peaks at width 768 (hundreds of MB) that change side from run to run.
    ("*", "", "peak RSS medium",
     "At width 768 the peaks are a few hundred MB above the process's start and move by tens of MB from "
     "run to run with the allocator's timing, in both directions (earlier runs had other rows on this side "
     "of the limit); what stays resident afterwards (RSS after) is the same on both sides, and at width "
     "3072 the quantization peaks are level."),
]


def note(comparison: str, baseline: str, metric: str, size: str) -> str | None:
    """The first explanation that fits; a metric written ``"peak RSS medium"`` fits that size only."""
    for c, words, m, text in NOTES:
        if c in (comparison, "*") and words in baseline and m in (metric, f"{metric} {size}"):
            return text
    return None

NOT_MEASURED = """\
- **pruna** (0.3.4): not installable beside this stack: it pins `hqq==0.2.7.post1` and `torchao<0.17`
  and pulls about forty packages (openvino, datasets, torchvision, lightning...) that would replace
  pinned versions here.  Its quantizers and compilers for these models wrap the libraries measured
  above (bitsandbytes, hqq, torchao, torch.compile).
- **torchao int4** on the CPU: every `Int4WeightOnlyConfig` packing format of torchao 0.18 needs CUDA,
  XPU or the `mslk` kernels; only int8 and float8 weight-only (and int8 dynamic) run on the CPU.
- **fp8 native by hand** on the CPU: torchao's fp8 matmul config refuses devices below CUDA compute
  capability 8.9; the GPU section compares it.
- **GPT-2**: its projections are `Conv1D`, which the by-hand `nn.Linear` replacement loops above do not
  cover (transformdsl's `quantize` does); left out of the by-hand comparison.
"""


# ---------------------------------------------------------------------- formatting

def sig(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def times(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def ok(row: dict) -> bool:
    return row.get("status") == "ok"


def script_text(comparison) -> str:
    """Our script as the page shows it (per-model scripts: as written for the medium Flux)."""
    if isinstance(comparison.script, str):
        return comparison.script
    from workloads import flux

    return comparison.script_for(flux("medium", 6))


def compared_section(rows: list[dict]) -> str:
    """Each comparison that ran: our script and the by-hand ways."""
    lines = []
    names = dict.fromkeys(r["comparison"] for r in rows if r["comparison"] in BY_NAME)
    for name in names:
        c = BY_NAME[name]
        hands = "; ".join(f"{b.label} (`{b.fn.__name__}`)" for b in by_hand(c)) or f"none: {c.no_baseline}"
        kwargs = "".join(f", {k}={v!r}" for k, v in c.transform_kwargs)
        call = f"`transform(model, {script_text(c)!r}{kwargs})`" if kwargs else f"`{script_text(c)}`"
        lines.append(f"- **{name}**: {call} — by hand: {hands}")
    return "\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- grouping

def by_workload(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[row["workload"]].append(row)
    return groups


def by_hand(comparison) -> list:
    """A comparison's by-hand ways (the unchanged model, an anchor, is not one)."""
    return [b for b in comparison.baselines if b.label != UNCHANGED_LABEL]


def pairs(rows: list[dict]):
    """(ours, baseline) rows of each comparison on each workload, both measured."""
    index = {(r["workload"], r["comparison"], r["side"]): r for r in rows}
    for row in rows:
        if row["side"] in (OURS, ORIGINAL, UNCHANGED_LABEL) or not ok(row):
            continue
        ours = index.get((row["workload"], row["comparison"], OURS))
        if ours and ok(ours):
            yield ours, row


def interleaved(hand: dict) -> float | None:
    """Ours ÷ by hand latency from calls made in turn in one process (see measure._duel)."""
    duel = hand.get("duel")
    return duel.get("ratio") if isinstance(duel, dict) else None


def transform_s(row: dict) -> float:
    """The transform's time: the median of its rounds where it ran several (``apply_rounds_s``)."""
    rounds = [t for t in row.get("apply_rounds_s") or () if t]
    return statistics.median(rounds) if len(rounds) > 1 else row["transform_s"]


def setup_s(row: dict) -> float:
    """The one-off cost of the transform: for compile, the first call (compilation) included."""
    compiles = "compile" in row["comparison"]
    return transform_s(row) + (row["first_call_s"] if compiles else 0.0)


def round_ratios(ours: dict, hand: dict) -> list[float]:
    """Ours ÷ by hand for each round both sides ran (:attr:`comparisons.Comparison.apply_rounds`),
    in the order they ran; failed rounds left out."""
    return [a / b for a, b in zip(ours.get("apply_rounds_s") or (), hand.get("apply_rounds_s") or ()) if a and b]


def apply_ratio(ours: dict, hand: dict) -> float | None:
    """Ours ÷ by hand apply time: the median of the rounds' ratios where both sides ran several
    rounds in turn, else the ratio of their one job."""
    rounds = round_ratios(ours, hand)
    if len(rounds) > 1 and "compile" not in ours["comparison"]:
        return statistics.median(rounds)
    return ratio(setup_s(ours), setup_s(hand))


def rounds_note(ours: dict, hand: dict) -> str:
    """", median of 3 rounds (1.41–1.62×)": how an apply ratio of several rounds was found."""
    rounds = round_ratios(ours, hand)
    if len(rounds) < 2:
        return ""
    return f", median of {len(rounds)} rounds ({times(min(rounds))}–{times(max(rounds))})"


def ratios(ours: dict, hand: dict) -> dict[str, float | None]:
    """Ours ÷ by hand per metric; latency from the interleaved calls when there are some."""
    separate = ratio(ours["latency_s"], hand["latency_s"])
    return {"transform": apply_ratio(ours, hand),
            "weights": ratio(ours["weight_bytes"], hand["weight_bytes"]),
            "peak RSS": ratio(ours["peak_rss"], hand["peak_rss"]),
            "latency": interleaved(hand) or separate}


def latency_cell(ours: dict, hand: dict) -> str:
    value = interleaved(hand)
    return times(value) if value else times(ratio(ours["latency_s"], hand["latency_s"])) + " †"


def behind(r: dict[str, float | None]) -> list[str]:
    return [metric for metric, limit in LIMITS.items() if r.get(metric) is not None and r[metric] > limit]


def verdict(r: dict[str, float | None]) -> str:
    lagging = [m for m in behind(r) if m in ("latency", "weights")]
    if not lagging:
        return "yes"
    return "behind: " + ", ".join(f"{m} +{(r[m] - 1) * 100:.0f}%" for m in lagging)


# ---------------------------------------------------------------------- sections

def torchao_line(meta: dict) -> str:
    """Which torchao the torchao rows used (it is not part of the project's environment)."""
    from workloads import TORCHAO_SITE

    version = meta.get("torchao_version")
    if version is None:
        found = sorted(TORCHAO_SITE.glob("torchao-*.dist-info"))
        version = found[-1].name.removeprefix("torchao-").removesuffix(".dist-info") if found else None
    if not meta.get("torchao") or version is None:
        return ("torchao rows: not measured (torchao is not in the project's environment; "
                "`pip install --no-deps --target benchmarks/_work/torchao-site torchao` enables them).")
    return (f"torchao {version} was installed with `--no-deps` into `benchmarks/_work/torchao-site` and put on "
            "the path of these jobs only (installed in the project's environment, diffusers would import it, "
            "and torch._dynamo with it, on every import).")


def _on_cpu(cpu: dict | None) -> str:
    """", on an AVX512 CPU (avx512_vnni)": which CPU a run's rows were measured on (CPUs differ by
    far more than noise: bitsandbytes' int8 is 0.56x fp32 latency with VNNI, ~36x without)."""
    from transformdsl.capabilities import cpu_text

    return f", on {cpu_text(cpu)}" if cpu else ""


def rounds_text(rows: list[dict]) -> str:
    """Which rows' transform time is a median of rounds (:attr:`comparisons.Comparison.apply_rounds`)."""
    names = sorted({r["comparison"] for r in rows if len(r.get("apply_rounds_s") or ()) > 1})
    if not names:
        return "one job per side"
    counts = sorted({len(r["apply_rounds_s"]) for r in rows if len(r.get("apply_rounds_s") or ()) > 1})
    return (f"for {', '.join(f'`{n}`' for n in names)}, short transforms whose time moves ±20% between processes: the median of "
            f"{'/'.join(map(str, counts))} fresh processes per side, the sides in turn, each ratio to a by-hand way "
            "the median of the rounds' ratios; one job per side elsewhere")


def method(meta: dict, rows: list[dict]) -> str:
    load = "/".join(f"{x:.1f}" for x in meta["load_before"])
    load_after = "/".join(f"{x:.1f}" for x in meta["load_after"])
    where = "in this process (smoke run)" if meta["in_process"] else "each in a fresh process"
    runs = meta.get("runs", [])[1:]
    earlier = "".join(f"\nRows from an earlier run (`--merge` kept those this one did not measure again): "
                      f"`{r['command'].strip()}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(r['measured_at']))}"
                      f"{_on_cpu(r.get('cpu'))}."
                      for r in runs)
    return earlier + f"""
Command: `{meta['command'].strip()}`{' (`make bench`)' if meta['command'].strip().endswith('run.py') else ''} — this run took {meta['seconds']:.0f} s{_on_cpu(meta.get('cpu'))}; torch threads: {meta['threads']};
load average (1/5/15 min) {load} before, {load_after} after (other work on the machine inflates
times; ratios compare runs made one right after the other).  {torchao_line(meta)}

How each figure is measured ({where}, forked from one server that imported the libraries, so every
configuration starts from the same memory): the original model is read with `from_pretrained` (random
weights, seed 0, every byte read) and run once for the reference output; fp8 jobs then read its
bfloat16 checkpoint (memory-mapped), as users of bf16 models do.  **transform** is the wall time of
`transformdsl.transform(model, script)` or of the by-hand code ({rounds_text(rows)}); **first call** the next forward (it includes compilation); **latency** the median
of the steady forwards after it; **weights** the bytes of every parameter, buffer and state_dict
tensor (quantization state included), each storage once (for compile, the transform time in the
ratio tables includes the first call, where compilation happens); **peak RSS** the highest resident memory
from the start of the transform to the end of the latency runs, and **RSS after** what stays
resident once freed heap memory is handed back (`malloc_trim`), both above the process's memory before it read the model; **layers** counts modules
replaced, added or holding low-precision weights; **error** is the RMS of the difference to the
original fp32 output over the RMS of that output.  Ratios are ours ÷ by hand: below 1 we are
faster or smaller.  The **latency ratio** comes from calls of our model and of the by-hand one made
in turn in one process (the by-hand job builds ours too; median of the pair ratios), so that both
see the same load; a ratio marked † is from the two separate processes instead.
"""


def headline(rows: list[dict]) -> str:
    lines = []
    for ours, hand in pairs(rows):
        r = ratios(ours, hand)
        lines.append({"model": ours["workload"], "transform": ours["comparison"], "by hand": hand["side"],
                      "layers (ours/hand)": f"{ours['layers']}/{hand['layers']}",
                      "transform time": times(r["transform"]), "weights": times(r["weights"]),
                      "peak RSS": times(r["peak RSS"]), "latency": latency_cell(ours, hand),
                      "error (ours/hand)": f"{sig(ours['error'], 2)} / {sig(hand['error'], 2)}",
                      "as fast and as small": verdict(r)})
    if not lines:
        return "\nNo comparison could be measured on both sides yet.\n"
    columns = ["model", "transform", "by hand", "layers (ours/hand)", "transform time", "weights", "peak RSS",
               "latency", "error (ours/hand)", "as fast and as small"]
    return "\n" + table(lines, columns) + "\n"


def detail(rows: list[dict]) -> str:
    out = []
    for workload, group in by_workload(rows).items():
        originals = {r.get("run"): r for r in group if r["side"] == ORIGINAL and ok(r)}
        original = originals[max(originals, key=lambda run: run or 0)] if originals else None
        title = f"\n### {workload}"
        if original:
            title += (f" — {sig(original['params'] / 1e6)} M parameters, {sig(original['weight_bytes'] / MB)} MB, "
                      f"latency {sig(original['latency_s'] * 1e3)} ms, read in {sig(original['read_s'])} s")
        lines = []
        for r in group:
            if r["side"] == ORIGINAL:
                continue
            who = "**transformdsl**" if r["side"] == OURS else r["side"]
            if not ok(r):
                lines.append({"transform": r["comparison"], "who": who, "status": r["status"]})
                continue
            same_run = originals.get(r.get("run"))  # the anchor measured beside this row
            vs_original = ratio(r["latency_s"], same_run["latency_s"]) if same_run else None
            lines.append({"transform": r["comparison"], "who": who, "layers": r["layers"],
                          "transform s": sig(transform_s(r)), "first call s": sig(r["first_call_s"]),
                          "latency ms": sig(r["latency_s"] * 1e3), "latency ÷ original": times(vs_original),
                          "weights MB": sig(r["weight_bytes"] / MB),
                          "peak RSS MB": sig(r["peak_rss"] / MB), "RSS after MB": sig(r["rss_after"] / MB),
                          "error": sig(r["error"], 2), "status": "ok"})
        out.append(title + "\n\n" + table(lines, ["transform", "who", "layers", "transform s", "first call s",
                                                   "latency ms", "latency ÷ original", "weights MB", "peak RSS MB",
                                                   "RSS after MB", "error", "status"]) + "\n")
    return "".join(out)


def unpaired_section(rows: list[dict]) -> str:
    """Comparisons measured on our side only, and why there is no by-hand way to compare with."""
    lines = []
    for comparison in COMPARISONS:
        measured = sorted({r["workload"] for r in rows if r["comparison"] == comparison.name and r["side"] == OURS})
        if not measured:
            continue
        families = {r["family"] for r in rows if r["comparison"] == comparison.name and r["side"] == OURS}
        missing = [f for f in sorted(families) if not any(f in b.families for b in by_hand(comparison))]
        if missing and comparison.no_baseline:
            lines.append(f"- `{comparison.name}` on {', '.join(missing)}: {comparison.no_baseline}; "
                         "measured against the original model only (tables below).")
    return ("\nNo by-hand baseline:\n\n" + "\n".join(lines) + "\n") if lines else ""


def reload_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["side"] == OURS and ok(r) and isinstance(r.get("reload"), dict)]


def reload_section(rows: list[dict]) -> str:
    lines = []
    for r in reload_rows(rows):
        re_ = r["reload"]
        if "status" in re_:
            lines.append({"model": r["workload"], "script": r["comparison"], "bit-exact": re_["status"]})
            continue
        again = r["read_s"] + transform_s(r)
        lines.append({"model": r["workload"], "script": r["comparison"], "file MB": sig(re_["file_bytes"] / MB),
                      "save s": sig(re_["save_s"]), "floor s": sig(re_["floor_s"]), "load s": sig(re_["load_s"]),
                      "load ÷ floor": times(ratio(re_["load_s"], re_["floor_s"])),
                      "transform again s": sig(again), "load ÷ again": times(ratio(re_["load_s"], again)),
                      "bit-exact": "yes" if re_["exact"] else "NO"})
    if not lines:
        return "\nNo saved model could be reloaded yet.\n"
    return "\n" + table(lines, ["model", "script", "file MB", "save s", "floor s", "load s", "load ÷ floor",
                                "transform again s", "load ÷ again", "bit-exact"]) + "\n"


def fit(xs: list[float], ys: list[float]) -> dict:
    """Least squares ``y = a + b x``, its R², and the exponent of ``y ~ x^k`` (log-log slope)."""
    n = len(xs)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys) or 1e-30
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / ss_tot
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mlx, mly = statistics.fmean(lx), statistics.fmean(ly)
    k = sum((x - mlx) * (y - mly) for x, y in zip(lx, ly)) / (sum((x - mlx) ** 2 for x in lx) or 1e-30)
    return {"intercept": a, "slope": b, "r2": r2, "exponent": k, "n": n}


def scaling_points(scaling: list[dict]) -> dict[str, list[dict]]:
    """Per scaling script, its rows on the Flux widths, smallest first."""
    points: dict[str, list[dict]] = defaultdict(list)
    for r in scaling:
        if ok(r) and "status" not in r.get("reload", {"status": 1}):
            points[r["comparison"]].append(r)
    return {k: sorted(v, key=lambda r: r["params"]) for k, v in points.items() if len(v) >= 3}


def scaling_section(points: dict[str, list[dict]]) -> str:
    if not points:
        return "\nNot enough sizes measured yet.\n"
    out = []
    for name, pts in points.items():
        lines = [{"size": p["size"], "parameters (M)": sig(p["params"] / 1e6), "transform s": sig(p["transform_s"]),
                  "save s": sig(p["reload"]["save_s"]), "load s": sig(p["reload"]["load_s"]),
                  "floor s": sig(p["reload"]["floor_s"]),
                  "transform ms / M params": sig(p["transform_s"] * 1e3 / (p["params"] / 1e6)),
                  "load ms / M params": sig(p["reload"]["load_s"] * 1e3 / (p["params"] / 1e6))} for p in pts]
        out.append(f"\n`{script_text(BY_NAME[name])}` on Flux (1 double + 1 single block, heads of 128):\n\n"
                   + table(lines, list(lines[0])) + "\n")
        params = [p["params"] / 1e6 for p in pts]
        for what, ys in (("transform", [p["transform_s"] for p in pts]),
                         ("load", [p["reload"]["load_s"] for p in pts])):
            f = fit(params, ys)
            shape = ("a straight line" if f["r2"] >= 0.98 else
                     "fixed costs dominate at these sizes" if f["exponent"] < 0.7 else "not a straight line")
            sign = "+" if f["intercept"] >= 0 else "−"
            out.append(f"- {what}: {sig(f['slope'] * 1e3)} ms per million parameters {sign} "
                       f"{sig(abs(f['intercept']) * 1e3)} ms, R² = {f['r2']:.3f}; growth exponent (log-log slope) {f['exponent']:.2f} "
                       f"(1 = linear): {shape}\n")
    return "".join(out)


def gpu_section() -> str:
    page = HERE / "results" / "gpu.md"
    if page.exists():
        text = page.read_text()
        return "\n" + text.split("\n", 1)[1] if text.startswith("# ") else text
    return ("\nNot yet measured: no GPU was available to this run.  `python benchmarks/gpu.py` on a CUDA "
            "machine (H100/H200 class; a few minutes) writes `benchmarks/results/gpu.md`, which the next "
            "`make bench` puts here.\n")


def planning_section() -> str:
    """Planning time per model and kind of statement, from ``results/plan.json`` (benchmarks/bench_plan.py)."""
    import json

    path = HERE / "results" / "plan.json"
    if not path.exists():
        return "\nNot measured by this run: `python benchmarks/bench_plan.py` writes `results/plan.json`.\n"
    data = json.loads(path.read_text())
    budget = data["budget_ms"]
    plans = [r for r in data["rows"] if r["what"].startswith("`") and not r["what"].startswith(("`named", "`declared"))]
    rows = []
    for model, modules in data["models"]:
        mine = [r for r in plans if r["model"] == model]
        worst = max(mine, key=lambda r: r["CPU ms"])
        over = [r["what"] for r in mine if r["CPU ms"] >= budget]
        declared = next((r for r in data["rows"] if r["model"] == model and r["what"].startswith("`declared")), None)
        wall = max(mine, key=lambda r: r["median ms"])
        rows.append({"model": model, "modules": modules, "statements planned": len(mine),
                     "slowest (CPU ms)": f"{worst['CPU ms']:.1f} ({worst['what']})",
                     "slowest wall ms": f"{wall['median ms']:.1f}",
                     "`declared_exclusions` CPU ms": f"{declared['CPU ms']:.1f}" if declared else "",
                     f"over {budget:.0f} ms": ", ".join(over) or "none"})
    when = header("x", data.get("measured_at"), data.get("threads")).split("\n", 2)[2].split("\n", 1)[0]
    return ("\nMedian CPU time of `transformdsl.plan` for one statement of every kind (and the brief's script on "
            f"Flux.1 depth), {data['repeats']} runs each; target < {budget:.0f} ms on 1,000 modules.  {when}  "
            "Details: [results/plan.md](results/plan.md).\n\n"
            + f"Wall times on that run, at a load average of {data.get('load', float('nan')):.1f}, are in the "
            "table too (they grow with the machine's load).\n\n"
            + table(rows, ["model", "modules", "statements planned", "slowest (CPU ms)", "slowest wall ms",
                           "`declared_exclusions` CPU ms", f"over {budget:.0f} ms"]) + "\n" + _plan_curve())


def _plan_curve() -> str:
    """The curve against script length and model size (``bench_plan.py --curve``), if measured."""
    page = HERE / "results" / "plan_curve.md"
    if not page.exists():
        return ""
    return "\n### Against script length and model size\n\n" + page.read_text().split("\n", 2)[-1].lstrip("\n")


def undo_section() -> str:
    """The undo log's memory (``benchmarks/bench_undo.py`` writes ``results/undo.md``)."""
    page = HERE / "results" / "undo.md"
    if not page.exists():
        return "\nNot yet measured: `benchmarks/bench_undo.py` writes `benchmarks/results/undo.md`.\n"
    text = page.read_text()
    return "\n" + text.split("\n", 1)[1] if text.startswith("# ") else text


def cache_section() -> str:
    """Step caches against diffusers' enable_cache (``benchmarks/bench_cache.py`` writes ``results/cache.md``)."""
    heading = "## Step caches (cache MODE) against diffusers' enable_cache\n"
    page = HERE / "results" / "cache.md"
    if not page.exists():
        return heading + "\nNot yet measured: `benchmarks/bench_cache.py` writes `benchmarks/results/cache.md`.\n"
    body = page.read_text().split("Every figure below is written by the script that measured it.\n", 1)[-1]
    medium = HERE / "results" / "cache-medium.md"  # a second run's page (--models medium --out ...), if any
    if medium.exists():
        body += medium.read_text().split("Every figure below is written by the script that measured it.\n", 1)[-1]
    quiet = HERE / "results" / "cache-quiet.md"  # a run alone on the machine (--out ...cache-quiet.md), if any
    if quiet.exists():
        body = body.rstrip("\n") + "\n\n" + QUIET_INTRO + quiet.read_text().split(
            "Every figure below is written by the script that measured it.\n", 1)[-1] + QUIET_READING
    sources = "[results/cache.md](results/cache.md)" + (
        " and [results/cache-medium.md](results/cache-medium.md)" if medium.exists() else "")
    return (heading + f"\nFrom {sources}, each written by the script that measured it (the CPU and command head "
            "each table).\n" + body.rstrip("\n") + "\n")


def _subsection(name: str, title: str, *, cut: str | None = None, link: str = "The page", extra: str = "",
                strip_note: bool = True) -> str:
    """A result page below its section (``### title``, the page without its own title line, ``cut``
    and what follows it dropped, then a link to it), or "" where the page does not exist yet."""
    page = HERE / "results" / name
    if not page.exists():
        return ""
    body = page.read_text().split("\n", 1)[-1]
    if strip_note:
        body = body.replace("Every figure below is written by the script that measured it.\n", "")
    if cut:
        body = body.split(cut, 1)[0]
    return f"\n### {title}\n" + body.rstrip("\n") + f"\n\n{link}: [results/{name}](results/{name}).\n" + extra


def tune_section() -> str:
    """tune's pick against the best uniform script (``benchmarks/bench_tune.py`` writes ``results/tune.md``):
    the page's measurement lines and its table of ratios."""
    heading = "## Finding a script: tune's pick against the best uniform script\n"
    page = HERE / "results" / "tune.md"
    if not page.exists():
        return heading + "\nNot yet measured: `benchmarks/bench_tune.py` writes `benchmarks/results/tune.md`.\n"
    body = page.read_text().split("\n", 1)[-1].replace("Every figure below is written by the script that "
                                                      "measured it.\n", "")
    body = body.split("\n### Every uniform script", 1)[0]
    text = (heading + body.rstrip("\n") + "\n\nEvery uniform script, tune's scripts and its Pareto table: "
            "[results/tune.md](results/tune.md).\n\n![tune, goal size](results/tune_size.png)\n")
    text += _subsection("tune_smollm2.md", "On a shipped pretrained model: SmolLM2-135M-Instruct",
                        cut="\n### Every uniform script", link="Every uniform script, tune's scripts and its Pareto table",
                        extra="\n![tune on SmolLM2-135M-Instruct, goal size](results/tune_smollm2_size.png)\n")
    # bench_tune.py --model smollm2 --goal latency --stem tune_smollm2_latency
    text += _subsection("tune_smollm2_latency.md", "SmolLM2-135M-Instruct, goal latency again, with the whole-model "
                        "statements", cut="\n### Every uniform script",
                        link="Every uniform script, tune's script and its Pareto table")
    # bench_tune_samplers.py: the knapsack against optuna's samplers
    text += _subsection("tune_samplers.md", "Why a knapsack: tune against optuna's samplers, same space, same wall time",
                        cut="\n### tune's script")
    # bench_tune_builtins.py: the search's cost on the built-ins
    text += _subsection("tune_builtins.md", "What a tune costs: the built-in Llama and Flux, every declared mode")
    return text


def serving_section() -> str:
    """Our GGUF exports in llama.cpp and decode speed against it (``benchmarks/bench_serving.py``
    writes ``results/serving.md``)."""
    heading = "## Serving: our GGUF export in llama.cpp\n"
    page = HERE / "results" / "serving.md"
    if not page.exists():
        return heading + "\nNot yet measured: `benchmarks/bench_serving.py` writes `benchmarks/results/serving.md`.\n"
    body = page.read_text().split("\n", 1)[-1]
    text = heading + body.rstrip("\n") + "\n\nThe page: [results/serving.md](results/serving.md).\n"
    # bench_serving_trained.py: the same KL on the LM trained here, where llama.cpp's rounding is not chaotic
    text += _subsection("serving_trained.md", "The same KL on the LM trained here (llama.cpp's rounding is not "
                        "chaotic there)")
    # bench_decode_kernels.py: why the quantized layers decode with kernels of ours
    text += _subsection("decode_kernels.md", "Why our own decode kernels: quantized layers fed a few rows, ours "
                        "against aten's packed kernels")
    # bench_decode_kernels.py --layers ...: the block types a Q4_K_M file holds besides Q4_K (q5_0, q6_k)
    text += _subsection("decode_kernels_gguf.md", "GGUF's Q5_0 and Q6_K decode kernels, beside q4_0, q4_k and q8_0")
    # bench_decode_kernels.py --layers ... --out decode_kernels_int4.md: quantize int4 with activations=int8
    text += _subsection("decode_kernels_int4.md", "quantize int4 activations=int8: int4's groups multiplied as "
                        "integers, beside float activations and q4_0")
    # bench_decode_kernels.py --layers q5_0 'q5_0 activations=int8' ...: Q5_0 with llama.cpp's arithmetic
    text += _subsection("decode_kernels_q5_0.md", "quantize q5_0 activations=int8 beside float activations and q4_0's")
    # bench_int8_activations.py: why activations=int8 (llama.cpp's arithmetic) decodes faster
    text += _subsection("int8_activations.md", "activations=int8: llama.cpp's arithmetic in our kernels, against "
                        "float32 activations")
    # bench_gguf_kquant.py: llama.cpp's own Q4_K_M file read by our import
    text += _subsection("serving_kquant.md", "A GGUF file a user already has: llama.cpp's Q4_K_M, read by our import")
    # bench_gguf_kquant.py --ftype Q5_K_M: the same for llama.cpp's Q5_K_M (Q5_K, Q5_1, Q6_K)
    text += _subsection("serving_kquant_q5_k_m.md", "And llama.cpp's Q5_K_M, read by our import")
    # bench_decode_kernels.py --layers q4_k q5_k q6_k q8_0: the K-quant kernels side by side
    text += _subsection("decode_kernels_kquant.md", "The K-quant decode kernels: q5_k beside q4_k, q6_k and q8_0")
    return text


def calibration_section() -> str:
    """Calibration (GPTQ, AWQ, SmoothQuant) on a real pretrained LM beside llm-compressor
    (``benchmarks/bench_calibration.py`` writes ``results/calibration.md``)."""
    heading = "## Calibration: GPTQ, AWQ and SmoothQuant against llm-compressor\n"
    page = HERE / "results" / "calibration.md"
    if not page.exists():
        return heading + ("\nNot yet measured: `benchmarks/bench_calibration.py` writes "
                          "`benchmarks/results/calibration.md`.\n")
    body = page.read_text().split("\n", 1)[-1]
    text = heading + body.rstrip("\n") + "\n\nThe page: [results/calibration.md](results/calibration.md).\n"
    # bench_calibration.py --only 'GPTQ int4 g64', on another day or CPU
    text += _subsection("calibration_gptq.md", "GPTQ again, after its column loop was made faster (the same benchmark, "
                        "GPTQ rows only)", strip_note=False)
    # bench_activations.py: activations=memory against disk
    text += _subsection("calibration_activations.md", "The samples' activations: in memory or in a file",
                        strip_note=False)
    return text


QUIET_INTRO = """### Our overhead, 21 rounds

Ours and by hand run the same hooks, so "ours ÷ by hand" measures only what we add; 21 rounds narrow the noise of
the 5-round tables above ([results/cache-quiet.md](results/cache-quiet.md), `--out` that file):
"""

QUIET_READING = """
Reading: the same hooks run (outputs identical to the by-hand ones, bit for bit).  Ours adds one hook at the
denoiser call (the cache-context check) and, for the caches that need the timestep, reads it from the call's
tensor where the by-hand loop hands the cache a Python float: a fixed cost of tens of
microseconds per call.  That is up to 3% of the tiny model's 1.3 ms step, and within the 1.02× target at
width 512 (a 22 ms step).
"""


def convert_section() -> str:
    """``convert`` against model size, and the larger-than-memory run (``benchmarks/bench_convert.py``
    writes ``results/convert.md``)."""
    page = HERE / "results" / "convert.md"
    if not page.exists():
        return "\nNot yet measured: `benchmarks/bench_convert.py` writes `benchmarks/results/convert.md`.\n"
    text = page.read_text()
    text = "\n" + text.split("\n", 1)[1] if text.startswith("# ") else text
    if "\n## " not in text:
        text += ("\n### Larger than memory\n\nNot yet measured: `nice -n 10 .venv/bin/python benchmarks/bench_convert.py "
                 "--llama-13b /work/bigllama` (a Llama-2-13B-shaped checkpoint, 26 GB bf16, written and converted "
                 "with `quantize nf4` and `fp8 storage` under a 10 GiB watchdog) adds its rows here.\n")
    return text.replace("\n## ", "\n### ")


def quantized_compute_section() -> str:
    """Issue 25's targets (``benchmarks/bench_quantized_compute.py`` writes ``results/quantized_compute.md``):
    the page's measurement line and its targets table."""
    page = HERE / "results" / "quantized_compute.md"
    if not page.exists():
        return ("\nNot yet measured: `benchmarks/bench_quantized_compute.py` writes "
                "`benchmarks/results/quantized_compute.md`.\n")
    # The latest run, then earlier runs on other kinds of CPU kept beside it (quantized_compute-<cpu>.md):
    # the kernels' speed follows the CPU's instructions, so each CPU keeps its own figures.
    out = ""
    for each in [page, *sorted((HERE / "results").glob("quantized_compute-*.md"))]:
        text = each.read_text()
        measured = next((line for line in text.splitlines() if line.startswith("Measured ")), "")
        targets = text.split("## Targets\n", 1)[1].split("\n## ", 1)[0] if "## Targets\n" in text else ""
        out += (f"\n{measured}\n{targets.rstrip()}\n\nDetails (per layer, whole models, the crossover, imports): "
                f"[results/{each.name}](results/{each.name}).\n")
    return out


def gaps_section(rows: list[dict]) -> str:
    """Every ratio past its limit, grouped under its explanation (each explanation once)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for ours, hand in pairs(rows):
        r = ratios(ours, hand)
        for metric in behind(r):
            why = note(ours["comparison"], hand["side"], metric, ours["size"]) or "Not explained yet."
            groups[why].append(f"  - {ours['workload']}, {ours['comparison']} vs {hand['side']}: "
                               f"{metric} {times(r[metric])}")
    if not groups:
        return "\nNowhere: on every measured comparison we are within the margins above.\n"
    return "".join(f"\n- {why}\n" + "\n".join(lines) + "\n" for why, lines in groups.items())


#: Why a by-hand baseline fails where it does: (words in its label, words in its error, why).
FAILURES = (("Linear4bit", ("block_n", "is invalid for input of size"),
             "stock bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel at the first call, and that "
             "kernel rejects layers whose output size is not a multiple of its 32-row blocks (the tiny models have "
             "16-wide ones); our 4-bit "
             "layers keep bitsandbytes' portable kernels (spec.md, \"Quantized layers compute the same on every "
             "CPU\")"),)


def status_section(rows: list[dict]) -> str:
    failed: dict[tuple[str, str, str], list[str]] = {}
    for r in rows:
        if not ok(r):
            failed.setdefault((r["comparison"], r["side"], r["status"]), []).append(r["workload"])
    if not failed:
        return ""
    lines = []
    for (comparison, side, status), where in sorted(failed.items()):
        why = next((text for label, errors, text in FAILURES
                    if label in side and any(e in status for e in errors)), None)
        lines.append(f"- {comparison} ({'transformdsl' if side == OURS else side}) on {', '.join(sorted(where))}: "
                     f"{status}" + (f"; {why}" if why else ""))
    return "\n### Rows that could not be measured\n\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- issue 15's targets

#: (comparison, measure, target as text, the limit): the performance targets of issue 15.
FP8_SCALES = (("fp8 storage", "row"), ("fp8 storage scale=tensor", "tensor"), ("fp8 storage scale=none", "none"),
              ("fp8 storage undo=memory", "row, undo=memory"))


def same_run_original(rows: list[dict], row: dict) -> dict | None:
    """The original model measured by the run that measured ``row`` (its anchor)."""
    return next((r for r in rows if r["side"] == ORIGINAL and r["workload"] == row["workload"] and ok(r)
                 and r.get("run") == row.get("run")), None)


def vs_original(rows: list[dict], ours: dict) -> tuple[float | None, str]:
    """Ours ÷ the untransformed model: from calls made in turn in one process when the run had
    that job (robust on a busy machine), else from the original model's job of the same run."""
    anchor = next((r for r in rows if (r["workload"], r["comparison"], r["side"]) ==
                   (ours["workload"], ours["comparison"], UNCHANGED_LABEL) and ok(r)), None)
    if anchor and interleaved(anchor):
        return interleaved(anchor), "the unchanged model, calls in turn in one process"
    original = same_run_original(rows, ours)
    if original and original["latency_s"] and ours.get("latency_s"):
        return ratio(ours["latency_s"], original["latency_s"]), "the original model's job (separate process)"
    return None, ""


def _target(model: str, measure: str, value: float | None, limit: float, target: str, how: str) -> dict:
    met = "—" if value is None else "yes" if value <= limit else "NO"
    return {"model": model, "measure": measure, "ours ÷ anchor": times(value), "target": target, "met": met,
            "anchor, same run": how}


def target_rows(rows: list[dict]) -> list[dict]:
    """Each target's figure on every model the run measured it on, ours ÷ its anchor."""
    out = []
    index = {(r["workload"], r["comparison"], r["side"]): r for r in rows}
    for ours in [r for r in rows if r["comparison"] == "quantize int8 weight_only" and r["side"] == OURS and ok(r)]:
        model = ours["workload"]
        torchao = index.get((model, ours["comparison"], "torchao Int8WeightOnlyConfig (W8A16)"))
        if torchao and ok(torchao):
            out.append(_target(model, "int8 weight-only: latency ÷ torchao W8A16", ratios(ours, torchao)["latency"],
                               1.0, "≤ 1.0×", "calls in turn in one process" if interleaved(torchao) else
                               "separate processes"))
        value, how = vs_original(rows, ours)
        if value is not None:
            out.append(_target(model, "int8 weight-only: latency ÷ fp32", value, 1.3, "≤ 1.3×", how))
        if ours.get("covered"):
            before, after = ours["covered"]
            # torchao's scheme keeps the same per-row scales: its whole model, in bytes, beside ours
            same = (f" (whole model ÷ torchao W8A16: {times(ratio(ours['weight_bytes'], torchao['weight_bytes']))})"
                    if torchao and ok(torchao) and torchao.get("weight_bytes") else "")
            out.append(_target(model, f"int8 weight-only: bytes of the layers it covers ÷ fp32{same}",
                               ratio(after, before), 0.27, "≈ 0.25×", "the same layers before"))
    for name, scale in FP8_SCALES:
        for ours in [r for r in rows if r["comparison"] == name and r["side"] == OURS and ok(r)]:
            hand = index.get((ours["workload"], name, "diffusers enable_layerwise_casting(fp8)"))
            if hand and ok(hand):
                out.append(_target(ours["workload"], f"fp8 storage scale={scale}: apply time ÷ diffusers "
                                   f"(error {sig(ours['error'], 2)} / {sig(hand['error'], 2)})",
                                   apply_ratio(ours, hand), 1.5, "≤ 1.5×",
                                   "enable_layerwise_casting, next job" + rounds_note(ours, hand)))
    for ours in reload_rows(rows):
        reload = ours["reload"]
        if ours["comparison"] == "quantize hqq" and "status" not in reload:
            others = sorted(ratio(r["reload"]["load_s"], r["reload"]["floor_s"]) for r in reload_rows(rows)
                            if r["workload"] == ours["workload"] and r is not ours and "status" not in r["reload"])
            context = f"the other scripts on this model: {times(others[0])}–{times(others[-1])}" if others else ""
            if reload.get("architecture_s"):
                # the floor any rebuild from a configuration has: the library's own constructor
                context += ("; " if context else "") + ("building the architecture alone, on meta: "
                                                        f"{times(ratio(reload['architecture_s'], reload['floor_s']))}")
            context = f" ({context})" if context else ""
            out.append(_target(ours["workload"], f"hqq reload ÷ floor (reading the bytes){context}",
                               ratio(reload["load_s"], reload["floor_s"]), 3.0, "≤ 3×",
                               "safetensors load_file, same process"))
    for ours in [r for r in rows if r["comparison"] == "compile" and r["side"] == OURS and ok(r)]:
        steady, how = vs_original(rows, ours)
        if steady is not None:
            out.append(_target(ours["workload"], f"compile: steady latency ÷ eager; cold start (first call) "
                               f"{sig(ours['first_call_s'])} s, stated apart", steady, 1.0, "≤ 1.0× steady", how))
    return out


def targets_section(rows: list[dict]) -> str:
    lines = target_rows(rows)
    if not lines:
        return "\nNone of issue 15's targets was measured by this run.\n"
    return ("\nEach figure is ours ÷ its anchor, both measured by the same run (the anchor column says where). "
            "Apply time includes planning, and reload the fixed cost of building the skeleton: on the tiny "
            "models (a few thousand parameters) those fixed costs are the whole figure, a few milliseconds "
            "against diffusers' one (compare the other scripts' reload on the same model, and the library's own "
            "constructor).  The bytes of the covered layers include one float32 scale per row and the unchanged "
            "bias: 0.25× plus 1/in_features, so tiny layers (16 wide) sit above 0.25×.  fp8 jobs read their "
            "checkpoint in bf16, memory-mapped, as users of bf16 models do.  `scale=none` is diffusers' plain "
            "cast; a per-row or per-tensor scale costs one more pass over each weight (its largest magnitude, "
            "then a division before the cast).  fp8 storage keeps what it replaces until the script has run (a "
            "failure puts it back): memory-mapped originals give their pages back as they are replaced (the file "
            "holds them) and nothing is written; originals in the process's own memory (a model cast at load, or "
            "built in memory) past the undo budget (`undo=\"auto\"`: 5% of the model, at least 64 MiB) are "
            "written to a temporary file instead, which the apply time then includes (see \"The undo log's "
            "memory\").\n\n"
            + table(lines, ["model", "measure", "ours ÷ anchor", "target", "met", "anchor, same run"]) + "\n")


def write_measured(rows: list[dict], meta: dict, path: Path) -> None:
    """The figures the plan's device notes quote (:data:`transformdsl.capabilities.CITED`), copied
    from this page's rows into the package (``transformdsl/measured.json``), by the kind of CPU
    their run was measured on; the figures of other kinds of CPU already in the file are kept."""
    from transformdsl import capabilities
    from transformdsl.capabilities import CITED

    cpus = {r["measured_at"]: r.get("cpu") for r in meta.get("runs", [])}
    cpus.setdefault(meta.get("measured_at"), meta.get("cpu"))
    cited: dict[str, dict] = {}
    for workload, comparison in CITED:
        ours = next((r for r in rows if (r["workload"], r["comparison"], r["side"]) == (workload, comparison, OURS)
                     and ok(r)), None)
        value, how = vs_original(rows, ours) if ours else (None, "")
        cpu = cpus.get(ours.get("run", meta.get("measured_at"))) if ours else None
        if value is None or not cpu:  # a row from a run that did not record its CPU is not quoted
            continue
        entry = {"latency_vs_original": round(value, 3), "anchor": how,
                 "measured_at": ours.get("run", meta.get("measured_at"))}
        if ours.get("covered"):
            entry["bytes_vs_original"] = round(ours["covered"][1] / ours["covered"][0], 3)
        kind = cited.setdefault(capabilities.cpu_kind(cpu), {"cpu": cpu, "rows": {}})
        kind["rows"][f"{workload} | {comparison}"] = entry
    if not cited:
        return
    try:
        previous = json.loads(path.read_text())
        kinds = previous.get("by_cpu")
        if kinds is None and isinstance(previous.get("cpu"), dict):  # the one-CPU format of older files
            kinds = {capabilities.cpu_kind(previous["cpu"]): {"cpu": previous["cpu"], "rows": previous["rows"]}}
        kinds = dict(kinds or {})
    except (OSError, ValueError, AttributeError, KeyError):  # missing or unreadable: written anew
        kinds = {}
    for kind, entry in cited.items():  # row by row: a kind's rows this run did not measure stay
        old = kinds.get(kind) or {}
        kinds[kind] = {"cpu": entry["cpu"], "rows": {**(old.get("rows") or {}), **entry["rows"]}}
    data = {"source": "benchmarks/RESULTS.md (written by benchmarks/report.py; do not edit)", "by_cpu": kinds}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    capabilities.measured.cache_clear()


# ---------------------------------------------------------------------- page

def write_report(rows: list[dict], scaling: list[dict], meta: dict, out: Path, draw) -> Path:
    """Write ``out/RESULTS.md``, and ``out/charts/*.png`` with ``draw(rows, points, folder)`` (which
    returns figure name → path; :func:`charts.draw_all`); return the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    points = scaling_points(scaling)
    figures = draw(rows, points, out / "charts")
    text = header("Benchmarks: transformdsl against doing it by hand", meta.get("measured_at"), meta["threads"])
    text += method(meta, rows)
    text += "\n## What is compared\n" + compared_section(rows)
    text += "\n## Issue 15's targets\n" + targets_section(rows)
    text += "\n## Ours ÷ by hand, at realistic width\n"
    text += headline([r for r in rows if r["size"] != "tiny"])
    for name in ("ratios", "ratios-medium"):
        if name in figures:
            text += f"\n![ours ÷ by hand]({figures[name]})\n"
    text += "\n## Ours ÷ by hand, tiny built-in models\n"
    text += "\nOn models this small, fixed per-call costs (hooks, Python dispatch) dominate the latency.\n"
    text += headline([r for r in rows if r["size"] == "tiny"])
    text += unpaired_section(rows)
    text += "\n## Where we are behind, and why\n" + gaps_section([r for r in rows if r["size"] != "tiny"])
    text += ("\nOn the tiny models (not listed here) every figure is a few milliseconds: our transform "
             "time there is mostly planning (validation, the module-tree snapshot), a fixed cost, and "
             "latencies move with the load of the machine.\n")
    text += "\n## Every configuration\n" + detail(rows) + status_section(rows)
    text += ("\n## Reload against the floor and against transforming again\n\n"
             "**floor**: `safetensors.torch.load_file` of the same files (reading the same bytes); **load**: "
             "`transformdsl.load(dir)` (it maps the file), then every byte read on both sides; **transform again**: "
             "`from_pretrained` of the original (every byte read) plus the transform time above.\n")
    text += reload_section(rows)
    if "reload" in figures:
        text += f"\n![reload]({figures['reload']})\n"
    text += "\n## Cost against model size\n" + scaling_section(points)
    if "scaling" in figures:
        text += f"\n![scaling]({figures['scaling']})\n"
    text += "\n## Planning\n" + planning_section()
    text += "\n## The undo log's memory (fp8 storage against layerwise casting)\n" + undo_section()
    text += "\n## Streaming a checkpoint through a script (convert)\n" + convert_section()
    if "convert" in figures:
        text += f"\n![convert]({figures['convert']})\n"
    text += "\n## Quantized compute (W8A8, packed int8/int4 weight-only)\n" + quantized_compute_section()
    text += "\n" + cache_section()
    text += "\n" + tune_section()
    text += "\n" + calibration_section()
    text += "\n" + serving_section()
    text += "\n## GPU\n" + gpu_section()
    text += "\n## Not measured\n\n" + NOT_MEASURED
    text += f"\nComparisons are declared in `benchmarks/comparisons.py` ({len(COMPARISONS)} entries), the by-hand "
    text += "code in `benchmarks/baselines.py`; raw numbers in `results/run.json`.\n"
    page = out / "RESULTS.md"
    page.write_text(text)
    if out.resolve() == HERE and not meta.get("quick") and not meta.get("in_process"):
        write_measured(rows, meta, HERE.parent / "transformdsl" / "measured.json")
    return page
