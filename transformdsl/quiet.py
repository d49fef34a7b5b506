"""Log lines of the model libraries that say nothing a user can act on, dropped at their source.

bitsandbytes logs a warning when it is imported on a CPU with AVX512-BF16 and without the optional
``kernels`` package (it then uses its own slower 4-bit kernel).  diffusers and transformers import
bitsandbytes when they are imported, so the filter must be on bitsandbytes' logger before any of
them is: :func:`install` runs when ``transformdsl`` is imported.  The filters are narrow (one logger,
one message template each) and idempotent; this module imports only :mod:`logging`.
"""

from __future__ import annotations

import logging

#: Logger -> message templates (prefixes) dropped from it.
QUIET: dict[str, tuple[str, ...]] = {
    # Once per forward call with fp32/bf16 input: LLM.int8 quantizes activations via fp16 by design.
    "bitsandbytes.autograd._functions": ("MatMul8bitLt: inputs will be cast from",),
    # At import on AVX512-BF16 CPUs without the optional `kernels` package (a slower kernel is used).
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
}


class DropMessages(logging.Filter):
    """Drops records whose message template starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def install() -> None:
    """Put the filters on the loggers of :data:`QUIET` (idempotent)."""
    for name, prefixes in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(prefixes))
