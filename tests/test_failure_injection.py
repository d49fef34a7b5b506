"""Failure injection: a transform or a save that fails at any point loses nothing.

Transforms: an exception (or KeyboardInterrupt) raised at every point where a transform
touches the model, in turn (the Nth call of the Edit methods, of a pass's helpers, of
``torch.cat``...; before or right after the change), must leave the model bit-identical:
same state_dict keys in the same order, same tensor bytes, the same module objects of the
same types with the same attributes, the same history, the same outputs.

Saves: an exception raised at every write step in turn (safetensors writes, JSON writes,
fsync, renames, the atomic exchange), or a disk that fills up, must leave the previous
save intact and loadable (or the new one complete), and no temporary directory behind.

Also: ``transform(..., verify=True)`` rolls back a transform whose error exceeds its bound.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import inspect
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import transformdsl
from transformdsl import TransformError, models, registry
from transformdsl.edit import Edit
from transformdsl.executor import relative_error, script_error_bound
from transformdsl.extend import Transform
from transformdsl.history import history_of
from transformdsl.persist import atomic as persist_atomic
from transformdsl.persist import write as persist_write
from transformdsl.planner import module_components
from transformdsl.transforms.qkv import fusion as qkv
from transformdsl.transforms.qkv import install as qkv_install
from transformdsl.transforms.quantize.quantization import Int8Quantization
from transformdsl.verification import token_kl

# --------------------------------------------------------------------------- snapshots


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def _attributes(module: nn.Module) -> tuple:
    """Plain attributes (processors, flags, split sizes) by name, with their type and simple values."""
    out = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") and name != "_transformdsl_history":
            continue
        simple = value if isinstance(value, (bool, int, float, str, tuple, type(None))) else None
        out.append((name, type(value), id(value), simple))
    return tuple(out)


def snapshot(model) -> dict:
    """Everything a failed transform must leave exactly as it was."""
    roots = module_components(model)
    state = {}
    for name, root in roots.items():
        for key, tensor in root.state_dict(keep_vars=True).items():
            state[f"{name}/{key}"] = (type(tensor), tensor.dtype, tuple(tensor.shape), tensor.stride(),
                                      tensor.data_ptr(), _bytes(tensor), tensor.requires_grad)
    return {
        "keys": list(state),
        "state": state,
        "modules": [(n, path, type(m), id(m), m.training, _attributes(m))
                    for n, root in roots.items() for path, m in root.named_modules()],
        "history": {n: repr(history_of(root)) for n, root in roots.items()},
    }


def assert_unchanged(model, before: dict, output: torch.Tensor) -> None:
    after = snapshot(model)
    for part in ("keys", "modules", "history"):
        assert after[part] == before[part], f"{part} changed"
    assert after["state"] == before["state"], "tensors changed"
    assert torch.equal(run(model), output), "outputs changed"


def run(model) -> torch.Tensor:
    if isinstance(model, FakePipeline):
        return torch.cat([models.run(m).flatten() for m in model.components.values()])
    return models.run(model)


# --------------------------------------------------------------------------- injection


class Injector:
    """Raises ``exc`` at the ``n``-th call (from 1) of any function it wraps."""

    def __init__(self, n: int, exc: type[BaseException]):
        self.n, self.exc, self.calls, self.fired = n, exc, 0, False

    def wrap(self, function, after: bool = False):
        def wrapper(*args, **kwargs):
            self.calls += 1
            hit = self.calls == self.n
            if hit and not after:
                self._raise(function)
            result = function(*args, **kwargs)
            if hit and after:  # the change is made, then the failure: the worst moment
                self._raise(function)
            return result

        return wrapper

    def _raise(self, function):
        self.fired = True
        name = getattr(function, "__qualname__", repr(function))
        if issubclass(self.exc, OSError):
            raise self.exc(errno.ENOSPC, f"No space left on device (injected at {name})")
        raise self.exc(f"injected at call {self.n} ({name})")


def patch_points(monkeypatch, injector: Injector, points, after: bool) -> None:
    for owner, name in points:
        raw = inspect.getattr_static(owner, name)
        if isinstance(raw, (classmethod, staticmethod)):  # keep the binding
            wrapped = type(raw)(injector.wrap(raw.__func__, after))
        else:
            wrapped = injector.wrap(getattr(owner, name), after)
        monkeypatch.setattr(owner, name, wrapped)


#: The Edit methods passes change the model through.
EDIT_POINTS = [(Edit, "touch"), (Edit, "setattr"), (Edit, "delattr"), (Edit, "replace"), (Edit, "on_rollback")]


def inject_everywhere(monkeypatch, model, script: str, points, exc=RuntimeError, after: bool = False) -> int:
    """Fail ``transform(model, script)`` at each call of ``points`` in turn; check nothing changed.

    ``after``: raise right after the wrapped call made its change rather than before it.
    Returns the number of injection points exercised; ends with the transform succeeding
    (the count is past the last call), so every call was a failure point once.
    """
    output = run(model)  # first, so that anything a forward pass caches is in the snapshot
    before = snapshot(model)
    n = 1
    while True:
        injector = Injector(n, exc)
        with monkeypatch.context() as patch:
            patch_points(patch, injector, points, after)
            try:
                transformdsl.transform(model, script)
            except (TransformError, exc) as error:
                assert injector.fired, f"failed without an injection: {error}"
                if isinstance(error, TransformError):
                    assert "injected" in str(error) and "left unchanged" in str(error)
                assert_unchanged(model, before, output)
                n += 1
                continue
        assert not injector.fired, "an injected failure was swallowed"
        assert n > 1, "the injection points were never called"
        return n - 1


# --------------------------------------------------------------------------- a test-only transform


class Injected(Transform):
    """Rewrites each target in several steps, so that failures can land between any two.

    Per target: builds a new Linear (new tensors), replaces the old one, sets a plain
    attribute on the parent, changes the parent's class, registers an undo step.
    """

    verb = "injecttest"
    summary = "test-only: a multi-step rewrite of each Linear"
    default_target = ("Linear",)

    def apply(self, ctx, targets):
        for path in ctx.progress(targets, total=len(targets), desc="inject"):
            old = ctx.root.get_submodule(path)
            new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
            with torch.no_grad():
                new.weight = nn.Parameter(old.weight * 2)
                if old.bias is not None:
                    new.bias = nn.Parameter(old.bias + 1)
            ctx.edit.replace(ctx.root, path, new)
            parent = ctx.root.get_submodule(path.rpartition(".")[0]) if "." in path else ctx.root
            ctx.edit.setattr(parent, "injected", getattr(parent, "injected", 0) + 1)
            ctx.edit.touch(parent)
            old_class = type(parent)
            # The undo step first, then the change it undoes (a failure may come in between).
            ctx.edit.on_rollback(lambda parent=parent, old_class=old_class: setattr(parent, "__class__", old_class))
            parent.__class__ = _marked(old_class)
        return {"targets": list(targets)}


def _marked(base: type) -> type:
    return _MARKED.setdefault(base, type(f"Marked{base.__name__}", (base,), {}))


_MARKED: dict[type, type] = {}


@pytest.fixture
def injected():
    registry.register(Injected)
    yield Injected
    registry._TRANSFORMS.pop(Injected.key(), None)


class FakePipeline:
    """Duck-typed pipeline (a ``components`` dict): two real models, cheap to build."""

    def __init__(self):
        self.components = {"transformer": models.tiny_llama(), "text_encoder": models.tiny_gpt2()}


# --------------------------------------------------------------------------- transforms


def test_injected_transform_fails_cleanly_everywhere(monkeypatch, injected):
    model = models.tiny_llama()
    points = EDIT_POINTS + [(nn.Linear, "__init__")]
    count = inject_everywhere(monkeypatch, model, "injecttest in model.layers.0", points)
    assert count >= 7 * 5  # 7 Linears in a layer, 5+ calls each
    assert history_of(model).steps[-1].key == "injecttest"


def test_injected_transform_fails_cleanly_after_each_change(monkeypatch, injected):
    model = models.tiny_llama()
    inject_everywhere(monkeypatch, model, "injecttest in model.layers.1", EDIT_POINTS, after=True)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError, SystemExit])
def test_interrupts_and_fatal_errors_roll_back(monkeypatch, injected, exc):
    # KeyboardInterrupt and SystemExit are not Exceptions: they propagate as they are
    # (not wrapped in TransformError), after the rollback.
    model = models.tiny_llama()
    inject_everywhere(monkeypatch, model, "injecttest in model.layers.0.mlp", EDIT_POINTS, exc=exc)


def test_failure_in_second_component_rolls_back_the_first(monkeypatch, injected):
    pipe = FakePipeline()
    script = "injecttest in model.layers.0.mlp component=transformer\ninjecttest component=text_encoder"
    count = inject_everywhere(monkeypatch, pipe, script, [(Edit, "replace")])
    assert count == 3 + 1  # three MLP projections, then the GPT-2 lm_head: its failure undoes the first three


def test_failure_after_a_successful_transform_keeps_the_first(monkeypatch, injected):
    model = models.tiny_llama()
    transformdsl.transform(model, "fuse qkv")
    first = history_of(model)
    assert len(first.steps) == 1
    inject_everywhere(monkeypatch, model, "injecttest in model.layers.0.mlp", EDIT_POINTS)
    assert history_of(model).steps[0].key == "fuse qkv" and len(history_of(model).scripts) == 2


@pytest.mark.parametrize("arch, script", [("llama", "fuse qkv"), ("unet", "fuse qkv in down_blocks.0")])
def test_fuse_qkv_fails_cleanly_everywhere(monkeypatch, arch, script):
    points = EDIT_POINTS + [(torch, "cat"), (qkv, "concatenated"), (qkv_install, "_set_class")]
    inject_everywhere(monkeypatch, models.BUILTIN[arch](), script, points)
    inject_everywhere(monkeypatch, models.BUILTIN[arch](), script, [(Edit, "setattr"), (Edit, "delattr")], after=True)


def test_quantize_fails_cleanly_everywhere(monkeypatch):
    points = [(Edit, "replace"), (Int8Quantization, "build")]
    inject_everywhere(monkeypatch, models.tiny_gpt2(), "quantize int8 in transformer.h.0", points)
    inject_everywhere(monkeypatch, models.tiny_gpt2(), "quantize int8 in transformer.h.1", [(Edit, "replace")], after=True)


def test_rollback_runs_every_undo_even_if_one_fails():
    model = models.tiny_llama()
    before = snapshot(model)
    edit = Edit()
    edit.setattr(model.model.layers[0], "x", 1)
    edit.on_rollback(lambda: (_ for _ in ()).throw(RuntimeError("broken undo")))
    edit.replace(model, "model.layers.0.mlp.up_proj", nn.Identity())
    with pytest.raises(RuntimeError, match="broken undo"):
        edit.rollback()
    after = snapshot(model)
    assert after["modules"] == before["modules"] and after["state"] == before["state"]


# --------------------------------------------------------------------------- verify


def test_verify_rolls_back_beyond_the_bound(monkeypatch):
    model = models.tiny_gpt2()
    before, output = snapshot(model), run(model)
    monkeypatch.setattr(Int8Quantization, "error_bound", 1e-4)
    with pytest.raises(TransformError, match=r"verify: the output changed by .* more than the script's bound 0.0001 "
                                             r"\(quantize int8: 0.0001\); the model was left unchanged"):
        transformdsl.transform(model, "quantize int8", verify=True)
    assert_unchanged(model, before, output)


def test_verify_passes_within_the_bound_and_logs_the_error():
    model = models.tiny_gpt2()
    reference = run(model)
    lines = []
    transformdsl.transform(model, "quantize int8", verify=True, log=lines.append)
    # logits: per-token KL against the statement's KL bound (spec.md "Numerical guard")
    assert lines[-1].startswith("verify: kl ") and "within the bound 0.4 (the script's: quantize int8: 0.4)" in lines[-1]
    assert token_kl(reference, run(model)) <= 0.4


def test_verify_with_user_inputs(injected):
    model = models.tiny_llama()
    inputs = ((torch.arange(8).view(1, 8),), {"use_cache": False})
    before, output = snapshot(model), run(model)
    # The test transform doubles weights: far beyond its (default, exact) bound of 0.
    with pytest.raises(TransformError, match="more than the script's bound 0 "):
        transformdsl.transform(model, "injecttest in model.layers.0.mlp", verify_inputs=inputs)
    assert_unchanged(model, before, output)


def test_verify_leaves_training_flags_and_batchnorm_statistics_alone():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    stats = model[1].running_mean.clone()
    inputs = ((torch.randn(8, 4),), {})
    transformdsl.transform(model, "fuse qkv", verify_inputs=inputs)  # selects nothing; runs verify
    assert model.training and model[1].training and torch.equal(model[1].running_mean, stats)


def test_script_error_bound_sums_and_none_means_unbounded():
    class A:
        error_bound = 0.1

    class B:
        error_bound = None

    assert script_error_bound([A(), A()]) == pytest.approx(0.2)
    assert script_error_bound([A(), B()]) is None
    assert script_error_bound([]) == 0.0
    assert relative_error(torch.zeros(3), torch.tensor([0.0, 0.5, 0.0])) == 0.5


# --------------------------------------------------------------------------- saves


def digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


#: Every step save() writes through, in order.
SAVE_POINTS = [(persist_write, "save_aligned"), (Path, "write_text"),  # JSON files and script.tfm
               (os, "fsync"), (os, "rename"), (persist_atomic, "_renameat2_exchange")]


@pytest.fixture(scope="module")
def two_models():
    """(previous, new): the model saved first, and a changed one saved over it."""
    previous = models.tiny_gpt2()
    new = copy.deepcopy(previous)
    transformdsl.transform(new, "quantize int8 in transformer.h.0")
    return previous, new


def _check_save_outcome(target: Path, old_digest: dict | None, new_model) -> None:
    """After an injected failure the target holds exactly one complete save: the previous one,
    bit for bit (or nothing, if there was none), or the new one, loadable (the failure came
    after the swap); and no temporary directory is left."""
    assert not leftovers(target.parent, target.name), leftovers(target.parent, target.name)
    if not target.exists():
        assert old_digest is None
    elif digest(target) != old_digest:
        assert torch.equal(models.run(transformdsl.load(target)), models.run(new_model))
    else:
        transformdsl.load(target)


def interrupt_every_save_step(monkeypatch, target: Path, previous, new, exc, shard: int) -> int:
    """Save ``new`` over ``previous`` at ``target`` failing at each write step in turn."""
    if previous is not None:
        transformdsl.save(previous, target, max_shard_size=shard)
    n = 1
    while True:
        old_digest = digest(target) if target.exists() else None
        injector = Injector(n, exc)
        with monkeypatch.context() as patch:
            patch_points(patch, injector, SAVE_POINTS, after=False)
            try:
                transformdsl.save(new, target, max_shard_size=shard)
            except (TransformError, exc) as error:
                if isinstance(error, TransformError):  # an OSError, explained
                    assert exc is OSError and "No space left on device" in str(error) and str(target) in str(error)
        if not injector.fired:
            return n - 1
        _check_save_outcome(target, old_digest, new)
        if previous is not None and digest(target) != old_digest:
            transformdsl.save(previous, target, max_shard_size=shard)  # start the next step from the old save
        n += 1


#: Three shards and an index for the tiny GPT-2.
SHARD = 200_000


@pytest.mark.parametrize("exc, exchange", [(RuntimeError, True), (OSError, True), (KeyboardInterrupt, True),
                                           (RuntimeError, False), (OSError, False)],
                         ids=["error", "disk-full", "interrupt", "error-no-exchange", "disk-full-no-exchange"])
def test_interrupted_save_keeps_the_previous_save(monkeypatch, tmp_path, two_models, exc, exchange):
    previous, new = two_models
    if not exchange:  # the fallback: move the old save aside, move the new one in
        monkeypatch.setattr(persist_atomic, "_renameat2_exchange", lambda a, b: False)
    steps = interrupt_every_save_step(monkeypatch, tmp_path / "saved", previous, new, exc, SHARD)
    assert steps >= 12  # every shard, JSON file, fsync and rename was a failure point once
    assert torch.equal(models.run(transformdsl.load(tmp_path / "saved")), models.run(new))


@pytest.mark.parametrize("exc", [RuntimeError, OSError, KeyboardInterrupt])
def test_interrupted_first_save_leaves_nothing(monkeypatch, tmp_path, two_models, exc):
    _, new = two_models
    steps = interrupt_every_save_step(monkeypatch, tmp_path / "first", None, new, exc, SHARD)
    assert steps >= 10


def test_disk_full_mid_write_is_reported_and_leaves_nothing(monkeypatch, tmp_path, two_models):
    previous, new = two_models
    target = tmp_path / "saved"
    transformdsl.save(previous, target)
    old_digest = digest(target)
    real = persist_write.save_aligned

    def fills_up(tensors, path, metadata=None):
        real(tensors, path, metadata)
        with open(path, "r+b") as f:  # half the file made it to disk
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(persist_write, "save_aligned", fills_up)
    with pytest.raises(TransformError, match=r"cannot save to .*saved: No space left on device \(.*model.safetensors\); "
                                             r"nothing was written there and a previous save there, if any, is intact"):
        transformdsl.save(new, target)
    assert digest(target) == old_digest
    _check_save_outcome(target, old_digest, new)


def test_save_refuses_to_replace_what_is_not_a_save(tmp_path, two_models):
    previous, _ = two_models
    precious = tmp_path / "documents"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    with pytest.raises(TransformError, match="non-empty directory that holds no transformdsl save"):
        transformdsl.save(previous, precious)
    assert (precious / "thesis.txt").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    with pytest.raises(TransformError, match="exists and is not a directory"):
        transformdsl.save(previous, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    transformdsl.save(previous, tmp_path / "empty")
    transformdsl.save(previous, tmp_path / "empty")  # a previous save is replaced
    assert not leftovers(tmp_path, "empty")


def test_cli_apply_verify(tmp_path, monkeypatch, capsys):
    from transformdsl.cli import main

    script = tmp_path / "q.tfm"
    script.write_text("quantize int8 in transformer.h.0\n")
    assert main(["apply", str(script), "--model", "gpt2", "--verify", "--out", str(tmp_path / "ok")]) == 0
    assert "within the bound 0.4" in capsys.readouterr().out  # KL per token: the default metric for logits
    monkeypatch.setattr(Int8Quantization, "error_bound", 1e-6)
    assert main(["apply", str(script), "--model", "gpt2", "--verify", "-q", "--out", str(tmp_path / "no")]) == 1
    assert "verify: the output changed by" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_verify_without_a_sample_input_says_how_to_give_one():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TransformError, match=r"verify: cannot run the model on its sample input before transforming: "
                                             r"ValueError: no sample inputs for a Sequential.*pass verify_inputs"):
        transformdsl.transform(model, "fuse qkv", verify=True)
    assert history_of(model) is None


def test_verify_refuses_a_model_whose_output_is_not_finite_before_changing_it():
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.no_grad():
        model[0].bias.fill_(float("nan"))  # the user's model, before transformdsl touches it
    with pytest.raises(TransformError, match="not finite before transforming; cannot verify"):
        transformdsl.transform(model, "fuse qkv", verify_inputs=((torch.ones(1, 2),), {}))
    assert history_of(model) is None
