"""Property tests of the sampling fields (issue 14, cases 1, 5 and 9): one validation for JSONL
lines, HTTP bodies and gRPC requests, which accepts or raises RequestError with a one-line message
and nothing else; accepted values never give NaN, inf or an exception when sampling; stop strings
end the text exactly where a full scan of the text would."""
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raymoe.deploy.openai_api import APIError, parse_completion
from raymoe.deploy.protocol import ServedModel
from raymoe.protos import raymoe_pb2 as pb
from raymoe.deploy.grpc_service import engine_request
from raymoe.stages.errors import RequestError
from raymoe.stages.text.requests import sampling_params
from raymoe.stages.runtime.sampler import adjust_logits, logprob_entry, sample_token
from raymoe.stages.text.sampling_params import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOPS, SamplingParams
from raymoe.stages.runtime.sequence import Sequence

CONTEXT = 4096
VOCAB = 256
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# what a JSON body can hold, in any field
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | FLOATS | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                       max_size=3),
                           max_leaves=8)
NUMERIC = {"max_tokens": INT64, "temperature": FLOATS, "top_p": FLOATS, "top_k": INT64, "seed": INT64,
           "logprobs": INT64, "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS,
           "min_p": FLOATS}
TOKEN_IDS = st.integers(-3, VOCAB + 3)


def verdict(call):
    """None when accepted, else the RequestError's message; any other exception fails the test."""
    try:
        call()
    except RequestError as e:
        message = str(e)
        assert message and "\n" not in message and len(message) < 300, message
        return message
    return None


def jsonl(fields):
    """What the coordinator does with a deploy.generate line (flag defaults: the dataclass's)."""
    line = {"prompt_token_ids": [5, 6, 7], **fields}
    return verdict(lambda: sampling_params(line, SamplingParams(), CONTEXT, VOCAB))


@given(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs",
                                        "prompt_logprobs", "ignore_eos", "presence_penalty", "frequency_penalty",
                                        "repetition_penalty", "min_p", "logit_bias", "stop_token_ids", "n"]),
                       JSON_VALUES))
@SETTINGS
def test_any_json_value_is_accepted_or_rejected_with_a_message(fields):
    jsonl(fields)


@pytest.fixture(scope="module")
def serving():
    from raymoe.stages.files.loader import open_model
    tok = open_model("tiny-qwen35moe").tokenizer
    return SimpleNamespace(model_name="tiny", tokenizer=tok, vocab=VOCAB, context_length=CONTEXT,
                           served=ServedModel("tiny", tok, CONTEXT, VOCAB))


def http(fields, serving):
    """POST /v1/completions: the body's parse (a 400 APIError), then the coordinator's validation."""
    body = {"model": "tiny", "prompt": [5, 6, 7], **fields}
    try:
        p = parse_completion(body, serving.served)
    except APIError as e:
        assert e.status == 400
        return e.message
    return verdict(lambda: sampling_params(p.engine_request, SamplingParams(), CONTEXT, VOCAB))


def same_verdict(http_verdict, line_verdict) -> bool:
    """HTTP refuses what a line refuses, in the words of its request models (deploy/protocol.py), on one line."""
    return (http_verdict is None) == (line_verdict is None) and "\n" not in (http_verdict or "")


def grpc(fields, serving):
    """raymoe.Raymoe/Generate: the request as a JSONL line, then the coordinator's validation."""
    request = pb.GenerateRequest(model="tiny", prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), **fields)
    return verdict(lambda: sampling_params(engine_request(request, serving), SamplingParams(), CONTEXT, VOCAB))


@given(fields=st.fixed_dictionaries({"max_tokens": NUMERIC["max_tokens"]},
                                    optional={k: v for k, v in NUMERIC.items() if k != "max_tokens"}))
@SETTINGS
def test_numeric_fields_behave_the_same_over_jsonl_http_and_grpc(fields, serving):
    expected = jsonl(fields)
    assert same_verdict(http(fields, serving), expected)
    assert grpc(fields, serving) == expected


@given(bias=st.dictionaries(TOKEN_IDS, FLOATS, max_size=4), stops=st.lists(TOKEN_IDS, max_size=4))
@SETTINGS
def test_token_id_fields_behave_the_same_over_jsonl_http_and_grpc(bias, stops, serving):
    """logit_bias (string keys in JSON, int64 keys in gRPC's map) and stop_token_ids. A gRPC map has no
    order: its entries are checked in token order, so the lines here list theirs in that order."""
    bias = dict(sorted(bias.items()))
    fields = {"max_tokens": 4, "logit_bias": bias, "stop_token_ids": stops}
    expected = jsonl(fields)
    assert same_verdict(http({**fields, "logit_bias": {str(k): v for k, v in bias.items()}}, serving), expected)
    assert grpc(fields, serving) == expected


def test_limits_name_themselves():
    assert "max_tokens must be at most the model's context (4096 tokens)" in jsonl({"max_tokens": 10 ** 12})
    assert jsonl({"max_tokens": CONTEXT}) is None
    assert f"at most {MAX_STOPS} are allowed" in jsonl({"stop": ["x"] * (MAX_STOPS + 1)})
    assert f"at most {MAX_STOP_CHARS} characters" in jsonl({"stop": ["x" * (MAX_STOP_CHARS + 1)]})
    assert jsonl({"stop": ["x" * MAX_STOP_CHARS] * MAX_STOPS}) is None


VALID = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0, 100), st.floats(5e-324, 1e-3), st.sampled_from([1e-40, 1e-5])),
    top_p=st.one_of(st.just(1.0), st.floats(5e-324, 1.0, exclude_min=False)),
    top_k=st.one_of(st.sampled_from([-1, 0, 1]), st.integers(1, 2 ** 63)),
    seed=st.one_of(st.none(), st.integers(0, 2 ** 63 - 1)),
    logprobs=st.integers(0, MAX_LOGPROBS),
    min_p=st.one_of(st.just(0.0), st.floats(0, 1)),
    presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.01, 100)),
    logit_bias=st.dictionaries(st.integers(0, 39), st.floats(-100, 100), max_size=5))
HISTORY = st.lists(st.integers(0, 39), max_size=12)
LOGITS = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40)


@given(VALID, LOGITS, HISTORY, HISTORY)
@SETTINGS
def test_accepted_values_sample_any_finite_logits(params, logits, output, prompt):
    params.logit_bias = {t: b for t, b in params.logit_bias.items() if t < len(logits)}
    params.validate(CONTEXT, len(logits))
    output, prompt = [t for t in output if t < len(logits)], [t for t in prompt if t < len(logits)]
    row = adjust_logits(torch.tensor(logits, dtype=torch.float32), params, output, prompt)
    assert torch.isfinite(row).all()
    token = sample_token(row, params, params.seed or 0, 0)
    assert 0 <= token < len(logits)
    assert row[token] > -math.inf
    if params.top_k > 0:                     # a token outside the top k is never drawn
        assert row[token] >= torch.topk(row, min(params.top_k, len(logits))).values[-1]


@given(VALID, st.lists(st.floats(-1e4, 1e4, width=32), min_size=2, max_size=40))
@SETTINGS
def test_logprobs_of_real_logits_are_finite(params, logits):
    row = torch.tensor(logits, dtype=torch.float32)
    token = sample_token(row, params, params.seed or 0, 0)
    entry = logprob_entry(torch.log_softmax(row, -1), token, min(params.logprobs, len(logits)))
    assert math.isfinite(entry["logprob"]) and all(math.isfinite(lp) for _, lp in entry["top"])


class PieceTokenizer:
    """Token i decodes to PIECES[i]; token 0 is half a character: U+FFFD while last, "é" once followed
    (as an incomplete UTF-8 sequence is), so the decoded text can change behind its end."""
    PIECES = ["", "a", "b", "ab", " ", "ba"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\ufffd" if t == 0 and i == len(ids) - 1 else "é" if t == 0 else self.PIECES[t]
                       for i, t in enumerate(ids))


@given(st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), min_size=1, max_size=30),
       st.lists(st.text("abé \ufffd", min_size=1, max_size=4), min_size=1, max_size=4))
@SETTINGS
def test_stop_strings_end_the_text_as_a_full_scan_does(tokens, stops):
    tok = PieceTokenizer()
    seq = Sequence(0, "r", [1], SamplingParams(max_tokens=len(tokens), temperature=0, stop=stops), tok, set(), 10 ** 6)
    for t in tokens:
        seq.append_token(t)
        if seq.finish_reason is not None:
            break
    # the reference: after each token, the whole text (an incomplete character at its end held back, but for
    # the last token), each stop in order, its first occurrence
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n])
        if n < len(tokens):
            text = text.removesuffix("\ufffd")
        hit = next((text.find(s) for s in stops if s in text), None)
        if hit is not None:
            assert (len(seq.output_ids), seq.text, seq.finish_reason) == (n, text[:hit], "stop")
            return
    assert (seq.output_ids, seq.finish_reason) == (tokens, "length")


def test_draws_follow_the_distribution():
    """The counter-based stream (uniform(seed, position)) samples the softmax: over 20000 positions every
    token's frequency is within 4.5 standard deviations of its probability, under temperature and top-p."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    for params, expected in ((SamplingParams(temperature=1.0), torch.softmax(logits, -1)),
                             (SamplingParams(temperature=0.5), torch.softmax(logits / 0.5, -1)),
                             (SamplingParams(temperature=1.0, top_p=0.8), None)):
        if expected is None:        # top-p 0.8 keeps the first two tokens (0.61 + 0.22 >= 0.8), renormalised
            kept = torch.softmax(logits, -1)[:2]
            expected = torch.cat([kept / kept.sum(), torch.zeros(3)])
        n = 20000
        counts = torch.bincount(torch.tensor([sample_token(logits, params, 7, i) for i in range(n)]), minlength=5)
        sd = (expected * (1 - expected) / n).sqrt()
        assert ((counts / n - expected).abs() <= 4.5 * sd + 1e-9).all(), (counts / n, expected)


@pytest.mark.parametrize("scale", [8.0, 0.01])     # a peaked row (nucleus among the best 256) and a flat one (not)
def test_top_p_draws_only_from_the_nucleus_of_a_large_vocabulary(scale):
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * scale
    params = SamplingParams(temperature=1.0, top_p=0.9)
    probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
    nucleus = set(order[:int((probs.cumsum(0) - probs < 0.9).sum())].tolist())
    drawn = {sample_token(logits, params, 3, i) for i in range(300)}
    assert drawn <= nucleus and len(drawn) > 1
