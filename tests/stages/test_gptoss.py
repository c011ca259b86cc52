"""gpt-oss against transformers' GptOssForCausalLM in float32 (docs/model-formats.md §4, §5).

The oracle checkpoint has MXFP4 experts laid out like the released one, YaRN with `truncate: false`,
and a sliding window (8) much shorter than the prompt (48), so every gpt-oss feature shows in the logits.
"""
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from raymoe.deploy.convert import convert
from hf_models import assert_prompt_logprobs_match, hf_logprobs, mxfp4_to_float, random_mxfp4, run_one as run
from raymoe.kernels.dequant import dequantize
from raymoe.stages.layers import attention as shared_attention
from raymoe.stages.families import gptoss
from raymoe.stages.text.chat import render_chat
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.families.gptoss_hf import mxfp4_dequantize, mxfp4_to_ggml
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams

PROMPT_LEN = 48
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(oracle):
    o = oracle("gptoss")
    return o.dir, o.model


@pytest.fixture(scope="module")
def gguf_path(oracle):
    return oracle("gptoss").gguf


@pytest.fixture(scope="module")
def unquantised_dir(hf_model, tmp_path_factory):
    """The same weights as a plain float checkpoint: experts `[E, in, out]`, no quantization_config."""
    src = hf_model[0]
    out = tmp_path_factory.mktemp("gptoss-float")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_blocks")]:
        stem = name.removesuffix("_blocks")
        weight = mxfp4_to_float(tensors.pop(name), tensors.pop(stem + "_scales"))
        tensors[stem] = weight.transpose(1, 2).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(out / "config.json", "w"))
    for f in os.listdir(src):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(src, f), out / f)
    return str(out)


@pytest.fixture(scope="module")
def prompt(oracle):
    return oracle("gptoss").prompt


def prompt_logprobs(result):
    return torch.tensor([e["logprob"] for e in result["prompt_logprobs"][1:]])


def max_logprob_error(files, model, prompt):
    ours = prompt_logprobs(run(files, prompt, prompt_logprobs=0))
    ref = hf_logprobs(model, prompt)
    return (ours - ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]).abs().max().item()


def test_oracle_config_exercises_every_feature(hf_model):
    cfg = hf_model[1].config
    assert json.load(open(os.path.join(hf_model[0], "config.json")))["quantization_config"]["quant_method"] == "mxfp4"
    stored = load_file(os.path.join(hf_model[0], "model.safetensors"))
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    assert cfg.sliding_window < PROMPT_LEN // 4 and "sliding_attention" in cfg.layer_types
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["truncate"] is False
    files = open_model(hf_model[0])
    a, _ = gptoss.yarn_inv_frequencies(10000.0, 16, 32.0, 4096, 32.0, 1.0, truncate=False)
    b, _ = gptoss.yarn_inv_frequencies(10000.0, 16, 32.0, 4096, 32.0, 1.0, truncate=True)
    assert not torch.equal(a, b) and files.config.rope_truncate is False


@pytest.mark.parametrize("path", ["hf-unquantised", "gguf-unquantised"])
def test_unquantised_checkpoint_matches_transformers(hf_model, unquantised_dir, prompt, path, tmp_path):
    """The same weights as plain float experts (tests/stages/test_families.py runs the MXFP4 checkpoint)."""
    model = unquantised_dir
    if path == "gguf-unquantised":       # float experts: written as F32, not MXFP4
        model = convert(unquantised_dir, str(tmp_path / "float.gguf"), "f32", progress=False)
        types = {t.name: t.tensor_type for t in gguf.GGUFReader(model).tensors}
        assert types["blk.0.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.F32
    result = run(open_model(model), prompt, prompt_logprobs=5)
    assert_prompt_logprobs_match(result, hf_logprobs(hf_model[1], prompt), TOL)


def _without_sinks(monkeypatch):
    attention = shared_attention.attention
    monkeypatch.setattr(shared_attention, "attention", lambda *a, sinks=None, **k: attention(*a, **k))


def _without_window(monkeypatch):
    monkeypatch.setattr(gptoss.GptOssConfig, "is_sliding", lambda self, layer: False)


def _without_yarn_attention_factor(monkeypatch):
    yarn = gptoss.yarn_inv_frequencies
    monkeypatch.setattr(gptoss, "yarn_inv_frequencies", lambda *a, **k: (yarn(*a, **k)[0], 1.0))


def _always_truncate(monkeypatch):
    yarn = gptoss.yarn_inv_frequencies
    monkeypatch.setattr(gptoss, "yarn_inv_frequencies",
                        lambda base, dim, factor, orig, fast, slow, truncate, attn: yarn(base, dim, factor, orig, fast,
                                                                                         slow, True, attn))


def _without_up_plus_one(monkeypatch):
    def swiglu(gate_up, alpha, limit):
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return up.clamp(min=-limit, max=limit) * (gate * torch.sigmoid(gate * alpha))
    monkeypatch.setattr(gptoss, "clamped_swiglu", swiglu)


WRONG = {"sinks": _without_sinks, "window": _without_window, "yarn_attention_factor": _without_yarn_attention_factor,
         "truncate": _always_truncate, "up_plus_one": _without_up_plus_one}


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_wrong_conventions_fail(hf_model, prompt, monkeypatch, wrong):
    """Negative controls: each gpt-oss feature, left out, breaks the match by far more than the tolerance."""
    files = open_model(hf_model[0])
    assert max_logprob_error(files, hf_model[1], prompt) < TOL
    WRONG[wrong](monkeypatch)
    assert max_logprob_error(open_model(hf_model[0]), hf_model[1], prompt) > 1e-2


def test_sliding_cache_memory_stays_flat(hf_model, prompt):
    """Sliding layers hold at most twice `window` positions (they drop the old ones when full) and their
    bytes stop growing; full layers keep all."""
    files = open_model(hf_model[0])
    window = files.config.sliding_window
    engine = LocalEngine(files)
    engine.eos_ids = set()
    seq = engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0))
    stage = engine.stages[0]
    sliding_bytes = set()
    while engine.has_work():
        engine.step()
        caches = stage.caches.get(seq.seq_id)
        if caches is None:          # finished and released
            break
        for layer in stage.layers:
            cache = caches[layer.index]
            if files.config.is_sliding(layer.index):
                assert cache.length <= cache.k.shape[0] <= max(2 * window, 16)
                sliding_bytes.add(cache.nbytes())
            else:
                assert cache.length == seq.n_cached
    assert len(sliding_bytes) == 1 and seq.n_cached > PROMPT_LEN + 30


def test_mxfp4_repack_is_exact():
    """HF MXFP4 (interleaved nibbles, separate scales) -> GGML MXFP4 blocks: gguf-py and our dequantiser
    read back exactly what transformers computes from the checkpoint, every scale byte included."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks, _ = random_mxfp4(g, 2, 6, 64)
    scales = torch.randint(0, 255, (2, 6, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)   # [E, rows, cols]
    ours = mxfp4_dequantize(blocks, scales)
    assert torch.equal(ours, hf) and torch.equal(ours, mxfp4_to_float(blocks, scales))
    raw = mxfp4_to_ggml(blocks, scales)
    assert raw.shape == (2, 6, 2 * 17) and raw.dtype == np.uint8
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(ref, hf.numpy()) and torch.equal(dequantize(raw, gguf.GGMLQuantizationType.MXFP4), hf)


def test_an_expert_slice_of_the_checkpoint_holds_those_experts(hf_model):
    """What an expert actor reads of the MXFP4 checkpoint (a slice of the experts) is those experts' GGML bytes."""
    source = open_model(hf_model[0]).source
    whole, kind = source.raw("blk.1.ffn_down_exps.weight")
    part, part_kind = source.raw("blk.1.ffn_down_exps.weight", range(2, 5))
    assert kind == part_kind == gguf.GGMLQuantizationType.MXFP4 and torch.equal(part, whole[2:5])


def test_converted_gguf_layout(hf_model, gguf_path):
    reader = gguf.GGUFReader(gguf_path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        assert types[f"blk.0.{name}.weight"] == gguf.GGMLQuantizationType.MXFP4
        assert types[f"blk.0.{name}.bias"] == gguf.GGMLQuantizationType.F32
    assert "blk.0.attn_sinks.weight" in types and "blk.3.attn_output.bias" in types
    hf_cfg, gguf_cfg = open_model(hf_model[0]).config, open_model(gguf_path).config
    assert gguf_cfg.sliding_layers == hf_cfg.sliding_layers == [True, False, True, False]
    assert (gguf_cfg.sliding_window, gguf_cfg.rope_scaling, gguf_cfg.rope_truncate) == (8, "yarn", False)
    assert gguf_cfg.rope_factor == 32.0 and gguf_cfg.rope_original_context == 4096


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}},
    {"rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "original_max_position_embeddings": 4096, "truncate": False}},
    {"rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 16.0,
                                            "original_max_position_embeddings": 1024}},          # truncate absent
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "attention_factor": 1.1,
                         "original_max_position_embeddings": 512, "truncate": True}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},                          # plain RoPE
    {"rope_theta": 20000.0},                                                 # no block: gpt-oss's YaRN default
])
def test_rope_parameters_as_transformers_reads_them(tmp_path, rope):
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 32,
              "num_local_experts": 4, "num_experts_per_tok": 2, **rope}
    json.dump(config, open(tmp_path / "config.json", "w"))
    rotary = GptOssRotaryEmbedding(AutoConfig.from_pretrained(str(tmp_path)))
    inv_freq, scale = gptoss.config_from_hf(config, "test").rope_tables()
    assert torch.equal(inv_freq, rotary.inv_freq) and scale == rotary.attention_scaling


def test_tokenizer_and_harmony_template_from_both_formats(hf_model, gguf_path):
    hf_tok, gguf_tok = open_model(hf_model[0]).tokenizer, open_model(gguf_path).tokenizer
    text = "<|start|>user<|message|>Hello, world! I'LL don't 12345 naïve<|end|><|start|>assistant"
    assert hf_tok.encode(text) == gguf_tok.encode(text)
    assert hf_tok.encode("<|start|>") == [hf_tok.token_to_id("<|start|>")]
    assert hf_tok.chat_template == gguf_tok.chat_template and "<|channel|>" in gguf_tok.chat_template
    messages = [{"role": "user", "content": "Write a haiku."}]
    rendered = render_chat(gguf_tok.chat_template, messages)
    assert rendered == "<|start|>user<|message|>Write a haiku.<|end|><|start|>assistant"
    assert gguf_tok.token_to_id("<|return|>") in gguf_tok.eos_token_ids


def test_embedded_model_runs():
    tiny = open_model("tiny-gptoss")
    assert tiny.family is gptoss.FAMILY and tiny.path.endswith(".gguf")
    assert tiny.source.tensors["blk.0.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.MXFP4
    out = run(tiny, tiny.tokenizer.encode("Hello, my name is"), max_tokens=8)
    assert len(out["token_ids"]) >= 1
