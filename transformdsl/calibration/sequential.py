"""Calibration block by block: each block fitted on what the blocks before it, already quantized, give it.

The sequential pipeline of llm-compressor and the GPTQ paper, for any module tree:

1. The targets are split by *block*: the outermost ancestor that is a child of an
   ``nn.ModuleList`` (``model.layers.3``, ``transformer_blocks.7``); targets in no block are the
   *rest* (calibrated last, on the whole model).
2. One traced forward of the first sample over the float model gives the blocks' call order and,
   between consecutive blocks, how the next block's arguments come from the previous block's
   inputs and output (found by object identity: ``hidden_states = layer(hidden_states, ...)``
   passes the output on, the rotary embeddings and masks are the same objects for every block).
3. The first block's inputs are captured for every sample (the model runs up to it and stops).
   Then, block by block: the block runs on every sample with hooks reading its targets' inputs
   (one hook per input tensor: ``q_proj``, ``k_proj`` and ``v_proj`` read one), the method fits
   and replaces the targets (through the edit log, like any transform), the block runs again,
   quantized, and its outputs become the next block's inputs.  A block whose arguments are not
   found that way is captured by running the model up to it again.

Memory: the block and the samples' activations at its input and output, never all blocks'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import TransformError
from .activations import ActivationStore
from .data import Sample
from .shares import Share


class _Stop(Exception):
    """Raised by a capture hook to end a forward once the block's inputs are read."""


@dataclass
class InputGroup:
    """Targets that read one input tensor (``q_proj``, ``k_proj``, ``v_proj`` after a norm)."""

    #: Paths below the root, in module order.
    paths: list[str]
    #: Path (below the root) of the module whose output that tensor is, when a module made it.
    producer: str | None = None
    #: Other modules of the unit that read the same tensor but are not targets.
    other_readers: list[str] = field(default_factory=list)


@dataclass
class Unit:
    """One block (or the rest of the model) as a method sees it."""

    root: nn.Module
    #: The block's path below the root ("" for the rest: the whole model runs).
    path: str
    module: nn.Module
    groups: list[InputGroup]
    inputs: list[Sample]
    #: Which of all the samples ``inputs`` are (this process's share of them: :mod:`.shares`).
    share: Share | None = None
    #: The index in ``inputs`` of the sample being run.
    current: int = 0

    def __post_init__(self):
        if self.share is None:
            self.share = Share.whole(len(self.inputs))

    @property
    def part(self) -> int:
        """The slice (:mod:`.shares`) of the sample being run: where its statistics are summed."""
        return self.share.slice_of(self.current)

    def run(self, sample: Sample) -> Any:
        """The unit's output for one of its inputs (as the model would compute it now)."""
        args, kwargs = sample
        return self.module(*args, **kwargs)

    @property
    def name(self) -> str:
        return self.path or "the model outside its blocks"


class Method:
    """What a calibration method does with a unit (GPTQ, AWQ, SmoothQuant: :mod:`.methods`)."""

    def begin(self, unit: Unit) -> None:
        """Before the unit's float pass: ``unit.groups`` are known."""

    def observe(self, group: int, x: torch.Tensor) -> None:
        """One input tensor of group ``group`` (its targets' common input) in the float pass."""

    def finish(self, unit: Unit) -> None:
        """After the float pass: fit and replace the unit's targets."""


def split_into_blocks(root: nn.Module, targets: list[str]) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """``(blocks, targets by block, rest)``: every child of a ``ModuleList`` holding a target's
    outermost list-child ancestor (blocks without targets too: they run between the others)."""
    lists: dict[str, list[str]] = {}
    by_block: dict[str, list[str]] = {}
    rest: list[str] = []
    for path in targets:
        parts = path.split(".")
        found = None
        for depth in range(1, len(parts)):  # the target itself is never its own block
            parent_path = ".".join(parts[:depth - 1])
            if isinstance(root.get_submodule(parent_path), nn.ModuleList):
                found = ".".join(parts[:depth])
                lists.setdefault(parent_path, [])
                break
        if found is None:
            rest.append(path)
        else:
            by_block.setdefault(found, []).append(path)
    blocks = []
    for list_path in lists:
        holder = root.get_submodule(list_path)
        blocks.extend(f"{list_path}.{name}" if list_path else name for name, _ in holder.named_children())
    return blocks, by_block, rest


@contextmanager
def _hooks(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def evaluating(root: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd while calibrating; each module's mode put back after."""
    modes = [(m, m.training) for m in root.modules()]
    root.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def _call(module: nn.Module, sample: Sample) -> Any:
    args, kwargs = sample
    return module(*args, **kwargs)


def _flat_outputs(output: Any) -> tuple:
    if isinstance(output, torch.Tensor):
        return (output,)
    if isinstance(output, (tuple, list)):
        return tuple(output)
    if hasattr(output, "to_tuple"):
        return tuple(output.to_tuple())
    return (output,)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return False


Link = Callable[[Sample, Any], Sample]


def _link(prev_inputs: Sample, prev_output: Any, inputs: Sample) -> Link | None:
    """How the next block's arguments come from the previous block's inputs and output, or None."""
    prev_args, prev_kwargs = prev_inputs
    outputs = _flat_outputs(prev_output)

    def locate(value: Any):
        for index, out in enumerate(outputs):
            if value is out:
                return ("out", index)
        for index, arg in enumerate(prev_args):
            if value is arg:
                return ("arg", index)
        for name, arg in prev_kwargs.items():
            if value is arg:
                return ("kw", name)
        if _has_tensor(value):
            return None
        return ("const", value)

    args, kwargs = inputs
    arg_sources = [locate(a) for a in args]
    kw_sources = {name: locate(v) for name, v in kwargs.items()}
    if any(s is None for s in arg_sources) or any(s is None for s in kw_sources.values()):
        return None

    def resolve(source, sample: Sample, output: Any):
        kind, key = source
        if kind == "out":
            return _flat_outputs(output)[key]
        if kind == "arg":
            return sample[0][key]
        if kind == "kw":
            return sample[1][key]
        return key

    def link(sample: Sample, output: Any) -> Sample:
        return (tuple(resolve(s, sample, output) for s in arg_sources),
                {name: resolve(s, sample, output) for name, s in kw_sources.items()})

    return link


def _trace_blocks(root: nn.Module, blocks: list[str], sample: Sample) -> tuple[list[str], dict[str, Link | None]]:
    """The blocks' call order on ``sample`` and each block's link from the one before it."""
    calls: list[tuple[str, Sample, Any]] = []
    seen: dict[str, int] = {}
    handles = []

    def pre(name):
        def hook(module, args, kwargs):
            seen[name] = seen.get(name, 0) + 1
            if seen[name] == 1:
                calls.append((name, (args, kwargs), None))
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            if seen.get(name) == 1 and calls and calls[-1][0] == name and calls[-1][2] is None:
                calls[-1] = (name, calls[-1][1], output)
        return hook

    for name in blocks:
        module = root.get_submodule(name)
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    with _hooks(handles):
        _call(root, sample)
    order = [name for name, _, _ in calls]
    links: dict[str, Link | None] = {name: None for name in order}
    if any(count > 1 for count in seen.values()):  # a block run twice: capture each one's inputs
        return order, links
    for (_, prev_inputs, prev_output), (name, inputs, _) in zip(calls, calls[1:]):
        links[name] = _link(prev_inputs, prev_output, inputs) if prev_output is not None else None
    return order, links


def capture_inputs(root: nn.Module, block: str, samples: list[Sample],
                   store: ActivationStore | None = None, first: int = 0) -> list[Sample]:
    """Each sample's arguments to ``block``, by running the model up to it (kept by ``store``)."""
    module = root.get_submodule(block)
    captured: list[Sample] = []
    store = store or ActivationStore("memory")

    def hook(module, args, kwargs):
        sample = (tuple(_detached(a) for a in args), {k: _detached(v) for k, v in kwargs.items()})
        captured.extend(store.keep([sample], of=len(samples)))
        raise _Stop

    with _hooks([module.register_forward_pre_hook(hook, with_kwargs=True)]):
        for index, sample in enumerate(samples):
            before = len(captured)
            try:
                _call(root, sample)
            except _Stop:
                pass
            if len(captured) == before:
                raise TransformError(f"calibration: the model did not reach {block} on sample {first + index}")
    return captured


def first_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A layer's input tensor, passed by position or by name (diffusers' ``proj_in(input=x)``)."""
    if args:
        return args[0] if isinstance(args[0], torch.Tensor) else None
    value = kwargs.get("input", kwargs.get("hidden_states"))
    if value is None:
        value = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    return value if isinstance(value, torch.Tensor) else None


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def input_groups(unit_module: nn.Module, prefix: str, paths: list[str], root: nn.Module,
                 sample: Sample) -> list[InputGroup]:
    """Group the unit's targets by the input tensor they read on ``sample`` (by identity), each
    with the module that produced it and the other modules that read it too."""
    made_by: dict[int, str] = {}
    read_by: dict[int, list[str]] = {}
    handles = []
    target_set = set(paths)
    names = {id(m): (f"{prefix}.{n}" if prefix and n else prefix or n) for n, m in unit_module.named_modules()}
    keep: list[torch.Tensor] = []  # alive until the pass ends, so that ids are not reused

    def post(module, args, output):
        if isinstance(output, torch.Tensor):
            made_by.setdefault(id(output), names[id(module)])
            keep.append(output)

    def pre(module, args, kwargs):
        x = first_input(args, kwargs)
        if x is not None:
            read_by.setdefault(id(x), []).append(names[id(module)])
            keep.append(x)

    for module in unit_module.modules():
        if module is unit_module:
            continue
        handles.append(module.register_forward_hook(post))
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    with _hooks(handles):
        _call(unit_module, sample)
    groups: dict[int, InputGroup] = {}
    order = {path: i for i, path in enumerate(paths)}
    for tensor_id, readers in read_by.items():
        members = [r for r in dict.fromkeys(readers) if r in target_set]
        if not members:
            continue
        others = [r for r in dict.fromkeys(readers) if r not in target_set and not any(
            m.startswith(r + ".") for m in members)]
        groups[tensor_id] = InputGroup(sorted(members, key=order.get), made_by.get(tensor_id), others)
    found = {p for g in groups.values() for p in g.paths}
    for path in paths:  # a target the sample never reached: a group of its own, no data
        if path not in found:
            groups[-len(groups) - 1] = InputGroup([path])
    keep.clear()
    return sorted(groups.values(), key=lambda g: order[g.paths[0]])


def _check_finite(output: Any, where: str, index: int) -> None:
    for value in _flat_outputs(output):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            raise TransformError(f"calibration: {where} computes NaN or infinity on sample {index} (the calibration "
                                 "inputs, or the blocks quantized before it, overflow its dtype); nothing was changed")


def _run_unit(unit: Unit, method: Method) -> None:
    method.begin(unit)
    handles = []
    leaders = {}
    for index, group in enumerate(unit.groups):
        module = unit.root.get_submodule(group.paths[0])

        def hook(module, args, kwargs, index=index):
            x = first_input(args, kwargs)
            if x is not None:
                method.observe(index, x)

        leaders[index] = module
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with _hooks(handles):
        for index, sample in enumerate(unit.inputs):
            unit.current = index
            _check_finite(unit.run(sample), unit.name, unit.share.first + index)
    method.finish(unit)


@dataclass
class Report:
    """What a calibration pass did (for the log and the record)."""

    blocks: int = 0
    captures: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def calibrate(root: nn.Module, targets: list[str], samples: list[Sample], method: Method, *,
              progress: Callable = lambda it, **kw: it, desc: str = "calibrating",
              activations: str = "auto") -> Report:
    """Fit ``method`` on ``targets`` (paths below ``root``) block by block over ``samples``;
    ``activations``: where the samples' activations wait between blocks (:mod:`.activations`)."""
    started = time.perf_counter()
    report = Report()
    store = ActivationStore(activations)
    blocks, by_block, rest = split_into_blocks(root, targets)
    device = next((p.device for p in root.parameters()), torch.device("cpu"))
    samples = [_to_device(s, device) for s in samples]
    with evaluating(root):
        order, links = _trace_blocks(root, blocks, samples[0]) if blocks else ([], {})
        for block in blocks:
            if block not in links and by_block.get(block):
                rest.extend(by_block.pop(block))  # never ran on the sample: fitted with the whole model
                report.notes.append(f"{block} did not run on the first sample; its layers are fitted on the whole "
                                    "model's pass")
        todo = [b for b in order if by_block.get(b)]
        last = order.index(todo[-1]) if todo else -1
        inputs: list[Sample] | None = None
        for position in progress(range(last + 1), total=last + 1, desc=desc):
            block = order[position]
            if inputs is None:
                inputs = capture_inputs(root, block, samples, store)
                report.captures += 1
            if by_block.get(block):
                _fit_block(root, block, by_block[block], inputs, method)
                report.blocks += 1
            if position == last:
                break
            inputs = _next_inputs(root, block, inputs, links.get(order[position + 1]), store)
        if rest:
            groups = input_groups(root, "", rest, root, samples[0])
            _run_unit(Unit(root, "", root, groups, samples), method)
    report.seconds = time.perf_counter() - started
    if store.note():
        report.notes.append(store.note())
    return report


def _fit_block(root: nn.Module, block: str, targets: list[str], inputs: list[Sample], method: Method,
               share: Share | None = None) -> None:
    """Fit and replace ``block``'s ``targets`` with ``method`` on the block's ``inputs`` (``share``
    of all the samples: the processes holding the others fit the same layers with this one)."""
    module = root.get_submodule(block)
    groups = input_groups(module, block, targets, root, inputs[0])
    share = share or Share.whole(len(inputs))
    share.same(repr([group.paths for group in groups]), f"which of {block}'s layers read one input")
    _run_unit(Unit(root, block, module, groups, inputs, share), method)


def _next_inputs(root: nn.Module, block: str, inputs: list[Sample], link: Link | None,
                 store: ActivationStore | None = None, first: int = 0) -> list[Sample] | None:
    """The next block's inputs: ``block`` (as it is now: quantized) run on ``inputs``, its outputs
    passed on by ``link`` (None: not derivable, captured again by running the model), each kept by
    ``store`` as it is made."""
    module = root.get_submodule(block)
    store = store or ActivationStore("memory")
    following: list[Sample] = []
    for index, sample in enumerate(inputs):
        output = _call(module, sample)
        _check_finite(output, block, first + index)
        if link is not None:
            following.extend(store.keep([link(sample, output)], of=len(inputs)))
    return None if link is None else following


def _to_device(sample: Sample, device: torch.device) -> Sample:
    args, kwargs = sample

    def move(value):
        return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value

    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


# --------------------------------------------------------------------------- blocks one at a time (convert)


def trace_link(root: nn.Module, first: str, second: str, sample: Sample) -> Link:
    """How ``second``'s arguments come from ``first``'s inputs and output, read on ``sample`` with
    only the modules before ``second`` loaded (the model stops at ``second``)."""
    seen: list[tuple[str, Sample, Any]] = []

    def pre_first(module, args, kwargs):
        seen.append(("first", (args, kwargs), None))

    def post_first(module, args, kwargs, output):
        seen[-1] = ("first", seen[-1][1], output)

    def pre_second(module, args, kwargs):
        seen.append(("second", (args, kwargs), None))
        raise _Stop

    a, b = root.get_submodule(first), root.get_submodule(second)
    with _hooks([a.register_forward_pre_hook(pre_first, with_kwargs=True),
                 a.register_forward_hook(post_first, with_kwargs=True),
                 b.register_forward_pre_hook(pre_second, with_kwargs=True)]), evaluating(root):
        try:
            _call(root, sample)
        except _Stop:
            pass
    link = None
    if [kind for kind, _, _ in seen] == ["first", "second"] and seen[0][2] is not None:
        link = _link(seen[0][1], seen[0][2], seen[1][1])
    if link is None:
        raise TransformError(f"calibration: {second} is not called on what {first} returns (the blocks are not run "
                             "one after the other in their list's order), which convert needs to calibrate one "
                             "block at a time: load the model and transform it")
    return link


class BlockStream:
    """One calibrated statement's pass when the blocks arrive one at a time (``convert``): the
    samples' inputs to the next block, carried from block to block as :func:`calibrate` carries
    them over a whole model, so that the layers fitted are the same, bit for bit.

    The blocks are those of one list, called in the list's order, each on what the one before
    it returns (checked on the first two, by :func:`trace_link`); every target is in a block."""

    def __init__(self, root: nn.Module, targets: list[str], samples: list[Sample], activations: str = "auto",
                 share: Share | None = None):
        self.root = root
        #: Which of all the samples ``samples`` are (convert --workers N: this process's share).
        self.share = share or Share.whole(len(samples))
        self.store = ActivationStore(activations)
        self.blocks, self.by_block, self.rest = split_into_blocks(root, targets)
        self.samples = samples
        todo = [b for b in self.blocks if self.by_block.get(b)]
        self.last = self.blocks.index(todo[-1]) if todo else -1
        self.inputs: list[Sample] | None = None
        self.link: Link | None = None

    def start(self) -> None:
        """Capture the first block's inputs: the modules that run before it must be loaded."""
        if self.last >= 0:
            with evaluating(self.root):
                self.inputs = capture_inputs(self.root, self.blocks[0], self.samples, self.store, self.share.first)

    def advance(self, block: str, method: Callable[[], Method]) -> None:
        """Block ``block`` (loaded, the statements before this one applied to it): its targets fitted
        by ``method()``, then the block run on the samples for the next block's inputs."""
        position = self.blocks.index(block)
        if position > self.last:
            return
        with evaluating(self.root):
            if self.by_block.get(block):
                _fit_block(self.root, block, self.by_block[block], self.inputs, method(), self.share)
            self.inputs = None if position == self.last else _next_inputs(self.root, block, self.inputs, self.link,
                                                                          self.store, self.share.first)
