"""Train the small language model tests/trained/model/ (a Llama, byte-level) on Python's own docs.

    PYTHONPATH=$PWD python -m tests.trained.train                              # rewrites model/
    PYTHONPATH=$PWD python -m tests.trained.train --resume --minutes 10 --lr 1.5e-3  # then continues it

The fixture is those two runs (8 and 10 minutes on one core of a busy 2-core machine: 241 + 351 steps
of 8 x 512 bytes; held-out perplexity 7.09, then 4.40 bytes).

Nothing is downloaded.  The text is the Python Language Reference as every Python installation ships it
(``pydoc_data.topics``: ~750 KB of English prose with code examples).  Topics are sorted by name; every
8th is held out (never trained on) and the first :data:`HELDOUT_BYTES` of them are written to
``heldout.txt``, the text the tests and ``benchmarks/bench_verify.py`` evaluate on.

The tokenizer is the identity on UTF-8 bytes (vocabulary 256, :func:`tests.trained.encode`), so the
fixture needs no tokenizer files.  The weights are saved in bfloat16 (half the bytes); loaded in
float32 (:func:`tests.trained.load_model`) they are that model exactly.

Why train at all: a model with random weights has near-Gaussian weights and activations and
near-uniform output distributions, so every quantization scheme moves its logits by about the same
relative amount.  Training, even for minutes, makes a few hidden channels carry much larger
activations than the rest and sharpens the next-byte distributions (the printout compares the
trained model with its own random initialisation): the structure that separates int8 with an outlier
threshold from weight-only int8 from 4-bit, and what the numerical guard's bounds are calibrated on.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"
HELDOUT = HERE / "heldout.txt"
HELDOUT_BYTES = 16384
#: Every HELDOUT_EVERY-th topic (sorted by name) is held out.
HELDOUT_EVERY = 8

CONFIG = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=384,  # multiples of 64: hqq's default group size fits every layer
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def texts() -> tuple[str, str]:
    """(training text, held-out text) from ``pydoc_data.topics``."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[n] for i, n in enumerate(names) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [topics[n] for i, n in enumerate(names) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return "\n\n".join(train), "\n\n".join(heldout)


def outlier_stats(model, ids) -> dict:
    """How far the inputs of the Linear layers stray from Gaussian: the largest |x| over the RMS
    (worst layer), the share of hidden channels whose largest |x| passes 6 (LLM.int8's outlier
    threshold), and the weights' mean excess kurtosis."""
    import torch

    ratios, over6, kurt = [], [], []
    hooks = []

    def hook(module, args, _out):
        x = args[0].detach().float().flatten(0, -2)
        ratios.append((x.abs().max() / x.pow(2).mean().sqrt()).item())
        over6.append((x.abs().amax(0) > 6).float().mean().item())

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            hooks.append(module.register_forward_hook(hook))
            w = module.weight.detach().float().flatten()
            w = (w - w.mean()) / w.std()
            kurt.append((w.pow(4).mean() - 3).item())
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return {"max_over_rms": round(max(ratios), 1), "channels_over_6": round(max(over6), 3),
            "weight_excess_kurtosis": round(sum(kurt) / len(kurt), 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="training time budget")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    parser.add_argument("--resume", action="store_true", help="continue from the model in --out")
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    train_text, heldout_text = texts()
    HELDOUT.write_text(heldout_text.encode()[:HELDOUT_BYTES].decode(errors="ignore"))
    data = torch.tensor(list(train_text.encode()), dtype=torch.long)
    valid = torch.tensor(list(HELDOUT.read_text().encode()), dtype=torch.long)
    print(f"training text {len(data):,} bytes, held out {len(valid):,} bytes")

    config = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(config)
    if args.resume:
        model = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    probe = valid[: args.seq].view(1, -1)
    print("resumed:" if args.resume else "random init:", json.dumps(outlier_stats(model.eval(), probe)))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget = args.minutes * 60
    generator = torch.Generator().manual_seed(0)
    started, step = time.perf_counter(), 0
    while True:
        elapsed = time.perf_counter() - started
        if elapsed > budget:
            break
        # linear warm-up over 30 steps, then cosine decay over the time budget (by elapsed time)
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / budget)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - args.seq, (args.batch,), generator=generator)
        batch = torch.stack([data[s: s + args.seq] for s in starts.tolist()])
        loss = model(batch, labels=batch, use_cache=False).loss  # transformers shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0:
            print(f"step {step:4d}  {elapsed:6.0f} s  lr {lr:.2e}  loss {loss.item():.3f} nats/byte", flush=True)
        step += 1

    model.eval()
    with torch.no_grad():
        windows = valid[: (len(valid) // args.seq) * args.seq].view(-1, args.seq)
        heldout_loss = model(windows, labels=windows, use_cache=False).loss.item()
    print(f"{step} steps, {step * args.batch * args.seq:,} tokens; held-out loss {heldout_loss:.3f} nats/byte "
          f"(perplexity {math.exp(heldout_loss):.2f}; a uniform guess: 256)")
    print("trained:", json.dumps(outlier_stats(model, probe)))
    model.to(torch.bfloat16).save_pretrained(args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
