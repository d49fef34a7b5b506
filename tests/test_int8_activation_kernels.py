"""The int8-activation decode kernels (rows.c: ``quantize_q8_rows``, ``q8_0_q8_rows``, ``q4_0_q8_rows``,
``q4_1_q8_rows``; what ``activations=int8`` layers call): llama.cpp's arithmetic, activations rounded to Q8_0
blocks, an exact integer dot product per block times ``d_w * d_x``, compared with a torch reference of
the same arithmetic; the rounding compared with the ``gguf`` package's own Q8_0 bytes."""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import subprocess

import pytest
import torch

from transformdsl.transforms.quantize import kernels
from transformdsl.transforms.quantize.gguf_blocks import (
    _roundf,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
    unpack_q4_0,
)

build = importlib.import_module("transformdsl.transforms.quantize.kernels.build")  # (the package's ``build`` is a function)

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"decode kernels not built here: {kernels.status()}")

KINDS = ("q8_0", "q4_0", "q4_1")
ROWS = (1, 2, 3, 8)
SHAPES = [(61, 96), (21, 32), (100, 576), (13, 1536), (576, 160), (9, 2336)]  # N not a multiple of 8; odd block
# counts; 73 blocks: past one chunk of 64 (the scales converted a chunk at a time)


def reference_quantize(x: torch.Tensor):
    """llama.cpp's quantize_row_q8_0_ref / q8_1_ref in float32: (q, d rounded to float16, s rounded to float16)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(blocks * inverse[..., None])
    s = (q.sum(-1) * d).half().float()
    return q.to(torch.int8).reshape(x.shape), d.half().float(), s


def weight_of(kind: str, shape, generator):
    weight = torch.randn(*shape, generator=generator)
    if kind == "q8_0":
        values, scale = quantize_q8_0(weight)
        return values, scale, values.long()
    packed, scale = (quantize_q4_0 if kind == "q4_0" else quantize_q4_1)(weight)
    return packed, scale, unpack_q4_0(packed).long() - (8 if kind == "q4_0" else 0)


def reference_product(kind: str, q, d, s, codes, scale):
    """sum over blocks of float32(d_w * d_x) * (integer dot product), plus Q4_1's m_w * s_x; in float64."""
    rows, width = q.shape
    blocks = width // 32
    dots = torch.einsum("mbk,nbk->mnb", q.long().reshape(rows, blocks, 32), codes.reshape(-1, blocks, 32))
    dw = (scale[..., 0] if kind == "q4_1" else scale).float()
    products = dw[None] * d[:, None]  # float32, as the kernels (and ggml) multiply them
    out = (dots.double() * products.double()).sum(-1)
    if kind == "q4_1":
        out += s.double() @ scale[..., 1].double().T
    # what float32 summation error is relative to: the sum of the elementwise products' magnitudes (the
    # kernels sum a block in int32 lanes, then the lanes' float products)
    magnitudes = torch.einsum("mbk,nbk->mnb", q.long().abs().reshape(rows, blocks, 32), codes.abs().reshape(-1, blocks, 32))
    bound = (magnitudes.double() * products.double().abs()).sum(-1)
    if kind == "q4_1":
        bound += s.double().abs() @ scale[..., 1].double().abs().T
    return out, bound


def call(library, kind: str, q, d, s, weight, scale, bias=None, threads: int = 1) -> torch.Tensor:
    rows, width = q.shape
    out = torch.empty(rows, weight.shape[0])
    extra = (s.data_ptr(),) if kind == "q4_1" else ()
    getattr(library, f"{kind}_q8_rows")(q.data_ptr(), d.data_ptr(), *extra, weight.data_ptr(), scale.data_ptr(),
                                         None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
                                         weight.shape[0], width, threads)
    return out


def quantize(library, x: torch.Tensor):
    q, d, s = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0], x.shape[1] // 32), torch.empty(
        x.shape[0], x.shape[1] // 32)
    library.quantize_q8_rows(x.data_ptr(), q.data_ptr(), d.data_ptr(), s.data_ptr(), x.shape[0], x.shape[1])
    return q, d, s


def check_library(library, kinds=KINDS, rows_list=ROWS, shapes=SHAPES) -> float:
    """Every kernel against the reference; the largest error relative to the float32 bound."""
    worst = 0.0
    for kind in kinds:
        for shape in shapes:
            generator = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
            weight, scale, codes = weight_of(kind, shape, generator)
            for rows in rows_list:
                x = torch.randn(rows, shape[1], generator=generator) * 3
                x[0, :32] = 0  # an all-zero block: d = 0, q = 0
                q, d, s = quantize(library, x)
                rq, rd, rs = reference_quantize(x)
                assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
                out = call(library, kind, q, d, s, weight, scale)
                exact, bound = reference_product(kind, q, d, s, codes, scale)
                error = ((out.double() - exact).abs() / (bound + 1e-30)).max().item()
                assert error < 2e-6, (kind, shape, rows, error)
                worst = max(worst, error)
    return worst


def test_kernels_match_llama_cpp_arithmetic():
    check_library(kernels._library())


@pytest.mark.parametrize("kind", KINDS)
def test_bias_threads_and_wrappers(kind):
    generator = torch.Generator().manual_seed(5)
    weight, scale, codes = weight_of(kind, (203, 576), generator)
    x = torch.randn(5, 576, generator=generator)
    bias = torch.randn(203, generator=generator)
    q, d, s = kernels.quantize_q8_rows(x, sums=kind == "q4_1")
    args = (q, d, s) if kind == "q4_1" else (q, d)
    out = getattr(kernels, f"{kind}_q8_rows")(*args, weight, scale, bias)
    exact, bound = reference_product(kind, q, d, s if s is not None else d, codes, scale)
    assert ((out.double() - exact - bias.double()).abs() <= 2e-6 * bound + 1e-6).all()
    one = call(kernels._library(), kind, q, d, s, weight, scale, bias, threads=1)
    two = call(kernels._library(), kind, q, d, s, weight, scale, bias, threads=2)
    assert torch.equal(one, two) and torch.equal(one, out)


def test_quantize_matches_the_gguf_package():
    quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1536, generator=generator) * torch.logspace(-3, 2, 1536)
    x[1, 64:96] = 0
    x[2, :32] = torch.tensor([0.5, -0.5, 1.5, -2.5] * 8) * (127 / 2.5)  # ties at the rounding boundary
    q, d, _ = kernels.quantize_q8_rows(x)
    ours = torch.cat((d.half().view(torch.uint8).reshape(4, -1, 2), q.view(torch.uint8).reshape(4, -1, 32)), -1)
    theirs = quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.reshape(4, -1).numpy().tobytes() == theirs.tobytes()


VARIANTS = {"AVX2": ["-mno-avx512f"], "plain C": ["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx"]}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_narrower_builds_compute_the_same(variant, tmp_path):
    """The AVX2 and plain-C paths, compiled here with AVX-512 (or AVX2) switched off: the same results."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler")
    target = tmp_path / "rows.so"
    done = subprocess.run([compiler, "-O3", "-march=native", *VARIANTS[variant], "-shared", "-fPIC",
                           str(build.SOURCE), "-o", str(target)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"this compiler cannot build the {variant} variant: {done.stderr[-300:]}")
    library = ctypes.CDLL(str(target))
    build._declare(library)
    assert (library.kernel_lanes(), library.q8_kernel_step()) == ((8, 1) if variant == "AVX2" else (1, 1))
    check_library(library, rows_list=(1, 3), shapes=SHAPES[:3])
    check_int4(library, rows_list=(1, 3), shapes=INT4_SHAPES[:4])


# --------------------------------------------------------------------------- quantize q8_0|q4_0|q4_1 activations=int8

MODES = ("q8_0", "q4_0", "q4_1", "q5_0")


def int8_layer(kind: str, shape=(48, 96), bias: bool = True, seed: int = 0):
    from transformdsl.transforms.quantize.gguf_blocks import LAYERS

    generator = torch.Generator().manual_seed(seed)
    layer = LAYERS[kind].build(torch.randn(*shape, generator=generator),
                               torch.randn(shape[0], generator=generator) if bias else None)
    layer.activations = "int8"
    return layer


def torch_int8_arithmetic(layer, x):
    """What an ``activations=int8`` layer computes, written out: x rounded as llama.cpp rounds it, times the
    blocks' ``q * d``, plus Q4_1's minimum times Q8_1's block sums, plus the bias."""
    from transformdsl.transforms.quantize.gguf_blocks import round_activations

    rounded, sums = round_activations(x, sums=layer.kind == "q4_1")
    d = layer.weight_scale.float()
    q = layer.values().reshape(layer.out_features, -1, 32)
    out = rounded.double() @ (q * (d[..., 0] if d.dim() == 3 else d)[..., None]).reshape(layer.out_features, -1).double().T
    if sums is not None:
        out += sums.double() @ d[..., 1].double().T
    return out + layer.bias.double()


@pytest.mark.parametrize("kind", MODES)
@pytest.mark.parametrize("rows", [1, 2, 8, 40])
def test_int8_activations_compute_llamacpps_arithmetic_at_every_input_size(kind, rows):
    """Decode-sized inputs (our integer kernel) and larger ones (float32 on the dequantized blocks) give the
    same arithmetic within float32 rounding; it differs from the float-activation product by the
    activations' rounding."""
    layer = int8_layer(kind)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        out = layer(x)
        layer.activations = "float"
        exact = layer(x)
    reference = torch_int8_arithmetic(layer, x)
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    # float32 sums of products of ~1 over 96 inputs: an absolute error on the outputs' scale
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=float(reference.abs().max()) * 1e-5)
    assert not torch.allclose(out, exact, rtol=1e-5, atol=1e-5)  # the rounding shows
    assert float((out - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("kind", MODES)
def test_an_int8_activation_layer_compiles_to_the_custom_op(kind):
    torch._dynamo.reset()
    layer = int8_layer(kind)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", MODES)
def test_activations_int8_is_saved_reloaded_and_exported_as_the_same_blocks(kind, tmp_path):
    """The option is part of the statement: a reload computes the same logits bit for bit; the blocks (and
    their GGUF export) are those of ``activations=float``."""
    import transformdsl
    from transformdsl.models import tiny_llama

    script = f"quantize {kind} activations=int8 except lm_head"
    model = transformdsl.transform(tiny_llama(), script)
    plain = transformdsl.transform(tiny_llama(), f"quantize {kind} except lm_head")
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    with torch.no_grad():
        logits = model(ids).logits
        float_logits = plain(ids).logits
    assert not torch.equal(logits, float_logits)
    transformdsl.save(model, tmp_path / "saved")
    loaded = transformdsl.load(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
    layers = [m for m in loaded.modules() if hasattr(m, "activations")]
    assert layers and all(m.activations == "int8" for m in layers)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(ours, theirs), name


def test_activations_int8_is_refused_where_no_integer_arithmetic_is_defined():
    import transformdsl
    from transformdsl import ScriptError
    from transformdsl.models import tiny_llama

    with pytest.raises(ScriptError, match="activations"):
        transformdsl.plan(tiny_llama(), "quantize q4_k activations=int8")
    with pytest.raises(ScriptError, match="float.*int8|int8.*float"):
        transformdsl.plan(tiny_llama(), "quantize q4_0 activations=int4")


# --------------------------------------------------------------------------- quantize int4 activations=int8

#: (out, in, group_size): group counts below and past a vector of 16, blocks past a chunk of 64, N not a multiple of 8
INT4_SHAPES = [(61, 96, 32), (100, 576, 64), (13, 1536, 128), (21, 8192, 32), (9, 2304, 256), (17, 2336, 32)]


def int4_weight(shape, generator, dtype=torch.bfloat16):
    from transformdsl.transforms.quantize.int4 import pack_nibbles, quantize_groups

    rows, width, group = shape
    values, scale, zero = quantize_groups(torch.randn(rows, width, generator=generator), group, dtype)
    weight = ((values.reshape(rows, -1, group).double() - 8) * scale.double()[..., None]
              + zero.double()[..., None]).reshape(rows, width)
    return pack_nibbles(values), scale, zero, weight


def int4_reference(x: torch.Tensor, weight: torch.Tensor):
    """x rounded to Q8_0 blocks times the dequantized weight, in float64, and the float32 bound (the sum of the
    products' magnitudes)."""
    q, d, _ = reference_quantize(x)
    rounded = (q.double().reshape(x.shape[0], -1, 32) * d.double()[..., None]).reshape(x.shape)
    return rounded @ weight.T, rounded.abs() @ weight.abs().T


def check_int4(library, rows_list=ROWS, shapes=INT4_SHAPES) -> None:
    for shape in shapes:
        generator = torch.Generator().manual_seed(shape[0] + shape[1])
        for dtype in (torch.bfloat16, torch.float32):
            packed, scale, zero, weight = int4_weight(shape, generator, dtype)
            for rows in rows_list:
                x = torch.randn(rows, shape[1], generator=generator) * 3
                x[0, :32] = 0  # an all-zero block: d = 0, q = 0
                out = torch.empty(rows, shape[0])
                library.int4_q8x_rows(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                                      int(dtype is torch.bfloat16), shape[2], None, out.data_ptr(), rows, shape[0],
                                      shape[1], 1)
                exact, bound = int4_reference(x, weight)
                error = ((out.double() - exact).abs() / bound).max().item()
                assert error < 2e-6, (shape, dtype, rows, error)


def test_int4_kernel_is_the_product_of_the_rounded_activations():
    """``int4_q8x_rows``: x rounded per 32 inputs as llama.cpp rounds it, times ``quantize int4``'s stored
    weights ((q - 8) * s + z per group), bfloat16 and float32 scales, every group size, within float32 rounding."""
    check_int4(kernels._library())


def int4_layer(group_size: int = 32, compute=torch.bfloat16, shape=(48, 96), seed: int = 0, activations="int8"):
    from transformdsl.transforms.quantize.int4 import Int4WeightOnlyLinear

    generator = torch.Generator().manual_seed(seed)
    return Int4WeightOnlyLinear.build(torch.randn(*shape, generator=generator), torch.randn(shape[0], generator=generator),
                                      group_size, compute, activations=activations)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 8, 40])
def test_int4_activations_int8_at_every_input_size(compute, rows):
    """Decode-sized inputs (up to 8 rows: the integer kernel) and larger ones (the rounded input through aten's
    packed kernel or the dequantized weight) compute the rounded product; it differs from activations=float by
    the activations' rounding."""
    layer = int4_layer(compute=compute)
    float_layer = int4_layer(compute=compute, activations="float")
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        out, exact = layer(x), float_layer(x)
    reference, bound = int4_reference(x, layer.dequantize().double())
    reference += layer.bias.double()
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    if rows <= 8:  # the kernel: float32 rounding
        assert ((out.double() - reference).abs() <= 2e-6 * bound + 1e-6).all()
    else:  # bfloat16 activations in the packed kernel
        tolerance = 1e-2 if compute is torch.bfloat16 else 1e-5
        assert float((out.double() - reference).norm() / reference.norm()) < tolerance
    assert not torch.allclose(out, exact, rtol=1e-5, atol=1e-5)  # the rounding shows
    assert float((out - exact).norm() / exact.norm()) < 0.02


def test_an_int4_activation_layer_compiles_to_the_custom_op():
    torch._dynamo.reset()
    layer = int4_layer()
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_int4_activations_int8_is_saved_reloaded_and_refused_by_compressed_tensors(tmp_path):
    """The option is part of the statement: a reload computes the same logits bit for bit, the stored tensors are
    activations=float's, and compressed-tensors (whose W4A16 says nothing of rounded inputs) refuses it."""
    import transformdsl
    from transformdsl import TransformError
    from transformdsl.models import tiny_llama

    model = transformdsl.transform(tiny_llama(), "quantize int4 group_size=32 symmetric=true activations=int8")
    plain = transformdsl.transform(tiny_llama(), "quantize int4 group_size=32 symmetric=true")
    ids = torch.tensor([[5, 17, 3, 99, 42]])
    with torch.no_grad():
        logits = model(ids).logits
        one = model(ids[:, :1]).logits  # one row a layer: the integer kernel
        assert not torch.equal(logits, plain(ids).logits)
    transformdsl.save(model, tmp_path / "saved")
    loaded = transformdsl.load(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
        assert torch.equal(loaded(ids[:, :1]).logits, one)
    layers = [m for m in loaded.modules() if hasattr(m, "activations")]
    assert layers and all(m.activations == "int8" for m in layers)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(ours, theirs), name
    with pytest.raises(TransformError, match="activations=int8"):
        transformdsl.save(model, tmp_path / "ct", format="compressed-tensors")
    assert not (tmp_path / "ct").exists()
