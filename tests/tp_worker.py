"""One rank of tests/test_parallel.py's torchrun jobs (``torchrun ... tests/tp_worker.py SPEC OUT``).

SPEC is a JSON list of cases ``{"dir": path (may hold "{rank}"), "tp_plan": "auto" | dict}``.  For each
case the rank loads the save twice, whole and with ``tp_plan=``, runs both on the built-in sample
inputs, and records the largest logits difference and the plan (or the LoadError's message) in
OUT/rank<r>.json.  Nothing is compared here: the test does it.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(spec_path: str, out: str) -> None:
    import torch

    import transformdsl
    from transformdsl import models
    from transformdsl.errors import LoadError, TransformError

    rank = int(os.environ["RANK"])
    results = []
    for case in json.loads(open(spec_path).read()):
        directory = case["dir"].format(rank=rank)
        record: dict = {}
        if case.get("stock"):  # our transformers export, loaded by stock transformers, sharded and whole
            results.append(_stock(directory))
            torch.distributed.barrier()
            continue
        try:
            started = time.perf_counter()
            sharded = transformdsl.load(directory, tp_plan=case.get("tp_plan", "auto"), device=case.get("device"))
            record["load_s"] = time.perf_counter() - started
            whole = transformdsl.load(directory)
            args, kwargs = models.sample_inputs(whole)
            device = next(sharded.buffers(), next(sharded.parameters())).device
            with torch.no_grad():
                out_tp = sharded(*[_on(a, device) for a in args], **{k: _on(v, device) for k, v in kwargs.items()})
            out_tp, out_one = out_tp.logits.cpu(), models.run(whole)
            record["max_diff"] = (out_tp.float() - out_one.float()).abs().max().item()
            if case.get("lora"):  # a switchable LoRA's scale set on every rank reaches the shards
                for model in (sharded, whole):
                    transformdsl.set_lora(model, case["lora"], 0.3)
                again_tp, again_one = models.run(sharded), models.run(whole)
                record["rescaled_diff"] = (again_tp - again_one).abs().max().item()
                record["rescaled_moved"] = (again_one - out_one).abs().max().item()
            record["scale"] = out_one.float().abs().max().item()
            record["plan"] = sharded.tensor_parallel.describe()
            record["local_bytes"] = sum(t.numel() * t.element_size() for t in sharded.state_dict().values())
            record["whole_bytes"] = sum(t.numel() * t.element_size() for t in whole.state_dict().values())
            try:
                transformdsl.save(sharded, os.path.join(out, f"refused{rank}"))
            except TransformError as exc:
                record["save_error"] = str(exc)
            if case.get("latency"):
                record["latency"] = _latency(sharded, whole, case["latency"])
        except LoadError as exc:
            record["error"] = str(exc)
        results.append(record)
        torch.distributed.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def _stock(directory: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        sharded = AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=torch.float32)
        whole = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
        with torch.no_grad():
            out_tp, out_one = sharded(ids).logits, whole(ids).logits
        return {"max_diff": (out_tp - out_one).abs().max().item(), "scale": out_one.abs().max().item(),
                "local_bytes": sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                                   for t in sharded.state_dict().values()),
                "whole_bytes": sum(t.nbytes for t in whole.state_dict().values())}
    except Exception as exc:  # noqa: BLE001  (stock transformers' own refusals are what the test records)
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _on(value, device):
    return value.to(device) if hasattr(value, "to") and not isinstance(value, type) else value


def _latency(sharded, whole, tokens: int) -> dict:
    """Seconds per decoded token (greedy, with the KV cache) of both models, side by side."""
    import torch

    ids = torch.tensor([[1, 5, 9, 13]])
    times = {}
    for name, model in (("tp", sharded), ("one", whole)):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
            torch.distributed.barrier()
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            times[name] = (time.perf_counter() - started) / tokens
    return times


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
