"""qwen3next against transformers' Qwen3NextForCausalLM in float32 (docs/model-formats.md §7): what is particular
to this family; tests/stages/test_families.py runs what every family must do (HF and GGUF against transformers,
chunked prefill, stage splits, llama.cpp's names)."""
import json
import os

import gguf
import pytest
import torch

from hf_models import hf_logprobs, run_one as run
from raymoe.stages.layers import deltanet
from raymoe.stages.families import qwen3next, qwen3next_hf
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.loader import open_model

TOL = 1e-4


@pytest.fixture(scope="module")
def o(oracle):
    return oracle("qwen3next")


def max_logprob_error(path, o):
    result = run(open_model(path), o.prompt, prompt_logprobs=0)
    ours = torch.tensor([e["logprob"] for e in result["prompt_logprobs"][1:]])
    ref = hf_logprobs(o.model, o.prompt)
    return (ours - ref[torch.arange(len(o.prompt) - 1), torch.tensor(o.prompt[1:])]).abs().max().item()


def test_converted_deltanet_tensors_hold_what_transformers_reads(o):
    """llama.cpp's layout, checked against transformers' own reading of the fused projections
    (`fix_query_key_value_ordering`): attn_qkv gives every q, k and v (V heads grouped, as HF has them),
    attn_gate every z, ssm_ba per K head its b then a; ssm_norm keeps HF's weight, the other norms get +1."""
    cfg = o.model.config
    assert cfg.linear_num_value_heads // cfg.linear_num_key_heads == 3       # grouped and tiled orders differ
    tensors = {t.name: torch.tensor(t.data.copy()) for t in gguf.GGUFReader(o.gguf).tensors}
    assert not {n for n in tensors if n.startswith("blk.0.") and n.split(".")[2] in ("ssm_in", "ssm_beta", "ssm_alpha")}
    layer = o.model.model.layers[0]
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        q, k, v, z, b, a = layer.linear_attn.fix_query_key_value_ordering(layer.linear_attn.in_proj_qkvz(x),
                                                                          layer.linear_attn.in_proj_ba(x))
    qkv, gate, ba = (x @ tensors[f"blk.0.{n}.weight"].T for n in ("attn_qkv", "attn_gate", "ssm_ba"))
    assert torch.allclose(qkv, torch.cat([t.reshape(1, 3, -1) for t in (q, k, v)], -1), atol=1e-6)
    assert torch.allclose(gate, z.reshape(1, 3, -1), atol=1e-6)
    nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    ba = ba.reshape(1, 3, nk, 2, r)
    assert torch.allclose(ba[..., 0, :].reshape(1, 3, -1), b, atol=1e-6)
    assert torch.allclose(ba[..., 1, :].reshape(1, 3, -1), a, atol=1e-6)
    assert torch.equal(tensors["blk.0.ssm_norm.weight"], layer.linear_attn.norm.weight.detach())
    assert torch.equal(tensors["blk.0.attn_norm.weight"], layer.input_layernorm.weight.detach() + 1)
    assert torch.equal(tensors["blk.0.ssm_a"], -torch.exp(layer.linear_attn.A_log.detach()))


def _v_heads_tiled(monkeypatch):
    n = lambda n_k, r, d: torch.arange(n_k * r * d)     # noqa: E731
    monkeypatch.setattr(deltanet, "tiled_from_grouped", n)


def _qkvz_split_whole(monkeypatch):
    def split(self, t):
        c = self.cfg
        q, k, v, z = t.split([c.k_head_dim * c.n_k_heads] * 2 + [c.v_head_dim * c.n_v_heads] * 2)
        return torch.cat((q, k, v)), z
    monkeypatch.setattr(qwen3next_hf.Qwen3NextHFWeights, "_split_qkvz", split)


def _ba_split_whole(monkeypatch):
    order = deltanet.DeltaNetSpec.input_order

    def whole(spec):        # beta and alpha read as [every b | every a]
        idx = order(spec)
        n = spec.n_v_heads
        start = len(idx) - 2 * n
        tiled = deltanet.tiled_from_grouped(spec.n_k_heads, n // spec.n_k_heads, 1)
        idx[start:] = torch.cat((start + tiled, start + n + tiled))
        return idx
    monkeypatch.setattr(deltanet.DeltaNetSpec, "input_order", whole)


def _ssm_norm_plus_one(monkeypatch):
    get = qwen3next_hf.Qwen3NextHFWeights.get
    monkeypatch.setattr(qwen3next_hf.Qwen3NextHFWeights, "get",
                        lambda self, name: get(self, name) + (1 if name.endswith("ssm_norm.weight") else 0))


WRONG = {"v_heads_tiled": _v_heads_tiled, "qkvz_split_whole": _qkvz_split_whole, "ba_split_whole": _ba_split_whole,
         "ssm_norm_plus_one": _ssm_norm_plus_one}


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_wrong_conventions_fail(o, monkeypatch, wrong):
    """Negative controls: each Qwen3-Next difference from Qwen3.5-MoE, got wrong, breaks the match."""
    assert max_logprob_error(o.dir, o) < TOL
    WRONG[wrong](monkeypatch)
    assert max_logprob_error(o.dir, o) > 1e-2


@pytest.mark.parametrize("change, message", [
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "unsupported rope_type 'yarn'"),
])
def test_options_llama_cpp_lacks_are_refused(o, change, message):
    config = {**json.load(open(os.path.join(o.dir, "config.json"))), **change}
    with pytest.raises(ModelFormatError, match=message):
        qwen3next.config_from_hf(config, "test")


def test_released_v4_config_spelling(o):
    """The released config.json (transformers v4): rope_theta and partial_rotary_factor beside the rest,
    full_attention_interval instead of layer_types."""
    config = json.load(open(os.path.join(o.dir, "config.json")))
    v4 = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    v4.update(rope_theta=10000.0, partial_rotary_factor=0.5, rope_scaling=None, full_attention_interval=4)
    assert qwen3next.config_from_hf(v4, "v4") == qwen3next.config_from_hf(config, "v5")
