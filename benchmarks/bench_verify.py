"""The numerical guard on trained weights: each scheme's ``verify`` verdict beside what it costs.

    PYTHONPATH=$PWD python benchmarks/bench_verify.py [--windows 8]

Writes ``benchmarks/results/verify.md`` and ``verify.json``.  The model is tests/trained/ (a small
Llama trained here on Python's docs, byte-level; ``tests/trained/train.py``), in float32.  For each
scheme, on the held-out text it never saw (``--windows`` windows of 512 tokens):

- the cost: perplexity (and its change), mean KL per token of the next-token distributions against the
  float model, the share of tokens whose top-1 prediction changed; the relative RMS error of the
  logits and of the last hidden state;
- ``transform(model, script, verify=True)``'s verdict with the default metric and bound, on the
  library's own sample input (random tokens, 2 x 8) and on held-out text of 64 and 512 tokens;
- the guard's earlier metric (``max|after - before| / max|before|``) on 64 and 512 tokens, and its
  earlier bound: the figures issue 28 reported on a 135 M-parameter model, reproduced here;
- the same scheme done by hand with the stock library (bitsandbytes' ``Linear8bitLt``/``Linear4bit``,
  hqq's ``HQQLinear``, diffusers' layerwise fp8 casting; torchao is not installed here, so weight-only
  int8 by hand is its recipe in plain torch: per-row absmax / 127, round) and ours ÷ theirs.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from baselines import bnb_4bit, replace_linears  # noqa: E402
from common import header, table, write  # noqa: E402
from torch import nn  # noqa: E402

import transformdsl  # noqa: E402
from tests import trained  # noqa: E402
from transformdsl.verification import VerifyError, relative_error, relative_rms, token_kl, top1_changed  # noqa: E402

#: The guard's bounds before this benchmark (``max|after - before| / max|before|``), for the old column.
OLD_BOUNDS = {"quantize int8 weight_only=true": 0.03, "quantize int8": 0.05, "quantize int8 threshold=6": 0.05,
              "fp8 storage": 0.2, "fp8 storage scale=none": 0.2, "fp8 native": 0.15,
              "quantize hqq bits=8": 0.03, "quantize hqq bits=4 group_size=64": 0.4, "quantize hqq bits=3": 0.8,
              "quantize nf4": 0.4, "quantize fp4": 0.5}


# ---------------------------------------------------------------------- the stock libraries by hand

class WeightOnlyInt8(nn.Module):
    """torchao's ``Int8WeightOnlyConfig`` recipe in plain torch: int8 weights, one scale per output row
    (absmax / 127), dequantized into the float matmul."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.scale = weight.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        self.qweight = (weight / self.scale).round().clamp(-127, 127).to(torch.int8)
        self.bias = linear.bias

    def forward(self, x):
        return nn.functional.linear(x, (self.qweight.float() * self.scale).to(x.dtype), self.bias)


def by_hand_weight_only_int8(model):
    return replace_linears(model, WeightOnlyInt8)


def by_hand_int8(threshold: float):
    def convert(model):
        import bitsandbytes as bnb

        def make(linear):
            new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      has_fp16_weights=False, threshold=threshold)
            new.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
            if linear.bias is not None:
                new.bias = linear.bias
            return new.to("cpu")

        return replace_linears(model, make)

    return convert


def by_hand_hqq(bits: int, group_size: int = 64):
    def convert(model):
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

        config = BaseQuantizeConfig(nbits=bits, group_size=group_size, axis=1)
        return replace_linears(model, lambda linear: HQQLinear(linear, config, compute_dtype=torch.float32,
                                                               device="cpu"))

    return convert


def by_hand_fp8_cast(model):
    """diffusers' layerwise casting (its default skip patterns), float8_e4m3fn storage, float32 compute."""
    from diffusers.hooks import apply_layerwise_casting

    apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return model


#: (script, by-hand label, by-hand function) in the order of the tables.
SCHEMES = [
    ("quantize int8 weight_only=true", "torchao's int8 weight-only recipe (plain torch)", by_hand_weight_only_int8),
    ("quantize int8", "bitsandbytes Linear8bitLt threshold=0", by_hand_int8(0.0)),
    ("quantize int8 threshold=6", "bitsandbytes Linear8bitLt threshold=6", by_hand_int8(6.0)),
    ("fp8 storage", "diffusers layerwise casting e4m3 (no scale)", by_hand_fp8_cast),
    ("fp8 storage scale=none", "diffusers layerwise casting e4m3 (no scale)", by_hand_fp8_cast),
    ("fp8 native", None, None),
    ("quantize hqq bits=8", "hqq HQQLinear 8-bit, group 64", by_hand_hqq(8)),
    ("quantize hqq bits=4 group_size=64", "hqq HQQLinear 4-bit, group 64", by_hand_hqq(4)),
    ("quantize hqq bits=3", "hqq HQQLinear 3-bit, group 64", by_hand_hqq(3)),
    ("quantize nf4", "bitsandbytes Linear4bit nf4", bnb_4bit("nf4")),
    ("quantize fp4", "bitsandbytes Linear4bit fp4", bnb_4bit("fp4")),
]


# ---------------------------------------------------------------------- measuring

def windows(count: int, length: int = 512) -> torch.Tensor:
    ids = trained.heldout_ids()[0]
    count = min(count, len(ids) // length)
    return ids[: count * length].view(count, length)


@torch.no_grad()
def run(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, last hidden state) on ``ids``, one window at a time."""
    logits, hidden = [], []
    for row in ids:
        out = model(row[None], use_cache=False, output_hidden_states=True)
        logits.append(out.logits.float())
        hidden.append(out.hidden_states[-1].float())
    return torch.cat(logits), torch.cat(hidden)


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                       ids[:, 1:].reshape(-1))
    return math.exp(loss.item())


def cost(model, ids, reference) -> dict:
    logits, hidden = run(model, ids)
    ref_logits, ref_hidden = reference
    return {"ppl": perplexity(logits, ids), "kl": token_kl(ref_logits, logits),
            "top1": top1_changed(ref_logits, logits), "rms_logits": relative_rms(ref_logits, logits),
            "rms_hidden": relative_rms(ref_hidden, hidden),
            "max64": relative_error(ref_logits[:1, :64], logits[:1, :64]),
            "max512": relative_error(ref_logits[:1], logits[:1])}


VALUE = re.compile(r"verify: (?:\w+ |the output changed by )([0-9.eE+-]+|inf|nan) \((\w+):")


def verdict(model, script: str, inputs) -> dict:
    """``transform(copy, script, verify=True)`` on ``inputs`` (None: the sample input): pass/refuse, value."""
    lines = []
    try:
        transformdsl.transform(copy.deepcopy(model), script, verify=True, verify_inputs=inputs, log=lines.append)
    except VerifyError as exc:
        return {"passed": False, "metric": exc.report.metric, "value": exc.report.value, "bound": exc.report.bound}
    found = next(VALUE.match(line) for line in lines if line.startswith("verify:"))
    bound = re.search(r" within the bound ([0-9.eE+-]+) ", lines[-1])
    return {"passed": True, "metric": found.group(2), "value": float(found.group(1)),
            "bound": float(bound.group(1)) if bound else None}


def fmt(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}g}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8, help="held-out windows of 512 tokens (default 8)")
    parser.add_argument("--only", help="comma-separated scripts to run (default: all)")
    parser.add_argument("--render", action="store_true", help="only rewrite verify.md from verify.json")
    args = parser.parse_args(argv)
    if args.render:
        write("verify.md", render(json.loads((ROOT / "benchmarks" / "results" / "verify.json").read_text())))
        return
    torch.manual_seed(0)
    started = time.time()
    model = trained.load_model()
    ids = windows(args.windows)
    reference = run(model, ids)
    float_ppl = perplexity(reference[0], ids)
    inputs = {"sample": None, "text 64": trained.text_inputs(64), "text 512": trained.text_inputs(512)}
    results = []
    for script, hand_label, by_hand in SCHEMES:
        if args.only and script not in args.only.split(","):
            continue
        print(f"{script} ...", flush=True)
        ours = copy.deepcopy(model)
        transformdsl.transform(ours, script)
        row = {"script": script, "ours": cost(ours, ids, reference),
               "verify": {name: verdict(model, script, sample) for name, sample in inputs.items()}}
        if by_hand is not None:
            row["by_hand"] = hand_label
            row["stock"] = cost(by_hand(copy.deepcopy(model)), ids, reference)
        results.append(row)
        print(json.dumps(row), flush=True)

    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    data = {"float_ppl": float_ppl, "tokens": int(ids.numel()), "rows": results, "measured_at": started}
    (ROOT / "benchmarks" / "results" / "verify.json").write_text(json.dumps(data, indent=1) + "\n")
    write("verify.md", render(data))


def render(data: dict) -> str:
    rows = data["rows"]
    out = [header("The numerical guard on trained weights (`transform(..., verify=True)`)", data["measured_at"]),
           f"Model: tests/trained/ (Llama, 4 layers, hidden 128, byte-level; `tests/trained/train.py`), float32; "
           f"float perplexity {data['float_ppl']:.3f} on {data['tokens']:,} held-out tokens "
           "(`tests/trained/heldout.txt`).  KL: mean per token of KL(float ‖ scheme) of the next-token "
           "distributions, nats; top-1: share of tokens whose most likely next byte changed.  "
           "`PYTHONPATH=$PWD python benchmarks/bench_verify.py`.\n",
           "## Verdicts beside the cost\n",
           "verify: `transform(model, script, verify=True)` with the default metric (KL per token for logits) "
           "and the script's declared bound; on the sample input (random tokens, 2 x 8), and on held-out text "
           "of 64 and 512 tokens.  pass / **refused**, the measured KL.\n"]
    table_rows = []
    for row in rows:
        ours, v = row["ours"], row["verify"]
        cells = {name: ("pass" if r["passed"] else "**refused**") + f" {fmt(r['value'], 2)}" for name, r in v.items()}
        table_rows.append({
            "script": f"`{row['script']}`", "bound (KL)": fmt(v["text 512"]["bound"]) if v["text 512"]["bound"]
            is not None else "none",
            "ppl": f"{ours['ppl']:.3f}", "Δppl": f"{100 * (ours['ppl'] / data['float_ppl'] - 1):+.2f}%",
            "KL": fmt(ours["kl"]), "top-1 changed": f"{100 * ours['top1']:.2f}%",
            "verify: sample": cells["sample"], "text 64": cells["text 64"], "text 512": cells["text 512"]})
    out.append(table(table_rows, ["script", "ppl", "Δppl", "KL", "top-1 changed", "bound (KL)", "verify: sample",
                                  "text 64", "text 512"]))
    out.append("\n## Ours ÷ the stock library by hand\n")
    stock_rows = []
    for row in rows:
        if "stock" not in row:
            continue
        ours, stock = row["ours"], row["stock"]
        stock_rows.append({"script": f"`{row['script']}`", "by hand": row["by_hand"],
                           "ppl ours": f"{ours['ppl']:.3f}", "ppl by hand": f"{stock['ppl']:.3f}",
                           "ppl ÷": f"{ours['ppl'] / stock['ppl']:.4f}", "KL ours": fmt(ours["kl"]),
                           "KL by hand": fmt(stock["kl"])})
    out.append(table(stock_rows, ["script", "by hand", "ppl ours", "ppl by hand", "ppl ÷", "KL ours", "KL by hand"]))
    out.append("\n## Other metrics, and the guard's earlier one\n")
    growth = [row["ours"]["max512"] / row["ours"]["max64"] for row in rows if row["ours"]["max64"] > 0]
    out.append("rms: relative RMS error of the logits / of the last hidden state (after the final norm) on the "
               "held-out windows.  max: `max|after - before| / max|before|` of the logits (the earlier metric) on "
               "the first 64 and 512 tokens, against the earlier bound.  It tends to grow with the length (here 512 "
               f"tokens read {min(growth):.2f}-{max(growth):.2f}x the value of 64) and with the logits' scale; on "
               "this small model it stays under the earlier bounds, which the 135 M-parameter model of spec.md "
               "\"Numerical guard\" did not.\n")
    other = []
    for row in rows:
        ours = row["ours"]
        old = OLD_BOUNDS.get(row["script"])
        other.append({"script": f"`{row['script']}`", "KL": fmt(ours["kl"]), "rms logits": fmt(ours["rms_logits"]),
                      "rms hidden": fmt(ours["rms_hidden"]), "max 64": fmt(ours["max64"]),
                      "max 512": fmt(ours["max512"]), "earlier bound": "" if old is None else f"{old:g}",
                      "earlier verdict (512)": "" if old is None else ("pass" if ours["max512"] <= old
                                                                        else "refused")})
    out.append(table(other, ["script", "KL", "rms logits", "rms hidden", "max 64", "max 512", "earlier bound",
                             "earlier verdict (512)"]))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
