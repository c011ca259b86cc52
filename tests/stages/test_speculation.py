"""Speculative decoding (stages/runtime/speculation.py): a verify chunk's rows have the logits decode steps give
them, the caches settle back to the kept rows, greedy outputs are those without drafts at every stage split and
in every mode, and sampling keeps the model's distribution."""
import pytest
import torch

from raymoe.stages.errors import RaymoeError
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.batch import StepBatch
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.runtime.sampler import ChunkSampling, sample_chunks, token_probs
from raymoe.stages.runtime.speculation import (MAX_DRAFTS, PROBE_EVERY, NgramIndex, SpeculativeConfig, Speculation,
                                               SequenceSpeculation)
from raymoe.stages.runtime.sequence import Sequence
from raymoe.stages.runtime.stage import Stage
from raymoe.stages.text.sampling_params import SamplingParams
from thread_runs import full_width

NGRAM = SpeculativeConfig(num_speculative_tokens=4)


# ---- the setting -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ("{", "not JSON"),
    ("[1]", "expected a JSON object"),
    ('{"method": "eagle"}', "method 'eagle' is not supported"),
    ('{"method": "mtp", "prompt_lookup_max": 3}', "unknown field 'prompt_lookup_max' for method 'mtp'"),
    ('{"method": "mtp", "model": 3}', "model must be the path"),
    ('{"model": "x.gguf"}', "unknown field 'model' for method 'ngram'"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"num_speculative_tokens": true}', "must be a positive integer"),
    ('{"num_speculative_tokens": 99}', f"more than {MAX_DRAFTS}"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min is more than prompt_lookup_max"),
    ('{"draft_model": "x"}', "unknown field 'draft_model'"),
])
def test_bad_speculative_configs_are_refused_in_one_line(value, message):
    with pytest.raises(RaymoeError, match=message) as e:
        SpeculativeConfig.parse(value)
    assert "\n" not in str(e.value) and str(e.value).startswith("--speculative-config")


def test_speculative_config_reads_vllms_fields():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert config == SpeculativeConfig("ngram", 5, 3, 1)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}) == config
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None


# ---- the n-gram drafter ---------------------------------------------------------------------------------------------
def test_ngram_lookup_takes_the_longest_latest_match_and_continues_loops():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    assert index.follow(2) == [9, 2]            # "6 7" last followed by 9 (latest occurrence)
    index.extend([8])
    assert index.follow(3) == [1, 6, 7]         # "6 7 8" occurred once: what followed it
    index = NgramIndex(1, 4)
    index.extend([4, 1, 2, 1, 2, 1, 2])
    assert index.follow(5) == [1, 2, 1, 2, 1]   # a loop of two tokens goes on past its end
    unseen, short = NgramIndex(1, 4), NgramIndex(2, 2)
    unseen.extend([3])
    short.extend([1, 2])
    assert unseen.follow(2) == [] and short.follow(1) == []


def test_draft_length_follows_measured_costs_and_acceptance():
    spec = Speculation(NGRAM)
    assert spec.length(0.9, 0, 4) == 0          # a step without drafts is measured first
    spec.observe(1, 0.010)
    assert spec.length(0.9, 0, 4) == 4          # untried lengths cost what a plain step does: the longest is tried
    spec.observe(5, 0.040)                      # four drafts cost four steps (a CPU step that reads 4x the experts)
    assert spec.length(0.5, 0, 4) == 3          # untried 2-4 rows are taken to cost what 1 row does
    spec.observe(2, 0.025)
    spec.observe(3, 0.032)
    spec.observe(4, 0.036)
    assert spec.length(0.5, 0, 4) == 0           # a draft at 50% never pays for its rows here
    assert spec.length(0.99, 0, 4) == 4          # one accepted nearly always does


def test_a_sequence_whose_drafts_never_pay_stops_drafting_and_probes_again():
    spec = Speculation(NGRAM)
    spec.observe(1, 0.010)
    spec.observe(2, 0.030)
    seq = Sequence(0, "r", [1, 2, 1, 2, 1, 2], SamplingParams(temperature=0, max_tokens=1000), None, set(), 4096)
    seq.spec = SequenceSpeculation()
    seq.spec.acceptance = 0.1
    drafted = [len(spec.drafts(seq, 0)) for _ in range(2 * PROBE_EVERY)]
    assert drafted.count(0) >= 2 * PROBE_EVERY - 2 and 1 in drafted       # it tries one draft now and then


# ---- the verify chunk's bits and the caches' rollback ------------------------------------------------------------------
def verify_like_decode(path: str, mode: str, steps: int = 24, seed: int = 0):
    """Decode a greedy sequence step by step on one stage; on another, verify drafts of it (some wrong) and go on from
    the tokens kept: every row a kept draft's input reaches has the decode step's logits, bit for bit."""
    model = open_model(path)
    plain, spec = (Stage(model, range(model.n_layers), mode) for _ in range(2))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 1000, (9,), generator=g).tolist()
    for stage in (plain, spec):
        stage.forward(StepBatch(seq_ids=[0], start_pos=[0], lengths=[len(prompt)], token_ids=prompt,
                                logit_rows=[len(prompt) - 1]))
    tokens, logits = [prompt[-1]], []       # the input at each position from len(prompt) - 1, and its logits
    for step in range(steps + MAX_DRAFTS + 1):
        row = plain.forward(StepBatch(seq_ids=[0], start_pos=[len(prompt) - 1 + step], lengths=[1],
                                      token_ids=[tokens[-1]], logit_rows=[0]))[0]
        logits.append(row)
        tokens.append(int(torch.argmax(row)))
    at, rejected = 0, 0
    while at < steps:
        k = int(torch.randint(1, MAX_DRAFTS + 1, (1,), generator=g))
        drafts = tokens[at + 1:at + 1 + k]
        wrong = int(torch.randint(0, 2 * k, (1,), generator=g))     # about half the chunks have a wrong draft
        if wrong < k:
            drafts[wrong] = (drafts[wrong] + 1) % 1000
        out = spec.forward(StepBatch(seq_ids=[0], start_pos=[len(prompt) - 1 + at], lengths=[k + 1],
                                     token_ids=[tokens[at]] + drafts, logit_rows=list(range(k + 1)), drafts=[k]))
        kept = wrong + 1 if wrong < k else k + 1        # rows whose inputs were right
        for j in range(kept):
            assert torch.equal(out[j], logits[at + j]), (mode, at, j)
        rejected += kept <= k
        at += kept
    assert rejected >= 2


@pytest.mark.parametrize("mode", ["auto", "float32", "int8"])
@pytest.mark.parametrize("model", ["tiny-qwen35moe", "tiny-gptoss"])
def test_verify_chunks_have_the_bits_of_decode_steps(model, mode):
    verify_like_decode(model, mode, steps=24 if model == "tiny-qwen35moe" else 150)      # past gpt-oss's window


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3.5-35b-a3b", "gpt-oss-20b"])
def test_verify_chunks_of_full_width_layers_have_the_bits_of_decode_steps(model, tmp_path):
    path = full_width(model, tmp_path / "model.gguf")
    for mode in ("auto", "float32"):
        verify_like_decode(path, mode, steps=12)


# ---- whole engines --------------------------------------------------------------------------------------------------
PROMPTS = ["1 2 3 1 2 3 1 2 3 1 2", "the cat sat on the mat and the cat sat on the", "hello world"]


def generate(model, speculation, mode="float32", n_stages=1, **params):
    engine = LocalEngine(model, n_stages=n_stages, mode=mode, speculation=speculation)
    out = {}
    for i, text in enumerate(PROMPTS):
        engine.add_request(i, model.tokenizer.encode(text), SamplingParams(**params))
    engine.run_until_done(lambda s: out.__setitem__(s.request_id, s.result()))
    return out, engine


@pytest.mark.parametrize("mode", ["auto", "float32"])
@pytest.mark.parametrize("model_name", ["tiny-qwen35moe", "tiny-gptoss"])
def test_greedy_outputs_are_the_same_with_drafts_at_every_split(model_name, mode):
    model = open_model(model_name)
    params = dict(temperature=0, max_tokens=80, ignore_eos=True, logprobs=2)
    plain, _ = generate(model, None, mode, **params)
    for n_stages in (1, 2, 4):
        spec, engine = generate(model, NGRAM, mode, n_stages, **params)
        for i, result in plain.items():
            assert spec[i]["token_ids"] == result["token_ids"], (n_stages, i)
            assert spec[i]["logprobs"] == result["logprobs"], (n_stages, i)     # the logits' bits, row by row
            assert spec[i]["text"] == result["text"]
        load = engine.speculation.load()
        assert 0 < load["accepted_tokens"] < load["draft_tokens"], load
        assert sum(r["usage"].get("speculation", {}).get("accepted_tokens", 0) for r in spec.values()) == \
            load["accepted_tokens"]


def test_a_stop_inside_the_accepted_drafts_ends_the_sequence_there():
    model = open_model("tiny-qwen35moe")
    plain, _ = generate(model, None, temperature=0, max_tokens=80, ignore_eos=True)
    text = plain[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    for max_tokens in (37, 80):
        want, _ = generate(model, None, temperature=0, max_tokens=max_tokens, stop=[stop])
        got, engine = generate(model, NGRAM, temperature=0, max_tokens=max_tokens, stop=[stop])
        assert engine.speculation.load()["accepted_tokens"] > 0
        for i in want:
            assert (got[i]["text"], got[i]["finish_reason"]) == (want[i]["text"], want[i]["finish_reason"])
            assert len(got[i]["token_ids"]) <= max_tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=4), SamplingParams(temperature=1.0, top_p=0.8)])
def test_verify_sampling_draws_from_the_models_distribution(params):
    """Over many seeds, the first token is drawn from row 0's distribution, and after a kept draft the next from row
    1's, whatever the draft; a draft is kept with its probability."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 1.0, -0.5, 0.3]])
    want = [token_probs(row, params) / token_probs(row, params).sum() for row in logits]
    n = 6000
    for draft in (0, 2):
        first, second = torch.zeros(5), torch.zeros(5)
        for seed in range(n):
            c = ChunkSampling(params=params, seed=seed, tip=0, drafts=[draft])
            tokens, _, _ = sample_chunks(logits, [c])[0]
            first[tokens[0]] += 1
            if tokens[0] == draft:
                second[tokens[1]] += 1
        assert (first / n - want[0]).abs().sum() < 0.04, (draft, first / n, want[0])
        assert abs(first[draft] / n - want[0][draft]) < 0.02
        assert (second / second.sum() - want[1]).abs().sum() < 0.08, (draft, second / second.sum(), want[1])


def test_seeded_sampling_gives_the_same_tokens_with_drafts():
    """On the embedded model: each seeded request samples the tokens it samples without drafts, top-k and top-p too."""
    model = open_model("tiny-qwen35moe")
    prompt = model.tokenizer.encode("1 2 3 1 2 3 1 2 3 1 2 3 1 2")
    outputs = []
    for speculation in (None, SpeculativeConfig(num_speculative_tokens=3)):
        engine = LocalEngine(model, mode="float32", speculation=speculation)
        seen: dict = {}
        for first in range(0, 40, 4):      # a few at a time: a step drafts while its decode rows stay few
            for seed in range(first, first + 4):
                engine.add_request(seed, prompt, SamplingParams(temperature=0.7, seed=seed, max_tokens=12,
                                                                top_k=20 if seed % 2 else 0, top_p=0.9,
                                                                ignore_eos=True))
            engine.run_until_done(lambda s: seen.__setitem__(s.request_id, s.output_ids))
        outputs.append(seen)
    assert outputs[0] == outputs[1]
    load = engine.speculation.load()
    assert 0 < load["accepted_tokens"] < load["draft_tokens"]


def test_drafts_with_the_prefix_cache():
    """Prompts that share a preamble start from cached blocks; their drafts' rows never reach the cache, and the
    outputs are those of an engine with neither."""
    from raymoe.stages.runtime.scheduler import Scheduler
    model = open_model("tiny-qwen35moe")
    preamble = "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 "
    prompts = [preamble + "the cat sat", preamble + "the cat sat on the mat", preamble + "hello"]

    def run(speculation, cache_bytes):
        engine = LocalEngine(model, mode="float32", scheduler=Scheduler(max_batch_tokens=64, prefill_chunk=16),
                             prefix_cache_bytes=cache_bytes, speculation=speculation)
        out = {}
        for i, text in enumerate(prompts):      # one after another: each later one finds the blocks cached
            engine.add_request(i, model.tokenizer.encode(text), SamplingParams(temperature=0, max_tokens=40,
                                                                               ignore_eos=True))
            engine.run_until_done(lambda s: out.__setitem__(s.request_id, s.output_ids))
        return out, engine

    want, _ = run(None, 0)
    got, engine = run(NGRAM, 1 << 26)
    assert got == want
    assert engine.prefix.load()["hit_tokens"] > 0 and engine.speculation.load()["accepted_tokens"] > 0
