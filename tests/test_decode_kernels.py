"""Our compiled decode kernels (transformdsl/transforms/quantize/kernels): quantized layers fed a few
rows multiply the stored bytes with float32 activations, so their output is the exact product of the
stored weight (float32 summation aside), in eager, under ``torch.compile`` and on any thread count;
where the kernels are off, the layers take aten's packed kernels as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformdsl
from transformdsl.models import tiny_llama
from transformdsl.transforms.quantize import kernels
from transformdsl.transforms.quantize.gguf_blocks import (
    Q4_0Linear,
    Q4_1Linear,
    Q4_KLinear,
    Q5_0Linear,
    Q5_1Linear,
    Q5_KLinear,
    Q6_KLinear,
    Q8_0Linear,
)
from transformdsl.transforms.quantize.int4 import Int4WeightOnlyLinear
from transformdsl.transforms.quantize.int8_weight_only import Int8WeightOnlyLinear

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"decode kernels not built here: {kernels.status()}")

#: Layer builders by name: ``build(weight, bias)``.  int4 with ``compute=float32`` (scales and zeros in
#: float32) takes our kernel up to 8 rows; with bfloat16 (beside aten's packed kernel) up to 2.
LAYERS = {"int8": Int8WeightOnlyLinear.build, "q8_0": Q8_0Linear.build, "q4_0": Q4_0Linear.build,
          "q4_1": Q4_1Linear.build, "q5_0": Q5_0Linear.build, "q5_1": Q5_1Linear.build,
          "int4": lambda weight, bias: Int4WeightOnlyLinear.build(weight, bias, 32, torch.float32)}
CLASSES = (Int8WeightOnlyLinear, Q8_0Linear, Q4_0Linear, Q4_1Linear, Q5_0Linear, Q5_1Linear, Q4_KLinear, Q5_KLinear,
           Q6_KLinear, Int4WeightOnlyLinear)


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def on_one_and_two_threads(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer(x)`` with torch on one thread, then on two (the caller's count restored)."""
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = layer(x)
            torch.set_num_threads(2)
            return one, layer(x)
    finally:
        torch.set_num_threads(before)


def layer_of(kind: str, shape: tuple[int, int], bias: bool = True):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(*shape, generator=generator)
    return LAYERS[kind](weight, torch.randn(shape[0], generator=generator) if bias else None)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("shape", [(61, 96), (1536, 576), (576, 1536)])
def test_decode_sized_inputs_give_the_exact_product_of_the_stored_weight(kind, shape):
    layer = layer_of(kind, shape)
    assert layer.row_kernel
    exact_weight = layer.dequantize().double()
    for leading in [(1,), (3,), (2, 4), (1, 1, 1)]:  # up to 8 rows, any leading dimensions
        x = torch.randn(*leading, shape[1], generator=torch.Generator().manual_seed(len(leading)))
        with torch.no_grad():
            out = layer(x)
        exact = x.double() @ exact_weight.t() + layer.bias.double()
        assert out.shape == exact.shape and out.dtype == torch.float32
        assert relative_error(out, exact) < 1e-6  # float32 summation only: no bfloat16 anywhere
    half = layer.to(torch.bfloat16)
    x = torch.randn(2, shape[1], generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = half(x.bfloat16())
    assert out.dtype == torch.bfloat16
    assert relative_error(out, x.bfloat16().double() @ exact_weight.t() + half.bias.double()) < 1e-2


@pytest.mark.parametrize("layer_class", [Q4_KLinear, Q5_KLinear, Q6_KLinear])
@pytest.mark.parametrize("shape", [(61, 256), (576, 1536), (64, 2816)])  # 1, 6 and 11 super-blocks a row
def test_k_quant_super_blocks_give_the_exact_product_with_no_packed_copy(layer_class, shape):
    """Q4_K (256 inputs a super-block, 6-bit scales and mins unpacked per row in the kernel), Q5_K (Q4_K's with a
    fifth bit per value from its qh bytes) and Q6_K (16 int8
    scales a super-block, 6-bit values from two arrays): the exact product of ggml's dequantization of the stored
    bytes, for 1-8 rows, with nothing kept beside the bytes."""
    generator = torch.Generator().manual_seed(shape[1])
    layer = layer_class.build(torch.randn(*shape, generator=generator), torch.randn(shape[0], generator=generator))
    assert layer.row_kernel and not layer.packed_kernel and layer._packed.parts == ()
    exact_weight = layer.dequantize().double()
    for leading in [(1,), (3,), (2, 4)]:
        x = torch.randn(*leading, shape[1], generator=generator)
        with torch.no_grad():
            out = layer(x)
        assert relative_error(out, x.double() @ exact_weight.t() + layer.bias.double()) < 1e-6
    x = torch.randn(4, shape[1], generator=generator)
    one, two = on_one_and_two_threads(layer, x)
    assert torch.equal(one, two)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x[:1]), one[:1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_results_do_not_depend_on_the_thread_count(kind):
    layer = layer_of(kind, (1536, 576), bias=False)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(1))
    one, two = on_one_and_two_threads(layer, x)
    assert torch.equal(one, two)  # each output is one thread's sum, in one order, whatever the split


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_inputs_that_are_views_are_read_as_their_values(kind):
    layer = layer_of(kind, (64, 128))
    wide = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    x = wide[:, 64:192]  # a column slice: not contiguous
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x.contiguous()))
        assert torch.equal(layer(wide.t()[64:192].t()), layer(x.contiguous()))


def test_int4_beside_the_packed_kernel_takes_ours_for_one_and_two_rows_only():
    generator = torch.Generator().manual_seed(5)
    layer = Int4WeightOnlyLinear.build(torch.randn(64, 128, generator=generator), None, 64)  # compute=bfloat16
    assert layer.row_kernel and "row_kernel=True" in repr(layer)
    exact_weight = layer.dequantize().double()
    with torch.no_grad():
        for rows, bound in ((1, 1e-6), (2, 1e-6), (3, 1e-2)):  # three rows: aten's kernel, bfloat16 activations
            x = torch.randn(rows, 128, generator=generator)
            error = relative_error(layer(x), x.double() @ exact_weight.t())
            assert error < bound and (rows < 3 or not layer.packed_kernel or error > 1e-5)


def test_int8_inputs_that_are_no_multiple_of_the_vector_width():
    layer = layer_of("int8", (16, 24))
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(layer(x), x.double() @ layer.dequantize().double().t() + layer.bias.double()) < 1e-6


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_compiled_layer_calls_the_kernel_as_a_custom_op(kind):
    torch._dynamo.reset()
    layer = layer_of(kind, (64, 128))
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_block_layers_keep_no_packed_copy_beside_the_stored_blocks():
    for kind in ("q8_0", "q4_0", "q4_1", "q5_0"):
        layer = layer_of(kind, (64, 128))
        assert layer.row_kernel and not layer.packed_kernel and layer._packed.parts == ()
        assert "row_kernel=True" in repr(layer)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "int8 weight_only=true", "int4 group_size=32 compute=float32",
                                  "int4 group_size=32"])
def test_a_quantized_llama_decodes_as_the_float_model_of_its_stored_weights(kind):
    """The model checked here is the model its stored bytes describe: a decode step's logits equal, to
    float32 rounding, those of the float model whose linear weights are the dequantized blocks."""
    quantized = transformdsl.transform(tiny_llama(), f"quantize {kind}")
    reference = tiny_llama()
    for name, module in quantized.named_modules():
        if isinstance(module, CLASSES):
            reference.get_submodule(name).weight.data = module.dequantize()
    tokens = torch.tensor([[5, 17, 3, 99]])
    with torch.no_grad():
        ours = quantized(tokens[:, -1:]).logits  # one row per layer: the kernels
        exact = reference(tokens[:, -1:]).logits
    assert relative_error(ours, exact.double()) < 1e-5


def test_the_plan_names_the_kernel_and_a_switch_turns_it_off(monkeypatch):
    note = transformdsl.plan(tiny_llama(), "quantize q4_0").steps[0].device_note
    assert "row kernel" in note and "float32 activations" in note and kernels.status() in note
    note = transformdsl.plan(tiny_llama(), "quantize int8 weight_only=true").steps[0].device_note
    assert "row kernel" in note and "int8 bytes read as stored" in note
    monkeypatch.setenv(kernels.SWITCH, "off")
    kernels.reset()
    try:
        assert not kernels.available() and kernels.SWITCH in kernels.status()
        layer = layer_of("q8_0", (64, 128))
        assert not layer.row_kernel
        x = torch.randn(1, 128)
        with torch.no_grad():  # aten's packed kernel where this torch has it, else the exact dequantized product
            assert relative_error(layer(x), F.linear(x.double(), layer.dequantize().double(), layer.bias.double())) < 5e-3
        assert "row kernel" not in transformdsl.plan(tiny_llama(), "quantize q4_0").steps[0].device_note
    finally:
        monkeypatch.undo()
        kernels.reset()
    assert kernels.available()


def test_a_layer_moved_off_the_cpu_or_to_meta_stops_using_the_kernel():
    layer = layer_of("int8", (64, 128))
    assert layer.row_kernel
    assert not layer.to("meta").row_kernel
    blocks = nn.Sequential(layer_of("q4_0", (64, 128))).to("meta")
    assert not blocks[0].row_kernel


@pytest.fixture
def fresh_build(monkeypatch):
    """:func:`kernels.available` decided again under the test's environment, and again after it."""
    kernels.reset()
    yield monkeypatch
    monkeypatch.undo()
    kernels.reset()


def test_without_a_working_compiler_the_layers_keep_atens_kernels(fresh_build, tmp_path):
    fresh_build.setenv("CC", str(tmp_path / "no-such-cc"))
    assert not kernels.available() and "does not run" in kernels.status()
    assert not layer_of("q4_0", (64, 128)).row_kernel


def test_an_unwritable_cache_or_a_damaged_library_builds_in_a_private_folder(fresh_build, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    fresh_build.setenv("XDG_CACHE_HOME", str(not_a_folder))
    assert kernels.available()
    kernels.reset()
    fresh_build.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert kernels.available()
    built = list((tmp_path / "cache" / "transformdsl" / "kernels").glob("rows-*.so"))
    assert built
    for library in built:  # a new file in its place (this process maps the old one: never rewrite it in place)
        library.unlink()
        library.write_bytes(b"not a shared library")
    kernels.reset()
    assert kernels.available()  # rebuilt in a private folder, never loaded from the damaged file
    layer = layer_of("int8", (64, 128))
    x = torch.randn(1, 128)
    with torch.no_grad():
        assert layer.row_kernel and relative_error(layer(x), x.double() @ layer.dequantize().double().t()
                                                    + layer.bias.double()) < 1e-6
