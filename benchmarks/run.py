"""transformdsl against doing the same job by hand: the whole comparison, one command.

    .venv/bin/python benchmarks/run.py            # everything (`make bench`), a few minutes on 2 cores
    .venv/bin/python benchmarks/run.py --quick    # smoke run (< 1 min), written to benchmarks/_work/quick/

Writes ``benchmarks/RESULTS.md`` (tables), ``benchmarks/charts/*.png`` and the raw numbers
(``benchmarks/results/run.json``).  Every configuration (model x transform x who does it) is
measured in a fresh process (see :mod:`measure`); ours and the by-hand ways of one comparison
run one after the other so that they see the same machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402
import workloads  # noqa: E402
from comparisons import BY_NAME, COMPARISONS, Comparison  # noqa: E402
from measure import ORIGINAL, OURS, Isolated, Job, measure  # noqa: E402
from workloads import Workload  # noqa: E402

from transformdsl.capabilities import describe_cpu  # noqa: E402

#: The main comparison: every built-in architecture tiny, then Flux at width 768 and at FLUX.1's 3072.
FULL = [workloads.tiny("flux"), workloads.tiny("sd3"), workloads.tiny("unet"), workloads.tiny("llama"),
        workloads.flux("medium", heads=6), workloads.flux("large", heads=24)]
#: Not in the default run (minutes more on 2 cores); ``--models llama-large`` runs it.
EXTRA = [workloads.llama("large", workloads.LLAMA_LARGE)]
#: Flux at four widths (768 to 3072), for cost against size.
SCALING = [workloads.flux("medium", heads=6), workloads.flux("w1536", heads=12), workloads.flux("w2304", heads=18),
           workloads.flux("large", heads=24)]
SCALING_COMPARISON = "fuse qkv + quantize int8"
#: Calls of ours and of the by-hand model in turn, in one process (see measure._duel), per size.
DUEL_PAIRS = {"tiny": 7, "medium": 5, "large": 2}
QUICK_COMPARISONS = ("fuse qkv", "quantize int8", "fp8 storage")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny Flux, three comparisons: a smoke run (< 1 min)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this comparison (repeatable), e.g. --only 'quantize int8'")
    parser.add_argument("--models", action="append", default=[], metavar="KEY",
                        help="run only these workloads (repeatable), e.g. --models flux-large")
    parser.add_argument("--out", type=Path, help="where RESULTS.md and charts/ go "
                        "(default: benchmarks/, or benchmarks/_work/quick with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, fixed for every job (default 1: on a shared machine two OpenMP "
                             "threads wait on each other whenever another process holds a core)")
    parser.add_argument("--repeats", type=int, help="latency repeats (default 5, 3 with --quick)")
    parser.add_argument("--in-process", action="store_true",
                        help="run jobs in this process (for the smoke test; peak RSS then means little)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of results/run.json that this run does not measure again (a row "
                             "is a workload x comparison x side): regenerate only the sections you ran")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: write RESULTS.md and the charts again from results/run.json")
    return parser.parse_args(argv)


def applicable(comparison: Comparison, workload: Workload) -> bool:
    return workload.family in comparison.families and workload.size in comparison.sizes


def sides(comparison: Comparison, workload: Workload, quick: bool) -> list[str]:
    """Ours first, then every by-hand way that applies (torchao ones skipped in a quick run)."""
    return [OURS] + [b.label for b in comparison.baselines
                     if workload.family in b.families and workload.size in (b.sizes or comparison.sizes)
                     and not (quick and b.needs)]


def plan_jobs(args: argparse.Namespace) -> tuple[list[Job], list[Job]]:
    """The main jobs and the scaling jobs, in the order they run."""
    chosen = [c for c in COMPARISONS if c.name in args.only or not args.only and not c.optional]
    if args.quick:
        chosen = [c for c in chosen if args.only or c.name in QUICK_COMPARISONS]
    repeats = args.repeats or (3 if args.quick else 5)
    main_workloads = [workloads.tiny("flux")] if args.quick else FULL
    if args.models:
        main_workloads = [w for w in FULL + EXTRA if w.key in args.models]
    common = dict(threads=args.threads, warmup=1)
    jobs = []
    for workload in main_workloads:
        # the large models cost seconds per call: fewer repeats, as the median is stable there
        large = workload.size == "large"
        n = 1 if large else repeats  # at width 3072 the duels carry the latency ratios
        common["warmup"] = 0 if large else 1  # the timed first call warms up too
        jobs.append(Job(workload, ORIGINAL, ORIGINAL, repeats=n, **common))
        for comparison in chosen:
            if applicable(comparison, workload):
                # bf16 matmuls are slow on CPUs without bf16 units: no duel for fp8 jobs at width 3072
                duel = DUEL_PAIRS[workload.size] if comparison.duel and not (
                    large and comparison.dtype != torch.float32) else 0
                jobs += [Job(workload, comparison.name, side, repeats=n, duel=duel, **common)
                         for side in sides(comparison, workload, args.quick)]
                # more rounds of the apply time, the sides in turn, each round in the other order than the
                # one before (ABBA: a drift in the machine's speed weighs on both sides alike)
                order = sides(comparison, workload, args.quick)
                jobs += [Job(workload, comparison.name, side, apply_only=True, **common)
                         for r in range(1, comparison.apply_rounds) for side in (order[::-1] if r % 2 else order)]
    scaling = []
    if not args.quick and not args.only and not args.models:
        scaling = [Job(workload, SCALING_COMPARISON, OURS, latency=False, best_of=2, **common)
                   for workload in SCALING]
    return jobs, scaling


def needed_backends(jobs: list[Job]) -> set[str]:
    """Top-level packages the jobs import, so the fork server preloads them once."""
    from comparisons import BY_NAME

    need = set()
    for job in jobs:
        comparison = BY_NAME.get(job.comparison)
        if comparison is None:
            continue
        text = comparison.script_for(job.workload)
        if job.side == OURS:
            need |= {"bitsandbytes"} if any(m in text for m in ("int8", "nf4", "fp4")) else set()
            need |= {"hqq"} if "hqq" in text else set()
        for baseline in comparison.baselines:
            if baseline.label == job.side:
                name = baseline.fn.__name__  # e.g. "diffusers_fuse_qkv+bnb_int8"
                need |= {pkg for key, pkg in (("bnb", "bitsandbytes"), ("hqq", "hqq"), ("torchao", "torchao"),
                                              ("compile", "compile")) if key in name}
        need |= {"compile"} if "compile" in text else set()
    return need


def make_runner(args: argparse.Namespace, jobs: list[Job]):
    """``runner(job) -> row``: a fresh forked process per job, or this process for the smoke test."""
    need = needed_backends(jobs)
    paths = [str(HERE), str(HERE.parent)]
    if "torchao" in need and workloads.TORCHAO_SITE.is_dir():
        sys.path.append(str(workloads.TORCHAO_SITE))
        paths.append(str(workloads.TORCHAO_SITE))
    if args.in_process:
        return measure
    return Isolated(need, paths, timeout_s=args.timeout)


def torchao_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def execute(jobs: list[Job], runner, label: str) -> list[dict]:
    rows = []
    for i, job in enumerate(jobs, 1):
        started = time.perf_counter()
        row = runner(job)
        row["wall_s"] = time.perf_counter() - started
        rows.append(row)
        print(f"[{label} {i}/{len(jobs)}] {job.workload.key:12} {job.comparison:26} {job.side[:44]:44} "
              f"{row['wall_s']:6.1f} s  {row['status'][:70]}", flush=True)
    return rows


def fold_rounds(jobs: list[Job], rows: list[dict]) -> list[dict]:
    """The rows of the full jobs, each with ``apply_rounds_s``: its transform time and those of
    its comparison's other rounds, in the order they ran (None where a round failed, and its
    status in ``apply_rounds_failed``)."""
    full = {}
    out = []
    for job, row in zip(jobs, rows):
        key = (job.workload.key, job.comparison, job.side)
        if not job.apply_only:
            full[key] = row
            out.append(row)
            continue
        main = full.get(key)
        if main is None or main["status"] != "ok":
            continue
        main.setdefault("apply_rounds_s", [main["transform_s"]]).append(
            row.get("transform_s") if row["status"] == "ok" else None)
        if row["status"] != "ok":
            main.setdefault("apply_rounds_failed", []).append(row["status"])
    return out


def merged(old: dict, rows: list[dict], scaling: list[dict], meta: dict) -> tuple[list[dict], list[dict], dict]:
    """This run's rows in place of the same (workload, comparison, side) of an earlier run, the
    earlier run's other rows kept (tagged with the run that measured them); ``meta["runs"]``
    lists every run whose rows remain, newest first."""
    earlier = [{"command": old["meta"]["command"], "measured_at": old["meta"]["measured_at"],
                "seconds": old["meta"]["seconds"], "cpu": old["meta"].get("cpu")}, *old["meta"].get("runs", [])[1:]]

    def keep(old_rows: list[dict], new_rows: list[dict], key) -> list[dict]:
        fresh = {key(r) for r in new_rows}
        kept = []
        for row in old_rows:
            row.setdefault("run", old["meta"]["measured_at"])
            if key(row) not in fresh:
                kept.append(row)
        return kept + new_rows

    # An original row stays as long as rows of its run on its workload do: their ratios use it.
    rows = keep(old["rows"], rows, lambda r: (r["workload"], r["comparison"], r["side"],
                                              r.get("run") if r["side"] == "original" else None))
    used = {(r["workload"], r["run"]) for r in rows if r["side"] != "original"}
    rows = [r for r in rows if r["side"] != "original" or (r["workload"], r["run"]) in used]
    scaling = keep(old["scaling"], scaling, lambda r: r["workload"]) if scaling else old["scaling"]
    runs_left = {r.get("run") for r in rows + scaling}
    this = {"command": meta["command"], "measured_at": meta["measured_at"], "seconds": meta["seconds"],
            "cpu": meta.get("cpu")}
    meta = {**meta, "runs": [this, *(r for r in earlier if r["measured_at"] in runs_left)]}
    return rows, scaling, meta


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    out = args.out or (HERE / "_work" / "quick" if args.quick else HERE)
    if args.report_only:
        from charts import draw_all
        from report import write_report

        data = json.loads((out / "results" / "run.json").read_text())
        return write_report(data["rows"], data["scaling"], data["meta"], out, draw_all)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started, load_before = time.time(), os.getloadavg()
    torch.set_num_threads(args.threads)  # as in every job (and as the page header reports)
    jobs, scaling = plan_jobs(args)
    for stale in [workloads.WORK / "saved", *workloads.WORK.glob("inductor-*")]:
        shutil.rmtree(stale, ignore_errors=True)  # models saved and graphs compiled by an earlier run
    for workload in dict.fromkeys(job.workload for job in jobs + scaling):
        workloads.prepare(workload)
    for workload, dtype in dict.fromkeys((job.workload, BY_NAME[job.comparison].dtype) for job in jobs + scaling
                                         if job.comparison in BY_NAME):
        workloads.prepare(workload, dtype)  # the checkpoint a job in another dtype reads
    runner = make_runner(args, jobs + scaling)
    if args.in_process:
        gc.freeze()  # as the fork server does: keeps each gc.collect() of a job from scanning every import
    try:
        rows = fold_rounds(jobs, execute(jobs, runner, "main"))
        scaling_rows = execute(scaling, runner, "scaling")
    finally:
        gc.unfreeze()
    meta = {"measured_at": time.time(), "command": ".venv/bin/python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "quick": args.quick, "seconds": time.time() - started, "threads": args.threads,
            "load_before": load_before, "load_after": os.getloadavg(), "in_process": args.in_process,
            "torchao": "torchao" in needed_backends(jobs) and workloads.TORCHAO_SITE.is_dir(),
            "torchao_version": torchao_version(), "cpu": describe_cpu()}
    raw = out / "results" / "run.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    for row in rows + scaling_rows:
        row["run"] = meta["measured_at"]  # ratios to the original model use the original of the same run
    if args.merge and raw.exists():
        rows, scaling_rows, meta = merged(json.loads(raw.read_text()), rows, scaling_rows, meta)
    else:  # one run: the list of runs is this one (the rows name it; the page and the tests read it)
        meta["runs"] = [{"measured_at": meta["measured_at"], "command": meta["command"], "seconds": meta["seconds"],
                         "cpu": meta["cpu"]}]
    raw.write_text(json.dumps({"meta": meta, "rows": rows, "scaling": scaling_rows}, indent=1, default=str))
    from charts import draw_all
    from report import write_report

    page = write_report(rows, scaling_rows, meta, out, draw_all)
    print(f"\n{len(rows) + len(scaling_rows)} jobs in {meta['seconds']:.0f} s; written {page}")
    return page


if __name__ == "__main__":
    main()
