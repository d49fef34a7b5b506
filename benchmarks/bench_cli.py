"""Command-line start-up: ``check``, ``fmt``, ``--help`` and ``--version`` must answer in ≤ 0.3 s.

Each command runs in a fresh interpreter, as a user runs it (``python -m transformdsl ...``), several
times in turn with the anchors; the figure is the median wall time.  Anchors: the bare interpreter
(``python -c pass``, the floor) and ``import torch`` (what every command paid before the command line
stopped importing it).

``explain`` on each built-in model is set against building that model by hand in a fresh interpreter
(importing torch and its library, diffusers or transformers, then constructing it): what any tool that
looks at the model pays.  The ratio is what ``explain`` adds on top (our imports, the plan).  A plain
torch model (``benchmarks/cli_models.py``) shows what ``explain`` costs where the model's library imports
nothing heavy.  With ``--before DIR`` (another checkout of transformdsl, e.g. ``git archive`` of an older
commit unpacked there) the same ``explain`` commands of that checkout run in turn with ours.

    .venv/bin/python benchmarks/bench_cli.py            # writes benchmarks/results/cli.md
    .venv/bin/python benchmarks/bench_cli.py --quick    # 3 light runs each instead of 7, 1 heavy instead of 3
    .venv/bin/python benchmarks/bench_cli.py --before /tmp/transformdsl-old
    .venv/bin/python benchmarks/bench_cli.py --only-light   # light commands; explain table kept
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, table, write  # noqa: E402

EXAMPLES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.tfm"))
TARGET_S = 0.3
#: The last explain table (``--only-light`` keeps it).
EXPLAIN_JSON = ROOT / "benchmarks" / "results" / "cli_explain.json"

COMMANDS = {
    "python -c pass (floor)": ["-c", "pass"],
    "transformdsl --version": ["-m", "transformdsl", "--version"],
    "transformdsl --help": ["-m", "transformdsl", "--help"],
    "transformdsl check examples/*.tfm": ["-m", "transformdsl", "check", "-q", *EXAMPLES],
    "transformdsl fmt --check examples/*.tfm": ["-m", "transformdsl", "fmt", "--check", *EXAMPLES],
    "python -c 'import torch' (anchor)": ["-c", "import torch"],
}

#: model spec → the example written for it.
EXPLAINED = {
    "benchmarks.cli_models:mlp": "examples/gpt2_int8.tfm",
    "gpt2": "examples/gpt2_int8.tfm",
    "llama": "examples/llama_hqq.tfm",
    "flux": "examples/demo.tfm",
    "sd3": "examples/flux_int8.tfm",
    "unet": "examples/quantize_denoiser.tfm",
    "sd-pipeline": "examples/sd_pipeline.tfm",
}


def build_by_hand(spec: str) -> list[str]:
    """``python -c`` that builds the model of ``spec`` and nothing else (transformdsl.models imports only torch)."""
    if ":" in spec:
        module, factory = spec.split(":")
        return ["-c", f"import {module}; {module}.{factory}()"]
    return ["-c", f"from transformdsl.models import BUILTIN; BUILTIN[{spec!r}]()"]


def wall(argv: list[str], checkout: Path = ROOT) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds ``python ARGV`` takes with ``checkout``'s transformdsl (run
    from there: ``-m`` puts the current directory first on the path); ``examples/`` paths are this checkout's."""
    path = os.pathsep.join(dict.fromkeys([str(checkout), str(ROOT)]))  # ROOT: benchmarks.cli_models
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    argv = [str(ROOT / a) if a.startswith("examples/") else a for a in argv]
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return elapsed, (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime)


def medians(commands: dict[str, tuple[list[str], Path]], runs: int,
            warmup: bool = True) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each ``name → (argv, checkout)``, the commands run in turn ``runs`` times."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    if warmup:
        for argv, checkout in commands.values():  # one warm-up each (file cache)
            wall(argv, checkout)
    for _ in range(runs):
        for name, (argv, checkout) in commands.items():  # in turn: load on the machine hits all alike
            times[name].append(wall(argv, checkout))
    return {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for name, ts in times.items()}


def explain_rows(runs: int, before: Path | None) -> list[dict]:
    rows = []
    for spec, script in EXPLAINED.items():
        commands = {"by hand": (build_by_hand(spec), ROOT),
                    "explain": (["-m", "transformdsl", "explain", script, "--model", spec], ROOT)}
        if before is not None:
            commands["before"] = (commands["explain"][0], before)
        seconds = {name: wall_cpu[0] for name, wall_cpu in medians(commands, runs, warmup=False).items()}
        row = {"model": spec, "script": script, "build by hand (s)": f"{seconds['by hand']:.2f}",
               "explain (s)": f"{seconds['explain']:.2f}",
               "explain ÷ by hand": f"{seconds['explain'] / seconds['by hand']:.2f}"}
        if before is not None:
            row["explain before (s)"] = f"{seconds['before']:.2f}"
            row["after ÷ before"] = f"{seconds['explain'] / seconds['before']:.2f}"
        rows.append(row)
        print(row, flush=True)
    return rows


def explain_section(args: argparse.Namespace, runs: int) -> list[str]:
    """The explain table: measured now, or (``--only-light``) the last one, kept in ``EXPLAIN_JSON``."""
    if args.only_light:
        if not EXPLAIN_JSON.is_file():
            return []
        saved = json.loads(EXPLAIN_JSON.read_text())
    else:
        saved = {"rows": explain_rows(runs, args.before), "runs": runs, "load": os.getloadavg()[0],
                 "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "before": str(args.before) if args.before else None}
        EXPLAIN_JSON.write_text(json.dumps(saved, indent=1, ensure_ascii=False) + "\n")
    columns = ["model", "script", "build by hand (s)", "explain (s)", "explain ÷ by hand"]
    if saved["before"]:
        columns += ["explain before (s)", "after ÷ before"]
    parts = ["", f"`explain FILE --model SPEC` against building the model by hand (measured {saved['measured']}, "
                 f"median of {saved['runs']}, in turn; load average {saved['load']:.1f} after them):",
             "", table(saved["rows"], columns)]
    if saved["before"]:
        parts += ["", f"before: the checkout in {saved['before']} (`--before`)."]
    if saved.get("note"):
        parts += ["", f"Note: {saved['note']}."]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="another transformdsl checkout, measured in turn with this one")
    parser.add_argument("--only-light", action="store_true",
                        help="measure only the light commands; the explain table is the last run's")
    args = parser.parse_args()
    runs = 3 if args.quick else 7
    heavy_runs = 1 if args.quick else 3
    commands = {name: (argv, ROOT) for name, argv in COMMANDS.items()}
    if args.before is not None:
        commands["transformdsl check examples/*.tfm (before)"] = (commands["transformdsl check examples/*.tfm"][0],
                                                                  args.before)
    light = medians(commands, runs)
    floor, torch_s = light["python -c pass (floor)"][0], light["python -c 'import torch' (anchor)"][0]
    target = f"≤ {TARGET_S} s"
    rows = [{"command": name, "seconds": f"{s:.3f}", "CPU seconds": f"{cpu:.3f}", "÷ import torch": f"{s / torch_s:.2f}",
             target: ("yes" if s <= TARGET_S else "NO") if "transformdsl" in name else ""}
            for name, (s, cpu) in light.items()]
    load = os.getloadavg()
    parts = [
        header("Command-line start-up"),
        "",
        __doc__.split("\n\n    .venv")[0],
        "",
        f"Median wall time of {runs} runs each, in a fresh process; load average {load[0]:.1f} after them.",
        "CPU seconds (user + system) are what the command itself costs: its wall time on an idle machine.",
        "",
        table(rows, ["command", "seconds", "CPU seconds", "÷ import torch", target]),
        "",
        f"The floor (the interpreter alone) is {floor:.3f} s.",
    ]
    parts += explain_section(args, heavy_runs)
    write("cli.md", "\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
