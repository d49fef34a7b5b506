"""``attention BACKEND``: the attention kernel a model runs (declarations; torch-free).

Two libraries, two mechanisms, one statement:

- diffusers models: the backends of ``diffusers.models.attention_dispatch`` (``AttentionBackendName``;
  a leading underscore of diffusers' private names is dropped: ``attention native_math`` is
  ``_native_math``).  Set per attention module, on the processors' ``_attention_backend`` (what
  ``model.set_attention_backend`` sets), so ``in`` selects modules; the process-wide default is left alone.
- transformers models: ``attn_implementation`` (``eager``, ``sdpa``, ``flex_attention``,
  ``flash_attention_2``...), set with ``model.set_attn_implementation`` on the whole model.

The requirements (package, device, dtype) are checked when the script is planned, naming what is
missing and a backend that works there; ``load()`` checks them again on the loading machine and
refuses with a LoadError, unless :data:`FALLBACK` is on (then the model keeps its library's default
attention and a warning says so).
"""

from __future__ import annotations

from ...extend import RuntimeTransform
from ...switches import Switch

#: diffusers' AttentionBackendName values (tests/test_attention.py checks this list against the
#: installed diffusers); the statement's mode is the value without a leading underscore.
DIFFUSERS_BACKENDS = (
    "flash", "flash_hub", "flash_varlen", "flash_varlen_hub", "flash_4_hub", "_flash_3", "_flash_varlen_3",
    "_flash_3_hub", "_flash_3_varlen_hub", "aiter_fa2_hub", "flex", "native", "_native_cudnn", "_native_efficient",
    "_native_flash", "_native_math", "_native_npu", "_native_xla", "sage", "sage_hub", "sage_blackwell_hub",
    "sage_varlen", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton", "xformers",
)
#: transformers' attn_implementation names (the registered attention functions, and eager).
TRANSFORMERS_BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                         "flash_attention_4")
#: diffusers backends whose kernels run only on one kind of device (their checks do not all say so).
DEVICE_ONLY = {
    **{name: "cuda" for name in DIFFUSERS_BACKENDS if name.lstrip("_").startswith(("flash", "sage", "aiter"))},
    "xformers": "cuda", "_native_cudnn": "cuda", "_native_flash": "cuda", "_native_efficient": "cuda",
    "_native_npu": "npu", "_native_xla": "xla",
}
#: The same kind of kernel in the other library (for the message when a model's library lacks the name).
EQUIVALENT = {"native": "sdpa", "sdpa": "native", "flex": "flex_attention", "flex_attention": "flex",
              "flash": "flash_attention_2", "flash_attention_2": "flash", "_flash_3": "flash_attention_3",
              "flash_attention_3": "flash_3", "_native_math": "eager", "eager": "native_math"}

FALLBACK = Switch(
    "attention fallback",
    "on load, a saved 'attention' backend this machine cannot run is left out (the model keeps its library's "
    "default attention, with a warning) instead of refusing to load",
    default=False, environment="TRANSFORMDSL_ATTENTION_FALLBACK", when_set=True)


def library_name(mode: str) -> tuple[str, str]:
    """``(library, backend name in that library)`` for a statement's mode."""
    if mode in TRANSFORMERS_BACKENDS:
        return "transformers", mode
    for name in DIFFUSERS_BACKENDS:
        if name.lstrip("_") == mode:
            return "diffusers", name
    raise KeyError(mode)


class AttentionBackend(RuntimeTransform):
    verb = "attention"
    default_target = None  # the scope's top: the denoiser (or the model); its attention modules inside
    exclusive = "attention"
    runs_after = ("fuse *",)
    runs_before = ("compile*", "cache *")
    switches = (FALLBACK,)
    #: The library the backend belongs to, and its name there.
    library: str = ""
    backend: str = ""

    def incompatible(self, other):
        if other.verb == "attention" and other is not self and other.common.component == self.common.component \
                and not self.statement.scope and not other.statement.scope:
            return ("both set the attention of the whole model; keep one, or scope them to different modules "
                    "with 'in'")
        return None


def class_name(mode: str) -> str:
    return "Attention_" + mode


def _declare(mode: str) -> type:
    library, backend = library_name(mode)
    where = "diffusers' attention dispatcher" if library == "diffusers" else "transformers' attn_implementation"
    return type(class_name(mode), (AttentionBackend,), {
        "mode": mode, "library": library, "backend": backend,
        # SageAttention quantizes q and k to int8 (and p.v to fp8 in some kernels): lossy by design, by an
        # amount we cannot measure without its GPU, so no bound is claimed (verify checks shape and
        # finiteness only).  The others compute the same softmax(q k^T) v up to float rounding.
        "error_bound": None if mode.startswith("sage") else 0.0,
        "summary": f"run attention with '{backend}' ({where})",
        "implementation": f".run:{class_name(mode)}",
        "__module__": __name__,
    })


MODES = tuple(name.lstrip("_") for name in DIFFUSERS_BACKENDS) + TRANSFORMERS_BACKENDS
for _mode in MODES:
    globals()[class_name(_mode)] = _declare(_mode)
del _mode

#: The family's registry keys, one per backend (read by name by :data:`transformdsl.registry.FAMILY_TABLES`).
KEYS = {f"attention {mode}": f"{__name__}:{class_name(mode)}" for mode in MODES}
