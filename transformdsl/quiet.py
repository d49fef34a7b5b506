"""Log lines of the model libraries that say nothing a user can act on, dropped at their source.

bitsandbytes logs a warning when it is imported on a CPU with AVX512-BF16 and without the optional
``kernels`` package (it then uses its own slower 4-bit kernel).  diffusers and transformers import
bitsandbytes when they are imported, so the filter must be on bitsandbytes' logger before any of
them is: :func:`install` runs when ``transformdsl`` is imported.  The filters are narrow (one logger,
one message template each) and idempotent; this module imports only :mod:`logging` and :mod:`sys`.

torchao, a common companion of diffusers, is imported by diffusers too when it is installed; measured
with torchao 0.18 and diffusers 0.38 on a CPU-only machine, every command printed five lines:

- torchao's "Failed to load .../_C_cutlass_90a.abi3.so": its CUDA kernels, which a machine without a
  CUDA device cannot load (kept where one is present: there it is a broken install);
- torch's pytree "<enum ...> is an Enum subclass and is now natively supported": a deprecation aimed at
  torchao's own code, twice;
- diffusers' "Unable to import `torchao` Tensor objects": diffusers' list of torch.load safe globals
  names classes torchao 0.18 moved; it matters only to torch.load of a pickled torchao checkpoint, and
  nothing here unpickles.
"""

from __future__ import annotations

import logging
import sys

#: Logger -> message templates (prefixes) dropped from it.
QUIET: dict[str, tuple[str, ...]] = {
    # Once per forward call with fp32/bf16 input: LLM.int8 quantizes activations via fp16 by design.
    "bitsandbytes.autograd._functions": ("MatMul8bitLt: inputs will be cast from",),
    # At import on AVX512-BF16 CPUs without the optional `kernels` package (a slower kernel is used).
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # At import of torchao (diffusers imports it), once per CUDA extension; dropped without a CUDA device.
    "torchao": ("Failed to load ",),
    # At import of torchao, its Enums registered as pytree constants (a torch deprecation, not ours).
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
    # At import of diffusers beside torchao >= 0.18: only torch.load of a pickled checkpoint would care.
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
}

#: Loggers whose messages are dropped only on a machine without a CUDA device.
ONLY_WITHOUT_CUDA = frozenset({"torchao"})


def _has_cuda() -> bool:
    torch = sys.modules.get("torch")  # torchao imports torch before it logs
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:  # noqa: BLE001  (a broken CUDA runtime: keep its messages)
        return True


class DropMessages(logging.Filter):
    """Drops records whose message template starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...], only_without_cuda: bool = False):
        super().__init__()
        self.prefixes = prefixes
        self.only_without_cuda = only_without_cuda

    def filter(self, record: logging.LogRecord) -> bool:
        dropped = isinstance(record.msg, str) and record.msg.startswith(self.prefixes)
        return not (dropped and not (self.only_without_cuda and _has_cuda()))


def install() -> None:
    """Put the filters on the loggers of :data:`QUIET` (idempotent)."""
    for name, prefixes in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(prefixes, only_without_cuda=name in ONLY_WITHOUT_CUDA))
