"""Building the decode kernels: ``rows.c`` compiled with the C compiler on PATH for this CPU, cached, loaded
with ctypes and checked against a float64 product before any layer uses it.

The only process this package starts: the compiler, on the package's own ``rows.c`` (nothing read from
a model file reaches it).  The library goes to ``$XDG_CACHE_HOME/transformdsl/kernels`` (``~/.cache`` by
default) under a name made of the source's, the compiler's and the CPU's fingerprints; it is written
to a temporary file and renamed into place, so concurrent first uses are safe.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("rows.c")
#: The environment variable that switches the kernels off (``off``, ``0``, ``false`` or ``no``).
SWITCH = "TRANSFORMDSL_KERNELS"
#: The narrowest vector build used: narrower (plain C) loses to aten's kernels.
MIN_LANES = 8
_P, _N, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
#: The functions rows.c exports besides ``kernel_lanes``, with their argument types (rows.c's signatures).
SIGNATURES = {
    "int8_rows": [_P] * 5 + [_N] * 3 + [_I],
    "q8_0_rows": [_P] * 5 + [_N] * 3 + [_I],
    "q4_0_rows": [_P] * 5 + [_N] * 3 + [_I],
    "q4_1_rows": [_P] * 6 + [_N] * 3 + [_I],
    "int4_rows": [_P] * 4 + [_I, _N] + [_P] * 3 + [_N] * 3 + [_I],
    "q4_k_rows": [_P] * 7 + [_N] * 3 + [_I],
    "q5_0_rows": [_P] * 6 + [_N] * 3 + [_I],
    "q5_k_rows": [_P] * 8 + [_N] * 3 + [_I],
    "q5_1_rows": [_P] * 7 + [_N] * 3 + [_I],
    "q6_k_rows": [_P] * 7 + [_N] * 3 + [_I],
    # int8 activations (llama.cpp's arithmetic; ``activations=int8`` layers): x as Q8_0 blocks
    "quantize_q8_rows": [_P] * 4 + [_N] * 2,
    "q8_0_q8_rows": [_P] * 6 + [_N] * 3 + [_I],
    "q4_0_q8_rows": [_P] * 6 + [_N] * 3 + [_I],
    "q4_1_q8_rows": [_P] * 7 + [_N] * 3 + [_I],
    # the two in one call, x given as float32 (what the layers call); these return 0, or -1 out of memory
    "q8_0_q8x_rows": [_P] * 5 + [_N] * 3 + [_I],
    "q4_0_q8x_rows": [_P] * 5 + [_N] * 3 + [_I],
    "q4_1_q8x_rows": [_P] * 5 + [_N] * 3 + [_I],
    "int4_q8x_rows": [_P] * 4 + [_I, _N] + [_P] * 2 + [_N] * 3 + [_I],
    "q5_0_q8x_rows": [_P] * 6 + [_N] * 3 + [_I],
}
FUNCTIONS = tuple(SIGNATURES)


def _cpu_key() -> str:
    """What the compiled code depends on besides its source: the CPU's feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _openmp_flags() -> list[str] | None:
    """Link flags for torch's own OpenMP runtime (one thread pool for torch and the kernels), or None
    where torch ships none beside it (then the system's ``-fopenmp`` is used, if it links)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    for candidate in sorted(torch_lib.glob("libgomp*.so*")):
        return ["-fopenmp", f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", f"-l:{candidate.name}"]
    return None


def _compile(compiler: str, flags: list[str], target: Path) -> str | None:
    """Compile :data:`SOURCE` into ``target`` (atomically); the compiler's message on failure."""
    partial = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        done = subprocess.run([compiler, "-O3", "-march=native", "-shared", "-fPIC", str(SOURCE), "-o", partial,
                               *flags], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip()[-500:] or f"{compiler} exited with {done.returncode}"
        os.replace(partial, target)
        return None
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    finally:
        if partial and os.path.exists(partial):
            os.unlink(partial)


def _cache_dirs():
    """Where a built library may be kept: the user's cache, else a private folder made for this process
    (never a shared, predictable path: a library planted there would be loaded)."""
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        yield base / "transformdsl" / "kernels"
    except RuntimeError:  # no home directory
        pass
    yield Path(tempfile.mkdtemp(prefix="transformdsl-kernels-"))


def _load(target: Path) -> tuple[ctypes.CDLL | None, str]:
    try:
        library = ctypes.CDLL(str(target))
        _declare(library)
        return library, ""
    except (OSError, AttributeError) as error:  # unreadable, or not the library this source makes
        return None, str(error)


def build() -> tuple[ctypes.CDLL | None, str]:
    """The loaded library and a line saying what it is, or None and why not."""
    if os.environ.get(SWITCH, "").strip().lower() in ("off", "0", "false", "no"):
        return None, f"switched off ({SWITCH}={os.environ[SWITCH]})"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler on PATH (set CC)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the C compiler {compiler} does not run: {error}"
    openmp = _openmp_flags()
    errors = []
    for flags in (openmp or ["-fopenmp"], []):  # without OpenMP the kernels run on one thread
        key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, _cpu_key(), *flags]).encode())
        library = None
        for cache in _cache_dirs():
            target = cache / f"rows-{key.hexdigest()[:20]}.so"
            if target.exists():
                library, error = _load(target)
                if library is not None:
                    break
            error = _compile(compiler, flags, target)
            if error is None:
                library, error = _load(target)
                if library is not None:
                    break
            errors.append(error)
        if library is None:
            continue
        lanes = library.kernel_lanes()
        if lanes < MIN_LANES:
            return None, f"this CPU has no AVX2+FMA ({lanes}-wide build): aten's kernels are faster"
        wrong = _self_check(library)
        if wrong:
            return None, wrong
        threads = "OpenMP threads" if flags else "one thread (no OpenMP)"
        return library, f"{lanes}-wide float32 ({'AVX-512' if lanes == 16 else 'AVX2'}), {threads}"
    return None, f"compiling {SOURCE.name} failed: {errors[-1]}"


def _declare(library: ctypes.CDLL) -> None:
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = ctypes.c_int if name.endswith("_q8x_rows") else None
        function.argtypes = argtypes
    library.kernel_lanes.restype = ctypes.c_int
    library.kernel_lanes.argtypes = []


def _self_check(library: ctypes.CDLL) -> str | None:
    """A wrong build (a miscompile, a library from another CPU) is refused, never used."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=generator)
    q = torch.randint(-127, 128, (21, 64), dtype=torch.int8, generator=generator)
    scale = torch.rand(21, generator=generator)
    d = (torch.rand(21, 2, generator=generator) + 0.5).half()
    nibbles = torch.randint(0, 256, (21, 32), dtype=torch.uint8, generator=generator)
    lo, hi = (nibbles & 15).reshape(21, 2, 16), (nibbles >> 4).reshape(21, 2, 16)
    values4 = (torch.cat((lo, hi), dim=-1).double() - 8) * d.double()[..., None]
    expected = {
        "int8_rows": (q, scale, x.double() @ (q.double() * scale.double()[:, None]).T),
        "q8_0_rows": (q, d, x.double() @ (q.double().reshape(21, 2, 32) * d.double()[..., None]).reshape(21, 64).T),
        "q4_0_rows": (nibbles, d, x.double() @ values4.reshape(21, 64).T),
    }
    # quantize int4: input 2j in byte j's low nibble, 2j + 1 in its high one; (q - 8) * s + z per group of 32
    interleaved = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).reshape(21, 64).double()
    s32, z32 = torch.rand(21, 2, generator=generator), torch.randn(21, 2, generator=generator)
    values = ((interleaved.reshape(21, 2, 32) - 8) * s32.double()[..., None] + z32.double()[..., None]).reshape(21, 64)
    out, scratch = torch.empty(3, 21), torch.empty(3 * 64 + 3 * 2)
    library.int4_rows(x.data_ptr(), nibbles.data_ptr(), s32.data_ptr(), z32.data_ptr(), 0, 32, scratch.data_ptr(),
                      None, out.data_ptr(), 3, 21, 64, 1)
    if not torch.allclose(out.double(), x.double() @ values.T, rtol=1e-5, atol=1e-4):
        return "the compiled int4_rows failed its self-check"
    # GGUF Q4_K: one super-block of 256 inputs; random bytes for the values and the packed 6-bit scales
    if _q4_k_wrong(library, generator):
        return "the compiled q4_k_rows failed its self-check"
    if _q5_0_wrong(library, generator):
        return "the compiled q5_0_rows failed its self-check"
    if _q5_1_wrong(library, generator):
        return "the compiled q5_1_rows failed its self-check"
    if _q5_k_wrong(library, generator):
        return "the compiled q5_k_rows failed its self-check"
    if _q6_k_wrong(library, generator):
        return "the compiled q6_k_rows failed its self-check"
    # GGUF Q4_1: Q4_0's nibbles standing for q * d + m
    dm = torch.stack((d, (torch.randn(21, 2, generator=generator)).half()), dim=-1)
    values41 = torch.cat((lo, hi), dim=-1).double() * dm[..., 0].double()[..., None] + dm[..., 1].double()[..., None]
    out, scratch = torch.empty(3, 21), torch.empty(3 * 32)
    library.q4_1_rows(x.data_ptr(), nibbles.data_ptr(), dm.data_ptr(), scratch.data_ptr(), None, out.data_ptr(),
                      3, 21, 64, 1)
    if not torch.allclose(out.double(), x.double() @ values41.reshape(21, 64).T, rtol=1e-5, atol=1e-4):
        return "the compiled q4_1_rows failed its self-check"
    for name, (weight, scales, reference) in expected.items():
        out = torch.empty(3, 21)
        getattr(library, name)(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), None, out.data_ptr(), 3, 21, 64, 1)
        if not torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-4):
            return f"the compiled {name} failed its self-check (largest error {(out - reference).abs().max():.3g})"
    # int8 activations: x rounded to Q8_0 blocks (checked against a float64 rounding of the same), then the
    # exact products of the stored values (3 blocks: an odd count, as K = 96 would give)
    x3 = torch.randn(3, 96, generator=generator)
    qx, dx, sx = torch.empty(3, 96, dtype=torch.int8), torch.empty(3, 3), torch.empty(3, 3)
    library.quantize_q8_rows(x3.data_ptr(), qx.data_ptr(), dx.data_ptr(), sx.data_ptr(), 3, 96)
    blocks = x3.double().reshape(3, 3, 32)
    d64 = blocks.abs().amax(-1) / 127
    if (not torch.equal(dx, d64.float().half().float())
            or (qx.double().reshape(3, 3, 32) - blocks / d64[..., None]).abs().max() > 0.5 + 1e-4
            or not torch.allclose(sx.double(), qx.double().reshape(3, 3, 32).sum(-1) * d64, rtol=1e-3, atol=1e-3)):
        return "the compiled quantize_q8_rows failed its self-check"
    xq = (qx.double().reshape(3, 3, 32) * dx.double()[..., None]).reshape(3, 96)
    q96 = torch.randint(-128, 128, (21, 96), dtype=torch.int8, generator=generator)
    d96 = (torch.rand(21, 3, generator=generator) + 0.5).half()
    n96 = torch.randint(0, 256, (21, 48), dtype=torch.uint8, generator=generator)
    c96 = torch.cat(((n96 & 15).reshape(21, 3, 16), (n96 >> 4).reshape(21, 3, 16)), dim=-1).double()
    dm96 = torch.stack((d96, torch.randn(21, 3, generator=generator).half()), dim=-1)
    checks = {
        "q8_0_q8_rows": (q96, d96, q96.double().reshape(21, 3, 32) * d96.double()[..., None]),
        "q4_0_q8_rows": (n96, d96, (c96 - 8) * d96.double()[..., None]),
        "q4_1_q8_rows": (n96, dm96, c96 * dm96[..., 0].double()[..., None] + dm96[..., 1].double()[..., None]),
    }
    for name, (weight, scales, values) in checks.items():
        out = torch.empty(3, 21)
        extra = (sx.data_ptr(),) if name == "q4_1_q8_rows" else ()
        getattr(library, name)(qx.data_ptr(), dx.data_ptr(), *extra, weight.data_ptr(), scales.data_ptr(), None,
                               out.data_ptr(), 3, 21, 96, 1)
        reference = xq @ values.reshape(21, 96).T
        if name == "q4_1_q8_rows":  # ggml's Q8_1: the minimum times the stored s_x, not the sum of q_x * d_x
            reference += sx.double() @ dm96[..., 1].double().T - xq.reshape(3, 3, 32).sum(-1) @ dm96[..., 1].double().T
        if not torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-4):
            return f"the compiled {name} failed its self-check (largest error {(out - reference).abs().max():.3g})"
    if _int4_q8x_wrong(library, generator):
        return "the compiled int4_q8x_rows failed its self-check"
    if _q5_0_wrong(library, generator, int8=True):
        return "the compiled q5_0_q8x_rows failed its self-check"
    return None


def _q5_values(nibbles: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """ggml's Q5_0/Q5_1 values 0..31, (rows, blocks, 32) int64, from the nibbles (rows, in/2: byte j of a block holding
    input j low and j + 16 high) and the fifth bits (rows, in/32, 4: a little-endian word, bit j for input j).
    (gguf_blocks.unpack_q5_0 is this; it imports the kernels, so the check cannot import it.)"""
    blocks = nibbles.reshape(nibbles.shape[0], -1, 16)
    low = torch.cat((blocks & 15, blocks >> 4), dim=-1).long()
    word = (high.long() << torch.tensor([0, 8, 16, 24])).sum(-1, keepdim=True)
    return low | (((word >> torch.arange(32)) & 1) << 4)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x (rows, K) rounded to Q8_0 blocks as quantize_q8_rows rounds it, in float64: q from d as computed, times d
    rounded to float16 (a tie may round either way: within the callers' tolerance)."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / d) * d.float().half().double()).reshape(x.shape)


def _int4_q8x_wrong(library: ctypes.CDLL, generator: torch.Generator) -> bool:
    """Whether int4_q8x_rows misses the float64 product of ``quantize int4``'s weights (groups of 64, bfloat16
    scales and zeros; 20 groups: a vector's worth and a remainder) with x rounded to Q8_0 blocks (three input
    rows, the rounding checked against a float64 one: each value within half a step of its block)."""
    rows, width, group = 21, 1280, 64
    x = torch.randn(3, width, generator=generator)
    nibbles = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, width // group, generator=generator) * 0.1).bfloat16()
    zero = (torch.randn(rows, width // group, generator=generator) * 0.1).bfloat16()
    values = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).reshape(rows, -1, group).double()
    weight = ((values - 8) * scale.double()[..., None] + zero.double()[..., None]).reshape(rows, width)
    rounded = _rounded(x)
    out = torch.empty(3, rows)
    library.int4_q8x_rows(x.data_ptr(), nibbles.data_ptr(), scale.data_ptr(), zero.data_ptr(), 1, group, None,
                          out.data_ptr(), 3, rows, width, 1)
    return not torch.allclose(out.double(), rounded @ weight.T, rtol=1e-4, atol=1e-3)


def _q4_k_wrong(library: ctypes.CDLL, generator: torch.Generator) -> bool:
    """Whether q4_k_rows misses the float64 product with ggml's dequantization of random Q4_K blocks
    (two super-blocks, three input rows; the scales unpacked as ``get_scale_min_k4`` does)."""
    rows, width = 21, 512
    x = torch.randn(3, width, generator=generator)
    values = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=generator)
    dm = (torch.rand(rows, width // 256, 2, generator=generator) * 0.01).half()
    sub = torch.randint(0, 256, (rows, width // 256, 12), dtype=torch.uint8, generator=generator)
    d, m, md = sub[..., 0:4].long(), sub[..., 4:8].long(), sub[..., 8:12].long()
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1).double()
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1).double()
    chunks = values.reshape(rows, -1, 4, 1, 32)
    q = torch.cat((chunks & 0xF, chunks >> 4), dim=3).reshape(rows, -1, 8, 32).double()
    weight = (dm[..., :1].double() * sc)[..., None] * q - (dm[..., 1:].double() * mins)[..., None]
    out, scratch = torch.empty(3, rows), torch.empty(3 * width // 32)
    library.q4_k_rows(x.data_ptr(), values.data_ptr(), dm.data_ptr(), sub.data_ptr(), scratch.data_ptr(), None,
                      out.data_ptr(), 3, rows, width, 1)
    return not torch.allclose(out.double(), x.double() @ weight.reshape(rows, width).T, rtol=1e-5, atol=1e-4)


def _q5_1_wrong(library: ctypes.CDLL, generator: torch.Generator) -> bool:
    """Whether q5_1_rows misses the float64 product with ggml's dequantization of random Q5_1 blocks (three blocks,
    three input rows): Q5_0's values (no - 16) times d, plus m."""
    rows, width = 21, 96
    x = torch.randn(3, width, generator=generator)
    nibbles = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=generator)
    high = torch.randint(0, 256, (rows, width // 32, 4), dtype=torch.uint8, generator=generator)
    dm = torch.stack(((torch.rand(rows, width // 32, generator=generator) + 0.5),
                      torch.randn(rows, width // 32, generator=generator)), dim=-1).half()
    weight = _q5_values(nibbles, high).double() * dm[..., 0].double()[..., None] + dm[..., 1].double()[..., None]
    out, scratch = torch.empty(3, rows), torch.empty(3 * width // 32)
    library.q5_1_rows(x.data_ptr(), nibbles.data_ptr(), high.data_ptr(), dm.data_ptr(), scratch.data_ptr(), None,
                      out.data_ptr(), 3, rows, width, 1)
    return not torch.allclose(out.double(), x.double() @ weight.reshape(rows, width).T, rtol=1e-5, atol=1e-4)


def _q5_k_wrong(library: ctypes.CDLL, generator: torch.Generator) -> bool:
    """Whether q5_k_rows misses the float64 product with ggml's dequantization of random Q5_K super-blocks (two,
    three input rows): Q4_K's, each value plus 16 where its bit in ``qh`` is set (bit s of byte l: input 32 s + l)."""
    rows, width = 21, 512
    x = torch.randn(3, width, generator=generator)
    values = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=generator)
    dm = (torch.rand(rows, width // 256, 2, generator=generator) * 0.01).half()
    sub = torch.randint(0, 256, (rows, width // 256, 12), dtype=torch.uint8, generator=generator)
    high = torch.randint(0, 256, (rows, width // 8), dtype=torch.uint8, generator=generator)
    d, m, md = sub[..., 0:4].long(), sub[..., 4:8].long(), sub[..., 8:12].long()
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1).double()
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1).double()
    chunks = values.long().reshape(rows, -1, 4, 1, 32)
    bits = (high.long().reshape(rows, -1, 1, 32) >> torch.arange(8)[:, None]) & 1
    q = torch.cat((chunks & 0xF, chunks >> 4), dim=3).reshape(rows, -1, 8, 32) + 16 * bits
    weight = (dm[..., :1].double() * sc)[..., None] * q.double() - (dm[..., 1:].double() * mins)[..., None]
    out, scratch = torch.empty(3, rows), torch.empty(3 * width // 32)
    library.q5_k_rows(x.data_ptr(), values.data_ptr(), dm.data_ptr(), sub.data_ptr(), high.data_ptr(),
                      scratch.data_ptr(), None, out.data_ptr(), 3, rows, width, 1)
    return not torch.allclose(out.double(), x.double() @ weight.reshape(rows, width).T, rtol=1e-5, atol=1e-4)


def _q5_0_wrong(library: ctypes.CDLL, generator: torch.Generator, int8: bool = False) -> bool:
    """Whether q5_0_rows misses the float64 product with ggml's dequantization of random Q5_0 blocks (three
    blocks, three input rows: the fifth bit of input j is bit j of the block's little-endian word); with ``int8``,
    whether q5_0_q8x_rows misses it with x rounded to Q8_0 blocks (five blocks: a step of four and one more)."""
    rows, width = 21, 160 if int8 else 96
    x = torch.randn(3, width, generator=generator)
    nibbles = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=generator)
    high = torch.randint(0, 256, (rows, width // 32, 4), dtype=torch.uint8, generator=generator)
    d = (torch.rand(rows, width // 32, generator=generator) + 0.5).half()
    weight = (_q5_values(nibbles, high) - 16).double() * d.double()[..., None]
    out = torch.empty(3, rows)
    getattr(library, "q5_0_q8x_rows" if int8 else "q5_0_rows")(x.data_ptr(), nibbles.data_ptr(), high.data_ptr(),
                                                              d.data_ptr(), None, out.data_ptr(), 3, rows, width, 1)
    if int8:
        return not torch.allclose(out.double(), _rounded(x) @ weight.reshape(rows, width).T, rtol=1e-4, atol=1e-3)
    return not torch.allclose(out.double(), x.double() @ weight.reshape(rows, width).T, rtol=1e-5, atol=1e-4)


def _q6_k_wrong(library: ctypes.CDLL, generator: torch.Generator) -> bool:
    """Whether q6_k_rows misses the float64 product with ggml's dequantization of random Q6_K super-blocks
    (two, three input rows)."""
    rows, width = 21, 512
    x = torch.randn(3, width, generator=generator)
    ql = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=generator)
    qh = torch.randint(0, 256, (rows, width // 4), dtype=torch.uint8, generator=generator)
    sc = torch.randint(-128, 128, (rows, width // 256, 16), dtype=torch.int8, generator=generator)
    d = (torch.rand(rows, width // 256, generator=generator) * 0.01).half()
    out = torch.empty(3, rows)
    library.q6_k_rows(x.data_ptr(), ql.data_ptr(), qh.data_ptr(), sc.data_ptr(), d.data_ptr(), None, out.data_ptr(),
                      3, rows, width, 1)
    weight = _q6_k_reference(ql, qh, sc, d)
    return not torch.allclose(out.double(), x.double() @ weight.T, rtol=1e-5, atol=1e-4)


def _q6_k_reference(ql: torch.Tensor, qh: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """ggml's ``dequantize_row_q6_K`` in float64 on rows of Q6_K (ql (out, in/2), qh (out, in/4), sc int8
    (out, in/256, 16), d (out, in/256)): (out, in)."""
    rows = ql.shape[0]
    low = ql.long().reshape(rows, -1, 2, 2, 32)  # (super, half, ql[l] or ql[l + 32], l)
    high = qh.long().reshape(rows, -1, 2, 1, 32)
    q = torch.stack(((low[..., 0, :] & 15) | ((high[..., 0, :] & 3) << 4),
                     (low[..., 1, :] & 15) | (((high[..., 0, :] >> 2) & 3) << 4),
                     (low[..., 0, :] >> 4) | (((high[..., 0, :] >> 4) & 3) << 4),
                     (low[..., 1, :] >> 4) | (((high[..., 0, :] >> 6) & 3) << 4)), dim=-2)  # (super, half, 4, 32)
    q = (q - 32).reshape(rows, -1, 16, 16).double()  # input order: groups of 16
    return (q * (d.double()[..., None] * sc.double())[..., None]).reshape(rows, -1)
