"""The ``transformdsl`` command: check, fmt, explain, apply, inspect, demo.

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
    from .parser import parse_file

    return parse_file(path)


def _model(spec: str):
    from .models import resolve_model

    try:
        return resolve_model(spec)
    except ValueError as exc:
        message = str(exc)  # resolve_model names the spec itself in most messages: not twice
        raise TransformError(message if message.startswith("--model ") else f"--model {spec}: {message}") from None


def cmd_check(args) -> int:
    from .validate import validate

    status = 0
    for name in args.files:
        try:
            validated = validate(_read_script(name))
        except ScriptError as exc:
            _err(str(exc))
            status = 1
            continue
        if not args.quiet:
            print(f"{name}: ok ({len(validated.steps)} statement(s))")
    return status


def cmd_explain(args) -> int:
    from .planner import plan

    the_plan = plan(_model(args.model), _read_script(args.file))
    if args.json:
        print(json.dumps(the_plan.to_json(), indent=1))
    else:
        print(the_plan)
    return 0


def cmd_apply(args) -> int:
    from .executor import transform
    from .persist import save
    from .planner import plan

    model = _model(args.model)
    script = _read_script(args.file)
    the_plan = plan(model, script)
    if not args.quiet:
        print(the_plan)
        print()
    transform(model, the_plan, progress=not args.quiet and sys.stderr.isatty(),
              log=None if args.quiet else print, verify=args.verify)
    if args.out:
        save(model, args.out, format=args.format)
        if not args.quiet:
            print(f"saved to {args.out}")
    return 0


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


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(model_name=args.model, script_path=args.script, out=args.out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="transformdsl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="parse and validate scripts (no model needed)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing for valid scripts")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("fmt", help="rewrite scripts in canonical form (comments kept)")
    p.add_argument("files", nargs="+", metavar="FILE", help="scripts to rewrite in place; '-': stdin to stdout")
    p.add_argument("--check", action="store_true",
                   help="write nothing; list the files that are not in canonical form (exit status 1)")
    p.set_defaults(func=cmd_fmt)

    model_help = ("a built-in tiny model (unet, sd3, flux, llama, gpt2, sd-pipeline), a local diffusers or "
                  "transformers directory, or package.module:factory")
    p = sub.add_parser("explain", help="show what a script will do to a model")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--model", required=True, metavar="SPEC", help=model_help)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("apply", help="transform a model and save it")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--model", required=True, metavar="SPEC", help=model_help)
    p.add_argument("--out", metavar="DIR", help="directory to save the transformed model to")
    p.add_argument("--format", default="transformdsl", choices=("transformdsl", "transformers", "diffusers", "compressed-tensors"),
                   help="layout of the save: transformdsl's (default), or one the library's stock from_pretrained "
                        "loads without transformdsl (spec.md 'Interchange')")
    p.add_argument("--verify", action="store_true",
                   help="compare the model's output on a sample input before and after; fail (and leave the "
                        "model unchanged) if it moved beyond the script's error bound")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("inspect", help="show what a saved model contains")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("demo", help="the whole job on a built-in tiny model")
    p.add_argument("--model", default=None, help="built-in model name (default: the example's)")
    p.add_argument("--script", default=None, help="script to apply (default: examples/demo.tfm)")
    p.add_argument("--out", default=None, help="where to save (default: a temporary directory)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    _offline()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ScriptError as exc:
        _err(str(exc))
    except LoadError as exc:
        _err("error: " + _escaped(str(exc), keep=" \n"))
    except TransformError as exc:
        _err(f"error: {exc}")
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
