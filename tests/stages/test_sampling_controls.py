"""The OpenAI/vLLM sampling controls (docs/sampling.md): logit_bias, presence/frequency/repetition
penalties, min_p, stop_token_ids, the seeds of n choices and the model's sampling defaults. Each
transform on a logits row against values worked by hand; then through the in-process engine on the
embedded model against a reference computed from the model's raw logits."""
import json
import math

import pytest
import torch

from raymoe.stages.runtime.batch import StepBatch
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.errors import RequestError
from raymoe.stages.files.loader import open_model, sampling_defaults
from raymoe.stages.text.requests import sampling_params
from raymoe.stages.runtime.sampler import (ChunkSampling, adjust_logits, choice_seed, sample_chunks, sample_token,
                                           uniform)
from raymoe.stages.text.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams

MODEL = "tiny-qwen35moe"
PROMPT = [5, 6, 7, 8]


# ---- the transforms on one row ------------------------------------------------------------------

def test_logit_bias_adds_to_the_named_logits():
    row = torch.tensor([1.0, 2.0, 3.0, 4.0])
    p = SamplingParams.from_dict({"logit_bias": {"0": 100, 2: -1.5}}, vocab=4)
    assert p.logit_bias == {0: 100.0, 2: -1.5}
    assert adjust_logits(row, p).tolist() == [101.0, 2.0, 1.5, 4.0]
    assert row.tolist() == [1.0, 2.0, 3.0, 4.0]          # the raw row is left as it was (logprobs use it)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = torch.tensor([2.0, -2.0, 4.0, -4.0, 1.0])
    p = SamplingParams(repetition_penalty=2.0)
    # token 0 in the prompt, tokens 1 and 2 in the output, 3 and 4 unseen
    assert adjust_logits(row, p, output_ids=[1, 2, 2], prompt_ids=[0]).tolist() == [1.0, -4.0, 2.0, -4.0, 1.0]
    assert adjust_logits(row, SamplingParams(repetition_penalty=0.5), [1], [0]).tolist() == [4.0, -1.0, 4.0, -4.0, 1.0]


def test_frequency_and_presence_penalties_count_the_output_only():
    row = torch.zeros(5)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = adjust_logits(row, p, output_ids=[1, 3, 3, 3], prompt_ids=[0, 1, 2])
    assert out.tolist() == [0.0, -0.75, 0.0, -1.75, 0.0]      # -(0.5 * count + 0.25) for each output token
    neg = adjust_logits(row, SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0), [4, 4])
    assert neg.tolist() == [0.0, 0.0, 0.0, 0.0, 4.0]          # negative penalties encourage repeats


def test_the_order_is_bias_then_repetition_then_frequency_and_presence():
    row = torch.tensor([3.0, 0.0])
    p = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    # (3 + 1) / 2 - (1 * 1 + 0.5) = 0.5
    assert adjust_logits(row, p, output_ids=[0]).tolist() == [0.5, 0.0]


def test_huge_logits_stay_finite():
    row = torch.tensor([3e38, -3e38, 1.0])
    out = adjust_logits(row, SamplingParams(repetition_penalty=0.01), [0, 1])
    assert torch.isfinite(out).all()
    assert sample_token(out, SamplingParams(temperature=1.0), 1, 0) == 0


def test_min_p_keeps_only_tokens_near_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))
    p = SamplingParams(temperature=1.0, min_p=0.2)          # threshold 0.1: tokens 0..2 stay, renormalised
    kept = torch.tensor([0.5, 0.3, 0.12])
    expected = torch.cat([kept / kept.sum(), torch.zeros(1)])
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(logits, p, 11, i) for i in range(n)]), minlength=4)
    sd = (expected * (1 - expected) / n).sqrt()
    assert counts[3] == 0
    assert ((counts / n - expected).abs() <= 4.5 * sd + 1e-9).all(), (counts / n, expected)
    # after temperature: at 2.0 the probabilities flatten (0.5 : 0.08 -> sqrt: 0.71 : 0.28) and all four stay
    assert {sample_token(logits, SamplingParams(temperature=2.0, min_p=0.2), 11, i) for i in range(400)} == {0, 1, 2, 3}
    # min_p 1 keeps the best token alone
    assert {sample_token(logits, SamplingParams(temperature=1.0, min_p=1.0), 11, i) for i in range(200)} == {0}


def test_greedy_takes_the_argmax_of_the_adjusted_row():
    logits = torch.tensor([[5.0, 4.0, 1.0]] * 3)
    biased = SamplingParams(temperature=0, logit_bias={2: 10.0})
    penalized = SamplingParams(temperature=0, frequency_penalty=2.0)
    plain = SamplingParams(temperature=0)
    chunks = [ChunkSampling(tip=0, params=biased), ChunkSampling(tip=1, params=penalized, output_ids=[0]),
              ChunkSampling(tip=2, params=plain)]
    assert [r[0] for r in sample_chunks(logits, chunks)] == [2, 1, 0]


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    c = ChunkSampling(tip=0, params=SamplingParams(temperature=0, logprobs=1, logit_bias={2: 50.0}))
    token, entry, _ = sample_chunks(logits, [c])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert token == 2 and entry["logprob"] == pytest.approx(float(raw[2])) and entry["top"][0][0] == 0


def test_choice_seeds_are_distinct_reproducible_and_in_range():
    seeds = [choice_seed(1234, i) for i in range(16)]
    assert seeds[0] == 1234 and len(set(seeds)) == 16 and seeds == [choice_seed(1234, i) for i in range(16)]
    assert all(0 <= s < 2 ** 63 for s in seeds + [choice_seed(2 ** 63 - 1, i) for i in range(16)])


# ---- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number in [0.01, 100]"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a number"),
    ({"min_p": -0.1}, "min_p must be a number in [0, 1]"),
    ({"min_p": True}, "min_p must be a number in [0, 1]"),
    ({"logit_bias": [1, 2]}, "logit_bias must be an object"),
    ({"logit_bias": {"abc": 1}}, "logit_bias must hold token ids"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias must hold token ids"),
    ({"logit_bias": {"2053": 1}}, "logit_bias token id 2053 is outside the vocabulary (0..2052)"),
    ({"logit_bias": {"-1": 1}}, "logit_bias token id -1 is outside the vocabulary"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias values must be numbers in [-100, 100]"),
    ({"logit_bias": {"5": None}}, "logit_bias values must be numbers"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, f"at most {MAX_LOGIT_BIAS} are allowed"),
    ({"logit_bias": {str(i): 1 for i in range(10 ** 5)}}, f"at most {MAX_LOGIT_BIAS} are allowed"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [5, "6"]}, "stop_token_ids must hold token ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids must hold token ids"),
    ({"stop_token_ids": [10 ** 30]}, "stop_token_ids token id 1000000000000000000000000000000 is outside"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, f"at most {MAX_STOP_TOKEN_IDS} are allowed"),
    ({"n": 2}, "n must be 1 in an engine request"),
])
def test_each_field_is_bounded_and_named(fields, message):
    with pytest.raises(RequestError) as e:
        sampling_params({"prompt_token_ids": [1], **fields}, SamplingParams(), 4096, 2053)
    text = str(e.value)
    assert message in text and "\n" not in text and len(text) < 300
    assert text.split(" ", 1)[0] == next(iter(fields))       # the first word names the field (HTTP's `param`)


def test_limits_are_accepted():
    p = sampling_params({"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 100, "min_p": 1,
                         "logit_bias": {str(i): (-100 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS)},
                         "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)), "n": 1}, SamplingParams(), 4096, 2053)
    assert len(p.logit_bias) == MAX_LOGIT_BIAS and p.stop_token_ids == list(range(MAX_STOP_TOKEN_IDS))


# ---- the model's defaults -------------------------------------------------------------------------

def test_generation_config_gives_defaults(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05, "do_sample": True,
         "max_new_tokens": 99, "eos_token_id": [1, 2]}))
    assert sampling_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                                "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 5, "top_k": "x"}))
    assert sampling_defaults(str(tmp_path)) == {"temperature": 0.7}      # values a request could not hold: left out
    assert "top_p must be a number in (0, 1]" in caplog.text
    assert sampling_defaults(str(tmp_path / "nothing-here")) == {}


def test_gguf_sampling_keys_give_defaults():
    meta = {"general.sampling.temp": 0.8, "general.sampling.top_k": 40, "general.sampling.top_p": 0.9,
            "general.sampling.min_p": 0.05, "general.sampling.penalty_repeat": 1.1,
            "general.sampling.penalty_last_n": 64, "general.sampling.mirostat": 0}
    assert sampling_defaults("x.gguf", meta) == {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                                 "repetition_penalty": 1.1}
    assert sampling_defaults("x.gguf", {}) == {}
    assert open_model(MODEL).sampling_defaults == {}      # the embedded models give none: the built-in ones apply


@pytest.mark.cluster
def test_defaults_come_from_the_request_then_the_job_then_the_model(tmp_path):
    """A GGUF file with general.sampling.* keys, through the coordinator (in this process, as
    test_engine_faults runs it): a request without sampling fields takes the model's values; the job's
    defaults (deploy.generate flags) override them, and a request's own values override both."""
    import asyncio

    import gguf
    from gguf_edit import rewrite_gguf
    from local_pipeline import coordinator, results_of

    path = rewrite_gguf(open_model(MODEL).path, str(tmp_path / "with-defaults.gguf"), add_kv={
        "general.sampling.temp": (0.0, gguf.GGUFValueType.FLOAT32),
        "general.sampling.penalty_repeat": (1.8, gguf.GGUFValueType.FLOAT32)})
    files = open_model(path)
    assert files.sampling_defaults == {"temperature": 0.0, "repetition_penalty": pytest.approx(1.8)}
    base = {"prompt_token_ids": PROMPT, "max_tokens": 10, "ignore_eos": True}

    async def go():
        coord = coordinator(files)
        first = await results_of(coord, {"model": base, "explicit": {**base, "temperature": 0, "repetition_penalty": 1.8},
                                         "request": {**base, "repetition_penalty": 1.0}})
        ids = {await coord.submit("job", base, defaults={"repetition_penalty": 1.0, "top_k": None}): "job"}
        while not (done := await coord.wait_finished(timeout=10)):
            pass
        assert [ids[s] for s, _ in done] == ["job"]
        return {**first, "job": done[0][1]}

    out = asyncio.run(go())
    penalized = out["model"]["token_ids"]
    assert out["explicit"]["token_ids"] == penalized           # greedy with the model's repetition penalty
    plain, = generate(files, [{"max_tokens": 10, "temperature": 0, "ignore_eos": True}])
    assert penalized != plain.output_ids
    assert out["request"]["token_ids"] == plain.output_ids == out["job"]["token_ids"]


# ---- through the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return open_model(MODEL)


def generate(model, requests: list[dict]) -> list:
    """Sequences of requests (SamplingParams keyword dicts) run together through the in-process engine."""
    engine = LocalEngine(model, mode="float32")
    seqs = [engine.add_request(str(i), PROMPT, SamplingParams(**r)) for i, r in enumerate(requests)]
    engine.run_until_done()
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    return seqs


def raw_logits(model, ids: list[int]) -> torch.Tensor:
    """The model's float32 logits after every token of ids, from one forward pass of the whole sequence."""
    stage = LocalEngine(model, mode="float32").stages[0]
    batch = StepBatch(seq_ids=[0], start_pos=[0], lengths=[len(ids)], token_ids=ids, logit_rows=list(range(len(ids))))
    return stage.forward(batch)


def test_logit_bias_100_makes_every_token_that_one(model):
    eos = sorted(model.tokenizer.eos_token_ids)
    seqs = generate(model, [{"max_tokens": 12, "temperature": 1.0, "seed": s, "logit_bias": {42: 100.0}}
                            for s in range(3)]
                    + [{"max_tokens": 6, "temperature": 1.0, "seed": 0, "logit_bias": {t: -100.0 for t in eos},
                        "ignore_eos": False}])
    for s in seqs[:3]:
        assert s.output_ids == [42] * 12 and s.finish_reason == "length"
    assert not set(seqs[3].output_ids) & set(eos)


def test_stop_token_ids_stop(model):
    free, = generate(model, [{"max_tokens": 16, "temperature": 0}])
    target = free.output_ids[5]
    first = free.output_ids.index(target)
    stopped, never = generate(model, [{"max_tokens": 16, "temperature": 0, "stop_token_ids": [target, 2052]},
                                      {"max_tokens": 16, "temperature": 0, "stop_token_ids": [2052]}])
    assert stopped.output_ids == free.output_ids[:first + 1] and stopped.finish_reason == "stop"
    assert free.text.startswith(stopped.text)
    assert never.output_ids == free.output_ids and never.finish_reason == "length"
    # ignore_eos ignores end tokens, never stop tokens
    forced, = generate(model, [{"max_tokens": 8, "temperature": 1.0, "seed": 1, "logit_bias": {42: 100.0},
                                "stop_token_ids": [42], "ignore_eos": True}])
    assert forced.output_ids == [42] and forced.finish_reason == "stop"


PENALTIES = [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"presence_penalty": -1.0, "frequency_penalty": 0.3, "repetition_penalty": 0.7},
    {"frequency_penalty": 0.8, "repetition_penalty": 1.3, "logit_bias": {13: 3.0, 257: -2.0}},
]


def reference_row(raw: torch.Tensor, outputs: list[int], p: dict) -> torch.Tensor:
    """The definitions, token by token (OpenAI's penalties, vLLM/HF's repetition penalty)."""
    row = raw.clone().tolist()
    for t, b in p.get("logit_bias", {}).items():
        row[t] += b
    rp = p.get("repetition_penalty", 1.0)
    for t in set(PROMPT) | set(outputs):
        row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
    for t in set(outputs):
        row[t] -= p.get("frequency_penalty", 0.0) * outputs.count(t) + p.get("presence_penalty", 0.0)
    return torch.tensor(row, dtype=torch.float64)


@pytest.mark.parametrize("penalty", PENALTIES)
def test_penalties_follow_their_definition(model, penalty):
    """Greedy and seeded sampling with a penalty: at every position the token is the argmax (greedy) or the
    draw of uniform(seed, position) (temperature 1) of the reference row computed from the raw logits."""
    n = 16
    greedy, sampled, plain_greedy, plain_sampled = generate(model, [
        {"max_tokens": n, "temperature": 0, "ignore_eos": True, **penalty},
        {"max_tokens": n, "temperature": 1.0, "seed": 9, "ignore_eos": True, **penalty},
        {"max_tokens": n, "temperature": 0, "ignore_eos": True},
        {"max_tokens": n, "temperature": 1.0, "seed": 9, "ignore_eos": True}])
    assert greedy.output_ids != plain_greedy.output_ids and sampled.output_ids != plain_sampled.output_ids
    checked = 0
    for seq, greedy_mode in ((greedy, True), (sampled, False)):
        out = seq.output_ids
        logits = raw_logits(model, PROMPT + out)
        for i in range(n):
            row = reference_row(logits[len(PROMPT) - 1 + i], out[:i], penalty)
            if greedy_mode:
                top2 = torch.topk(row, 2).values
                if top2[0] - top2[1] < 1e-4:             # a near tie: float noise may decide it
                    continue
                assert out[i] == int(torch.argmax(row)), (i, out)
            else:
                cdf = torch.softmax(row, -1).cumsum(0)
                u = uniform(seq.seed, i)
                if (cdf - u).abs().min() < 1e-5:         # the draw lies on a boundary: float noise may decide it
                    continue
                assert out[i] == int((cdf <= u).sum()), (i, out)
            checked += 1
    assert checked >= 2 * n - 3


def test_min_p_removes_the_unlikely_tokens(model):
    """At temperature 1.5 with min_p 0.3, every drawn token's raw logprob is within 1.5 * ln(0.3) of the best
    token's (min_p applies after temperature); without min_p most draws of this flat model are not."""
    t, min_p = 1.5, 0.3
    bound = t * math.log(min_p)
    common = {"max_tokens": 16, "temperature": t, "logprobs": 1, "ignore_eos": True}
    with_p = generate(model, [{**common, "seed": s, "min_p": min_p} for s in range(6)])
    without = generate(model, [{**common, "seed": s} for s in range(6)])

    def gaps(seqs):
        return [e["logprob"] - e["top"][0][1] for s in seqs for e in s.logprobs]

    assert all(g >= bound - 1e-4 for g in gaps(with_p))
    assert sum(g < bound for g in gaps(without)) > len(gaps(without)) // 2
