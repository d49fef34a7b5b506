"""The plan's device notes of ``quantize``: when a mode has no fast kernel on the model's device,
what that costs (a figure the benchmarks measured on this kind of CPU, with its source) and what
runs faster.  Detection and the measured figures live in :mod:`transformdsl.capabilities`.

Importing this module imports no torch.
"""

from __future__ import annotations

from ...capabilities import (
    BF16_FLAGS,
    cited,
    cpu_bf16_matmul,
    cpu_capability,
    cpu_flags,
    cpu_int8_matmul,
    hqq_compiled_backend,
    measured_latency,
    packed_cpu_kernels,
    w8a8_kernel,
)


def int8_note(device_type: str) -> str | None:
    """Why ``quantize int8`` (bitsandbytes' LLM.int8) is slow on ``device_type``, or None."""
    if device_type != "cpu":
        return None
    kind = cpu_int8_matmul()
    if kind == "int8 dot product":
        return None
    alternative = measured_latency("flux-medium", "quantize int8 weight_only")
    faster = ("'quantize int8 weight_only=true' saves the same memory"
              + (f" at {alternative}" if alternative else " with a float matmul"))
    if kind == "float32":
        cost = measured_latency("flux-medium", "quantize int8")
        text = (f"this CPU ({cpu_capability()}) has no int8 matmul kernel: bitsandbytes converts both sides and "
                f"multiplies in float32 at every call" + (f", measured {cost}" if cost else "") + f"; {faster}")
        return cited(text, cost, alternative)
    # AVX-512 without VNNI/AMX: torch._int_mm runs without int8 dot products.  Not measured by this
    # project's benchmark machine (AVX2); measured once with the same model: 10.8 s against 0.30 s.
    return cited("this CPU has AVX-512 without int8 dot products (no avx512_vnni/avx_vnni/amx_int8): "
                  "bitsandbytes' int8 matmul (torch._int_mm) runs about 36× slower than fp32 on such a CPU; "
                  f"{faster}", alternative)


def w8a8_note(device_type: str, dtypes: set[str] = frozenset()) -> str | None:
    """What ``quantize w8a8`` costs on ``device_type`` where it has no fast int8 matmul, or where a
    bfloat16 model is as fast (AMX bf16 tiles); None where it is the fast choice.

    The figures: ``benchmarks/bench_quantized_compute.py`` on an AMD EPYC with avx512_vnni and an
    Intel Xeon with AMX (square layers of width 3072-4096, 512 tokens, one thread), the fallback
    measured with the int8 dot-product flags hidden."""
    if device_type != "cpu":
        return None
    if w8a8_kernel("cpu") == "int_mm":
        if "amx_bf16" not in cpu_flags():
            return None
        # Measured on an Intel Xeon with AMX (bench_quantized_compute.py, one thread, 512 tokens): w8a8
        # 0.27x / 0.20x fp32 at width 3072 / 4096, and a bfloat16 layer 0.18x / 0.20x.
        measured = ("(measured 1.0-1.5× the bf16 layer's time, 0.20-0.27× fp32, width 3072-4096, 512 tokens; "
                    "benchmarks/results/quantized_compute.md)")
        if dtypes and dtypes <= {"bfloat16"}:
            return ("this CPU multiplies bfloat16 in AMX tiles (amx_bf16): these bfloat16 layers ran about as fast "
                    f"as their int8 replacements or faster {measured}; w8a8 halves their weight bytes, not their time")
        return ("this CPU multiplies bfloat16 in AMX tiles (amx_bf16): a bfloat16 layer runs about as fast as these "
                f"int8 layers or faster {measured}: w8a8 halves the weight bytes of bfloat16; for speed alone "
                "model.to(torch.bfloat16) is enough here")
    return ("this CPU has no int8 dot-product instructions (avx512_vnni, avx_vnni, amx_int8): torch._int_mm "
            "runs ~35× slower than fp32 on such a CPU, so these layers multiply their int8 values in float32 "
            "(same results up to float rounding), measured 1.0-1.6× the fp32 layer; 'quantize int8 "
            "weight_only=true' keeps the same int8 weights with less error; with VNNI/AMX these layers ran "
            "0.13-0.17× fp32 (benchmarks/results/quantized_compute.md, width 3072-4096, 512 tokens)")


def weight_only_note(device_type: str, dtypes: set[str], bits: int) -> str | None:
    """That packed weight-only layers (int8, int4) compute in float32 on a CPU, where their packed
    kernels need bfloat16 activations; or that the kernel is missing; else None."""
    if device_type != "cpu":
        return None
    if bits == 8:
        row_kernel = _row_kernel_note("the int8 bytes")
        if row_kernel:
            return row_kernel
    name = "int8" if bits == 8 else "int4"
    if name not in packed_cpu_kernels():
        return (f"this torch has no packed {name} CPU kernel: these layers dequantize their weight at every "
                "call (about the float layer's cost)")
    if bits == 8 and dtypes and dtypes <= {"bfloat16"}:
        return None
    if bits == 8 and "float32" in dtypes:
        rest = sorted(dtypes - {"float32", "bfloat16"})
        return ("float32 layers: decode-sized inputs (up to 8 rows) take the packed bf16 × int8 kernel "
                "(aten._weight_int8pack_mm), their activations rounded to bfloat16 inside the layer (relative "
                "error ~0.4%, beside the int8 weights' own); larger inputs multiply a float32 copy of the weight"
                + (f"; {'/'.join(rest)} layers always do (the kernel takes bfloat16 or float32 inputs)" if rest
                   else ""))
    if bits == 8:
        return ("these layers compute in " + "/".join(sorted(dtypes)) + ": the packed bf16 × int8 kernel "
                "(aten._weight_int8pack_mm, decode-sized inputs) takes bfloat16 or float32 activations, so they "
                "multiply a float copy of the weight (about the float layer's cost); with model.to(torch.bfloat16) "
                "before the transform a Llama-7B-wide layer decoded at 0.49× the fp32 model's time per token "
                "(bfloat16 alone 0.65×; benchmarks/results/quantized_compute.md)")
    return None


def _row_kernel_note(stored: str, exact: str = "") -> str | None:
    """What decode-sized inputs take where our compiled row kernel runs (:mod:`.kernels`), or None."""
    from . import kernels  # imports torch: only when a plan asks

    if not kernels.available():
        return None
    return (f"decode-sized inputs (up to 8 rows) take transformdsl's row kernel (kernels/rows.c, compiled here: "
            f"{kernels.status()}): {stored} read as stored, float32 activations{exact}; at one row 1.1-2.6× "
            "(int8, q8_0) and 1.0-1.35× (q4_0) the weight bytes per second of aten's packed kernels, q4_1 0.8-1.0×, "
            "q4_k 0.9-1.1×, q5_0 1.0-1.5×; at 8 rows q4_0 0.75-0.9×, q4_1 0.55-0.7×, q4_k 0.6-0.8× "
            "(benchmarks/results/decode_kernels.md, decode_kernels_gguf.md; q6_k has no aten kernel, 2.3-2.5× the "
            "memory floor); "
            "larger inputs multiply a float copy of the weight")


def gguf_int8_note(device_type: str) -> str:
    """How ``quantize q8_0|q4_0|q4_1|q5_0 activations=int8`` layers multiply on ``device_type``."""
    from . import kernels  # imports torch: only when a plan asks

    rounding = ("activations rounded per 32 inputs to int8 with a float16 scale, as llama.cpp's CPU backend rounds "
                "them (q4_1: with Q8_1's block sums)")
    if device_type == "cpu" and kernels.available():
        return (f"{rounding}; decode-sized inputs (up to 8 rows) take transformdsl's integer kernel (kernels/rows.c, "
                f"compiled here: {kernels.status()}; about 2x faster than float32 activations for 4-bit blocks at one "
                "row, benchmarks/results/int8_activations.md), larger inputs the same arithmetic in float32 (within "
                "its rounding)")
    return f"{rounding}; computed in float32 on a dequantized weight at every call (no integer kernel runs here)"


def gguf_block_note(device_type: str, dtypes: set[str], mode: str, narrow: int = 0) -> str | None:
    """How ``quantize q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q5_k|q6_k`` layers multiply on ``device_type``: decode-sized inputs with the
    packed int4 CPU kernel (what that rounds, what the packed copy costs), the rest exactly.
    ``narrow``: how many targets have an ``out_features`` the kernel cannot take."""
    if device_type != "cpu":
        return (f"on {device_type} these layers dequantize their GGUF blocks at every call (no block kernel is "
                "wired there)")
    row_kernel = _row_kernel_note("the GGUF blocks", exact=" (the exact product of what format='gguf' writes; no "
                                  "packed copy)")
    if row_kernel:
        return row_kernel
    if mode == "q6_k":
        return ("transformdsl's row kernel does not run here and Q6_K's groups of 16 inputs have no packed int4 "
                "form: these layers dequantize their GGUF blocks at every call (about the float layer's cost)")
    if mode == "q5_k":
        return ("transformdsl's row kernel does not run here and Q5_K's 5-bit values have no packed int4 form (two "
                "packed copies would take more than the blocks): these layers dequantize their GGUF blocks at every "
                "call (about the float layer's cost)")
    if "int4" not in packed_cpu_kernels():
        return ("this torch has no packed int4 CPU kernel: these layers dequantize their GGUF blocks at every "
                "call (about the float layer's cost, more for q4_0)")
    fast = sorted(dtypes & {"float32", "bfloat16"})
    if not fast:
        return ("these layers compute in " + "/".join(sorted(dtypes)) + ": the packed int4 CPU kernel takes "
                "bfloat16 or float32 activations, so they dequantize their GGUF blocks at every call")
    halves = " as two 4-bit halves" if mode in ("q8_0", "q5_0", "q5_1") else ""
    extra = "1 byte" if mode in ("q8_0", "q5_0", "q5_1") else "0.5 byte"
    text = ("decode-sized inputs (up to 8 rows) take the packed int4 CPU kernel (aten._weight_int4pack_mm_for_cpu"
            f"{halves}), the activations and the float16 block scales rounded to bfloat16 inside the layer "
            "(relative error ~0.3%, a bfloat16 matmul's, beside the blocks' own; the stored blocks, and what "
            "format='gguf' writes, are unchanged); larger inputs multiply the exact blocks; the packed copy "
            f"takes {extra} per weight of memory beside the stored blocks")
    if narrow:
        text += f"; {narrow} layer{'s' if narrow > 1 else ''} with out_features not a multiple of 16 always dequantize"
    others = sorted(dtypes - {"float32", "bfloat16"})
    if others:
        text += f"; {'/'.join(others)} layers always dequantize (the kernel takes bfloat16 or float32)"
    return text


def four_bit_note(device_type: str, compute: str) -> str | None:
    """That 4-bit layers computing in float32 leave a CPU's bfloat16 instructions unused, or None."""
    if device_type != "cpu" or compute != "float32" or not cpu_bf16_matmul():
        return None
    cost = measured_latency("flux-medium", "quantize nf4")
    faster = measured_latency("flux-medium", "quantize nf4 compute=bfloat16")
    text = (f"this CPU multiplies bfloat16 natively ({', '.join(sorted(cpu_flags().intersection(BF16_FLAGS)))}): "
            "these layers dequantize and multiply in float32"
            + (f", measured {cost}" if cost else "") + "; 'compute=bfloat16' multiplies in bfloat16"
            + (f", measured {faster}" if faster else ""))
    return cited(text, cost, faster)


def hqq_note(device_type: str) -> str | None:
    """That ``quantize hqq`` layers dequantize in PyTorch on ``device_type``, and what it costs."""
    if device_type == "cpu":
        where = "hqq's compiled kernel (hqq_aten) runs on CUDA only"
    elif device_type != "cuda":
        return None
    elif not hqq_compiled_backend():
        where = "hqq's compiled kernel (hqq_aten) is not installed"
    else:
        where = "these layers use hqq's portable PyTorch path, not hqq_aten"
    note = f"{where}: each layer dequantizes its whole weight at every call"
    if device_type == "cpu":  # the figures were measured on a CPU
        cost = measured_latency("flux-medium", "quantize hqq")
        alternative = measured_latency("flux-medium", "quantize int8 weight_only")
        note += f", measured {cost}" if cost else ""
        note += (f"; 'quantize int8 weight_only=true' (twice the bytes of 4-bit) runs at {alternative}"
                 if alternative else "")
        note = cited(note, cost, alternative)
    return note
