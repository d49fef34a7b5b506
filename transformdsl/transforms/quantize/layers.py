"""The quantized layers ``quantize`` puts in place: thin subclasses of bitsandbytes' and hqq's.

Imported only when a script quantizes (bitsandbytes and hqq take seconds to import).  Each
class is built by one classmethod, ``build(weight, bias, ...)``, from a float weight laid
out ``(out_features, in_features)``:

- with a real weight it quantizes (the source tensors are read, never written);
- with a weight on the meta device it produces the same structure, state_dict keys, shapes
  and dtypes without computing anything: that is what loading a saved model replays.

What the subclasses change, and why:

- ``state_dict`` holds only tensors (safetensors can store it) and ``_load_from_state_dict``
  restores the quantized state from exactly those tensors, also with ``assign=True`` (which
  would otherwise replace bitsandbytes' ``Int8Params``/``Params4bit`` with plain Parameters,
  and which bitsandbytes refuses for int8 unless the layer was quantized first).
- ``forward`` never changes the layer: bitsandbytes casts the bias *in place* to the input
  dtype (``bias.data = ...``), which would change what a later save writes, and on CPUs with
  AVX512-BF16 repacks a 4-bit weight in place at the first eval call (turned off per layer).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ...quiet import install as _quiet_bitsandbytes

_quiet_bitsandbytes()  # before bitsandbytes is imported (transformdsl's import did it too)

import bitsandbytes as bnb  # noqa: E402  (after the log filters)
from bitsandbytes.functional import QuantState  # noqa: E402
from hqq.core.quantize import HQQLinear, Quantizer, hqq_base_quant_config  # noqa: E402


def _frozen(tensor: torch.Tensor | None) -> nn.Parameter | None:
    """A frozen Parameter over ``tensor``'s storage (no copy)."""
    return None if tensor is None else nn.Parameter(tensor.detach(), requires_grad=False)


def _take(state_dict: dict, prefix: str, names) -> dict:
    """Pop ``prefix + name`` for each name present (the loader's own copy of the dict)."""
    return {name: state_dict.pop(prefix + name) for name in names if prefix + name in state_dict}


def _load_bias(module: nn.Module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
               error_msgs) -> None:
    """Let ``nn.Module`` load the plain tensors (the bias) and check for unexpected keys."""
    nn.Module._load_from_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                    unexpected_keys, error_msgs)
    # The weight was taken out of the dict beforehand: it is restored by the caller.
    if prefix + "weight" in missing_keys:
        missing_keys.remove(prefix + "weight")


# =========================================================================== int8


@functools.cache
def int_mm_misreads_one_input_column() -> bool:
    """Whether ``torch._int_mm`` (bitsandbytes' int8 matmul on AVX-512 CPUs) is wrong for a weight of
    one input column (an inner dimension of 1, with two outputs or more; seen with torch 2.13 on an
    AMD EPYC with VNNI: relative errors of 10^3-10^4, as in ConsisID's
    ``perceiver_cross_attention.*.to_out``, a Linear(1, 16)).  Probed once, on the CPU whatever
    device context is active."""
    rows = torch.arange(-3, 4, dtype=torch.int8, device="cpu").reshape(7, 1)
    weight = torch.arange(-8, 8, dtype=torch.int8, device="cpu").reshape(16, 1)
    try:
        return not torch.equal(torch._int_mm(rows, weight.t()), rows.int() @ weight.t().int())
    except RuntimeError:  # no int8 matmul on this CPU build: bitsandbytes does not take that path either
        return False


class Int8Linear(bnb.nn.Linear8bitLt):
    """bitsandbytes LLM.int8 linear layer: int8 weight rows with one fp32 scale each (``SCB``).

    state_dict: ``weight`` (int8, out x in), ``bias``, ``SCB`` (fp32, out), ``weight_format``
    (uint8 0 = row-major), as bitsandbytes writes it.  ``.weight`` is bitsandbytes' ``Int8Params``,
    as in transformers' bitsandbytes models (model code allows for int8: spec, quantize, Drop-ins).
    """

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float) -> Int8Linear:
        out_features, in_features = weight.shape
        # no throwaway random init; the argument, not a device context, whose mode every tensor
        # call inside bitsandbytes' constructor would go through
        layer = cls(in_features, out_features, bias=bias is not None, has_fp16_weights=False, threshold=threshold,
                    device="meta")
        if weight.is_meta:  # loading: the saved tensors hold the values (bitsandbytes' meta kernels are slow)
            data = torch.empty(out_features, in_features, dtype=torch.int8, device="meta")
            scales = torch.empty(out_features, dtype=torch.float32, device="meta")
        else:
            # bitsandbytes quantizes from fp16 (as Int8Params does); the copy leaves the source untouched.
            half = weight.detach().to(torch.float16, copy=True).contiguous()
            data, scales, _ = bnb.functional.int8_vectorwise_quant(half)
        layer._set_quantized(data, scales)
        layer.bias = _frozen(bias)
        return layer

    def _set_quantized(self, data: torch.Tensor, scales: torch.Tensor) -> None:
        # The state bitsandbytes' forward sets up on its first call (init_8bit_state), done now.
        self.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
        self.state.CB = data
        self.state.SCB = scales
        #: Multiply in float on CPU (a plain attribute: compile guards on it); see forward.
        self.single_input_in_float = data.shape[-1] == 1 and int_mm_misreads_one_input_column()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        """Any number of leading dimensions (bitsandbytes' CPU path takes at most 3)."""
        if self.single_input_in_float and input.device.type == "cpu":
            # One input feature: LLM.int8 rounds each activation to +-127 times its own scale, so its
            # result is the input times the dequantized weight (up to its fp16 rounding of the
            # activations), computed here in float32.
            weight = self.weight.data.float() * (self.state.SCB.float() / 127.0)[:, None]
            bias = None if self.bias is None else self.bias.float()
            return F.linear(input.float(), weight, bias).to(input.dtype)
        self.state.is_training = self.training
        bias = self.bias
        if bias is not None and bias.dtype != input.dtype:
            bias = bias.to(input.dtype)  # a cast copy: bitsandbytes would rebind self.bias.data
        rows = input.reshape(-1, input.shape[-1])
        out = bnb.matmul(rows, self.weight, bias=bias, state=self.state)
        return out.reshape(*input.shape[:-1], out.shape[-1])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        own = _take(state_dict, prefix, ("weight", "SCB", "weight_format"))
        _load_bias(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        missing = [prefix + k for k in ("weight", "SCB") if k not in own]
        if missing:
            missing_keys.extend(missing)
            return
        data, scales = own["weight"], own["SCB"]
        expected = tuple(self.weight.shape)
        if data.dtype != torch.int8 or tuple(data.shape) != expected:
            error_msgs.append(f"{prefix}weight: expected an int8 tensor of shape {list(expected)}, got "
                              f"{str(data.dtype).removeprefix('torch.')}{list(data.shape)}")
            return
        if scales.dtype != torch.float32 or tuple(scales.shape) != expected[:1]:
            error_msgs.append(f"{prefix}SCB: expected float32[{expected[0]}], got "
                              f"{str(scales.dtype).removeprefix('torch.')}{list(scales.shape)}")
            return
        if "weight_format" in own and int(own["weight_format"]) != 0:
            error_msgs.append(f"{prefix}weight_format: only row-major (0) int8 weights are supported")
            return
        self._set_quantized(data.detach(), scales.detach())


# =========================================================================== nf4 / fp4


def dequantize_4bit_portable(data: torch.Tensor, state: QuantState, dtype: torch.dtype) -> torch.Tensor:
    """A 4-bit weight in ``dtype`` (straight from the float32 values, as bitsandbytes' matmul
    dequantizes into the compute dtype), computed with bitsandbytes' own portable implementation
    (its default backend, which its CPU kernel also falls back to for odd shapes), run eagerly:
    bitsandbytes wraps it in ``torch.compile``, a compilation per new shape outside any compile."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    absmax = state.absmax
    if state.nested:
        absmax = bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return compute(data.view(torch.uint8).reshape(-1), absmax.float(), state.code.to(data.device),
                   state.blocksize, tuple(state.shape), dtype)


@functools.cache
def cpu_kernel_misreads_crossing_blocks() -> bool:
    """Whether bitsandbytes' native CPU 4-bit dequantization is wrong for a weight whose rows are
    not a whole number of blocks (a block then continues on the next row).

    bitsandbytes 0.50.2's kernel computes such weights row by row on some CPUs (seen on an AMD EPYC
    with AVX512-BF16: a relative weight error of 0.2-0.4 instead of 0.09 for 32-wide layers with
    blocks of 64) and correctly on others, so it is probed once, on a small weight, against the
    portable implementation.  Layers whose rows are whole blocks (every layer of real models with
    widths that are multiples of 64) always take the native kernel.
    """
    # On the CPU whatever device context is active (a meta context would make the answer meaningless).
    weight = torch.linspace(-1.0, 1.0, 4 * 96, device="cpu").reshape(4, 96)
    data, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", quant_storage=torch.uint8)
    native = bnb.functional.dequantize_4bit(data, state)
    return not torch.equal(native, dequantize_4bit_portable(data, state, torch.float32))


class FourBitLinear(bnb.nn.Linear4bit):
    """bitsandbytes 4-bit linear layer (nf4 or fp4): two weights per byte, one absmax per block.

    state_dict: ``weight`` (uint8, packed), ``bias`` and the quant state as bitsandbytes writes
    it: ``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.bitsandbytes__<type>``
    (JSON in a uint8 tensor) and, with double quantization, ``weight.nested_absmax`` and
    ``weight.nested_quant_map``.  ``.weight`` is bitsandbytes' ``Params4bit`` (packed; the layer's
    shape is ``.weight.quant_state.shape``), as in transformers' bitsandbytes models.
    """

    STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map",
             "quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, quant_type: str, blocksize: int,
              double_quant: bool, compute: torch.dtype, nested_offset: float | None = None) -> FourBitLinear:
        """``nested_offset``: on the meta device with double quantization, the offset recorded at
        quantization (it is written as text into the quant-state tensor, whose length depends on it)."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None, compute_dtype=compute,
                    compress_statistics=double_quant, quant_type=quant_type, device="meta")
        data, state = bnb.functional.quantize_4bit(weight.detach().contiguous(), blocksize=blocksize,
                                                   compress_statistics=double_quant, quant_type=quant_type,
                                                   quant_storage=torch.uint8)
        if weight.is_meta and double_quant:
            state.offset = torch.tensor(float(nested_offset or 0.0))
        layer._set_quantized(data, state)
        # Stored in the compute dtype: the forward then never needs to cast it (bitsandbytes
        # would cast it in place); bitsandbytes casts it to the compute dtype anyway.
        layer.bias = _frozen(None if bias is None else bias.detach().to(compute))
        return layer

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        if self.portable_dequantize and input.device.type == "cpu":
            return self._portable_forward(input)
        return super().forward(input)

    def _portable_forward(self, input: torch.Tensor) -> torch.Tensor:
        """bitsandbytes' forward (no outlier handling in 4-bit: cast to the compute dtype, the
        dequantized weight, bias, back to the input's dtype) with its portable dequantization."""
        x = input.to(self.compute_dtype) if self.compute_dtype is not None else input
        weight = dequantize_4bit_portable(self.weight.data, self.weight.quant_state, x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias).to(input.dtype)

    def _set_quantized(self, data: torch.Tensor, state: QuantState) -> None:
        self.weight = bnb.nn.Params4bit(data, requires_grad=False, quant_state=state, blocksize=state.blocksize,
                                        compress_statistics=state.nested, quant_type=state.quant_type,
                                        quant_storage=data.dtype, module=self, bnb_quantized=True)
        self.quant_state = state
        # On CPUs with AVX512-BF16, bitsandbytes' first eval forward repacks the weight in place
        # into a CPU layout (and its quant state: absmax to bfloat16) and then computes in
        # bfloat16 whatever the compute dtype: a layer whose out_features is not a multiple of 32
        # fails there, a save after a forward would write the repacked tensors, and results
        # would differ by CPU.  The portable path keeps the layer as quantized, on every CPU.
        self.support_avx512bf16_for_cpu = False
        #: Dequantize with bitsandbytes' portable code on CPU (a plain attribute: compile guards on it).
        self.portable_dequantize = (state.shape[-1] % state.blocksize != 0
                                    and cpu_kernel_misreads_crossing_blocks())

    @property
    def nested_offset(self) -> float | None:
        state = self.weight.quant_state
        return float(state.offset.item()) if state.nested and not state.offset.is_meta else None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        data = state_dict.pop(prefix + "weight", None)
        stats = _take(state_dict, prefix + "weight.", self.STATS)
        _load_bias(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if data is None:
            missing_keys.append(prefix + "weight")
            return
        expected = self.weight.quant_state
        try:
            state = QuantState.from_dict(stats, device=data.device)
        except (ValueError, KeyError, AssertionError) as exc:
            error_msgs.append(f"{prefix}weight: invalid 4-bit quant state: {exc}")
            return
        found = (state.quant_type, state.blocksize, tuple(state.shape), state.dtype, state.nested)
        wanted = (expected.quant_type, expected.blocksize, tuple(expected.shape), expected.dtype, expected.nested)
        if found != wanted or data.dtype != torch.uint8 or tuple(data.shape) != tuple(self.weight.shape):
            error_msgs.append(f"{prefix}weight: saved 4-bit state {found} does not match this layer's {wanted}")
            return
        self._set_quantized(data.detach(), state)


# =========================================================================== hqq


class HQQLayer(HQQLinear):
    """hqq's half-quadratic quantized linear layer, as a regular ``nn.Module``.

    ``HQQLinear`` keeps its scales in a dict, encodes Python values into its own state_dict
    (and ``eval``s a dtype name back on load), ignores ``.to()`` and switches ``forward`` for
    the whole class through a global backend.  This subclass registers ``W_q``, ``scale``,
    ``zero`` and ``bias`` as parameters/buffers, so the ordinary state_dict, ``load_state_dict``
    and ``.to(device)`` work; the non-tensor meta data (bits, group size, shape...) follows
    from the statement's options and is rebuilt by :meth:`build`.  The forward is hqq's
    portable PyTorch path (dequantize, then matmul) in ``compute_dtype``; whole-model
    compilation is the ``compile`` statement's business.
    """

    @classmethod
    def build(cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int, axis: int,
              compute: torch.dtype) -> HQQLayer:
        config = hqq_base_quant_config(nbits=bits, group_size=group_size, axis=axis)
        params = dict(config["weight_quant_params"])
        if weight.is_meta:
            params["optimize"] = False  # the optimizer needs values; shapes and dtypes do not depend on it
        layer = cls(None, config, compute_dtype=compute, device=weight.device, initialize=False)
        if weight.is_meta and params.get("channel_wise", True) and not params.get("view_as_float"):
            # loading: the saved tensors hold the values; only the shapes are needed
            packed, meta = _hqq_structure(weight.shape, params)
        else:
            # Quantizer.quantize reads the weight (as float32, no copy when it is float32) and
            # returns new tensors; hqq's optimizer runs in inference mode, hence the clones below.
            packed, meta = Quantizer.quantize(weight.detach(), device=weight.device, compute_dtype=compute,
                                              **params)
        scale, zero = meta.pop("scale"), meta.pop("zero")
        meta.update(quant_scale=False, quant_zero=False, compute_dtype=compute)
        layer.meta = meta
        layer.W_q = nn.Parameter(_normal(packed), requires_grad=False)
        layer.register_buffer("scale", _normal(scale.to(compute)))
        layer.register_buffer("zero", _normal(zero.to(compute)))
        del layer.bias  # HQQLinear's plain attribute, replaced by a registered parameter (or None)
        layer.bias = _frozen(None if bias is None else bias.detach().to(compute))
        layer.out_features, layer.in_features = weight.shape
        #: The dtype of the weight this layer replaced: what :attr:`weight` reads as.
        layer.weight_dtype = weight.dtype
        layer.ready = True
        return layer

    @classmethod
    def set_backend(cls, backend) -> None:
        """hqq's backend switch assigns ``cls.forward`` (called from ``HQQLinear.__init__``): not here."""

    def place_on(self, device: torch.device) -> None:
        """Move the layer for ``load(device_map=...)`` (the placement protocol of a layer whose ``.to()``
        cannot): HQQLinear's ``.to()`` does nothing; ``.cuda()`` moves the quantized state."""
        if device.type != "cpu":
            self.cuda(device)

    def dequantize(self) -> torch.Tensor:
        return Quantizer.dequantize(self.W_q, {**self.meta, "scale": self.scale, "zero": self.zero})

    @property
    def weight(self) -> torch.Tensor:
        """The effective weight, (out_features, in_features) in :attr:`weight_dtype`: a new tensor,
        dequantized on each read (model code reads ``layer.weight.dtype`` to cast its inputs)."""
        return self.dequantize().to(self.weight_dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear.forward's name)
        out = torch.matmul(input.to(self.compute_dtype), self.dequantize().t())
        if self.bias is not None:
            out = out + self.bias
        return out.to(input.dtype)

    # HQQLinear overrides these to encode meta data or to do nothing; plain nn.Module behaviour
    # is right for registered tensors.
    state_dict = nn.Module.state_dict
    load_state_dict = nn.Module.load_state_dict
    _load_from_state_dict = nn.Module._load_from_state_dict
    to = nn.Module.to
    cpu = nn.Module.cpu
    cuda = nn.Module.cuda
    type = nn.Module.type
    half = nn.Module.half
    float = nn.Module.float
    bfloat16 = nn.Module.bfloat16
    double = nn.Module.double


def _hqq_structure(shape: torch.Size, params: dict) -> tuple[torch.Tensor, dict]:
    """What ``Quantizer.quantize(params)`` returns for a weight of ``shape``, on the meta device,
    computed from the shape alone (running it on meta tensors costs ~30 ms a layer in torch's
    Python meta kernels: most of a reload).  ``tests/test_quantize.py`` checks it against hqq's."""
    bits, size, axis = params["nbits"], params["group_size"], params["axis"]
    numel = shape[0] * shape[1]
    grouped = (numel // size, size) if axis == 1 else (size, numel // size)
    packing = Quantizer.bit_to_packing[bits]
    rows = grouped[0]
    if packing == "3bit_32":
        packed = (-(-rows // 10), grouped[1])
    else:
        packed = (rows // {"8bit_u8": 1, "4bit_u8": 2, "2bit_u8": 4, "1bit_u8": 8}[packing], grouped[1])
    stats = (grouped[0], 1) if axis == 1 else (1, grouped[1])
    meta = {"nbits": bits, "group_size": size, "shape": torch.Size(shape), "axis": axis, "packing": packing,
            "unpack_view_dtype": Quantizer.unpack_view_dtype[packing], "view_as_float": False,
            "scale": torch.empty(stats, device="meta"), "zero": torch.empty(stats, device="meta")}
    dtype = torch.int32 if packing == "3bit_32" else torch.uint8
    return torch.empty(packed, dtype=dtype, device="meta"), meta


def _normal(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor usable outside inference mode (hqq computes its scales under ``inference_mode``)."""
    return tensor.clone() if tensor.is_inference() else tensor


#: The classes this module defines (a layer of one of them is already quantized).
QUANTIZED_CLASSES = (Int8Linear, FourBitLinear, HQQLayer)
