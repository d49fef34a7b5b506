"""CI slice of the support matrix (tests/zoo/): the models users run most, every main transform.

Each cell is what ``make zoo`` checks (tests/zoo/matrix.py, :func:`run_cell`): the transform runs
with ``verify=True`` on the model's test input, the error stays within the script's declared bound on
a held-out input too, ``load(dir)`` alone (no ``model=``) rebuilds it and the reloaded output is
bit-identical.  Cells that fail today because of a defect listed in issue 11 are marked
``xfail(strict=True)``: the fix makes them pass, and whoever lands it removes the mark.
"""

from __future__ import annotations

import functools

import pytest

from tests.zoo import corpus, matrix, support

DIFFUSERS = (
    "UNet2DConditionModel",
    "SD3Transformer2DModel[SD35Transformer]",
    "FluxTransformer2DModel[FluxTransformer]",
    "WanTransformer3DModel",
    "QwenImageTransformer2DModel",
    "LTXVideoTransformer3DModel",
    "SanaTransformer2DModel",
    "HunyuanVideoTransformer3DModel[HunyuanVideoTransformer]",
    "CogVideoXTransformer3DModel[CogVideoXTransformer]",
    "Lumina2Transformer2DModel",
)
TRANSFORMERS = ("Llama", "Qwen3", "Gemma2", "T5-encoder", "CLIP-text", "CLIP-vision", "Falcon", "BERT")
MODELS = tuple(f"diffusers/{m}" for m in DIFFUSERS) + tuple(f"transformers/{m}" for m in TRANSFORMERS)
SCRIPTS = ("fuse qkv", "quantize int8", "quantize nf4", "quantize hqq", "fp8 storage", "fp8 native",
           "fuse qkv; quantize int8", "fuse bias_act_dropout")

D1 = "issue 11 defect 1: tensors held as plain attributes are not saved; load(dir) leaves them on meta"
D9 = "issue 11 defect 9: hqq group_size that does not divide a layer fails the statement"

#: (model, script) -> the issue 11 defect that makes the cell fail today (from `make zoo` on main).
KNOWN = {
    ("diffusers/UNet2DConditionModel", "quantize hqq"): D9,
    ("diffusers/SD3Transformer2DModel[SD35Transformer]", "quantize hqq"): D9,
    ("diffusers/FluxTransformer2DModel[FluxTransformer]", "quantize hqq"): D9,
    ("diffusers/WanTransformer3DModel", "quantize hqq"): D9,
    ("diffusers/QwenImageTransformer2DModel", "fuse qkv"): D1,
    ("diffusers/QwenImageTransformer2DModel", "quantize int8"): D1,
    ("diffusers/QwenImageTransformer2DModel", "quantize nf4"): D1,
    ("diffusers/QwenImageTransformer2DModel", "quantize hqq"): D9,
    ("diffusers/QwenImageTransformer2DModel", "fp8 storage"): D1,
    ("diffusers/QwenImageTransformer2DModel", "fp8 native"): D1,
    ("diffusers/QwenImageTransformer2DModel", "fuse qkv; quantize int8"): D1,
    ("diffusers/QwenImageTransformer2DModel", "fuse bias_act_dropout"): D1,
    ("diffusers/LTXVideoTransformer3DModel", "quantize hqq"): D9,
    ("diffusers/SanaTransformer2DModel", "quantize hqq"): D9,
    ("diffusers/HunyuanVideoTransformer3DModel[HunyuanVideoTransformer]", "quantize hqq"): D9,
    ("diffusers/CogVideoXTransformer3DModel[CogVideoXTransformer]", "quantize hqq"): D9,
    ("diffusers/Lumina2Transformer2DModel", "fuse qkv"): D1,
    ("diffusers/Lumina2Transformer2DModel", "quantize int8"): D1,
    ("diffusers/Lumina2Transformer2DModel", "quantize nf4"): D1,
    ("diffusers/Lumina2Transformer2DModel", "quantize hqq"): D9,
    ("diffusers/Lumina2Transformer2DModel", "fp8 storage"): D1,
    ("diffusers/Lumina2Transformer2DModel", "fp8 native"): D1,
    ("diffusers/Lumina2Transformer2DModel", "fuse qkv; quantize int8"): D1,
    ("transformers/Llama", "quantize hqq"): D9,
    ("transformers/Qwen3", "quantize hqq"): D9,
    ("transformers/Gemma2", "quantize hqq"): D9,
    ("transformers/T5-encoder", "quantize nf4"): "issue 11 defect 4: nf4 ignores _keep_in_fp32_modules (T5's wo)",
    ("transformers/T5-encoder", "quantize hqq"): D9,
    ("transformers/T5-encoder", "fp8 storage"):
        "issue 11 defect 6: an fp8 storage Embedding returns bf16 in a float32 model",
    ("transformers/T5-encoder", "fp8 native"):
        "issue 11 defect 5: model code reads .weight.dtype (here an fp8 native weight)",
    ("transformers/CLIP-text", "quantize hqq"): D9,
    ("transformers/CLIP-vision", "quantize hqq"): D9,
    ("transformers/CLIP-vision", "fp8 storage"):
        "issue 11 defect 3: fp8 storage ignores _skip_layerwise_casting_patterns",
    ("transformers/Falcon", "quantize hqq"): D9,
    ("transformers/Falcon", "fp8 storage"):
        "issue 11 defect 8: fp8 storage refuses nn.Linear subclasses (FalconLinear)",
    ("transformers/Falcon", "fp8 native"): "issue 11 defect 8: fp8 refuses nn.Linear subclasses (FalconLinear)",
    ("transformers/BERT", "quantize hqq"): D9,
}

#: Models whose attention ``fuse qkv`` does not (all) fuse yet (issue 11, QKV fusion by mechanism).
NOT_FUSED = {}


@functools.cache
def _cell(model_id: str, script: str) -> dict:
    """One matrix cell, run once per test session (the fusion test reads the "fuse qkv" cells)."""
    return matrix.run_cell(model_id, script)


def _cells():
    for model in MODELS:
        for script in SCRIPTS:
            reason = KNOWN.get((model, script))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(model, script, marks=marks, id=f"{model.split('/', 1)[1]}|{script}")


@pytest.mark.parametrize(("model_id", "script"), list(_cells()))
def test_cell(model_id, script):
    cell = _cell(model_id, script)
    assert cell["status"] in ("ok", "not applicable"), f"{cell['status']}: {cell['detail']}"
    if script.startswith(("quantize", "fp8")):  # every slice model has layers these change
        assert cell["status"] == "ok" and cell["changed"] > 0, cell
    if cell["status"] == "ok":
        assert cell["error"] <= cell["bound"] + 1e-5 and cell["reload"] == "bit-identical", cell


def _fusion_params():
    for model in MODELS:
        if model == "transformers/Falcon":  # query_key_value: already one projection
            continue
        reason = NOT_FUSED.get(model)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        yield pytest.param(model, marks=marks, id=model.split("/", 1)[1])


@pytest.mark.parametrize("model_id", list(_fusion_params()))
def test_fuse_qkv_fuses_every_attention_with_separate_projections(model_id):
    cell = _cell(model_id, "fuse qkv")
    assert cell["candidates"], "every slice model has attention with separate q, k, v projections"
    assert cell["fused"] == cell["candidates"], cell
    # fused outputs equal the unfused ones up to float rounding (reloading is test_cell's business)
    assert cell["error"] is not None and cell["error"] <= 1e-5, cell


def test_corpus_covers_the_libraries_and_builds_deterministically():
    entries = corpus.entries()
    ids = [e["id"] for e in entries]
    assert len(ids) == len(set(ids))
    assert len({e["class"] for e in corpus.entries("diffusers")}) >= 60
    assert len({e["class"] for e in corpus.entries("transformers")}) >= 30
    entry = corpus.entry("diffusers/FluxTransformer2DModel[FluxTransformer]")
    first, inputs = corpus.build(entry)
    second, same_inputs = corpus.build(entry)
    assert corpus.run(first, inputs).equal(corpus.run(second, same_inputs))
    held_out = corpus.inputs(entry, seed=1)
    assert not held_out[1]["hidden_states"].equal(inputs[1]["hidden_states"])


def test_support_page_reports_every_cell():
    cells = [_cell("transformers/Llama", "fuse qkv"), _cell("transformers/BERT", "fp8 storage")]
    report = {"seconds": 1.0, "workers": 1, "versions": {"torch": "x"}, "scripts": {"fuse qkv": "fuse qkv",
              "fp8 storage": "fp8 storage"}, "compile_slice": [], "skipped": {},
              "models": [{"id": "transformers/Llama", "library": "transformers", "class": "LlamaForCausalLM"},
                         {"id": "transformers/BERT", "library": "transformers", "class": "BertModel"}],
              "cells": cells}
    page = support.render(report)
    assert "| Llama | " + support.cell_text(cells[0]) + " |  |" in page
    assert "| BERT |  | " + support.cell_text(cells[1]) + " |" in page
    assert "fuse qkv` coverage:** of the 2 models" in page
