"""Run a stock bitsandbytes model on the kernels every CPU runs (shared by the tests, the zoo and
tests/stock_loader.py, which imports nothing of transformdsl).

On CPUs with AVX512-BF16, bitsandbytes 0.50's ``Linear4bit`` repacks its weight in place at the
first eval call and then computes in bfloat16 whatever the compute dtype;
``support_avx512bf16_for_cpu`` is bitsandbytes' own per-layer switch for that path (our layers
keep it off: spec.md, quantize).  Comparing outputs bit for bit with ours is only meaningful on
the same kernels.
"""


def stock_runs_portable_4bit(model):
    """Turn the repacking path off in every layer of ``model`` that has it; returns ``model``."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model
