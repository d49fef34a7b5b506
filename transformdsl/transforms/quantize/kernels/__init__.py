"""Decode kernels for quantized layers: ``rows.c``, compiled here for this CPU on first use.

``int8_rows``, ``q8_0_rows``, ``q4_0_rows``, ``q4_1_rows``, ``q5_0_rows``, ``q4_k_rows``, ``q6_k_rows`` and
``int4_rows`` (and ``q5_1_rows``, ``q5_k_rows``) multiply a few float32 rows (decoding: one token per sequence) by a weight stored as
``quantize int8 weight_only=true``, ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``q4_k``, ``q5_k``, ``q6_k`` or
``int4`` store it, reading the stored bytes directly: no dequantized copy, no packed second copy, and
float32 activations (the exact product of the stored values, up to float32 summation order).  Measured
against aten's packed kernels, which these replace for decode-sized inputs: benchmarks/results/decode_kernels.md.

What a user may rely on:

- :func:`available` says whether the kernels run here, and :func:`status` why not when they do not:
  no C compiler, a CPU without AVX2+FMA (the plain-C build is slower than aten's kernels, so it is not
  used), a failed self-check, or ``TRANSFORMDSL_KERNELS=off`` in the environment.  Where they do not
  run, the layers use aten's kernels as before: results differ by rounding only.
- The library is built once per source, compiler and CPU (``-O3 -march=native``, so the vector width
  is this CPU's) into ``$XDG_CACHE_HOME/transformdsl/kernels`` (``~/.cache`` by default; a temporary
  file renamed into place, so concurrent first uses are safe), and checked against a float64
  product when it is loaded.
- The functions take contiguous CPU tensors and return a new float32 ``(rows, out)`` tensor.  Under
  ``torch.compile`` they are the custom ops ``torch.ops.transformdsl.*`` (opaque to the compiler).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from .build import FUNCTIONS, SWITCH, build

__all__ = ["SWITCH", "available", "status", "reset", "rows", "int4", "q4_k", "int8_rows", "q8_0_rows", "q4_0_rows",
           "q4_1_rows", "int4_rows", "int4_q8x_rows", "q4_k_rows", "q5_k", "q5_k_rows", "q5_0", "q5_0_rows", "q5_0_q8x_rows", "q5_1", "q5_1_rows", "q6_k",
           "q6_k_rows"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _library() -> ctypes.CDLL | None:
    if "library" not in _state:
        with _lock:
            if "library" not in _state:
                library, _state["status"] = build()
                if library is not None:  # the bound functions, looked up once (a call runs per layer and token)
                    _state.update({name: getattr(library, name) for name in FUNCTIONS})
                _state["library"] = library
    return _state["library"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the kernels run here (built and checked on first call; the answer is then fixed for
    the process unless :func:`reset` is called)."""
    return _library() is not None


def status() -> str:
    """What the kernels are here (vector width, threads), or why they are not used."""
    _library()
    return str(_state["status"])


def reset() -> None:
    """Forget the answer of :func:`available` (after changing :data:`SWITCH`; layers built before keep theirs)."""
    with _lock:
        _state.clear()


def _rows(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor | None) -> torch.Tensor:
    """The ``name`` kernel on a contiguous float32 ``x`` of any leading dimensions: (..., out) float32.
    (The ``*_q8x_rows`` kernels return -1 when they cannot allocate their rounded activations; the others
    return nothing.)"""
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    width = x.shape[-1]
    if _state[name](x.data_ptr(), weight.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
                    out.data_ptr(), x.numel() // width if width else 0, weight.shape[0], width, 0):
        raise MemoryError(f"{name}: no memory for the rounded activations of a {tuple(x.shape)} input")
    return out


def int8_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias``: x float32 (..., in), weight int8 (out, in), scale and
    bias float32 (out); all contiguous on the CPU."""
    return _rows("int8_rows", x, weight, scale, bias)


def q8_0_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q8_0 blocks: weight int8 (out, in), scale float16 (out, in/32)."""
    return _rows("q8_0_rows", x, weight, scale, bias)


def q4_0_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q4_0 blocks: weight uint8 (out, in/2) in GGUF's nibble order, scale float16
    (out, in/32)."""
    return _rows("q4_0_rows", x, weight, scale, bias)


def q4_1_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q4_1 blocks: weight as Q4_0's, scale float16 (out, in/32, 2): each block's d and m."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    scratch = torch.empty(rows * (width // 2), dtype=torch.float32)
    _state["q4_1_rows"](x.data_ptr(), weight.data_ptr(), scale.data_ptr(), scratch.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, weight.shape[0], width, 0)
    return out


def int4_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with ``quantize int4``'s groups: weight uint8 (out, in/2), input ``2j`` in byte ``j``'s low
    nibble; scale and zero (out, in/group_size), both bfloat16 or both float32; ``group_size`` a multiple of 32."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    scratch = torch.empty(rows * width + rows * (width // group_size), dtype=torch.float32)
    _state["int4_rows"](x.data_ptr(), weight.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                        int(scale.dtype is torch.bfloat16), group_size, scratch.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, weight.shape[0], width, 0)
    return out


def int4_q8x_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`int4_rows` with ``x`` first rounded per 32 inputs to int8 with a float16 scale (as
    :func:`quantize_q8_rows` rounds it), then integer dot products per block: ``quantize int4 activations=int8``.
    The exact product of the stored weights with the rounded ``x``, up to float32 summation order."""
    width = x.shape[-1]
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    if _state["int4_q8x_rows"](x.data_ptr(), weight.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                               int(scale.dtype is torch.bfloat16), group_size, None if bias is None else bias.data_ptr(),
                               out.data_ptr(), x.numel() // width if width else 0, weight.shape[0], width, 0):
        raise MemoryError(f"int4_q8x_rows: no memory for the rounded activations of a {tuple(x.shape)} input")
    return out


def q4_k_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q4_K super-blocks: weight uint8 (out, in/2) as GGUF orders each super-block's 128
    value bytes, scale float16 (out, in/256, 2: ``d``, ``dmin``), sub uint8 (out, in/256, 12: the packed 6-bit
    scales and mins); ``in`` a multiple of 256."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    scratch = torch.empty(rows * (width // 32), dtype=torch.float32)
    _state["q4_k_rows"](x.data_ptr(), weight.data_ptr(), scale.data_ptr(), sub.data_ptr(), scratch.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, weight.shape[0], width, 0)
    return out


def q5_0_q8x_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, high: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`q5_0_rows` with ``x`` first rounded to Q8_0 blocks (as :func:`quantize_q8_rows` rounds it), then
    integer dot products per block: ``quantize q5_0 activations=int8``, llama.cpp's Q5_0 x Q8_0 arithmetic."""
    width = x.shape[-1]
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    if _state["q5_0_q8x_rows"](x.data_ptr(), weight.data_ptr(), high.data_ptr(), scale.data_ptr(),
                               None if bias is None else bias.data_ptr(), out.data_ptr(),
                               x.numel() // width if width else 0, weight.shape[0], width, 0):
        raise MemoryError(f"q5_0_q8x_rows: no memory for the rounded activations of a {tuple(x.shape)} input")
    return out


def q5_1_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, high: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q5_1 blocks: weight and high as :func:`q5_0_rows` takes Q5_0's, scale float16 (out, in/32,
    2): each block's d and m (values ``q * d + m``)."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    scratch = torch.empty(rows * (width // 32), dtype=torch.float32)
    _state["q5_1_rows"](x.data_ptr(), weight.data_ptr(), high.data_ptr(), scale.data_ptr(), scratch.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, weight.shape[0], width, 0)
    return out


def q5_k_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor, high: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q5_K super-blocks: weight, scale and sub as :func:`q4_k_rows` takes Q4_K's (the low 4
    bits of each value), high uint8 (out, in/8: each super-block's 32 ``qh`` bytes, bit ``s`` of byte ``l`` the
    fifth bit of input ``32 s + l``); ``in`` a multiple of 256."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    scratch = torch.empty(rows * (width // 32), dtype=torch.float32)
    _state["q5_k_rows"](x.data_ptr(), weight.data_ptr(), scale.data_ptr(), sub.data_ptr(), high.data_ptr(),
                        scratch.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
                        weight.shape[0], width, 0)
    return out


def q5_0_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, high: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q5_0 blocks: weight uint8 (out, in/2) as Q4_0's, scale float16 (out, in/32), high
    uint8 (out, in/32, 4): each block's fifth bits, a little-endian word (bit j: input j)."""
    width = x.shape[-1]
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    _state["q5_0_rows"](x.data_ptr(), weight.data_ptr(), high.data_ptr(), scale.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), x.numel() // width if width else 0,
                        weight.shape[0], width, 0)
    return out


def q6_k_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, high: torch.Tensor, sub: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The product with GGUF Q6_K super-blocks: weight uint8 (out, in/2: each super-block's 128 ``ql`` bytes),
    scale float16 (out, in/256: ``d``), high uint8 (out, in/256, 64: ``qh``), sub int8 (out, in/256, 16: the
    scales per 16 inputs); ``in`` a multiple of 256."""
    width = x.shape[-1]
    out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    _state["q6_k_rows"](x.data_ptr(), weight.data_ptr(), high.data_ptr(), sub.data_ptr(), scale.data_ptr(),
                        None if bias is None else bias.data_ptr(), out.data_ptr(), x.numel() // width if width else 0,
                        weight.shape[0], width, 0)
    return out


def quantize_q8_rows(x: torch.Tensor, sums: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` float32 (..., in) contiguous, ``in`` a multiple of 32, rounded to GGUF Q8_0 blocks as llama.cpp
    rounds activations (``quantize_row_q8_0_ref``): ``(q int8 (..., in), d float32 (..., in/32), s)``, ``d``
    holding values rounded to float16; ``s`` (with ``sums``) ``d * sum(q)`` per block rounded to float16
    (ggml's Q8_1, what :func:`q4_1_q8_rows` takes), else None."""
    width = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.int8)
    d = torch.empty((*x.shape[:-1], width // 32), dtype=torch.float32)
    s = torch.empty_like(d) if sums else None
    _state["quantize_q8_rows"](x.data_ptr(), q.data_ptr(), d.data_ptr(), None if s is None else s.data_ptr(),
                               x.numel() // width if width else 0, width)
    return q, d, s


def _q8_rows(name: str, q: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, *extra: torch.Tensor) -> torch.Tensor:
    out = torch.empty((*q.shape[:-1], weight.shape[0]), dtype=torch.float32)
    width = q.shape[-1]
    _state[name](q.data_ptr(), d.data_ptr(), *(t.data_ptr() for t in extra), weight.data_ptr(), scale.data_ptr(),
                 None if bias is None else bias.data_ptr(), out.data_ptr(), q.numel() // width if width else 0,
                 weight.shape[0], width, 0)
    return out


def q8_0_q8_rows(q: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`q8_0_rows` with activations already rounded by :func:`quantize_q8_rows` (``q``, ``d``):
    llama.cpp's integer dot products per block."""
    return _q8_rows("q8_0_q8_rows", q, d, weight, scale, bias)


def q4_0_q8_rows(q: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`q4_0_rows` with activations rounded by :func:`quantize_q8_rows`."""
    return _q8_rows("q4_0_q8_rows", q, d, weight, scale, bias)


def q4_1_q8_rows(q: torch.Tensor, d: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`q4_1_rows` with activations rounded by :func:`quantize_q8_rows` (``sums=True``: ``s``, ggml's
    Q8_1)."""
    return _q8_rows("q4_1_q8_rows", q, d, weight, scale, bias, s)


EAGER = {"int8": int8_rows, "q8_0": q8_0_rows, "q4_0": q4_0_rows, "q4_1": q4_1_rows}
#: The GGUF block kinds a kernel here reads (Q4_K, Q5_K, Q5_0, Q5_1 and Q6_K through :func:`q4_k`, :func:`q5_k`,
#: :func:`q5_0`, :func:`q5_1` and :func:`q6_k`, the others through :func:`rows`).
BLOCK_KINDS = frozenset(("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"))


#: ``activations=int8`` (:func:`rows`): ``x`` rounded to Q8_0 blocks (Q4_1: with Q8_1's sums), then the integer
#: products, in one call (``<kind>_q8x_rows``), with (``x``, ``weight``, ``scale``, ``bias``) as :data:`EAGER`'s take.
EAGER_INT8 = {kind: functools.partial(_rows, f"{kind}_q8x_rows") for kind in ("q8_0", "q4_0", "q4_1")}


def _custom_op(kind: str, eager=None, name: str | None = None):
    """``torch.ops.transformdsl.<kind>_rows``: what a compiled graph calls (dynamo does not trace ctypes)."""
    eager = eager or EAGER[kind]

    @torch.library.custom_op(f"transformdsl::{name or kind + '_rows'}", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        _library()
        return eager(x, weight, scale, bias)

    @op.register_fake
    def _(x, weight, scale, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)

    return op


COMPILED = {kind: _custom_op(kind) for kind in EAGER}
COMPILED_INT8 = {kind: _custom_op(kind, eager, f"{kind}_q8_rows") for kind, eager in EAGER_INT8.items()}


# The kernels with more operands than (x, weight, scale, bias), one factory per signature (custom_op reads the
# operands' types from the signature, so each arity is written once).
def _op_extra(name: str, eager):
    """``torch.ops.transformdsl.<name>`` for a kernel taking ``(x, weight, scale, extra, bias)``."""
    @torch.library.custom_op(f"transformdsl::{name}", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, extra: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
        _library()
        return eager(x, weight, scale, extra, bias)

    @op.register_fake
    def _(x, weight, scale, extra, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)

    return op


def _op_two_extra(name: str, eager):
    """``torch.ops.transformdsl.<name>`` for a kernel taking ``(x, weight, scale, first, second, bias)``."""
    @torch.library.custom_op(f"transformdsl::{name}", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, first: torch.Tensor, second: torch.Tensor,
           bias: torch.Tensor | None) -> torch.Tensor:
        _library()
        return eager(x, weight, scale, first, second, bias)

    @op.register_fake
    def _(x, weight, scale, first, second, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)

    return op


def _op_groups(name: str, eager):
    """``torch.ops.transformdsl.<name>`` for a ``quantize int4`` kernel: ``(x, weight, scale, zero, group_size, bias)``."""
    @torch.library.custom_op(f"transformdsl::{name}", mutates_args=())
    def op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
           bias: torch.Tensor | None) -> torch.Tensor:
        _library()
        return eager(x, weight, scale, zero, group_size, bias)

    @op.register_fake
    def _(x, weight, scale, zero, group_size, bias):
        return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)

    return op


_int4_op, _int4_q8_op = _op_groups("int4_rows", int4_rows), _op_groups("int4_q8_rows", int4_q8x_rows)
_q4_k_op, _q5_0_op = _op_extra("q4_k_rows", q4_k_rows), _op_extra("q5_0_rows", q5_0_rows)
_q5_0_q8_op, _q5_1_op = _op_extra("q5_0_q8_rows", q5_0_q8x_rows), _op_extra("q5_1_rows", q5_1_rows)
_q5_k_op, _q6_k_op = _op_two_extra("q5_k_rows", q5_k_rows), _op_two_extra("q6_k_rows", q6_k_rows)


def _run(eager, compiled, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *args) -> torch.Tensor:
    """``eager(x, weight, *args, bias)`` (``compiled`` under ``torch.compile``) on ``x`` made contiguous
    float32, the bias fused where it is float32 and added after otherwise; in ``x``'s dtype.  Only what a
    call needs is done here: it runs once per layer per decoded token."""
    dtype = x.dtype
    if dtype is not torch.float32:
        x = x.float()
    if not x.is_contiguous():  # (.to(memory_format=) would return a float32 view unchanged)
        x = x.contiguous()
    if not weight.is_contiguous():  # a loader may assign any tensor; the kernels read rows in place
        weight = weight.contiguous()
    fused = bias is None or bias.dtype is torch.float32
    call = compiled if torch.compiler.is_compiling() else eager
    out = call(x, weight, *args, bias if fused else None)
    if not fused:
        out = out + bias.float()
    return out if dtype is torch.float32 else out.to(dtype)


def rows(kind: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
         bias: torch.Tensor | None, activations: str = "float") -> torch.Tensor:
    """The ``kind`` kernel (``"int8"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``) on ``x`` (any float dtype, any
    leading dimensions, a few rows in all) plus ``bias`` (any float dtype or None): (..., out) in ``x``'s dtype.

    ``activations="int8"`` (GGUF kinds): ``x`` rounded per 32 inputs to int8 with a float16 scale, as
    llama.cpp's CPU backend rounds activations (ggml's reference ``quantize_row_q8_0``; Q4_1: ``q8_1``,
    with the block's sum), then integer dot products per block times the two scales."""
    if activations == "int8":
        return _run(EAGER_INT8[kind], COMPILED_INT8[kind], x, weight, bias, scale)
    return _run(EAGER[kind], COMPILED[kind], x, weight, bias, scale)


def int4(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
         bias: torch.Tensor | None, activations: str = "float") -> torch.Tensor:
    """As :func:`rows`, for ``quantize int4`` layers (:func:`int4_rows`; ``activations="int8"``:
    :func:`int4_q8x_rows`)."""
    if activations == "int8":
        return _run(int4_q8x_rows, _int4_q8_op, x, weight, bias, scale, zero, group_size)
    return _run(int4_rows, _int4_op, x, weight, bias, scale, zero, group_size)


def q4_k(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor,
         bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`rows`, for ``quantize q4_k`` layers (:func:`q4_k_rows`)."""
    return _run(q4_k_rows, _q4_k_op, x, weight, bias, scale, sub)


def q5_1(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, high: torch.Tensor,
         bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`rows`, for ``quantize q5_1`` layers (:func:`q5_1_rows`)."""
    return _run(q5_1_rows, _q5_1_op, x, weight, bias, scale, high)


def q5_k(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, sub: torch.Tensor, high: torch.Tensor,
         bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`rows`, for ``quantize q5_k`` layers (:func:`q5_k_rows`)."""
    return _run(q5_k_rows, _q5_k_op, x, weight, bias, scale, sub, high)


def q5_0(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, high: torch.Tensor,
         bias: torch.Tensor | None, activations: str = "float") -> torch.Tensor:
    """As :func:`rows`, for ``quantize q5_0`` layers (:func:`q5_0_rows`; ``activations="int8"``:
    :func:`q5_0_q8x_rows`)."""
    if activations == "int8":
        return _run(q5_0_q8x_rows, _q5_0_q8_op, x, weight, bias, scale, high)
    return _run(q5_0_rows, _q5_0_op, x, weight, bias, scale, high)


def q6_k(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, high: torch.Tensor, sub: torch.Tensor,
         bias: torch.Tensor | None) -> torch.Tensor:
    """As :func:`rows`, for ``quantize q6_k`` layers (:func:`q6_k_rows`)."""
    return _run(q6_k_rows, _q6_k_op, x, weight, bias, scale, high, sub)
