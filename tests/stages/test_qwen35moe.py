"""qwen35moe against transformers' Qwen3_5MoeForCausalLM in float32 (docs/model-formats.md §3, §5): what is
particular to this family; tests/stages/test_families.py runs what every family must do."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import assert_greedy_matches, assert_prompt_logprobs_match, hf_logprobs, run_one as run
from raymoe.stages.families import qwen35moe_hf
from raymoe.stages.files.loader import open_model

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(oracle):
    o = oracle("qwen35moe")
    return o.dir, o.model


@pytest.fixture(scope="module")
def prompt(oracle):
    return oracle("qwen35moe").prompt


def test_torch_glue_matches_transformers(hf_model, prompt, monkeypatch):
    """Without the compiled DeltaNet kernels (no compiler) the torch operations compute the layers."""
    import raymoe.kernels.deltanet as dn
    monkeypatch.setattr(dn, "library", lambda: None)
    files = open_model(hf_model[0])
    assert_prompt_logprobs_match(run(files, prompt, prompt_logprobs=5), hf_logprobs(hf_model[1], prompt), TOL)
    assert_greedy_matches(files, hf_model[1], prompt[:20])


def max_logprob_error(files, model, prompt):
    result = run(files, prompt, prompt_logprobs=0)
    ref = hf_logprobs(model, prompt)
    ours = torch.tensor([e["logprob"] for e in result["prompt_logprobs"][1:]])
    return (ours - ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]).abs().max().item()


@pytest.mark.parametrize("wrong", ["v_head_order", "norm_plus_one", "scale_twice"])
def test_wrong_conventions_fail(hf_model, prompt, monkeypatch, wrong):
    """Negative controls: each easy-to-get-wrong convention, got wrong, breaks the match."""
    files = open_model(hf_model[0])
    assert max_logprob_error(files, hf_model[1], prompt) < TOL
    if wrong == "v_head_order":
        monkeypatch.setattr(qwen35moe_hf, "grouped_to_tiled", lambda t, n_k, n_v: t)
    elif wrong == "norm_plus_one":
        original = qwen35moe_hf.Qwen35MoeHFWeights._transform
        monkeypatch.setattr(qwen35moe_hf.Qwen35MoeHFWeights, "_transform",
                            lambda self, t, how: t if how == "plus_one" else original(self, t, how))
    else:
        import raymoe.kernels.deltanet as dn
        from raymoe.stages.layers import deltanet
        for name in ("delta_rule_chunked", "delta_rule_recurrent"):
            rule = getattr(dn, name)
            monkeypatch.setattr(deltanet, name, lambda q, k, v, g, b, s, _r=rule: _r(q * q.shape[-1] ** -0.5, k, v, g, b, s))
    assert max_logprob_error(open_model(hf_model[0]), hf_model[1], prompt) > 1e-2


def test_fused_experts_multimodal_and_sharded_layouts(hf_model, prompt, tmp_path):
    """The same weights as a released multimodal checkpoint: text_config, model.language_model.*,
    visual and MTP tensors to skip, fused experts, two shards with an index."""
    src, model = hf_model
    tensors = load_file(os.path.join(src, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    out = {}
    E = cfg["num_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        gate = torch.stack([tensors.pop(f"{p}{e}.gate_proj.weight") for e in range(E)])
        up = torch.stack([tensors.pop(f"{p}{e}.up_proj.weight") for e in range(E)])
        out[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat((gate, up), dim=1)
        out[f"model.language_model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
    for name, t in tensors.items():
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    out["mtp.fc.weight"] = torch.zeros(4, 4)
    names = sorted(out)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: out[k].contiguous() for k in keys}, str(tmp_path / fname))
    json.dump({"weight_map": {k: f for f, ks in shards.items() for k in ks}},
              open(tmp_path / "model.safetensors.index.json", "w"))
    json.dump({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": cfg}, open(tmp_path / "config.json", "w"))
    for f in os.listdir(src):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(src, f), tmp_path / f)
    assert max_logprob_error(open_model(str(tmp_path)), model, prompt) < TOL
