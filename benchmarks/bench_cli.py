"""Command-line start-up: ``check``, ``fmt``, ``--help`` and ``--version`` must answer in ≤ 0.3 s.

Each command runs in a fresh interpreter, as a user runs it (``python -m transformdsl ...``), several
times in turn with the anchors; the figure is the median wall time.  Anchors: the bare interpreter
(``python -c pass``, the floor) and ``import torch`` (what every command paid before the command line
stopped importing it).  ``explain`` on the smallest built-in model is set against importing the model
library it needs (transformers' GPT-2), which is most of its time.

    .venv/bin/python benchmarks/bench_cli.py            # writes benchmarks/results/cli.md
    .venv/bin/python benchmarks/bench_cli.py --quick    # 3 runs each instead of 7
"""

from __future__ import annotations

import argparse
import os
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

COMMANDS = {
    "python -c pass (floor)": ["-c", "pass"],
    "transformdsl --version": ["-m", "transformdsl", "--version"],
    "transformdsl --help": ["-m", "transformdsl", "--help"],
    "transformdsl check examples/*.tfm": ["-m", "transformdsl", "check", "-q", *EXAMPLES],
    "transformdsl fmt --check examples/*.tfm": ["-m", "transformdsl", "fmt", "--check", *EXAMPLES],
    "python -c 'import torch' (anchor)": ["-c", "import torch"],
}
HEAVY = {
    "python -c 'import transformers...modeling_gpt2' (anchor)":
        ["-c", "import torch, transformers.models.gpt2.modeling_gpt2"],
    "transformdsl explain examples/gpt2_int8.tfm --model gpt2":
        ["-m", "transformdsl", "explain", "examples/gpt2_int8.tfm", "--model", "gpt2"],
}


def wall(argv: list[str]) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def medians(commands: dict[str, list[str]], runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in commands}
    for argv in commands.values():  # one warm-up each (file cache)
        wall(argv)
    for _ in range(runs):
        for name, argv in commands.items():  # in turn: load on the machine hits all alike
            times[name].append(wall(argv))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs = 3 if args.quick else 7
    light = medians(COMMANDS, runs)
    heavy = medians(HEAVY, max(1, runs // 2))
    floor, torch_s = light["python -c pass (floor)"], light["python -c 'import torch' (anchor)"]
    target = f"≤ {TARGET_S} s"
    rows = [{"command": name, "seconds": f"{s:.3f}", "÷ import torch": f"{s / torch_s:.2f}",
             target: ("yes" if s <= TARGET_S else "NO") if "transformdsl" in name else ""}
            for name, s in light.items()]
    anchor = heavy["python -c 'import transformers...modeling_gpt2' (anchor)"]
    heavy_rows = [{"command": name, "seconds": f"{s:.2f}", "÷ importing GPT-2": f"{s / anchor:.2f}"}
                  for name, s in heavy.items()]
    load = os.getloadavg()
    text = "\n".join([
        header("Command-line start-up"),
        "",
        __doc__.split("\n\n    .venv")[0],
        "",
        f"Median wall time of {runs} runs each, in a fresh process; load average {load[0]:.1f} at the end.",
        "",
        table(rows, ["command", "seconds", "÷ import torch", target]),
        "",
        f"Commands that need a model import the library that builds it (median of {max(1, runs // 2)}):",
        "",
        table(heavy_rows, ["command", "seconds", "÷ importing GPT-2"]),
        "",
        f"The floor (the interpreter alone) is {floor:.3f} s.",
    ])
    write("cli.md", text + "\n")


if __name__ == "__main__":
    main()
