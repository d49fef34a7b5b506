"""``calibrate "PATH"``: the data that methods learning from data (GPTQ, AWQ, SmoothQuant) run on (declaration).

The statement changes nothing in the model: it names the calibration data of the script's
``quantize ... method=gptq|awq`` and ``quantize w8a8 smooth=...`` statements, read and checked
before any statement runs (:mod:`transformdsl.calibration.data`).  The model's history records the
data's file name, size, sample and token counts and SHA-256, never its contents or directories.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...extend import Transform, option
from ..lora import file_name


@dataclass(frozen=True)
class CalibrateOptions:
    samples: int = option(128, "inputs to fit on (windows of text, or a tensor file's first samples)",
                          min=1, max=100_000)
    seqlen: int = option(512, "tokens per window of text (ignored for a tensor file)", min=1, max=1 << 20)
    seed: int = option(0, "which windows of the text are taken (a seeded random choice)", min=0, max=2**31 - 1)
    activations: str = option("auto", "where the samples' activations wait between blocks: auto (in memory up to "
                              "1/8 of the machine's, then an unlinked temporary file), memory, disk",
                              choices=("auto", "memory", "disk"))


class Calibrate(Transform):
    verb = "calibrate"
    summary = "calibration data for methods that learn from data (GPTQ, AWQ, SmoothQuant)"
    Options = CalibrateOptions
    argument = ('the calibration data (a text file, a folder or glob of text files, or a safetensors file of '
                'inputs; quoted)|calibrate "calibration.txt" samples=128 seqlen=512')
    #: The whole model (the data are its inputs); nothing is changed.
    default_target = None
    changes_weights = False
    changes_modules = False
    exclusive = "calibration data"
    error_bound = 0.0
    record_version = 1
    implementation = ".apply:Calibrate"

    def recorded_argument(self) -> str:
        """The data's file name: a save never records the directories above it."""
        return file_name(self.statement.argument.text) if self.statement.argument is not None else ""
