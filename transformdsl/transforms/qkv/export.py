"""``fuse qkv`` in a library's layout: written back unfused (the fused weight split in q, k, v order: exact),
also under int8 (rows and their scales split) and fp8; refused under 4-bit quantization, whose blocks
straddle the projections.  ``transformdsl.load`` fuses them again.
"""

from __future__ import annotations

import torch

from ...errors import TransformError
from ...history import AppliedStep
from ...interop.hook_types import Exported


def export_unfused(step: AppliedStep, out: Exported) -> None:
    where = out.where(step)
    out.notes.append(f"{where}: written unfused (q, k, v as the library names them; exact); "
                     "transformdsl.load fuses them again")
    out.renames.update(unfuse(out, step.record, where))


def unfuse(out: Exported, record: dict, where: str) -> dict[str, list[str]]:
    """Split each fused projection's tensors back into its sources (in place in ``out``);
    returns fused path → source paths."""
    renames: dict[str, list[str]] = {}
    for module in record["modules"]:
        base = module["path"]
        for group in module["groups"]:
            fused = f"{base}.{group['name']}" if base else group["name"]
            sources = [f"{base}.{s}" if base else s for s in group["sources"]]
            splits = [int(s) for s in group["splits"]]
            for key in [k for k in out.tensors if k.startswith(fused + ".")]:
                suffix = key[len(fused) + 1:]
                tensor = out.tensors.pop(key)
                names = [f"{s}.{suffix}" for s in sources]
                rows = tensor.shape[0] if tensor.dim() else None
                if suffix in ("weight", "bias", "SCB", "weight_scale") and rows == sum(splits):
                    parts = tensor.split(splits, dim=0)
                    op = "cat"
                elif suffix in ("weight_format", "weight_scale") and tensor.numel() == 1:
                    parts = [tensor.clone() for _ in sources]
                    op = "same"
                else:
                    raise TransformError(f"{where}: cannot write '{fused}' unfused: its tensor '{suffix}' does not "
                                         "split by output rows (bitsandbytes 4-bit blocks straddle the projections); "
                                         "drop 'fuse qkv' (diffusers' fuse_qkv_projections() can fuse after loading),"
                                         " or save with format='transformdsl'")
                entry = {"key": key, "from": names, "op": op}
                if suffix == "bias" and group.get("zero_bias"):
                    # The rows of a projection that has no bias (Whisper's k_proj) are not written.
                    zeros = [[i, int(parts[i].shape[0])] for i, s in enumerate(group["sources"])
                             if s in group["zero_bias"]]
                    for i, _ in zeros:
                        if torch.count_nonzero(parts[i]):
                            raise TransformError(f"{where}: '{sources[i]}' has no bias in the library's model, but "
                                                 f"its rows of '{key}' are no longer zero (trained?)")
                    keep = [i for i in range(len(parts)) if i not in {z[0] for z in zeros}]
                    names, parts = [names[i] for i in keep], [parts[i] for i in keep]
                    entry = {"key": key, "from": names, "op": op, "zeros": zeros}
                for name, part in zip(names, parts):
                    out.tensors[name] = part.contiguous()
                out.layout.append(entry)
            renames[fused] = sources
    return renames
