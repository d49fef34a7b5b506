"""Load saved directories with stock diffusers/transformers only, run them, write the outputs.

Run as a script in a fresh process (tests/test_interop.py does): importing transformdsl is
blocked, and the process checks at the end that it never was imported.

    python tests/stock_loader.py JOBS.json

``JOBS.json``: ``[{"dir": ..., "library": "transformers" | "diffusers", "class": name,
"inputs": file.safetensors, "out": file.safetensors, "device": "cpu"}]``.  Inputs are the model's
arguments (``arg0``, ``arg1``... positional, other names keyword); the output file gets ``out``
(``.logits`` or ``.sample``) and ``layers`` is reported on stdout: the class names of the
quantized layers the library built.
"""

import importlib.abc
import json
import sys


class _NoTransformdsl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "transformdsl" or name.startswith("transformdsl."):
            raise ImportError("transformdsl must not be imported by the stock loader")
        return None


sys.meta_path.insert(0, _NoTransformdsl())
sys.path = [p for p in sys.path if p not in ("", ".")]

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from stock_kernels import stock_runs_portable_4bit  # noqa: E402  (beside this script; no transformdsl)


def main(jobs_file: str) -> None:
    report = []
    for job in json.load(open(jobs_file)):
        library = __import__(job["library"])
        cls = getattr(library, job["class"])
        kwargs = {"device_map": job.get("device", "cpu")} if job["library"] == "transformers" else {}
        model = cls.from_pretrained(job["dir"], local_files_only=True, **kwargs)
        model.eval()
        stock_runs_portable_4bit(model)  # the kernels ours run, on every CPU (stock_kernels.py)
        device = next(model.parameters()).device  # diffusers' bitsandbytes loader places it on the GPU
        inputs = {k: v.to(device) for k, v in load_file(job["inputs"]).items()}
        args = [inputs.pop(f"arg{i}") for i in range(len([k for k in inputs if k.startswith("arg")]))]
        with torch.no_grad():
            out = model(*args, **inputs)
        tensor = out.logits if hasattr(out, "logits") else out.sample if hasattr(out, "sample") else out[0]
        save_file({"out": tensor.float().cpu().contiguous()}, job["out"])
        layers = sorted({type(m).__name__ for m in model.modules()
                         if type(m).__module__.startswith(("bitsandbytes", "transformers.integrations"))})
        report.append({"dir": job["dir"], "layers": layers, "dtype": str(tensor.dtype), "device": str(device)})
    assert "transformdsl" not in sys.modules
    print("STOCK " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
