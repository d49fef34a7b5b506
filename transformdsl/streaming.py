"""``convert``: a checkpoint through a script into a save, one unit of the model at a time.

The source (a diffusers or transformers model directory, a diffusers pipeline directory, or a
transformdsl save) is opened by the reader :func:`transformdsl.load` uses; its architecture is
built on the meta device and planned on (the plan ``explain`` prints).  The model is then
split into *units*: each repeated block (a child of a ``ModuleList``) and each remaining
module, with every tensor of the model in exactly one unit.  Unit by unit, only that unit's
tensors are read from the safetensors files, each statement runs its own ``apply`` on the
unit's targets (the same code as :func:`transformdsl.transform`), the result goes to the
writer :func:`transformdsl.save` uses, and the unit is dropped.  Peak memory is about one
unit's input and output, whatever the model's size.

Units grow where a statement needs more at once: a target above several units (``fuse qkv``
on a module holding more than one block, say) makes them one unit, and so do tensors shared
between modules (tied embeddings).  A statement that changes no weight and targets more than
one unit (``compile`` of the whole model) runs after the units, on the skeleton, when nothing
after it in the script changes weights.  Each statement's records from the units are merged
by :meth:`~transformdsl.extend.Transform.merge_records` into the record ``transform``
would have written, so the output is the save ``load → transform → save`` writes, tensor for
tensor and bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import os
import shutil
import stat
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import registry
from .dtypes import checkpoint_dtype, meta_parameters_to
from .edit import Edit
from .errors import LoadError, TransformError
from .executor import MostlySkippedWarning, NothingToDoWarning, apply_step, idle_statements, mostly_skipped_statements
from .extend import ApplyContext
from .history import append_history, applied_step, recorded_text, set_history
from .persist import guard
from .persist.atomic import writing
from .persist.checks import read_json, read_metadata
from .persist.format import DEFAULT_SHARD_BYTES, META_FILE, write_json
from .persist.read import OpenedModule, assign_tensors, open_module, saved_history
from .persist.savedir import SaveDir
from .persist.write import ShardWriter, collect_tensors, write_manifest, write_module_metadata, write_pipeline_metadata
from .planner import DENOISERS, Plan, plan
from .tree import WEIGHTS_PENDING, parameter_bytes


def convert(source: str | os.PathLike, script: Any, out: str | os.PathLike, *, component: str | None = None,
            progress: bool = False, max_shard_size: int = DEFAULT_SHARD_BYTES, strict: bool = False,
            log: Callable[[str], None] | None = None, calibration: Any = None, tokenizer: Any = None,
            workers: int = 1) -> Path:
    """Apply ``script`` to the model saved at ``source`` and save the result at ``out``, reading
    and writing one unit (a block) of the model at a time; returns ``out``.

    ``source``: a diffusers or transformers model directory (``config.json`` and safetensors
    weights, sharded or not), a diffusers pipeline directory (``model_index.json``; the
    denoiser is converted, or the component named by ``component``, and the other components
    are copied), or a transformdsl save (the script's steps follow those already applied).

    The output is what ``save(transform(load(source), script), out)`` writes (for a pipeline
    directory: ``DiffusionPipeline.from_pretrained``), tensor for tensor, with metadata that
    differs only in its save id; ``load(out)`` reads it.  Peak memory is about the largest
    unit's input and output bytes plus a fixed overhead, not the model's size.  Writing is
    atomic like :func:`~transformdsl.save`: an interrupted run leaves nothing at ``out`` (nor a
    previous save there changed).  ``progress=True`` shows bytes converted and throughput.
    A statement that changes nothing warns (:class:`~transformdsl.executor.NothingToDoWarning`),
    or with ``strict=True`` is a :class:`TransformError` before anything is written.

    ``log`` receives the plan (as ``explain`` prints it) before anything is written, then one line
    per statement when the conversion is done: the modules it changed, their bytes before and after,
    the time it took over all units.  A pipeline's ``component=`` statements that name the converted
    component apply to it; those that name another are a :class:`ScriptError`.

    ``calibration``/``tokenizer``: the data of the statements that learn from it (``quantize int4
    method=gptq``...), as :func:`~transformdsl.transform` takes them (or the script's ``calibrate``
    statement; text is tokenized with the tokenizer in ``source``).  Those statements are fitted
    block by block as the blocks are read, the samples' activations carried from one block to the
    next, so the output is still ``transform``'s, bit for bit; their targets must be inside the
    model's blocks (one list of them, called in order): ``lm_head``, fitted on the whole model's
    pass, is refused (add ``except lm_head``).

    ``workers``: with ``N > 1``, the model's units that are whole subtrees (its blocks, its embeddings,
    its head) are converted in ``N`` worker processes (spawned; each opens the source and plans the
    script itself and gets a share of this process's torch threads), while this process converts
    the rest and writes every unit's tensors in order: the output is the one-process output, byte
    for byte (save id aside).  A GPTQ statement's samples are split instead (its blocks go in order):
    ``N`` processes each run the blocks on a share of them, every process with this one's torch
    threads, and the Hessians are summed in one order whatever the split, so the output is still the
    one-process output, byte for byte; AWQ and SmoothQuant are refused with ``workers > 1``.  The per-statement
    seconds ``log`` prints are then summed over the processes.  The workers are spawned: a script
    that calls ``convert(..., workers=N)`` does so under ``if __name__ == "__main__":``.

    Not supported: a save in a library's layout (``save(..., format="transformers")``): load
    and save it first.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise TransformError(f"workers={workers!r}: the number of processes, a whole number from 1")
    source, out = Path(source), Path(out)
    with guard.loading(), SaveDir.open(source) as folder:
        located = _locate(folder, component)
        opened = located.open()
        stamps = opened.files.stamps()
        try:
            the_plan = _plan_on(opened, located, script, calibration is not None)
            if workers > 1:
                _check_workers(the_plan, workers)
            idle = idle_statements(the_plan)
            if idle and strict:
                raise TransformError("; ".join(idle) + " (strict: nothing was written)")
            for line in idle:
                warnings.warn(line, NothingToDoWarning, stacklevel=2)
            for line in mostly_skipped_statements(the_plan):
                warnings.warn(line, MostlySkippedWarning, stacklevel=2)
            data = _calibration_data(the_plan, opened.skeleton, located.folder.path, calibration, tokenizer, log)
            if log is not None:
                log(str(the_plan))
                log("")
            with writing(out, finish=write_manifest) as (tmp, save_id):
                target = tmp
                if located.pipeline is not None:
                    target = tmp / located.name
                    target.mkdir()
                stream = _Stream(opened, the_plan, target, max_shard_size, save_id, progress, data)
                if workers > 1:
                    stream.workers = (workers, (os.path.abspath(source), component, the_plan.script))
                stream.run()
                changed = [name for (name, _, _), before, after in zip(opened.files.opened, stamps,
                                                                        opened.files.stamps()) if before != after]
                if changed:  # what was read may mix the old bytes and the new
                    raise LoadError(f"{located.folder.path / changed[0]}: rewritten while convert read it (its "
                                    "size or modification time changed); nothing was written: convert again")
                if log is not None:
                    stream.summary(log)
                if located.pipeline is not None:
                    _copy_pipeline(folder, located, tmp, save_id)
        finally:
            opened.close()
    return out


def _plan_on(opened: OpenedModule, located: _Located, script: Any, calibrated: bool) -> Plan:
    """The plan of ``script`` on the opened source's skeleton, as ``explain`` prints it (each worker
    process of ``workers=N`` makes the same one)."""
    checkpoint = checkpoint_dtype(located.folder.path)
    if checkpoint is not None:  # the plan counts the bytes the checkpoint holds (its tensors load as they are)
        meta_parameters_to(opened.skeleton, checkpoint)
    opened.skeleton.__dict__[WEIGHTS_PENDING] = True
    try:
        return plan(opened.skeleton, script, calibration=calibrated,
                    component=located.name if located.pipeline is not None else None)
    finally:
        del opened.skeleton.__dict__[WEIGHTS_PENDING]


def _check_workers(the_plan: Plan, workers: int) -> None:
    """Refuse ``workers > 1`` for what it cannot run, before anything is written."""
    source = the_plan.script.source
    for step in the_plan.steps:
        if step.transform.needs_calibration and not step.transform.shares_samples:
            raise TransformError(f"line {step.statement.line}: '{step.text(source)}' learns from calibration "
                                 f"data in a way that processes holding different samples cannot sum back exactly "
                                 f"(method=gptq without smooth= can): convert it without workers={workers} "
                                 f"(--workers); nothing was written")


def _calibration_data(the_plan: Plan, skeleton: nn.Module, folder: Path, calibration: Any, tokenizer: Any, log):
    """The run's calibration data (read and checked against the model before anything is written), or None."""
    from .calibration import for_run
    from .calibration.data import tokenizer_in

    if tokenizer is None and any(step.transform.verb == "calibrate" for step in the_plan.steps):
        tokenizer = tokenizer_in(folder)
    data = for_run(the_plan, {step.component: skeleton for step in the_plan.steps}, calibration, tokenizer)
    if data is not None:
        for line in data.warnings():
            warnings.warn(line, UserWarning, stacklevel=3)
            if log is not None:
                log(line)
    return data


# --------------------------------------------------------------------------- sources


@dataclasses.dataclass
class _Located:
    """The module to convert in an opened source: its folder, and the pipeline around it."""

    folder: SaveDir
    #: ``transformdsl.json`` metadata of a transformdsl save, or None (a library directory).
    meta: dict | None
    #: The pipeline's ``model_index.json`` and its components' storage, if the source is one.
    pipeline: tuple[dict, dict[str, str], str] | None = None
    name: str = ""

    def open(self) -> OpenedModule:
        if self.meta is None:
            from .interop.imports import library_skeleton

            meta, skeleton = library_skeleton(self.folder)
            return open_module(self.folder, meta, lambda: skeleton)
        if "layout" in self.meta["tensors"]:  # even an empty one: the files are in the library's layout
            raise LoadError(f"{self.folder.path}: a save in a library's layout cannot be converted; load and save "
                            "it (transformdsl format) first")
        return open_module(self.folder, self.meta, None)


def _locate(folder: SaveDir, component: str | None) -> _Located:
    if folder.exists(META_FILE):
        meta = read_metadata(folder)
        if meta["kind"] == "module":
            if component is not None:
                raise LoadError(f"{folder.path}: a saved module, not a pipeline; drop component=")
            return _Located(folder, meta)
        index = read_json(folder, "model_index.json", "pipeline index")
        components = dict(meta["components"])
        pipeline_class = meta["pipeline_class"]
    elif folder.exists("model_index.json"):
        index = read_json(folder, "model_index.json", "pipeline index")
        if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
            raise LoadError(f"{folder.path / 'model_index.json'}: not a diffusers pipeline index")
        components = {name: "library" for name, entry in index.items()
                      if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2
                      and all(isinstance(e, str) for e in entry)}
        pipeline_class = index["_class_name"]
    else:
        if component is not None:
            raise LoadError(f"{folder.path}: a model directory, not a pipeline; drop component=")
        return _Located(folder, None)
    if component is None:
        component = next((name for name in DENOISERS if name in components), None)
        if component is None:
            raise LoadError(f"{folder.path}: this pipeline has no denoiser ({', '.join(DENOISERS)}); name the "
                            f"component to convert with component= (one of {', '.join(sorted(components))})")
    if component not in components:
        raise LoadError(f"{folder.path}: the pipeline has no component {component!r} (its components: "
                        f"{', '.join(sorted(components))})")
    sub = folder.subdir(component)
    meta = read_metadata(sub) if components[component] == "transformdsl" else None
    if meta is not None and meta["kind"] != "module":
        raise LoadError(f"{sub.path}: not a saved module")
    return _Located(sub, meta, (index, components, pipeline_class), component)


def _copy_pipeline(folder: SaveDir, located: _Located, tmp: Path, save_id: str) -> None:
    """The pipeline's other components, copied file for file (regular files only), its index,
    and the metadata of a transformdsl pipeline save."""
    index, components, pipeline_class = located.pipeline
    components = {**components, located.name: "transformdsl"}
    for name in components:
        if name == located.name:
            continue
        sub = folder.subdir(name)
        for rel, info in sub.walk():
            if stat.S_ISDIR(info.st_mode):
                (tmp / name / rel).mkdir(parents=True, exist_ok=True)
                continue
            if not stat.S_ISREG(info.st_mode):
                raise LoadError(f"{sub.path / rel}: not a regular file; refusing to copy it")
            holder, file_name = sub.descend(rel)
            (tmp / name / rel).parent.mkdir(parents=True, exist_ok=True)
            fd = holder.open_file(file_name)
            try:
                _copy_sparse(fd, tmp / name / rel)
            finally:
                os.close(fd)
        if not (tmp / name).exists():
            (tmp / name).mkdir()
    write_json(tmp / "model_index.json", index)
    write_pipeline_metadata(tmp, pipeline_class, components, save_id)


def _copy_sparse(fd: int, target: Path) -> None:
    """Copy the open file ``fd`` to ``target`` keeping its holes: only the data regions are read and
    written (``SEEK_DATA``/``SEEK_HOLE``), and blocks of zeros within them are skipped too, so a
    sparse file (1 GiB apparent size, 4 KiB on disk) costs its data, not its size, on both sides."""
    size = os.fstat(fd).st_size
    chunk = 1 << 24
    with open(target, "wb") as dst:
        position = 0
        while position < size:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
                end = os.lseek(fd, start, os.SEEK_HOLE)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole is left
                    break
                start, end = position, size  # no hole support here: read it all (zeros still skipped)
            except AttributeError:  # pragma: no cover - no SEEK_DATA on this platform
                start, end = position, size
            while start < end:
                data = os.pread(fd, min(chunk, end - start), start)
                if not data:
                    break
                if data.count(0) != len(data):
                    dst.seek(start)
                    dst.write(data)
                start += len(data)
            position = max(end, start)
        dst.truncate(size)


# --------------------------------------------------------------------------- units


@dataclasses.dataclass
class Unit:
    """Part of a model read, transformed and written at once: module subtrees (``whole``) and
    modules whose own tensors only (not their children's) belong to it."""

    parts: list[tuple[str, bool]]  # (module path, whole subtree?)

    def has_module(self, path: str) -> bool:
        return any(path == p or whole and (p == "" or path.startswith(p + ".")) for p, whole in self.parts)

    def has_key(self, key: str) -> bool:
        """Whether a tensor (``module.path.name``) belongs to the unit."""
        return self.has_module(key.rpartition(".")[0])

    def covers(self, path: str) -> bool:
        """Whether the module at ``path`` and everything below it belong to the unit."""
        return any(whole and (p == "" or path == p or path.startswith(p + ".")) for p, whole in self.parts)


_LISTS = (nn.ModuleList, nn.ModuleDict)


def split_units(root: nn.Module) -> list[Unit]:
    """The model's units, in module order: each child of a ``ModuleList``/``ModuleDict`` (a
    block), each other subtree holding no such list, and the own tensors of the modules on the
    way to the lists."""
    holds_list = {path for path, module in root.named_modules() if isinstance(module, _LISTS)}
    for path in list(holds_list):
        while path:
            path = path.rpartition(".")[0]
            holds_list.add(path)
    if "" not in holds_list:
        return [Unit([("", True)])]
    units: list[Unit] = []

    def visit(path: str, module: nn.Module) -> None:
        if any(t is not None for t in (*module._parameters.values(), *module._buffers.values())):
            units.append(Unit([(path, False)]))
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if isinstance(module, _LISTS) or child_path not in holds_list:
                units.append(Unit([(child_path, True)]))
            else:
                visit(child_path, child)

    visit("", root)
    return units


def _merge(units: list[Unit], chosen: list[int], replace_below: str | None = None) -> list[Unit]:
    """``units`` with those at ``chosen`` made one (at the first one's place); with
    ``replace_below``, their parts under that path become that path's whole subtree."""
    if len(chosen) <= 1 and replace_below is None:
        return units
    parts: list[tuple[str, bool]] = []
    for i in chosen:
        parts.extend(units[i].parts)
    if replace_below is not None:
        below = [(p, w) for p, w in parts if replace_below == "" or p == replace_below
                 or p.startswith(replace_below + ".")]
        parts = [(replace_below, True)] + [part for part in parts if part not in below]
    merged = Unit(list(dict.fromkeys(parts)))
    first = min(chosen) if chosen else len(units)
    return [merged if i == first else unit for i, unit in enumerate(units) if i not in chosen or i == first] \
        if chosen else units + [merged]


def plan_units(root: nn.Module, the_plan: Plan, aliases: dict[str, str]) -> tuple[list[Unit], set[int]]:
    """The units to stream ``the_plan`` through, and the steps to run after them on the skeleton."""
    units = split_units(root)
    # Tensors shared between modules (tied weights) are read and written by one unit.
    owners: dict[int, list[str]] = {}
    for name, tensor in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        owners.setdefault(id(tensor), []).append(name)
    groups = [names for names in owners.values() if len(names) > 1] + [[k, t] for k, t in aliases.items()]
    for names in groups:
        chosen = sorted({i for i, unit in enumerate(units) for name in names if unit.has_key(name)})
        units = _merge(units, chosen)
    steps = the_plan.steps
    source = the_plan.script.source
    calibrated_lists: dict[str, Any] = {}
    for step in steps:
        if step.transform.needs_calibration:
            for name in _check_calibrated(root, step, source):
                calibrated_lists.setdefault(name, step)
        if not step.transform.streams:
            raise TransformError(f"line {step.statement.line}: '{step.text(source)}' cannot be applied block by "
                                 "block: convert without it, then load the result and transform it (nothing was "
                                 "written)")
    if len(calibrated_lists) > 1:
        (a, first), (b, second) = list(calibrated_lists.items())[:2]
        raise TransformError(f"line {first.statement.line}: '{first.text(source)}' fits layers in {a}, and line "
                             f"{second.statement.line}: '{second.text(source)}' in {b}; convert carries calibration "
                             "samples through one list of blocks: convert with one, then transform the result with "
                             "the other (nothing was written)")
    deferred: set[int] = {i for i, step in enumerate(steps) if not step.transform.changes_modules}
    for i in range(len(steps) - 1, -1, -1):  # the trailing statements that change no weight
        step = steps[i]
        if step.transform.changes_weights or not any(_spans(units, t) for t in step.targets):
            break
        deferred.add(i)
    for i, step in enumerate(steps):
        if i in deferred:
            continue
        for target in step.targets:
            if target == "" and len(units) > 1:
                raise TransformError(f"line {step.statement.line}: '{step.text(source)}' changes the model as a "
                                     "whole, so convert would read the whole checkpoint at once; convert without "
                                     "it (or move it to the end if it changes no weight), then load the result and "
                                     "transform it (nothing was written)")
            if _spans(units, target):
                chosen = [j for j, unit in enumerate(units)
                          if any(target == "" or p == target or p.startswith(target + ".") for p, _ in unit.parts)]
                units = _merge(units, chosen, replace_below=target)
    return units, deferred


def _check_calibrated(root: nn.Module, step, source: str) -> list[str]:
    """Refuse, naming the statement, a calibrated statement convert cannot fit one block at a time;
    the list of blocks it fits in (none, or one)."""
    from .calibration.sequential import split_into_blocks
    from .extend import Transform

    where = f"line {step.statement.line}: '{step.text(source)}'"
    if type(step.transform).apply_blocks is Transform.apply_blocks:
        raise TransformError(f"{where} learns from calibration data and cannot be fitted one block at a time: "
                             "load the model, then transform(model, script, calibration=...) and save it (nothing "
                             "was written)")
    blocks, _, rest = split_into_blocks(root, list(step.targets))
    if rest:
        shown = ", ".join(rest[:3]) + (f" and {len(rest) - 3} more" if len(rest) > 3 else "")
        raise TransformError(f"{where} fits {shown} on the whole model's pass (outside the model's blocks), which "
                             f"convert never holds at once: add 'except {rest[0]}' (or load the model and transform "
                             "it; nothing was written)")
    lists = list(dict.fromkeys(block.rpartition(".")[0] for block in blocks))
    if len(lists) > 1:
        raise TransformError(f"{where} fits layers in {len(lists)} lists of blocks ({', '.join(lists)}); convert "
                             "carries the calibration samples through one list, block by block: select one list "
                             "('in " + lists[0] + ".*'), or load the model and transform it (nothing was written)")
    return lists


def _spans(units: list[Unit], target: str) -> bool:
    """Whether the module at ``target`` is not inside one unit."""
    return not any(unit.covers(target) for unit in units)


# --------------------------------------------------------------------------- streaming


class _Stream:
    """One run of :func:`convert` over an opened module."""

    def __init__(self, opened: OpenedModule, the_plan: Plan, directory: Path, max_shard_size: int, save_id: str,
                 progress: bool, data: Any = None):
        self.opened = opened
        self.data = data
        self.root = opened.skeleton
        self.plan = the_plan
        self.directory = directory
        self.save_id = save_id
        self.writer = ShardWriter(directory, max_shard_size, save_id, stream=True)
        self.progress = progress
        self.meta = opened.meta
        layout = self.meta["tensors"]
        self.aliases: dict[str, str] = layout.get("aliases", {})
        self.attributes: dict[str, Any] = layout.get("attributes", {})
        self.nonpersistent = list(layout.get("nonpersistent", []))
        self.sizes = opened.files.sizes()
        #: Per statement (by identity): modules changed, bytes of them before and after, seconds.
        self.stats: dict[int, list[float]] = {id(step): [0, 0, 0, 0.0] for step in the_plan.steps}
        self.started = time.perf_counter()
        #: ``(N, (source, component, script))`` to convert whole-subtree units in N worker processes.
        self.workers: tuple[int, tuple] | None = None
        #: The calibration samples this process holds (None: all; convert --workers N: a share of them).
        self.share: Any = None
        #: False in a process sharing the samples with the writing one: units are dropped, not written.
        self.writing = directory is not None

    def summary(self, log: Callable[[str], None]) -> None:
        """One line per statement, as ``apply`` prints them, then the total time."""
        from .explain import human_bytes

        source = self.plan.script.source
        for step in self.plan.steps:
            count, before, after, seconds = self.stats[id(step)]
            sizes = f", {human_bytes(before)} -> {human_bytes(after)}" if before or after else ""
            log(f"line {step.statement.line}: {step.text(source)}: {int(count)} module(s){sizes} ({seconds:.2f} s)")
        log(f"done in {time.perf_counter() - self.started:.2f} s")

    def run(self) -> None:
        self.root.eval()
        units, deferred = plan_units(self.root, self.plan, self.aliases)
        modules = {path for path, _ in self.root.named_modules(remove_duplicate=False)}
        stray = sorted(key for key in self.sizes if key.rpartition(".")[0] not in modules)
        if stray:  # a tensor of no module of the architecture, which no unit reads: load() refuses it, and so
            # does convert (one of a module is read with its unit, and refused there as load() does)
            raise LoadError(f"{self.opened.folder.path}: the saved tensors do not match the architecture "
                            f"(unexpected {len(stray)} tensor(s): {', '.join(stray[:5])}); was it saved from "
                            "another model?")
        steps = self.plan.steps
        records: list[list[tuple[int, dict]]] = [[] for _ in steps]
        layout: dict[str, Any] = {"nonpersistent": [], "aliases": {}}
        attributes: dict[str, Any] = {}
        notes: dict = {}
        bar = self._bar()
        calibrated = any(step.transform.needs_calibration for i, step in enumerate(steps) if i not in deferred)
        try:
            with self._sharing(calibrated) as sharing:
                streams: dict[int, Any] = {}
                written: set[int] = set()
                if calibrated:
                    streams, written = self._start_calibration(units, steps, deferred, records, layout, attributes,
                                                               notes, bar)
                with self._pool(units, written, calibrated) as workers:
                    for index, unit in enumerate(units):
                        if index in written:
                            continue
                        if workers is not None and index in workers:
                            done = self._receive(unit, workers.result(index), records, layout, attributes)
                        else:
                            done = self._unit(unit, steps, deferred, records, layout, attributes, notes, streams)
                        if bar is not None:
                            bar.update(done)
                if sharing is not None:
                    sharing.finish()
        finally:
            if bar is not None:
                bar.close()
        edit = Edit()
        for i in sorted(deferred):
            ctx = ApplyContext(self.root, edit, _no_progress, notes, self.data)
            # on the skeleton, whose converted units are gone: no bytes to count
            records[i].append((0, self._apply(steps[i], ctx, list(steps[i].targets), weights=False)))
        edit.commit()
        layout["nonpersistent"] = sorted(layout["nonpersistent"])
        if attributes:
            layout["attributes"] = attributes
        files = self.writer.finish()
        history = saved_history(self.meta)
        applied = []
        source, texts = recorded_text(self.plan)
        for i, step in enumerate(steps):
            if not step.targets:  # it changes nothing (warned): not recorded, as transform() records it
                continue
            parts = [record for _, record in sorted(records[i], key=lambda pair: pair[0])]
            record = step.transform.merge_records(parts) if parts else self._empty_record(step)
            applied.append(applied_step(step, texts[id(step)], record))
        set_history(self.root, history)
        if applied:  # (a script that changed nothing is not recorded, as transform() records it)
            append_history(self.root, source, applied)
        write_module_metadata(self.directory, self.root, files, layout, self.save_id)

    def _empty_record(self, step) -> dict:
        """The record of a statement with no target: ``apply`` on an empty list."""
        ctx = ApplyContext(self.root, Edit(), _no_progress, {}, self.data)
        return self._apply(step, ctx, [])

    def _apply(self, step, ctx: ApplyContext, targets: list[str], weights: bool = True, stream: Any = None,
               blocks: list[str] | None = None) -> dict:
        """Apply ``step`` to ``targets`` (``weights``: they are read, so their bytes count); a calibrated
        statement on the unit's ``blocks``, its samples carried by ``stream``."""
        stats = self.stats[id(step)]
        before = sum(_bytes_at(ctx.root, t) for t in targets) if weights else 0
        started = time.perf_counter()
        blocks_apply = None if stream is None else (
            lambda ctx, targets: step.transform.apply_blocks(ctx, targets, stream, blocks))
        record = apply_step(step, ctx, targets, "nothing was written", apply=blocks_apply)
        stats[3] += time.perf_counter() - started
        stats[0] += len(targets)
        if weights:
            stats[1] += before
            stats[2] += sum(_bytes_at(ctx.root, t) for t in targets)
        return record

    def _bar(self):
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        total = sum(nbytes for _, nbytes in self.sizes.values())
        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", file=sys.stderr,
                    leave=False)

    def _unit(self, unit: Unit, steps, deferred: set[int], records, layout: dict, attributes: dict,
              notes: dict, streams: dict[int, Any], read: tuple | None = None) -> int:
        """Read, transform, write and drop one unit; the source bytes it read.  ``read``: the unit was
        read already (:meth:`_read`'s result)."""
        restore, done = read if read is not None else self._read(unit)
        self._transform(unit, steps, deferred, records, notes, streams)
        self._write(unit, restore, layout, attributes)
        return done

    def _transform(self, unit: Unit, steps, deferred: set[int], records, notes: dict, streams: dict[int, Any]) -> None:
        """Run the statements on the (read) unit, in order, adding their records."""
        edit = Edit()
        for i, step in enumerate(steps):
            if i in deferred:
                continue
            targets = [t for t in step.targets if unit.covers(t)]
            stream = streams.get(i)
            blocks = [b for b in stream.blocks if unit.covers(b)] if stream is not None else []
            if targets or blocks:
                ctx = ApplyContext(self.root, edit, _no_progress, notes, self.data)
                order = list(step.targets).index(targets[0]) if targets else len(step.targets)
                records[i].append((order, self._apply(step, ctx, targets, stream=stream, blocks=blocks)))
        edit.commit()

    def _read(self, unit: Unit) -> tuple[list, int]:
        """Read the unit's tensors into the skeleton: what :meth:`_write` needs to drop it, and the bytes read."""
        from .persist import plain_tensors

        root = self.root
        keys = [key for key in self.sizes if unit.has_key(key) and key not in self.aliases]
        attribute_layout = {name: how for name, how in self.attributes.items() if unit.has_key(name)}
        restore = self._slots(unit)
        tensors = self.opened.files.read_some(keys, self.sizes)
        attribute_tensors = plain_tensors.take(tensors, attribute_layout, self.opened.folder.path)
        assign_tensors(root, tensors, self.meta, self.opened.folder.path, only=unit.has_key)
        plain_tensors.restore(root, attribute_layout, attribute_tensors, self.opened.folder.path)
        return restore, sum(self.sizes[key][1] for key in keys)

    def _write(self, unit: Unit, restore: list, layout: dict, attributes: dict) -> None:
        if not self.writing:  # a process sharing the samples: the writing one writes the same unit
            self._drop(unit, restore)
            _give_back_freed_memory()
            return
        out, part = collect_tensors(self.root, only=unit.has_key)
        self.writer.add(out)
        del out
        layout["nonpersistent"].extend(part["nonpersistent"])
        layout["aliases"].update(part["aliases"])
        attributes.update(part.get("attributes", {}))
        self._drop(unit, restore)
        _give_back_freed_memory()

    def _start_calibration(self, units: list[Unit], steps, deferred: set[int], records, layout: dict,
                           attributes: dict, notes: dict, bar) -> tuple[dict[int, Any], set[int]]:
        """Before the blocks: every unit outside them is read, the statements run on it in order and,
        at each calibrated statement, its samples' inputs to the first block are captured (the model
        as ``transform`` would run it at that statement); the link from block to block is traced on
        the first two blocks; then those units are written.  Returns the calibrated statements'
        streams, and the units written."""
        from .calibration.sequential import BlockStream, trace_link
        from .calibration.shares import Share

        share = self.share or Share.whole(len(self.data.samples))
        samples = self.data.samples[share.first:share.first + share.count]
        streams = {i: BlockStream(self.root, list(step.targets), samples, self.data.activations, share)
                   for i, step in enumerate(steps) if step.transform.needs_calibration and i not in deferred}
        blocks = next((s.blocks for s in streams.values() if s.blocks), [])
        outside = [i for i, unit in enumerate(units) if not any(unit.covers(b) for b in blocks)]
        first = next((i for i, unit in enumerate(units) if blocks and unit.covers(blocks[0])), None)
        read = {i: self._read(units[i]) for i in outside}
        edit = Edit()
        for i, step in enumerate(steps):
            if i in deferred:
                continue
            if i in streams:
                streams[i].start()
                continue
            for j in outside:
                targets = [t for t in step.targets if units[j].covers(t)]
                if targets:
                    ctx = ApplyContext(self.root, edit, _no_progress, notes, self.data)
                    records[i].append((list(step.targets).index(targets[0]), self._apply(step, ctx, targets)))
        edit.commit()
        if first is not None and len(blocks) > 1:
            read[first] = self._read(units[first])
            link = trace_link(self.root, blocks[0], blocks[1], samples[0])
            for stream in streams.values():
                stream.link = link
        for j in outside:
            restore, done = read.pop(j)
            self._write(units[j], restore, layout, attributes)
            if bar is not None:
                bar.update(done)
        if first is not None and first in read:  # read for the trace: transformed now, in its turn
            done = self._unit(units[first], steps, deferred, records, layout, attributes, notes, streams,
                              read=read.pop(first))
            if bar is not None:
                bar.update(done)
            return streams, set(outside) | {first}
        return streams, set(outside)

    # ------------------------------------------------------------------- across processes

    @contextlib.contextmanager
    def _sharing(self, calibrated: bool):
        """With ``workers=N`` and a calibrated statement: the processes holding the other shares of the
        calibration samples (:class:`~transformdsl.convert_workers.SampleGroup`), this one holding the
        first; each runs the calibrated blocks on its share and sums its statistics with the others.
        Otherwise None."""
        from .calibration.shares import Share, split
        from .convert_workers import SampleGroup

        if self.workers is None or not calibrated:
            yield None
            return
        count, (source, component, script) = self.workers
        total = len(self.data.samples)
        shares = split(total, count)
        if len(shares) < 2:
            yield None
            return
        plugins = [(cls.__module__, cls.__qualname__) for cls in registry.registered_at_run_time()]
        # every process computes with this one's thread count: a float sum's bytes depend on it
        threads = torch.get_num_threads()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if len(shares) * threads > cores:
            warnings.warn(f"convert: {len(shares)} processes share the calibration samples, each with this process's "
                          f"{threads} torch threads (the bytes written depend on the thread count), on {cores} "
                          f"cores: they contend for them and the run may be slower than one process (measured 1.56x "
                          f"on 2 cores with 2 threads each, 0.70x with 1 each); {max(1, cores // len(shares))} "
                          "thread(s) per process (torch.set_num_threads, OMP_NUM_THREADS) lets them run side by side",
                          ContendedWarning, stacklevel=2)
        group = SampleGroup(shares, _share_helper, (source, component, script, threads, plugins, self.data))
        try:
            self.share = Share(*shares[0], total, group.group, 0, group.size)
            try:
                yield group
            except Exception as exc:
                if _exchange_failed(exc):  # a helper ended first: its error is the run's
                    raise group.failure() from None
                raise
        finally:
            self.share = None
            group.close()

    def follow(self) -> None:
        """In a process holding a share of the calibration samples: run the units the calibrated
        statements fit, in order, as :meth:`run` does in the writing process, writing nothing."""
        self.root.eval()
        units, deferred = plan_units(self.root, self.plan, self.aliases)
        steps = self.plan.steps
        records: list[list[tuple[int, dict]]] = [[] for _ in steps]
        notes: dict = {}
        layout: dict[str, Any] = {"nonpersistent": [], "aliases": {}}
        streams, written = self._start_calibration(units, steps, deferred, records, layout, {}, notes, None)
        blocks = {block for stream in streams.values() for block in stream.blocks[:stream.last + 1]}
        todo = [i for i, unit in enumerate(units) if i not in written and any(unit.covers(b) for b in blocks)]
        for index in todo:
            restore, _ = self._read(units[index])
            self._transform(units[index], steps, deferred, records, notes, streams)
            self._drop(units[index], restore)
            _give_back_freed_memory()

    def _pool(self, units: list[Unit], written: set[int], calibrated: bool = False):
        """The worker processes of ``workers=N`` with the units they convert (whole subtrees not
        written yet), or a null context (one process; nothing for workers to do; or a calibrated
        statement's blocks, which go in order: its samples are shared instead, :meth:`_sharing`)."""
        from .convert_workers import PARTS, pool, threads_per_worker

        if self.workers is None or calibrated:
            return contextlib.nullcontext()
        count, (source, component, script) = self.workers
        remote = [i for i, unit in enumerate(units) if i not in written and len(unit.parts) == 1
                  and unit.parts[0][1] and unit.parts[0][0] != ""]
        if len(remote) < 2:
            return contextlib.nullcontext()
        parts = self.directory / PARTS
        parts.mkdir()
        plugins = [(cls.__module__, cls.__qualname__) for cls in registry.registered_at_run_time()]
        start_args = (source, component, script, threads_per_worker(count), plugins, str(parts))
        return _removing(parts, pool(min(count, len(remote)), _worker_start, start_args, _worker_unit, remote))

    def _receive(self, unit: Unit, part, records, layout: dict, attributes: dict) -> int:
        """Write a unit a worker converted, as :meth:`_write` would have: its tensors, records and counts;
        then drop it from this process's skeleton as :meth:`_write` does.  The source bytes it read."""
        from .convert_workers import read_part

        for i, order, record in part.records:
            records[i].append((order, record))
        for i, delta in part.stats.items():
            stats = self.stats[id(self.plan.steps[i])]
            for j, value in enumerate(delta):
                stats[j] += value
        for key, tensor in read_part(part):
            self.writer.add({key: tensor})
            del tensor
        layout["nonpersistent"].extend(part.layout["nonpersistent"])
        layout["aliases"].update(part.layout["aliases"])
        attributes.update(part.layout.get("attributes", {}))
        self._drop(unit, self._slots(unit))
        _give_back_freed_memory()
        return part.read

    def convert_part(self, units: list[Unit], index: int, deferred: set[int]):
        """In a worker process: read, transform and write unit ``index`` to a part file beside the
        output, then drop it; the :class:`~transformdsl.convert_workers.Part` to hand back."""
        from .convert_workers import Part, write_part

        unit = units[index]
        steps = self.plan.steps
        for stats in self.stats.values():
            stats[:] = [0, 0, 0, 0.0]
        records: list[list[tuple[int, dict]]] = [[] for _ in steps]
        restore, done = self._read(unit)
        self._transform(unit, steps, deferred, records, {}, {})
        out, layout = collect_tensors(self.root, only=unit.has_key)
        path = self.directory / f"{index:06d}.safetensors"
        keys = write_part(path, out)
        del out
        self._drop(unit, restore)
        _give_back_freed_memory()
        return Part(index, str(path), keys, [(i, order, record) for i, pairs in enumerate(records)
                                             for order, record in pairs],
                    layout, {i: list(self.stats[id(step)]) for i, step in enumerate(steps)}, done)

    def _slots(self, unit: Unit) -> list[tuple[nn.Module, dict, dict]]:
        """The (meta) tensors of the unit's modules as they are before it is read, to put back."""
        slots = []
        for path, module in self.root.named_modules(remove_duplicate=False):
            if unit.has_module(path):
                slots.append((module, dict(module._parameters), dict(module._buffers)))
        return slots

    def _drop(self, unit: Unit, slots) -> None:
        """Free the unit: its source modules get their meta tensors back (the plan still refers to
        them) and what replaced them is dropped (an empty module in its place)."""
        for module, parameters, buffers in slots:
            module._parameters.update(parameters)
            module._buffers.update(buffers)
        for path, whole in unit.parts:
            if whole and path:
                parent_path, _, name = path.rpartition(".")
                parent = self.root.get_submodule(parent_path) if parent_path else self.root
                parent._modules[name] = _Converted()
            elif not whole:
                module = self.root.get_submodule(path)
                for name, tensor in list(module._parameters.items()):
                    if tensor is not None and not tensor.is_meta:
                        module._parameters[name] = nn.Parameter(torch.empty_like(tensor, device="meta"),
                                                                requires_grad=tensor.requires_grad)
                for name, tensor in list(module._buffers.items()):
                    if tensor is not None and not tensor.is_meta:
                        module._buffers[name] = torch.empty_like(tensor, device="meta")


def _bytes_at(root: nn.Module, path: str) -> int:
    """Bytes of the module at ``path`` (0 if a statement removed it)."""
    try:
        return parameter_bytes(root.get_submodule(path))
    except AttributeError:
        return 0


def _give_back_freed_memory() -> None:
    """Return the heap pages freed with a unit to the system (glibc's ``malloc_trim``; elsewhere
    nothing).  Without it, glibc keeps them for reuse and, as tensor sizes vary from unit to unit,
    the process grows by a fraction of every unit converted."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


@contextlib.contextmanager
def _removing(directory: Path, inner):
    """``inner``'s context, then ``directory`` removed (the workers' parts are not part of the save)."""
    try:
        with inner as value:
            yield value
    finally:
        shutil.rmtree(directory, ignore_errors=True)


#: A worker process's state: its stream over the source, the units and deferred statements (or the
#: failure of its start, handed back for every unit).
_WORKER: dict[str, Any] = {}


def _worker_start(source: str, component: str | None, script: Any, threads: int,
                  plugins: list[tuple[str, str]], parts: str) -> None:
    """Run once in each worker process: open the source and plan the script as ``convert`` did."""
    from .convert_workers import failure

    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")  # the parent has warned
    try:
        registry.register_by_name(plugins)
        stack = contextlib.ExitStack()
        stack.enter_context(guard.loading())
        folder = stack.enter_context(SaveDir.open(Path(source)))
        located = _locate(folder, component)
        opened = located.open()
        stack.callback(opened.close)
        the_plan = _plan_on(opened, located, script, False)
        stream = _Stream(opened, the_plan, Path(parts), DEFAULT_SHARD_BYTES, "", False)
        stream.root.eval()
        units, deferred = plan_units(stream.root, the_plan, stream.aliases)
        _WORKER.update(stack=stack, stream=stream, units=units, deferred=deferred)
    except Exception as exc:  # noqa: BLE001 - handed back to the parent with the first unit
        _WORKER["failure"] = failure(exc)


def _worker_unit(index: int):
    """Convert unit ``index`` in a worker process: its Part, or the Failure that stopped it."""
    from .convert_workers import failure

    if "failure" in _WORKER:
        return _WORKER["failure"]
    try:
        return _WORKER["stream"].convert_part(_WORKER["units"], index, _WORKER["deferred"])
    except Exception as exc:  # noqa: BLE001 - raised again in the parent
        return failure(exc)


class ContendedWarning(UserWarning):
    """``convert --workers N`` with calibration: the processes' threads outnumber the cores."""


def _share_helper(rank: int, size: int, port: int, share: tuple[int, int], source: str, component: str | None,
                  script: Any, threads: int, plugins: list[tuple[str, str]], data: Any, pipe) -> None:
    """A process holding share ``share`` (first sample, count) of a calibrated convert's samples: it
    joins the writing process's group, opens the source and plans the script as ``convert`` did, then
    :meth:`_Stream.follow`; says "done" on ``pipe``, or the failure that stopped it."""
    from .calibration.shares import Share
    from .convert_workers import failure, join_group

    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")  # the parent has warned
    try:
        pipe.send("ready")
        group = join_group(port, rank, size)
        registry.register_by_name(plugins)
        with guard.loading(), SaveDir.open(Path(source)) as folder:
            located = _locate(folder, component)
            opened = located.open()
            try:
                stream = _Stream(opened, _plan_on(opened, located, script, True), None, DEFAULT_SHARD_BYTES, "",
                                 False, data)
                stream.share = Share(*share, len(data.samples), group, rank, size)
                stream.follow()
            finally:
                opened.close()
        pipe.send("done")
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        try:
            pipe.send(failure(exc))
        except (BrokenPipeError, OSError):
            pass


def _exchange_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (maybe wrapped by a statement's error) is gloo's: another process of the group ended."""
    while exc is not None:
        if isinstance(exc, RuntimeError) and ("gloo" in str(exc).lower() or "Connection closed" in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _Converted(nn.Module):
    """Stands where a unit was once it is written."""


def _no_progress(iterable, **kwargs):
    return iterable
