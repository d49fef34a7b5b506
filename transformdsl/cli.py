"""The ``transformdsl`` command: check, fmt, explain, apply, convert, inspect, tune, demo.

Exit status: 0 on success, 1 when the input is wrong (a script, a saved model, a model
spec), 2 for a usage error.  Diagnostics go to stderr as ``FILE:LINE:COL: message``
followed by the offending line and a caret.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from .errors import LoadError, ScriptError, TransformError


def _offline() -> None:
    # Nothing in this tool may reach a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _err(message: str) -> None:
    print(message, file=sys.stderr)


def _read_script(path: str):
    """The script in file ``path``; ``-``: standard input (at most the script size limit is read)."""
    from .parser import MAX_SCRIPT_CHARS, parse, parse_file

    if path == "-":
        return parse(sys.stdin.read(MAX_SCRIPT_CHARS + 1), filename="<stdin>")  # parse refuses longer
    return parse_file(path)


def _model(spec: str, dtype: str = "auto"):
    from .dtypes import parse_dtype
    from .models import resolve_model

    directory = os.path.expanduser(spec)
    if os.path.isfile(os.path.join(directory, "transformdsl.json")):
        # A transformdsl save (``apply --out``): loaded as `load` would, its transforms replayed.
        from .persist import load

        if dtype != "auto":
            raise TransformError(f"--model {spec}: a transformdsl save is read in the dtypes it was saved in; "
                                 "drop --dtype")
        return load(directory)
    try:
        return resolve_model(spec, dtype=parse_dtype(dtype))
    except ValueError as exc:
        message = str(exc)  # resolve_model names the spec itself in most messages: not twice
        raise TransformError(message if message.startswith("--model ") else f"--model {spec}: {message}") from None


def cmd_check(args) -> int:
    from .registry import declarations
    from .validate import validate

    status = 0
    for name in args.files:
        try:
            validated = validate(_read_script(name), declarations())  # the declarations only: no torch
        except ScriptError as exc:
            _err(str(exc))
            status = 1
            continue
        if not args.quiet:
            print(f"{'<stdin>' if name == '-' else name}: ok ({len(validated.steps)} statement(s))")
    return status


def cmd_explain(args) -> int:
    if args.options:
        from .explain import render_options
        from .registry import declarations
        from .validate import validate

        print(render_options(validate(_read_script(args.file), declarations())))  # the declarations: no torch
        return 0
    if args.model is None:
        args.explain_parser.error("the following arguments are required: --model")
    from .planner import plan

    the_plan = plan(_model(args.model, args.dtype), _read_script(args.file))
    if args.json:
        print(json.dumps(the_plan.to_json(), indent=1))
    else:
        print(the_plan)
    return 0


def cmd_apply(args) -> int:
    from .executor import transform
    from .persist import save
    from .planner import plan

    model = _model(args.model, args.dtype)
    if args.verify or args.verify_with is not None:
        _check_verify(model)
    script = _read_script(args.file)
    the_plan = plan(model, script)
    if not args.quiet:
        print(the_plan)
        print()
    import warnings

    from .executor import NothingToDoWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NothingToDoWarning)
        try:
            transform(model, the_plan, progress=not args.quiet and sys.stderr.isatty(),
                      log=None if args.quiet else print, verify=_verify_arg(args), strict=args.strict)
        except TransformError as exc:
            raise TransformError(_cli_words(str(exc))) from exc
    for warning in caught:
        if issubclass(warning.category, NothingToDoWarning):
            _err(f"warning: {warning.message} (--strict makes this an error)")
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if args.out:
        save(model, args.out, format=args.format)
        if not args.quiet:
            print(f"saved to {args.out}")
    else:
        _err("note: no --out DIR given: the transformed model was checked and discarded, not saved")
    return 0


def cmd_convert(args) -> int:
    """Stream a checkpoint through a script into a save, one unit (block) at a time."""
    import warnings

    from .executor import NothingToDoWarning
    from .streaming import convert

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NothingToDoWarning)
        convert(args.model, _read_script(args.file), args.out, component=args.component,
                progress=not args.quiet and sys.stderr.isatty(), max_shard_size=args.max_shard_size,
                strict=args.strict, log=None if args.quiet else print, workers=args.workers)
    for warning in caught:
        if issubclass(warning.category, NothingToDoWarning):
            _err(f"warning: {warning.message} (--strict makes this an error)")
    if not args.quiet:
        print(f"saved to {args.out}")
    return 0


def _positive(text: str) -> int:
    """A whole number from 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number from 1")
    return int(text)


def _byte_count(text: str) -> int:
    """``5GB``, ``500MB``, ``200KB`` or a number of bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    upper = text.strip().upper()
    for suffix, factor in units.items():
        if upper.endswith(suffix) and upper[:-len(suffix)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[:-len(suffix)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB)")


def _verify_arg(args) -> object:
    """``transform``'s ``verify=`` from ``--verify`` and ``--verify-with``."""
    if args.verify_with is not None:
        from .verification import parse_cli

        return parse_cli(args.verify_with)
    return args.verify


def _cli_words(message: str) -> str:
    """An error of the Python API, its fix said the way the command line can do it."""
    from .executor import VERIFY_INPUTS_HINT

    return message.replace(VERIFY_INPUTS_HINT, _VERIFY_FIX)


#: How to do without the command line's sample inputs.
_VERIFY_FIX = "drop --verify, or verify from Python, where transform() takes sample inputs of your own"


def _check_verify(model) -> None:
    """``--verify`` on a model the command line cannot make a sample input for: refused before anything runs."""
    from .models import SAMPLE_KINDS, sample_inputs_problem

    problem = sample_inputs_problem(model)
    if problem:
        raise TransformError(f"--verify runs the model on a sample input, which the command line makes from the "
                             f"model's config for {SAMPLE_KINDS} (and subclasses): not for {problem}; "
                             f"{_VERIFY_FIX} (nothing was changed)")


def cmd_fmt(args) -> int:
    """Rewrite scripts in canonical form (or, with --check, list those that are not)."""
    from .formatter import format_script
    from .parser import MAX_SCRIPT_CHARS, parse, read_script_file

    status = 0
    for name in args.files:
        if name == "-":
            text, filename = sys.stdin.read(MAX_SCRIPT_CHARS + 1), "<stdin>"  # parse refuses longer
        else:
            try:
                text, filename = read_script_file(name, newline=""), name
            except (OSError, UnicodeDecodeError) as exc:
                _err(f"{name}: cannot read: {exc}")
                status = 1
                continue
        try:
            formatted = format_script(parse(text, filename=filename))
        except ScriptError as exc:
            _err(str(exc))
            status = 1
            continue
        if name == "-":
            sys.stdout.write(formatted)
        elif formatted != text:
            if args.check:
                print(f"would reformat {name}")
                status = 1
            else:
                _replace_file(name, formatted)
                print(f"reformatted {name}")
    return status


def _replace_file(name: str, text: str) -> None:
    """Write ``text`` to ``name`` atomically (a sibling temporary file renamed over it)."""
    import shutil
    import tempfile

    directory = os.path.dirname(os.path.abspath(name))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(name)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        shutil.copymode(name, tmp)
        os.replace(tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cmd_inspect(args) -> int:
    from .explain import human_bytes
    from .persist import inspect

    info = inspect(args.dir)
    if args.json:
        print(json.dumps(info, indent=1))  # ensure_ascii: control characters come out as \u escapes
        return 0
    _print_inspect(_escaped(info), human_bytes, indent="")
    return 0


def _escaped(value, keep: str = " "):
    """``value`` with every string's control characters shown escaped (``\x1b``): text from
    a shared save must not drive the terminal (retitle, clear, fake output)."""
    if isinstance(value, str):
        return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in value)
    if isinstance(value, dict):
        return {_escaped(k): _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def _print_inspect(info: dict, human_bytes, indent: str) -> None:
    if info.get("kind") == "pipeline":
        print(f"{indent}pipeline {info['pipeline_class']} (format version {info['format_version']})")
        for name, part in info["components"].items():
            if part.get("kind") == "module":
                print(f"{indent}  {name}:")
                _print_inspect(part, human_bytes, indent + "    ")
            else:
                print(f"{indent}  {name}: saved by its library")
        return
    if "format_version" not in info:
        return
    print(f"{indent}model: {info['model']} ({info.get('library') or 'no config'}), "
          f"format version {info['format_version']}")
    interop = info.get("interop") or {}
    if interop.get("imported"):
        print(f"{indent}a {interop['imported']} checkpoint; layers it holds already quantized are listed as applied")
    elif interop.get("format"):
        if interop.get("stock_needs"):
            print(f"{indent}saved in the {interop['format']} layout: its stock from_pretrained loads it only with "
                  f"{interop['stock_needs']}; transformdsl.load reads it on any machine")
        else:
            print(f"{indent}saved in the {interop['format']} layout: its stock from_pretrained loads it")
        for note in interop["notes"]:
            print(f"{indent}  {note}")
    if info["steps"]:
        print(f"{indent}applied:")
        for step in info["steps"]:
            print(f"{indent}  line {step['line']}: {step['statement']}")
    else:
        print(f"{indent}applied: nothing")
    total = sum(e["bytes"] for e in info["tensors"].values())
    print(f"{indent}tensors: {human_bytes(total)} in {len(info['files'])} file(s)")
    for dtype, entry in sorted(info["tensors"].items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"{indent}  {dtype:<8} {entry['tensors']:>6} tensors {human_bytes(entry['bytes']):>12}")


def _duration(text: str) -> float:
    """``--budget``: seconds, or a number with s, m or h (``90s``, ``10m``, ``1.5h``)."""
    units = {"s": 1, "m": 60, "h": 3600}
    value = text.strip().lower()
    factor = units.get(value[-1:], None)
    try:
        seconds = float(value[:-1] if factor else value) * (factor or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 90s, 10m or 1.5h") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration above 0")
    return seconds


def _calibration(path: str | None) -> list | None:
    """``--calibration FILE``: the rows of the ``input_ids`` tensor (N, L) of a safetensors file."""
    if path is None:
        return None
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise LoadError(f"--calibration {path}: not a readable safetensors file ({exc})") from None
    ids = tensors.get("input_ids")
    if ids is None or ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool or not ids.numel():
        found = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in tensors.items()) or "no tensor"
        raise LoadError(f"--calibration {path}: expected an integer tensor named input_ids of shape (N, L); found {found}")
    return [row.view(1, -1).long() for row in ids]


def cmd_tune(args) -> int:
    from .tune import check, tune

    budgets = {"max_kl": args.max_kl, "max_rms": args.max_rms, "max_ppl_ratio": args.max_ppl_ratio}
    model = _model(args.model, args.dtype)
    calibration = _calibration(args.calibration)
    if args.check:
        result = check(model, args.check, calibration=calibration, **budgets)
        print(result)
        return 0 if result.passed else 1
    if args.out is None:
        raise TransformError("tune: --out FILE is where the script is written (or --check FILE to re-measure one)")
    storage = args.storage if args.storage is not None else args.out + ".study.db"
    result = tune(model, goal=args.goal, calibration=calibration, modes=args.mode, budget_s=args.budget,
                  storage=None if storage == "memory" else storage, evaluations=args.evaluations,
                  statements=None if args.statement is None else [s for s in args.statement if s != "none"],
                  progress=not args.quiet, log=None if args.quiet else _err, **budgets)
    print(result.table())
    print(result)
    if result.script:
        with open(args.out, "w") as handle:
            handle.write(result.script)
        print(f"wrote {args.out}")
        plot = args.plot if args.plot is not None else os.path.splitext(args.out)[0] + ".png"
        if plot != "none":
            print(f"wrote {result.plot(plot)}")
    if result.partial and "interrupted" in result.reason:
        return 130
    return 0 if result.passed else 1


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(model_name=args.model, script_path=args.script, out=args.out)


def build_parser() -> argparse.ArgumentParser:
    from .version import __version__

    parser = argparse.ArgumentParser(prog="transformdsl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="parse and validate scripts (no model needed)")
    p.add_argument("files", nargs="+", metavar="FILE", help="scripts to check; '-': standard input")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing for valid scripts")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("fmt", help="rewrite scripts in canonical form (comments kept)")
    p.add_argument("files", nargs="+", metavar="FILE", help="scripts to rewrite in place; '-': stdin to stdout")
    p.add_argument("--check", action="store_true",
                   help="write nothing; list the files that are not in canonical form (exit status 1)")
    p.set_defaults(func=cmd_fmt)

    model_help = ("a built-in tiny model (unet, sd3, flux, llama, gpt2, sd-pipeline), a local diffusers or "
                  "transformers directory, a .gguf file (llama.cpp), or package.module:factory")
    dtype_help = ("floating dtype to read the model in: auto (default: a directory's checkpoint dtype; the built-ins "
                  "are float32), float32, bfloat16 or float16; the plan's first line says which")
    p = sub.add_parser("explain", help="show what a script will do to a model")
    p.add_argument("file", metavar="FILE", help="the script; '-': standard input")
    p.add_argument("--model", metavar="SPEC", help=model_help + " (required, but with --options)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help=dtype_help)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--options", action="store_true",
                   help="list each statement's options (value, default, type, meaning) instead; needs no model")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no warnings or progress bars from the model libraries")
    p.set_defaults(func=cmd_explain, explain_parser=p)

    p = sub.add_parser("apply", help="transform a model and save it")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--model", required=True, metavar="SPEC", help=model_help)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help=dtype_help)
    p.add_argument("--out", metavar="DIR", help="directory to save the transformed model to")
    p.add_argument("--format", default="transformdsl",
                   choices=("transformdsl", "transformers", "diffusers", "compressed-tensors", "gguf"),
                   help="layout of the save: transformdsl's (default), or one the library's stock from_pretrained "
                        "loads without transformdsl (spec.md 'Interchange')")
    p.add_argument("--verify", action="store_true",
                   help="compare the model's output on a sample input before and after; fail (and leave the "
                        "model unchanged) if it moved beyond the script's error bound (per-token KL for "
                        "logits, relative RMS otherwise)")
    p.add_argument("--verify-with", metavar="CHECK",
                   help="--verify with another metric or bound: a metric (kl, top1, rms, max), a bound on the "
                        "default metric (0.05), or both (kl=0.05)")
    p.add_argument("--strict", action="store_true",
                   help="fail, changing nothing, if a statement would change no module (else a warning)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only errors: no plan, no per-statement lines, no progress bars, no warnings "
                        "from the model libraries")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("convert", help="stream a checkpoint through a script into a save, one block at a time "
                                       "(for models larger than memory)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a diffusers or transformers model directory, a diffusers pipeline directory, or a "
                        "transformdsl save")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to save the result to")
    p.add_argument("--component", metavar="NAME",
                   help="the pipeline component to convert (default: the denoiser); the others are copied")
    p.add_argument("--max-shard-size", type=_byte_count, default="5GiB", metavar="SIZE",
                   help="largest tensor file of the output, e.g. 2GB or 500MiB (default: 5GiB)")
    p.add_argument("--strict", action="store_true",
                   help="fail, writing nothing, if a statement would change no module (else a warning)")
    p.add_argument("--workers", type=_positive, default=1, metavar="N",
                   help="convert the model's blocks in N processes, each with a share of the threads (a GPTQ "
                        "statement: N processes each running the blocks on a share of the calibration samples); "
                        "the output is the one-process output, byte for byte (default: 1)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only errors: no progress bar, no warnings from the model libraries")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="show what a saved model contains")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("tune", help="find the smallest or fastest script within a quality budget, on this machine")
    p.add_argument("--model", required=True, metavar="SPEC", help=model_help)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help=dtype_help)
    p.add_argument("--calibration", metavar="FILE",
                   help="a safetensors file with an integer tensor input_ids of shape (N, L): its last quarter "
                        "is held out to measure quality on, the rest calibrates (default: the model's own "
                        "sample inputs, random)")
    quality = p.add_mutually_exclusive_group()
    quality.add_argument("--max-kl", type=float, metavar="X", help="mean per-token KL to the float model's logits")
    quality.add_argument("--max-ppl-ratio", type=float, metavar="R", help="perplexity / the float model's")
    quality.add_argument("--max-rms", type=float, metavar="E", help="relative RMS error of the output")
    p.add_argument("--goal", default="size", choices=("size", "latency"),
                   help="what to minimise: the saved bytes (default) or the latency measured here")
    p.add_argument("--budget", type=_duration, metavar="TIME",
                   help="time limit (90s, 10m, 1h): then the best so far, marked partial")
    p.add_argument("--out", metavar="FILE", help="where to write the script (best.tfm)")
    p.add_argument("--plot", metavar="PNG", help="where to write the plot (default: beside --out; none: no plot)")
    p.add_argument("--storage", metavar="PATH|URL",
                   help="the optuna study storage: a SQLite file or a database URL shared by several workers "
                        "(default: FILE.study.db beside --out; memory: none); a tune run again resumes from it")
    p.add_argument("--mode", action="append", metavar="STATEMENT",
                   help="a mode to try, e.g. 'quantize int8 weight_only=true' (repeat; default: every mode declared)")
    p.add_argument("--statement", action="append", metavar="STATEMENT",
                   help="with --goal latency: a whole-model statement tried on the chosen script, kept when measured "
                        "faster (repeat; default: 'fuse qkv' and 'compile'; none: no statement)")
    p.add_argument("--evaluations", type=int, default=5, metavar="N",
                   help="most whole scripts measured after the per-layer pass (default 5)")
    p.add_argument("--check", metavar="FILE",
                   help="re-measure a tuned script against its budget (its '# tune:' line, or the one given); "
                        "exit status 1 when it no longer holds")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no warnings from the libraries")
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("demo", help="the whole job on a built-in tiny model")
    p.add_argument("--model", default=None, help="built-in model name (default: the example's)")
    p.add_argument("--script", default=None, help="script to apply (default: the demo script, examples/demo.tfm)")
    p.add_argument("--out", default=None, help="where to save (default: a temporary directory)")
    p.set_defaults(func=cmd_demo)
    return parser


def _quiet_libraries() -> None:
    """``-q``: no progress bars, warnings or info lines from transformers, diffusers, torch and friends."""
    import logging
    import warnings

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["DIFFUSERS_VERBOSITY"] = "error"
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["PYTHONWARNINGS"] = "ignore"  # for any subprocess (compile workers)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)


class _Interrupts:
    """Remembers a Ctrl-C even when a library turns the KeyboardInterrupt into another error (an
    import interrupted half-way fails later as ``ModuleNotFoundError``): the command still exits 130."""

    seen = False

    @classmethod
    def install(cls) -> None:
        import signal

        cls.seen = False
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when SIGINT is ignored
            signal.signal(signal.SIGINT, cls._handler)

    @classmethod
    def _handler(cls, signum, frame):
        cls.seen = True
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (130 after Ctrl-C, with one line on stderr)."""
    try:
        _Interrupts.install()
        return _run(argv)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) or (_Interrupts.seen and isinstance(exc, Exception)):
            _err("interrupted")
            return 130
        raise


def _run(argv: list[str] | None) -> int:
    try:
        _offline()
        args = build_parser().parse_args(argv)
        if getattr(args, "quiet", False):
            _quiet_libraries()
        return args.func(args)
    except (ScriptError, LoadError, TransformError) as exc:
        if _Interrupts.seen:  # the error is what a library made of the Ctrl-C
            raise KeyboardInterrupt from exc
        if isinstance(exc, ScriptError):
            _err(str(exc))
        elif isinstance(exc, LoadError):
            _err("error: " + _escaped(str(exc), keep=" \n"))
        else:
            _err(f"error: {exc}")
    return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
