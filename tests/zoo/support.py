"""docs/SUPPORT.md from the matrix results (tests/zoo/matrix.py): generated, never typed by hand.

    python -m tests.zoo.support docs/SUPPORT.json docs/SUPPORT.md     # re-render without re-running
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

from .matrix import STATUSES

#: Short text of a status inside a table cell.
SHORT = {
    "ok": "ok",
    "not applicable": "–",
    "refused by verify": "**refused**",
    "past bound silently": "**PAST BOUND**",
    "crash in forward": "**CRASH**",
    "transform fails": "**FAILS**",
    "plan fails": "**plan fails**",
    "reload needs model=": "**needs model=**",
    "reload fails": "**reload fails**",
    "reload crash in forward": "**reload crash**",
    "reload mismatch": "**reload differs**",
    "timeout": "**timeout**",
    "worker died": "**died**",
    "corpus model fails": "**model fails**",
}

LEGEND = """\
Each cell: status · modules changed (for `fuse qkv`: fused / attention modules with separate q, k, v) ·
the error verify measures on the model's test input (spec.md "Numerical guard": KL per token for logits,
relative RMS error `‖after - before‖ / ‖before‖` otherwise) · `=` when `load(dir)` (no `model=`) gave a
bit-identical output.

| status | meaning |
|---|---|
| ok | ran with `verify=True` on the test input and two more samples, error within the script's declared bound (also on a held-out input verify never saw), saved, reloaded with `load(dir)` alone, bit-identical output |
| – | not applicable: no statement selected a module it can change (nothing to do) |
| refused | `verify=True` refused the result: on one of its samples the output moved past the script's declared bound (the model was left unchanged) |
| PAST BOUND | verify accepted, but on a held-out input the error is past the declared bound |
| CRASH | the transformed model's own forward raised (verify rolled the change back) |
| FAILS / plan fails | the statement failed while applying / planning (the model was left unchanged) |
| needs model= | the save only reloads when `model=` is passed |
| reload fails / reload crash / reload differs | `load(dir)` raised / the reloaded model's forward raised / its output is not bit-identical |
| timeout / died | the cell ran past its time limit / its worker process died |
"""



def _cpu_text(cpu: dict | None) -> str:
    """", on an AVX512 CPU (avx512_vnni, avx512_bf16)": the kernels bitsandbytes and torch pick differ by CPU."""
    from transformdsl.capabilities import cpu_text

    return f", on {cpu_text(cpu)}" if cpu else ""

def _fmt_error(value) -> str:
    if value is None:
        return ""
    if value == 0:
        return "0"
    return f"{value:.1e}"


def cell_text(cell: dict) -> str:
    parts = [SHORT.get(cell["status"], cell["status"])]
    if cell.get("fused") is not None:
        parts.append(f"{cell['fused']}/{cell.get('candidates') or 0}")
    elif cell.get("changed"):
        parts.append(str(cell["changed"]))
    if cell["status"] not in ("not applicable",) and cell.get("error") is not None:
        parts.append(_fmt_error(cell["error"]))
    if cell.get("reload") == "bit-identical" and cell["status"] != "not applicable":
        parts.append("=")
    return " · ".join(parts)


#: Short names of the ``save(format=...)`` targets (tests/zoo/matrix.py ``FORMATS``).
FORMAT_SHORT = {"transformers": "tf", "diffusers": "df", "compressed-tensors": "ct"}

FORMAT_LEGEND = """\
Which `save(model, dir, format=...)` targets carry each transformed model (spec.md, "Interchange"): **tf**
`format="transformers"`, **df** `format="diffusers"`, **ct** `format="compressed-tensors"`.  A name alone: the
directory was written and the library's stock `from_pretrained` (without transformdsl) loaded it here, its output
within the script's bound of the untransformed model's.  `name*`: written, but the stock loader does not run on
this machine (diffusers' bitsandbytes loader needs a GPU; the compressed-tensors package is not installed), so
only the writing is checked.  A format not listed was refused before anything was written (the reasons are
below); **bold** marks a failure (`save fails`, `stock load fails`, `stock past bound`).  `save(format=
"transformdsl")`, the default, carries every cell marked ok above.
"""


def format_text(cell: dict) -> str:
    """The save-format cell: working targets, ``*`` where only the writing is checked, failures bold."""
    formats = cell.get("formats")
    if not formats:
        return "–" if cell["status"] == "not applicable" else ""
    parts = []
    for fmt, result in formats.items():
        short = FORMAT_SHORT.get(fmt, fmt)
        if result["status"] == "ok":
            parts.append(short)
        elif result["status"] == "written":
            parts.append(short + "\\*")
        elif result["status"] != "refused":
            parts.append(f"**{short} {result['status']}**")
    return " ".join(parts) if parts else "none"


def qkv_coverage(report: dict) -> dict:
    """Models with separate q/k/v projections, and how many of them ``fuse qkv`` fused (all / some)."""
    cells = [c for c in report["cells"] if c["script"] == "fuse qkv" and c.get("candidates")]
    models = {"total": len(cells), "all": [], "some": [], "none": []}
    for cell in cells:
        fused = cell.get("fused") or 0 if cell["status"] in ("ok", "not applicable") else 0
        key = "all" if fused >= cell["candidates"] else "some" if fused else "none"
        models[key].append(cell["model"])
    return models


def summary(report: dict) -> dict:
    counts = Counter(cell["status"] for cell in report["cells"])
    return {status: counts[status] for status in STATUSES if counts[status]}


def cause(detail: str) -> str:
    """``detail`` without what varies between models (module paths, numbers): one key per cause."""
    detail = re.sub(r"[\w\[\]]+(\.[\w\[\]]+)+", "<path>", detail)
    return re.sub(r"\d+", "N", detail)[:120]


def _causes(cells: list[dict]) -> list[tuple[str, str, str, list[str]]]:
    """(status, script, detail, models) for every failing cell, grouped by identical cause."""
    groups = defaultdict(list)
    for cell in cells:
        if cell["status"] in ("ok", "not applicable"):
            continue
        detail = cell.get("detail") or ""
        groups[(cell["status"], cell["script"], cause(detail))].append((cell["model"].split("/", 1)[1], detail))
    found = [(s, sc, members[0][1][:240].replace("|", "\\|"), [m for m, _ in members])
             for (s, sc, _), members in groups.items()]
    return sorted(found,
                  key=lambda g: (STATUSES.index(g[0]) if g[0] in STATUSES else 99, g[1], -len(g[3])))


def _not_fused(report: dict) -> list[str]:
    """``Model: path (reason)`` for every q/k/v module ``fuse qkv`` left alone, where the cell says why."""
    out = []
    for cell in report["cells"]:
        if cell["script"] == "fuse qkv" and cell.get("not_fused"):
            name = cell["model"].split("/", 1)[1]
            out += [f"{name}: {path} ({reason})".replace("|", "\\|") for path, reason in cell["not_fused"].items()]
    return out


def _format_refusals(cells: list[dict]) -> list[tuple[str, str, str, int]]:
    """(format, script, first error, count) for each refused format, grouped by cause."""
    groups: dict = defaultdict(list)
    for cell in cells:
        for fmt, result in (cell.get("formats") or {}).items():
            if result["status"] == "refused":
                groups[(fmt, cell["script"], cause(result["detail"] or ""))].append(result["detail"] or "")
    found = [(fmt, script, details[0][:200].replace("|", "\\|"), len(details))
             for (fmt, script, _), details in groups.items()]
    return sorted(found, key=lambda g: (g[0], g[1], -g[3]))


def render(report: dict) -> str:
    columns = list(report["scripts"])
    by_model = defaultdict(dict)
    for cell in report["cells"]:
        by_model[cell["model"]][cell["script"]] = cell
    lines = [
        "# Is my model supported?",
        "",
        "<!-- Generated by `make zoo` (tests/zoo/matrix.py + tests/zoo/support.py). Do not edit by hand: "
        "re-run `make zoo`. -->",
        "",
        "**Generated** by `make zoo` (`python -m tests.zoo.matrix --markdown docs/SUPPORT.md`; the raw results are "
        "in [SUPPORT.json](SUPPORT.json)); never edited by hand.  Every transform on every model of the corpus "
        "(tests/zoo/): the tiny configurations diffusers' own model tests use, for every denoiser class they "
        "cover, and tiny configurations of transformers families, with random weights, on CPU.",
        "",
        f"Commit {report.get('commit', 'unknown')}; versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + f".  {len(report['cells'])} cells in {report['seconds'] / 60:.0f} min on {report['workers']} "
        "worker processes" + _cpu_text(report.get("cpu")) + ".",
        "",
        *([f"**Partial run:** {report['note']}", ""] if report.get("note") else []),
        "Scripts: " + "; ".join(f"**{name}** = `{text}`" for name, text in report["scripts"].items())
        + (f" (`compile` on {', '.join(m.split('/', 1)[1] for m in report['compile_slice'])} only: it is slow)"
           if "compile" in report["scripts"] else "") + ".",
        "",
        "## Summary",
        "",
    ]
    totals = summary(report)
    lines.append("| library | models | cells | " + " | ".join(totals) + " |")
    lines.append("|---|---|---|" + "---|" * len(totals))
    for library in ("diffusers", "transformers", None):
        cells = [c for c in report["cells"] if library is None or c["model"].startswith(library + "/")]
        counts = Counter(c["status"] for c in cells)
        name = library or "**all**"
        lines.append(f"| {name} | {len({c['model'] for c in cells})} | {len(cells)} | "
                     + " | ".join(str(counts[s]) for s in totals) + " |")
    coverage = qkv_coverage(report)
    if coverage["total"]:
        fused_any = len(coverage["all"]) + len(coverage["some"])
        lines += [
            "",
            f"**`fuse qkv` coverage:** of the {coverage['total']} models that have attention modules with separate "
            f"q, k, v projections, `fuse qkv` fuses all of them in **{len(coverage['all'])}** "
            f"({100 * len(coverage['all']) / coverage['total']:.0f}%), some in {len(coverage['some'])}, none in "
            f"{len(coverage['none'])}; at least one in {fused_any} ({100 * fused_any / coverage['total']:.0f}%).",
        ]
        if coverage["none"]:
            lines.append("Not fused: " + ", ".join(m.split("/", 1)[1] for m in coverage["none"]) + ".")
        if coverage["some"]:
            lines.append("Partly fused: " + ", ".join(m.split("/", 1)[1] for m in coverage["some"]) + ".")
        reasons = _not_fused(report)
        if reasons:
            lines.append("Not fused, with the plan's reason: " + "; ".join(reasons) + ".")
    lines += ["", LEGEND]
    for library in ("diffusers", "transformers"):
        models = [m for m in report["models"] if m["library"] == library]
        if not models:
            continue
        lines += _model_table(f"## {library}", models, by_model, columns, cell_text)
        skipped = report.get("skipped", {}).get(library) or []
        if skipped:
            lines.append(f"Not in the corpus ({library}):")
            lines += [f"- {s['class']}: {s['reason']}" for s in skipped]
            lines.append("")
    if any(cell.get("formats") for cell in report["cells"]):
        lines += ["## Save formats", "", FORMAT_LEGEND]
        for library in ("diffusers", "transformers"):
            models = [m for m in report["models"] if m["library"] == library]
            if not models:
                continue
            lines += _model_table(f"### {library}", models, by_model, columns, format_text)
        refusals = _format_refusals(report["cells"])
        if refusals:
            lines += ["Refused formats, by cause:", "", "| format | script | cells | first line of the error |",
                      "|---|---|---|---|"]
            for fmt, script, detail, count in refusals:
                lines.append(f"| {fmt} | {script} | {count} | {detail} |")
            lines.append("")
    causes = _causes(report["cells"])
    if causes:
        lines += ["## What fails, by cause", "", "| status | script | models | first line of the error |",
                  "|---|---|---|---|"]
        for status, script, detail, models in causes:
            names = ", ".join(models[:12]) + (f" and {len(models) - 12} more" if len(models) > 12 else "")
            lines.append(f"| {status} | {script} | {len(models)}: {names} | {detail} |")
        lines.append("")
    return "\n".join(lines)


def write_page(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(report))



def _model_table(heading: str, models: list[dict], by_model: dict, columns: list[str], render) -> list[str]:
    """One row per model, one column per script, each cell written by ``render``."""
    lines = [heading, "", "| model | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for model in models:
        cells = by_model[model["id"]]
        row = [render(cells[c]) if c in cells else "" for c in columns]
        lines.append(f"| {model['id'].split('/', 1)[1]} | " + " | ".join(row) + " |")
    return lines + [""]


if __name__ == "__main__":
    write_page(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
