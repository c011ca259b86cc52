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
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.text.sampling_params import SamplingParams

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
    ({"mlp_only_layers": "1"}, "mlp_only_layers must be a list of layer indices below 8"),     # bad values
    ({"mlp_only_layers": [9]}, "mlp_only_layers must be a list of layer indices below 8"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "unsupported rope_type 'yarn'"),
])
def test_options_llama_cpp_lacks_are_refused(o, change, message):
    config = {**json.load(open(os.path.join(o.dir, "config.json"))), **change}
    with pytest.raises(ModelFormatError, match=message):
        qwen3next.config_from_hf(config, "test")


def test_dense_layers_match_transformers(tmp_path, o):
    """mlp_only_layers and decoder_sparse_step make some layers dense (a SwiGLU feed-forward of
    intermediate_size): layer 0 listed, layers 2, 4 and 6 by a sparse step of 2. The checkpoint and its GGUF
    conversion (dense layers in raymoe's keys, llama.cpp's ffn_gate/up/down names) match transformers, at
    one stage and at two."""
    from hf_models import make_qwen3next
    from raymoe.deploy.convert import convert
    from raymoe.tools.tiny_tokenizer import build_tiny_tokenizer

    d = str(tmp_path / "dense")
    build_tiny_tokenizer(d, "qwen3next")
    model = make_qwen3next(d, seed=3, vocab_size=o.model.config.vocab_size, mlp_only_layers=[0],
                           decoder_sparse_step=2, intermediate_size=40)
    dense = [i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts")]
    assert dense == [0, 2, 4, 6]
    path = convert(d, str(tmp_path / "dense.gguf"), "f32", progress=False)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    assert "blk.1.ffn_gate_exps.weight" in names and "blk.1.ffn_gate.weight" not in names
    for source in (d, path):
        files = open_model(source)
        assert files.config.dense_layers == (0, 2, 4, 6) and files.config.dense_ff == 40
        ref = hf_logprobs(model, o.prompt)[torch.arange(len(o.prompt) - 1), torch.tensor(o.prompt[1:])]
        for n_stages in (1, 2):
            engine = LocalEngine(files, n_stages, "float32")
            seq = engine.add_request("r", o.prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
            engine.run_until_done()
            ours = torch.tensor([e["logprob"] for e in seq.result()["prompt_logprobs"][1:]])
            assert (ours - ref).abs().max().item() < TOL, (source, n_stages)


def test_released_v4_config_spelling(o):
    """The released config.json (transformers v4): rope_theta and partial_rotary_factor beside the rest,
    full_attention_interval instead of layer_types."""
    config = json.load(open(os.path.join(o.dir, "config.json")))
    v4 = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    v4.update(rope_theta=10000.0, partial_rotary_factor=0.5, rope_scaling=None, full_attention_interval=4)
    assert qwen3next.config_from_hf(v4, "v4") == qwen3next.config_from_hf(config, "v5")
