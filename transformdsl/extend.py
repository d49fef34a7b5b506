"""The public API for writing a transform: what the built-in transforms use, and what a plugin uses.

A transform is a :class:`Transform` subclass.  Its *declaration* (class attributes, ``Options``,
:meth:`Transform.incompatible`) is all that ``transformdsl check`` reads, so the module defining it
should import no torch.  Its behaviour (:meth:`~Transform.candidate`, :meth:`~Transform.apply`,
:meth:`~Transform.rebuild`...) may live in the same class, importing torch inside the methods, or
in a subclass in another module named by :attr:`Transform.implementation` (``".run:WholeCompile"``),
imported only when a model is planned, transformed or loaded.

The registry finds transforms by key (``"verb mode"``): the built-ins in its table, third-party
ones through the entry-point group ``transformdsl.transforms`` (spec.md, "Writing a transform")::

    [project.entry-points."transformdsl.transforms"]
    "scale weights" = "my_package.scale:ScaleWeights"

A declaration states:

- its ``verb`` and ``mode`` (the registry key is ``"verb mode"``), a one-line ``summary``;
- ``Options``: a frozen dataclass of typed options (:func:`option`), whose ``__post_init__`` may
  check fields against each other (``check`` runs it: raise ``ValueError`` with the fix);
- ``default_target`` / ``default_except``: selector text used when a statement gives none
  (``default_target = None`` means "the modules the ``in`` clause names, or the root"), and
  ``honoured_declarations``: the model's own declarations (``_keep_in_fp32_modules``...) whose
  modules are default exclusions too;
- ordering rules: ``runs_after`` / ``runs_before`` (registry keys, globs allowed);
- ``exclusive``: a group name; two statements of the same group may not touch the same
  module (e.g. two quantizations), unless one ``overrides`` the other, in which case the
  overridden statement gives the shared modules up;
- ``record_version``: the version of the record :meth:`Transform.apply` returns, saved with it;
  a save whose record is newer than this is refused on load with a :class:`LoadError` naming both;
- and behaviour, all optional except :meth:`Transform.apply`:
  :meth:`~Transform.candidate` (can this module be transformed? else the reason, shown in the plan),
  :meth:`~Transform.check` (options valid for this module? else an error naming it),
  :meth:`~Transform.incompatible` (a rule against another statement of the script, which may
  depend on both statements' options: ``check`` runs it),
  :meth:`~Transform.plan_effect` (the structural change, on the planning snapshot),
  :meth:`~Transform.apply` (do it, through an :class:`~transformdsl.edit.Edit`; raise
  :class:`TransformError` for a failure the user can act on),
  :meth:`~Transform.rebuild` (replay the structure on a skeleton when loading a saved model) and
  :meth:`~Transform.finalize` (after the saved tensors are loaded, e.g. compile again).

The helpers the built-in transforms use are exported here too: :func:`put_module` (a module put on a
skeleton in ``rebuild``), :func:`recorded_targets` (the modules a record names, read back on load),
:func:`tied_weights` (weights held by several modules), :func:`is_conv1d` (transformers' ``Conv1D``) and
:func:`human_bytes` (sizes in messages); and :data:`API_VERSION`, which a transform may require
(:attr:`Transform.requires_api`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import LoadError, TransformError
from .ir import Statement
from .options import CommonOptions, NoOptions, option
from .transforms.common.modules import is_conv1d, put_module, recorded_targets, tied_weights
from .units import human_bytes

if TYPE_CHECKING:  # pragma: no cover  (the declarations import no torch: `check` validates without it)
    from pathlib import Path

    from torch import nn

    from .edit import Edit
    from .history import AppliedStep
    from .interop.hook_types import Exported, Headers
    from .tree import ModuleInfo, ModuleTree

__all__ = ["API_VERSION", "FRESH_RUN", "ApplyContext", "CommonOptions", "LoadError", "NoOptions", "RuntimeTransform",
           "Transform", "TransformError", "human_bytes", "is_conv1d", "option", "put_module", "recorded_targets", "tied_weights"]

#: The version of this API (the :class:`Transform` attributes and hooks, :class:`ApplyContext`, the helpers
#: exported here, and what they promise).  It increases when a change would break a transform written
#: against the previous one; a transform declares the lowest it needs (:attr:`Transform.requires_api`) and
#: the registry refuses one that needs a newer API than this transformdsl has, naming both.
API_VERSION = 1


@dataclass
class ApplyContext:
    """What :meth:`Transform.apply` gets besides its targets."""

    root: nn.Module
    edit: Edit
    #: ``progress(iterable, total=None, desc=None)``: wraps long loops in a progress bar (or not).
    progress: Any
    #: Free space for a transform to leave facts for later statements of the same run.
    notes: dict = field(default_factory=dict)
    #: The run's calibration data (:class:`transformdsl.calibration.CalibrationData`: a script's
    #: ``calibrate`` statement, or ``transform(..., calibration=)``), or ``None``; a transform whose
    #: :attr:`~Transform.needs_calibration` is true gets it.
    calibration: Any = None


class Transform:
    verb: ClassVar[str]
    mode: ClassVar[str | None] = None
    summary: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    default_target: ClassVar[tuple[str, ...] | None] = ("Linear",)
    default_except: ClassVar[tuple[str, ...]] = ()
    #: Model declarations whose modules are default exclusions too (``declarations.KNOWN``:
    #: ``_keep_in_fp32_modules``, ``_skip_layerwise_casting_patterns``...), shown in the plan.
    honoured_declarations: ClassVar[tuple[str, ...]] = ()
    runs_after: ClassVar[tuple[str, ...]] = ()
    runs_before: ClassVar[tuple[str, ...]] = ()
    exclusive: ClassVar[str | None] = None
    overrides: ClassVar[tuple[str, ...]] = ()
    #: Whether ``apply`` changes tensors (so the result must be saved) or only structure/runtime.
    changes_weights: ClassVar[bool] = True
    #: Whether :meth:`apply` reads or changes modules at all (``False``: a declaration such as
    #: ``calibrate``, which ``convert`` runs once, outside the units, whatever it targets).
    changes_modules: ClassVar[bool] = True
    #: Whether a plan with this transform needs a statement ``in`` clause.
    requires_scope: ClassVar[bool] = False
    #: The most the transform may change the model's output (spec.md "Numerical guard", checked by
    #: ``transform(..., verify=True)``): a mapping metric -> bound (``kl``, ``top1``, ``rms``,
    #: ``max``: :mod:`transformdsl.verification`), or a number: a bound on the relative RMS error
    #: ``‖after - before‖ / ‖before‖``.  ``0.0``: exact up to float rounding in every metric (the
    #: default: a lossy transform must say how lossy); ``None``: no bound.  A transform whose bound
    #: depends on its options defines ``error_bound`` as a property instead.
    error_bound: ClassVar[float | dict[str, float] | None] = 0.0
    #: Number fields of the record that add up over parts of the targets (:meth:`merge_records`).
    summed_record_fields: ClassVar[tuple[str, ...]] = ()
    #: Version of the record :meth:`apply` returns, saved beside it; bump it when the record's layout
    #: changes in a way older code cannot read.  :meth:`rebuild` gets records of this version or older
    #: (the loader refuses newer ones); reading an older layout is the transform's own business.
    record_version: ClassVar[int] = 1
    #: ``"module:Class"`` (``".module:Class"``: relative to this class's package) of the subclass that
    #: implements this declaration, imported only when a model is planned, transformed or loaded;
    #: ``None``: this class is its own implementation.
    implementation: ClassVar[str | None] = None
    #: The runtime switches (:class:`transformdsl.switches.Switch`) this transform's modules read.
    switches: ClassVar[tuple] = ()
    #: What the statement's quoted argument is (``lora "PATH"``: ``"the LoRA file (.safetensors)"``),
    #: with an example statement after a ``|`` for errors; ``None``: the statement takes none.  A
    #: transform that takes one may also be given it as one bare word (``lora style.safetensors``).
    argument: ClassVar[str | None] = None
    #: Whether ``convert`` can apply it to a model streamed block by block (``False``: it refuses the
    #: statement, naming it).
    streams: ClassVar[bool] = True
    #: Whether :meth:`apply` learns from calibration data (``ctx.calibration``): the plan fails when a
    #: script has neither a ``calibrate`` statement nor ``calibration=`` data for it.  A property
    #: when it depends on the options (``quantize int4 method=gptq``).
    needs_calibration: ClassVar[bool] = False
    #: Whether :meth:`apply_blocks` fits on statistics that processes holding different calibration
    #: samples sum back exactly (:mod:`transformdsl.calibration.shares`: ``convert --workers N`` splits
    #: the samples); ``False``: ``convert`` refuses ``workers > 1`` for the statement.
    shares_samples: ClassVar[bool] = False
    #: ``quant_method`` values of a library checkpoint's ``quantization_config`` whose layers this
    #: transform rebuilds as its own (:meth:`import_checkpoint`): ``load(dir)`` reads such a checkpoint.
    quant_methods: ClassVar[tuple[str, ...]] = ()
    #: The lowest :data:`API_VERSION` this transform is written against; the registry refuses it (naming
    #: both versions) where transformdsl's API is older.
    requires_api: ClassVar[int] = 1

    def __init__(self, statement: Statement, options: Any, common: CommonOptions | None = None):
        self.statement = statement
        self.options = options
        self.common = common or CommonOptions()

    @classmethod
    def key(cls) -> str:
        return f"{cls.verb} {cls.mode}" if cls.mode else cls.verb

    # ------------------------------------------------------------------ planning

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        """``None`` if the selected module can be transformed, else the reason it cannot.

        Modules with a reason are listed in the plan as near misses, never silently dropped.
        """
        return None

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        """``None`` if the options suit this module, else an error message (the plan fails)."""
        return None

    def incompatible(self, other: Transform) -> str | None:
        """A rule against another statement of the same script: the reason and fix, or ``None``.

        Called for every ordered pair; the validator reports it naming both lines.
        """
        return None

    def plan_effect(self, tree: ModuleTree, targets: list[str]) -> None:
        """Update the planning snapshot as :meth:`apply` will change the real tree."""

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        """Extra lines for the plan (e.g. a hardware fallback), after targets are known."""
        return []

    def idle_reason(self, tree: ModuleTree) -> str | None:
        """Why the statement changes nothing on this model where what it selected and skipped does not say
        it (asked only when it targets no module and skips none): the warning's reason."""
        return None

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        """One line when the backend this statement uses has no fast kernel on the device the
        targets are on (detected by :mod:`transformdsl.capabilities`): shown by the plan and logged
        once by ``transform()``."""
        return None

    def recorded_argument(self) -> str:
        """The statement's quoted argument as the model's history (and so a save) records it:
        as written by default; a transform whose argument is private (a file's path) shortens it."""
        return self.statement.argument.text if self.statement.argument is not None else ""

    # ------------------------------------------------------------------ execution

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        """Transform the modules at ``targets`` (paths below ``ctx.root``).

        Every change to an existing module goes through ``ctx.edit``; tensors are never
        modified in place.  Returns a JSON-serialisable record with everything
        :meth:`rebuild` needs to recreate the structure when loading (no tensors).
        """
        raise NotImplementedError(f"'{self.key()}' is declared but cannot be executed yet")

    def apply_blocks(self, ctx: ApplyContext, targets: list[str], stream: Any, blocks: list[str]) -> dict:
        """:meth:`apply` of a transform that learns from calibration data, when ``convert`` streams
        the model one unit at a time: ``targets`` are the statement's targets inside ``blocks``
        (loaded, in the order the model calls them), and ``stream`` (a
        :class:`transformdsl.calibration.sequential.BlockStream`) carries the samples' inputs from
        block to block: call ``stream.advance(block, method)`` for each block, in order.  The records
        of the units are joined by :meth:`merge_records`.  Default: not streamed (``convert`` refuses
        the statement, naming it)."""
        raise NotImplementedError

    @classmethod
    def merge_records(cls, records: list[dict]) -> dict:
        """The record :meth:`apply` returns for all its targets, from the records it returned for
        disjoint parts of them, given in target order (``convert`` applies a statement to a
        model one unit, e.g. one block, at a time).

        Default: list fields are concatenated, dict fields united (their keys are paths),
        fields named in :attr:`summed_record_fields` added; any other field must be the same
        in every record.  A transform whose record does not fit these rules overrides this.
        """
        if len(records) == 1:
            return records[0]
        merged: dict = {}
        for record in records:
            for name, value in record.items():
                if name not in merged:
                    merged[name] = list(value) if isinstance(value, list) else dict(value) if isinstance(
                        value, dict) else value
                elif name in cls.summed_record_fields:
                    merged[name] += value
                elif isinstance(value, list):
                    merged[name].extend(value)
                elif isinstance(value, dict):
                    clash = [key for key in value if key in merged[name] and merged[name][key] != value[key]]
                    if clash:
                        raise ValueError(f"'{cls.key()}': record field {name} differs between parts at {clash[0]!r}")
                    merged[name].update(value)
                elif merged[name] != value:
                    raise ValueError(f"'{cls.key()}': record field {name} differs between parts "
                                     f"({merged[name]!r}, {value!r}); override merge_records")
        return merged

    # ------------------------------------------------------------------ loading

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        """Recreate on ``root`` (a skeleton, usually on the meta device) the structure that
        :meth:`apply` produced, from its record, without computing anything.  The saved
        tensors are loaded afterwards by the loader, by state_dict key."""
        raise NotImplementedError(f"'{cls.key()}' cannot be reloaded")

    @classmethod
    def finalize(cls, root: nn.Module, record: dict, options: Any) -> None:
        """Runs after the saved tensors are in place (e.g. to compile again)."""

    # ------------------------------------------------------------------ other formats

    @classmethod
    def import_checkpoint(cls, path: Path, quantization_config: dict, headers: Headers) -> tuple[list[dict], str]:
        """The saved steps (as in ``transformdsl.json``) and the script a library checkpoint's
        ``quantization_config`` (one of :attr:`quant_methods`) stands for, from its safetensors
        ``headers`` (tensor name → file; ``headers.info``: name → (dtype, shape)); a
        :class:`LoadError` when the checkpoint is not what the config says."""
        raise LoadError(f"{path}: '{cls.key()}' reads no library checkpoint")

    @classmethod
    def export(cls, step: AppliedStep, out: Exported) -> None:
        """Carry an applied step into a library's layout (``save(..., format="transformers")``): rename or
        split tensors in ``out``, add a note, or ask for the ``quantization_config``; raise
        ``out.refuse(step, why)`` when the format cannot carry it (the default)."""
        raise out.refuse(step, f"{out.library} has no representation of '{step.key}'")


#: The attribute :class:`RuntimeTransform` sets on a module it attached to when it keeps state between calls
#: (a step cache): its :meth:`~RuntimeTransform.fresh_run`, which ``verify`` enters around each sample.
FRESH_RUN = "_transformdsl_fresh_run"


class RuntimeTransform(Transform):
    """A statement that changes how the model runs, not its weights or structure (``compile``, a step
    ``cache``, an ``attention`` backend): nothing of it is stored, so :meth:`rebuild` has nothing to do, a
    library's layout gets a note instead (:meth:`export`), and loading attaches it again (:meth:`finalize`).

    A subclass writes one method, :meth:`attach`, used both when the statement runs and when a saved model
    is loaded; :meth:`apply` is written on it: each target's attributes are saved first
    (``edit.touch`` of :meth:`touches`) and :meth:`detach` is registered, so a failure later in the
    script rolls the model back to exactly what it was.  A technique that keeps state between calls
    (a step cache) also writes :meth:`fresh_run`.  Modelled on diffusers' ``ModelHook``: attach, detach,
    reset.
    """

    changes_weights: ClassVar[bool] = False
    #: The record field that lists what :meth:`attach` returned (e.g. ``"modules"`` a backend was set on).
    attached_field: ClassVar[str | None] = None
    #: The advice the note of a library layout gives (``save(..., format="transformers")``): what its user
    #: calls after ``from_pretrained`` instead.
    after_from_pretrained: ClassVar[str] = "apply it again after from_pretrained"
    #: Why the layout cannot keep it (``{library}`` is replaced by the library's name).
    not_stored: ClassVar[str] = "{library} keeps no run-time setting in a checkpoint"

    @classmethod
    def attach(cls, module: nn.Module, path: str, options: Any, edit: Edit | None) -> list[str] | None:
        """Attach the technique to ``module`` (the target at ``path``); ``edit`` is the run's edit log while
        the statement runs (route any change outside module attributes through it), None on load.  Returns
        the names of what it attached to, recorded under :attr:`attached_field` (or None)."""
        raise NotImplementedError(f"'{cls.key()}' attaches nothing")

    @classmethod
    def detach(cls, module: nn.Module) -> None:
        """Undo :meth:`attach` beyond the module attributes a rollback restores by itself (e.g. hooks a
        library registered elsewhere).  Default: nothing."""

    @classmethod
    def touches(cls, module: nn.Module) -> list[nn.Module]:
        """The modules whose attributes :meth:`attach` sets (saved before it runs).  Default: the target."""
        return [module]

    @classmethod
    def fresh_run(cls, module: nn.Module) -> Any:
        """A context manager in which one call of ``module`` starts from no state kept since an earlier call,
        and leaves none behind (``transform(..., verify=True)`` runs each sample in it); None (the default):
        the technique keeps no state between calls."""
        return None

    def record_fields(self) -> dict:
        """What the record holds besides ``targets`` (and :attr:`attached_field`).  Default: the options."""
        import dataclasses

        return {"options": dataclasses.asdict(self.options)} if dataclasses.is_dataclass(self.options) else {}

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        cls = type(self)
        record: dict = {"targets": list(targets), **self.record_fields()}
        attached: list[str] = []
        for path in ctx.progress(targets, total=len(targets), desc=self.key()):
            module = ctx.root.get_submodule(path) if path else ctx.root
            for touched in cls.touches(module):
                ctx.edit.touch(touched)
            ctx.edit.on_rollback(lambda m=module: cls.detach(m))
            attached.extend(cls.attach(module, path, self.options, ctx.edit) or [])
            cls.mark_stateful(module, ctx.edit)
        if cls.attached_field:
            record[cls.attached_field] = attached
        return record

    @classmethod
    def mark_stateful(cls, module: nn.Module, edit: Edit | None) -> None:
        """Leave :data:`FRESH_RUN` on ``module`` when the technique keeps state between calls."""
        if cls.fresh_run.__func__ is RuntimeTransform.fresh_run.__func__:
            return
        if edit is not None:
            edit.setattr(module, FRESH_RUN, cls.fresh_run)
        else:
            setattr(module, FRESH_RUN, cls.fresh_run)

    @classmethod
    def rebuild(cls, root: nn.Module, record: dict, options: Any) -> None:
        """Nothing structural: it changes no module and no state_dict key."""

    @classmethod
    def export(cls, step: AppliedStep, out: Exported) -> None:
        """Nothing to store: a note says what to call after ``from_pretrained``."""
        out.notes.append(f"{out.where(step)}: not stored ({cls.not_stored.format(library=out.library)}); "
                         f"{cls.after_from_pretrained}")

    @classmethod
    def finalize(cls, root: nn.Module, record: dict, options: Any) -> None:
        """Attach it again to the recorded targets of the loaded model (nothing of it was saved)."""
        for path, module in recorded_targets(root, record, cls.key()):
            cls.attach(module, path, options, None)
            cls.mark_stateful(module, None)
