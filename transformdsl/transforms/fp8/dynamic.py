"""``fp8 dynamic``: ``fp8 native``'s layers without its fallbacks (implementation).

Planning refuses a device without fp8 matmul (CUDA before compute capability 8.9, ROCm, a CPU
unless :data:`~transformdsl.transforms.fp8.CPU_SCALED_MM` is on) naming the requirement, and leaves
out, with the reason, layers whose shapes ``torch._scaled_mm``'s CUDA kernels reject.  The layers
are :class:`~.layers.FP8Linear` in native, strict mode: saved and reloaded as ``fp8 native``'s are.
"""

from __future__ import annotations

from ...extend import ApplyContext
from ...tree import ModuleInfo, ModuleTree
from . import FP8Dynamic as DynamicDeclaration
from .apply import FP8Native
from .cuda import device_fp8_problem, native_layer_problems
from .layers import FP8Linear
from .numerics import NATIVE_DTYPE


def _device(tree: ModuleTree, targets: list[str]):
    """The device the targets' weights are on (weights still to be read, as ``convert`` plans them,
    are read to the CPU); None when unknown.  As ``fp8 native`` finds it."""
    import torch

    for path in [*targets, ""]:
        info = tree.get(path)
        module = info.module if info is not None else None
        for tensor in (module.parameters() if module is not None else ()):
            return torch.device("cpu") if tensor.is_meta and tree.weights_pending else tensor.device
    return None


class FP8Dynamic(FP8Native, DynamicDeclaration):

    def candidate(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        reason = super().candidate(info, tree)
        if reason is None:
            problems = self.layer_problems(info)
            if problems:
                return "torch._scaled_mm's CUDA kernels reject it: " + "; ".join(problems)
        return reason

    def check(self, info: ModuleInfo, tree: ModuleTree) -> str | None:
        device = _device(tree, [info.path])
        if device is None or device.type == "meta":
            return None
        problem = device_fp8_problem(device)
        if problem is None:
            return None
        fix = ("; 'fp8 native' upcasts where there is no fp8 matmul (memory savings only), and "
               "transformdsl.transforms.fp8.CPU_SCALED_MM.set(True) runs torch._scaled_mm's slow CPU reference "
               "(to test the GPU code path)") if device.type == "cpu" else "; 'fp8 native' upcasts instead"
        return f"{problem}: fp8 dynamic needs CUDA with compute capability 8.9+ (fp8 tensor cores){fix}"

    def notes(self, tree: ModuleTree, targets: list[str]) -> list[str]:
        return [n for n in super().notes(tree, targets) if "stored in fp8 with upcast" not in n]

    def device_note(self, tree: ModuleTree, targets: list[str]) -> str | None:
        device = _device(tree, targets)
        if device is not None and device.type == "cpu":  # only reachable with CPU_SCALED_MM on
            return ("CPU_SCALED_MM is on: these layers run torch._scaled_mm's CPU reference, the code path a GPU "
                    "takes, several times slower than a float matmul (for testing, not speed)")
        return None

    def apply(self, ctx: ApplyContext, targets: list[str]) -> dict:
        layers = {}
        for path in ctx.progress(targets, total=len(targets), desc=self.key()):
            old = ctx.root.get_submodule(path)
            problems = native_layer_problems(old.in_features, old.out_features, self.options.scaling,
                                             self.compute, old.bias is not None)
            if problems:  # refused by candidate(): the planning snapshot and the model disagree
                raise ValueError(f"{path}: {'; '.join(problems)}")
            new = FP8Linear.from_linear(old, NATIVE_DTYPE, self.compute, native=True,
                                        scaling=self.options.scaling, strict=True)
            new.statement = self.key()
            ctx.edit.replace(ctx.root, path, new)
            layers[path] = {"kind": "linear", "native": True, "weight_dtype": str(old.weight.dtype).removeprefix("torch.")}
        return {"format": 1, "scaling": self.options.scaling, "compute": self.options.compute,
                "strict": True, "layers": layers}

    @classmethod
    def rebuild(cls, root, record: dict, options) -> None:
        super().rebuild(root, record, options)
        for path in record["layers"]:
            root.get_submodule(path).statement = cls.key()
