"""The family contract (stages/families/contract.py, docs/families.md), for every family in the registry: each loads from
HF safetensors and from the GGUF deploy.convert writes, and computes in float32 what transformers' model
computes; prefilling in chunks and splitting the layers into stages leave the results as they are; and the
converted file is laid out as llama.cpp lays it out (gguf-py's tensor names for the architecture, and
llama.cpp itself, where it is installed, reads it and computes the same within its f16 cache's error)."""
import dataclasses

import gguf
import pytest
import torch

from hf_models import ORACLES, assert_greedy_matches, assert_prompt_logprobs_match, hf_logprobs, run_one as run
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.families.registry import families, find_family
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.runtime.scheduler import Scheduler

FAMILIES = sorted(ORACLES)
TOL = 1e-4
# A one-row product and a many-row product round differently (~2e-6 relative on one projection, measured);
# the recurrent and chunked delta rules differ as much again, and eight random layers amplify that to ~2e-4
# on a logprob.
CHUNKED_TOL = {"gptoss": TOL, "qwen35moe": 5e-4, "qwen3next": 5e-4}


def source(oracle, path):
    return oracle.dir if path == "hf" else oracle.gguf


def test_one_registry_and_an_oracle_for_every_family(oracle):
    """Every family is found by its GGUF architecture and by each HF model_type (no key twice), and each has
    a transformers oracle here: a family added to the registry without one fails this test."""
    archs = [f.arch for f in families()]
    hf_types = [t for f in families() for t in f.hf_model_types]
    assert len(set(archs)) == len(archs) and len(set(hf_types)) == len(hf_types)
    for family in families():
        assert find_family("x", gguf_arch=family.arch) is family
        assert all(find_family("x", hf_model_type=t) is family for t in family.hf_model_types)
    opened = {name: (open_model(oracle(name).dir).family, open_model(oracle(name).gguf).family) for name in FAMILIES}
    assert all(hf is g for hf, g in opened.values())
    assert sorted(f.arch for f, _ in opened.values()) == sorted(archs)


@pytest.mark.parametrize("path", ["hf", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_match_transformers(oracle, family, path):
    o = oracle(family)
    result = run(open_model(source(o, path)), o.prompt, prompt_logprobs=5)
    assert_prompt_logprobs_match(result, hf_logprobs(o.model, o.prompt), TOL)


@pytest.mark.parametrize("path", ["hf", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_transformers(oracle, family, path):
    o = oracle(family)
    assert_greedy_matches(open_model(source(o, path)), o.model, o.prompt[:20])


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_chunks_equals_the_whole_prompt(oracle, family):
    """One token per step (every cache read, DeltaNet's recurrent form), then chunks shorter and longer than
    gpt-oss's window (8) and the chunked delta rule's threshold (16), continuing from carried state."""
    o = oracle(family)
    files = open_model(o.dir)
    full = run(files, o.prompt, prompt_logprobs=3, max_tokens=4)
    for chunk in (1, 5, 13, 23):
        other = run(files, o.prompt, scheduler=Scheduler(prefill_chunk=chunk), prompt_logprobs=3, max_tokens=4)
        a, b = (torch.tensor([e["logprob"] for e in r["prompt_logprobs"][1:]]) for r in (full, other))
        assert torch.allclose(a, b, atol=CHUNKED_TOL[family], rtol=0), (chunk, (a - b).abs().max())
        assert other["token_ids"] == full["token_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_stages_compute_the_same_and_hold_only_their_layers(oracle, family):
    o = oracle(family)
    files = open_model(o.gguf)
    whole, split = LocalEngine(files, n_stages=1), LocalEngine(files, n_stages=2)
    a, b = whole.stages, split.stages
    assert sum(s.parameter_bytes() for s in b) == a[0].parameter_bytes()
    assert all(s.parameter_bytes() < 0.7 * a[0].parameter_bytes() for s in b)
    results = []
    for engine in (whole, split):
        seq = engine.add_request("r", o.prompt, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1))
        engine.run_until_done()
        results.append(seq.result())
    assert results[0] == results[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_file_has_llama_cpp_names_and_the_same_config(oracle, family):
    """Every tensor is one gguf-py names for the architecture, and the file reads back the HF config
    (floats as GGUF's float32 holds them)."""
    o = oracle(family)
    hf, converted = open_model(o.dir), open_model(o.gguf)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == converted.family.arch)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    names = {t.name.rsplit(".", 1)[0] if t.name.endswith((".weight", ".bias")) else t.name
             for t in gguf.GGUFReader(o.gguf).tensors}
    assert names <= {k.format(bid=i) for k in known for i in range(hf.n_layers)}
    for field in dataclasses.fields(hf.config):
        ours, theirs = getattr(converted.config, field.name), getattr(hf.config, field.name)
        assert ours == (pytest.approx(theirs, rel=1e-6) if isinstance(theirs, float) else theirs), field.name


# gpt-oss is left out: llama.cpp quantises the activations of its MXFP4 products to 8 bits and rounds YaRN's
# correction range (docs/model-formats.md §4, §5), far more than the tolerance below on this oracle.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gptoss"])
def test_llama_cpp_computes_the_same_from_the_converted_file(oracle, family):
    """llama.cpp reads the file as its own architecture: its logprobs are transformers' to within what its
    f16 KV cache and f16 activations in places cost (measured: 3.4e-3 at most here)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp is a benchmark extra (pip install -e .[bench])")
    import numpy as np

    o = oracle(family)
    prompt = o.prompt[:40]
    llm = llama_cpp.Llama(o.gguf, n_ctx=64, n_batch=64, logits_all=True, n_threads=1, verbose=False)
    llm.eval(prompt)
    ours = torch.log_softmax(torch.tensor(np.array(llm.scores[:len(prompt)])), -1)
    assert (ours - hf_logprobs(o.model, prompt)).abs().max() < 1e-2


@pytest.mark.parametrize("arch, kind", [("qwen35moe", "q8_0"), ("gptoss", "f32")])      # gpt-oss: MXFP4 experts
@pytest.mark.parametrize("mode", ["auto", "float32"])
def test_decode_token_moe_in_one_call_keeps_every_bit(tmp_path, monkeypatch, arch, kind, mode):
    """A file with GGML-block experts runs each MoE layer of a batch-1 decode step after its router in one call
    (blocks.TokenMoE, moe_token_op's CPU call: the routed experts' gate/up products, activation and down products
    with their biases, the shared expert, the weighted sum); the tokens and logprobs are those of the separate
    calls, bit for bit."""
    from raymoe.kernels import blocks
    from raymoe.stages.layers import moe
    from raymoe.tools.make_tiny import make_tiny
    path = make_tiny(arch, str(tmp_path), gguf_type=kind)
    prompt = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    monkeypatch.setattr(moe.MoE, "token_ffn", lambda self, norm, eps: None)     # the MoE call itself, from Python
    calls = []
    one_call = blocks.TokenMoE.__call__
    monkeypatch.setattr(blocks.TokenMoE, "__call__", lambda *args: calls.append(1) or one_call(*args))
    fused = run(open_model(path), prompt, mode=mode, max_tokens=8, logprobs=3)
    n = len(calls)
    assert n >= 7 * open_model(path).n_layers         # every layer of every decode step
    monkeypatch.setattr(moe.MoE, "_token_call", lambda self: None)
    separate = run(open_model(path), prompt, mode=mode, max_tokens=8, logprobs=3)
    assert len(calls) == n and fused == separate


@pytest.mark.parametrize("arch, kind", [("qwen35moe", "q8_0"), ("qwen35moe", "f32"), ("gptoss", "f32")])
@pytest.mark.parametrize("mode", ["auto", "float32"])
def test_decode_token_layers_in_c_calls_keep_every_bit(tmp_path, monkeypatch, arch, kind, mode):
    """A batch-1 decode step runs each layer in two C calls (kernels/token_calls.py): its mixer (TokenDeltaNet: the
    input RMSNorm, the projections, the DeltaNet step, the out projection, the residual sum; TokenAttention: the
    input RMSNorm, the q/k/v product, q/k norms, RoPE, the cache's new row, attention with its window and sinks,
    Qwen's output gate, the out product, the residual sum) and its feed-forward where the experts are GGML blocks
    (TokenFFN: the post-attention RMSNorm, the router's product, the routing in C, the experts, the residual sum);
    the tokens and logprobs are those of the separate calls, bit for bit, greedy and sampled."""
    from raymoe.kernels import token_calls
    from raymoe.stages.layers import block as family
    from raymoe.stages.layers.deltanet import DeltaNetSpec
    from raymoe.tools.make_tiny import make_tiny
    path = make_tiny(arch, str(tmp_path), gguf_type=kind)
    # 24 prompt tokens: gpt-oss's sliding layers (a window of 16) mask and trim keys while it decodes
    prompt = torch.randint(0, 500, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    calls = {"ffn": 0, "deltanet": 0, "attention": 0}
    for name, cls in (("ffn", token_calls.TokenFFN), ("deltanet", token_calls.TokenDeltaNet),
                      ("attention", token_calls.TokenAttention)):
        def counted(*args, name=name, call=cls.__call__):
            calls[name] += 1
            return call(*args)
        monkeypatch.setattr(cls, "__call__", counted)
    files = open_model(path)
    fused = [run(files, prompt, mode=mode, max_tokens=8, logprobs=3, temperature=t, seed=7) for t in (0, 1)]
    steps = 2 * 7         # decode steps: each request's tokens after its first
    deltanet_layers = sum(isinstance(files.family.layer_mixer(files.config, i), DeltaNetSpec)
                          for i in range(files.n_layers))
    assert calls["deltanet"] >= steps * deltanet_layers and (deltanet_layers > 0) == (arch == "qwen35moe")
    assert calls["attention"] >= steps * (files.n_layers - deltanet_layers)
    assert calls["ffn"] >= (steps * files.n_layers if kind == "q8_0" or arch == "gptoss" else 0)
    counted_calls = dict(calls)
    monkeypatch.setattr(family.Block, "_token_calls", lambda self, x: (None, None))
    separate = [run(files, prompt, mode=mode, max_tokens=8, logprobs=3, temperature=t, seed=7) for t in (0, 1)]
    assert calls == counted_calls and fused == separate


@pytest.mark.parametrize("arch, kind", [("qwen35moe", "q8_0"), ("gptoss", "f32")])
@pytest.mark.parametrize("mode", ["auto", "float32"])
def test_decode_steps_of_several_sequences_in_c_calls_keep_every_bit(tmp_path, monkeypatch, arch, kind, mode):
    """Decode steps of 2 to 5 sequences (prompts of different lengths, so each attention reads a cache of its own
    length; gpt-oss's window crossed) run each layer in the same two C calls, n rows each: the feed-forward sorts
    the tokens' experts as the separate calls do and reads each expert once for its tokens. Every token and
    logprob of every sequence equals the separate calls', greedy and sampled."""
    from raymoe.kernels import token_calls
    from raymoe.stages.layers import block as family
    from raymoe.tools.make_tiny import make_tiny
    path = make_tiny(arch, str(tmp_path), gguf_type=kind)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 24, 11, 17, 6)]
    rows = []
    for cls in (token_calls.TokenFFN, token_calls.TokenDeltaNet, token_calls.TokenAttention):
        def counted(self, x, *args, call=cls.__call__):
            rows.append(x.shape[0])
            return call(self, x, *args)
        monkeypatch.setattr(cls, "__call__", counted)

    def batch() -> list[dict]:
        engine = LocalEngine(open_model(path), mode=mode)
        seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=4 + 2 * i, temperature=i % 2, seed=i,
                                                             logprobs=3)) for i, p in enumerate(prompts)]
        engine.run_until_done()
        return [s.result() for s in seqs]

    fused = batch()
    assert max(rows) == len(prompts) and {2, 3, 4} <= set(rows)       # sequences finish one after another
    monkeypatch.setattr(family.Block, "_token_calls", lambda self, x: (None, None))
    count = len(rows)
    assert batch() == fused and len(rows) == count


@pytest.mark.parametrize("arch", ["qwen35moe", "gptoss"])
def test_tied_router_scores_take_the_separate_calls(tmp_path, monkeypatch, arch):
    """Every expert's router row (and bias) made the first one's: every token's scores tie, which torch.topk orders its own
    way. The feed-forward's C call hands each step back (None) and the separate calls route it with torch: the
    tokens and logprobs are theirs, bit for bit, at one sequence and at three."""
    from raymoe.kernels import token_calls
    from raymoe.kernels.weights import ConcatWeight
    from raymoe.stages.layers import block as family
    from raymoe.tools.make_tiny import make_tiny
    path = make_tiny(arch, str(tmp_path), gguf_type="q8_0" if arch == "qwen35moe" else "f32")
    answers = []
    real_call = token_calls.TokenFFN.__call__
    monkeypatch.setattr(token_calls.TokenFFN, "__call__", lambda *args: answers.append(real_call(*args)))

    def generate() -> list[dict]:
        engine = LocalEngine(open_model(path), mode="auto")
        for layer in (layer for stage in engine.stages for layer in stage.layers):
            router = layer.ffn.inputs.parts[0] if isinstance(layer.ffn.inputs, ConcatWeight) else layer.ffn.inputs
            rows = router.t if hasattr(router, "t") else router.raw
            rows[1:] = rows[0]
            if layer.ffn.router_bias is not None:       # gpt-oss's
                layer.ffn.router_bias[1:] = layer.ffn.router_bias[0]
        seqs = [engine.add_request(str(i), list(range(20 + i, 29 + 2 * i)),
                                   SamplingParams(max_tokens=5, temperature=i % 2, seed=i, logprobs=2))
                for i in range(3)]
        engine.run_until_done()
        one = engine.add_request("alone", [7, 8, 9], SamplingParams(max_tokens=4, temperature=0, logprobs=2))
        engine.run_until_done()
        return [s.result() for s in seqs + [one]]

    fused = generate()
    assert len(answers) >= 3 * 4 + 3 and all(a is None for a in answers)
    monkeypatch.setattr(family.Block, "_token_calls", lambda self, x: (None, None))
    assert generate() == fused
