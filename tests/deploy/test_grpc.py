"""The gRPC service of protos/ through Ray Serve's gRPC proxy, beside HTTP, on a real
`python -m raymoe.deploy.serve` process: gRPC results and streamed tokens equal the HTTP API's, errors map
to gRPC status codes, structured outputs equal HTTP's response_format, a cancelled stream frees its
sequence, and SIGINT stops everything."""
import json
import signal

import grpc
import jsonschema
import openai
import pytest

from raymoe.protos import raymoe_pb2 as pb
from raymoe.protos import raymoe_pb2_grpc as pb_grpc
from serve_util import descendants, running_server, still_running, wait_idle
from raymoe.stages.files.loader import open_model
from structured_cases import ASK, SCHEMAS, reasoning_end_bias, response_format

pytestmark = pytest.mark.cluster

MODEL = "tiny-qwen35moe"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("grpc") / "serve.log", "--max-running", "16") as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield pb_grpc.RaymoeStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def http(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


CASES = [
    dict(prompt="Hello there", max_tokens=10, temperature=0),
    dict(prompt="Sampled", max_tokens=12, temperature=0.9, top_p=0.9, top_k=30, seed=7),
    dict(prompt_token_ids=[3, 50, 7, 99], max_tokens=8, temperature=0.7, seed=11, logprobs=2),
    dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=9, temperature=1.0, seed=3),
    dict(prompt="Penalised", max_tokens=10, temperature=0.8, seed=5, presence_penalty=0.5, frequency_penalty=0.4,
         repetition_penalty=1.3, min_p=0.05, logit_bias={13: 2.0, 257: -1.0}, stop_token_ids=[2052]),
]
EXTRA = ("top_k", "repetition_penalty", "min_p", "stop_token_ids")


def grpc_request(case: dict) -> pb.GenerateRequest:
    fields = {k: v for k, v in case.items() if k not in ("prompt_token_ids", "messages")}
    if "prompt_token_ids" in case:
        fields["prompt_token_ids"] = pb.TokenIds(ids=case["prompt_token_ids"])
    if "messages" in case:
        fields["messages"] = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in case["messages"]])
    return pb.GenerateRequest(model=MODEL, **fields)


def http_result(http, case: dict) -> dict:
    kw = {k: case[k] for k in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
          if k in case}
    if "logit_bias" in case:
        kw["logit_bias"] = {str(t): b for t, b in case["logit_bias"].items()}
    extra = {"return_token_ids": True, **{k: case[k] for k in EXTRA if k in case}}
    if "messages" in case:
        r = http.chat.completions.create(model=MODEL, messages=case["messages"], extra_body=extra, **kw)
        text = r.choices[0].message.content
        reasoning = r.choices[0].message.model_extra["reasoning_content"]
    else:
        r = http.completions.create(model=MODEL, prompt=case.get("prompt", case.get("prompt_token_ids")),
                                    logprobs=case.get("logprobs"), extra_body=extra, **kw)
        text, reasoning = r.choices[0].text, None
    c = r.choices[0]
    return {"token_ids": c.model_extra["token_ids"], "prompt_token_ids": c.model_extra["prompt_token_ids"],
            "text": text, "reasoning": reasoning, "finish_reason": c.finish_reason,
            "completion_tokens": r.usage.completion_tokens, "logprobs": c.logprobs}


def test_list_models_and_health(stub):
    models = stub.ListModels(pb.ListModelsRequest()).models
    assert [m.id for m in models] == [MODEL] and models[0].context_length == 4096 and models[0].pipeline_stages == 1
    health = stub.Health(pb.HealthRequest())
    assert health.healthy and health.status == "ok"


@pytest.mark.parametrize("case", CASES, ids=["greedy", "sampled", "token-ids", "chat", "penalised"])
def test_grpc_equals_http(stub, http, case):
    want = http_result(http, case)
    r = stub.Generate(grpc_request(case))
    assert list(r.token_ids) == want["token_ids"] and r.text == want["text"]
    # a chat's reasoning apart from its answer, as over HTTP
    assert (r.reasoning_content if r.HasField("reasoning_content") else None) == want["reasoning"]
    assert list(r.prompt_token_ids) == want["prompt_token_ids"] and r.finish_reason == want["finish_reason"]
    assert r.usage.completion_tokens == want["completion_tokens"] == len(r.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if "logprobs" in case:
        assert [lp.token_id for lp in r.logprobs] == want["token_ids"]
        assert [lp.logprob for lp in r.logprobs] == pytest.approx(want["logprobs"].token_logprobs)
        assert all(len(lp.top) == case["logprobs"] for lp in r.logprobs)

    messages = list(stub.GenerateStream(grpc_request(case)))
    assert [t for m in messages for t in m.token_ids] == want["token_ids"]
    assert "".join(m.text for m in messages) == want["text"]
    assert "".join(m.reasoning_content for m in messages) == (want["reasoning"] or "")
    assert list(messages[0].prompt_token_ids) == want["prompt_token_ids"]
    assert messages[-1].finish_reason == want["finish_reason"] and not any(m.finish_reason for m in messages[:-1])
    assert messages[-1].usage.completion_tokens == want["completion_tokens"]


def test_grpc_errors(stub):
    def code_of(call):
        with pytest.raises(grpc.RpcError) as info:
            call()
        return info.value.code(), info.value.details()

    assert code_of(lambda: stub.Generate(pb.GenerateRequest(model="nope", prompt="x")))[0] == grpc.StatusCode.NOT_FOUND
    code, details = code_of(lambda: stub.Generate(pb.GenerateRequest(prompt="x", temperature=-1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in details
    code, details = code_of(lambda: stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * 4096))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context" in details
    assert code_of(lambda: stub.Generate(pb.GenerateRequest()))[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, details = code_of(lambda: list(stub.GenerateStream(pb.GenerateRequest(prompt="x", top_p=3))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in details
    code, details = code_of(lambda: stub.Generate(pb.GenerateRequest(prompt="x", logit_bias={10 ** 6: 1.0})))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("logit_bias token id 1000000")
    code, details = code_of(lambda: stub.Generate(pb.GenerateRequest(prompt="x", min_p=-1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("min_p")
    code, _ = code_of(lambda: list(stub.GenerateStream(pb.GenerateRequest(model="nope", prompt="x"))))
    assert code == grpc.StatusCode.NOT_FOUND


def test_structured_outputs(stub, http):
    """json_schema is HTTP's response_format (a chat's reasoning free, then the JSON): the same answer, which
    validates; grammar keeps the output to a Lark grammar; bad ones are INVALID_ARGUMENT naming the field."""
    bias = {int(t): b for t, b in reasoning_end_bias(open_model(MODEL).tokenizer).items()}
    case = dict(messages=ASK, max_tokens=160, temperature=1.0, seed=5, logit_bias=bias)
    want = http.chat.completions.create(model=MODEL, messages=ASK, max_tokens=160, temperature=1.0, seed=5,
                                        logit_bias={str(t): b for t, b in bias.items()},
                                        response_format=response_format("order")).choices[0]
    r = stub.Generate(grpc_request({**case, "json_schema": json.dumps(SCHEMAS["order"])}))
    assert r.text == want.message.content and r.finish_reason == want.finish_reason == "stop"
    assert r.reasoning_content == want.message.model_extra["reasoning_content"]
    jsonschema.validate(json.loads(r.text), SCHEMAS["order"])
    streamed = list(stub.GenerateStream(grpc_request({**case, "json_schema": json.dumps(SCHEMAS["order"])})))
    assert "".join(m.text for m in streamed) == r.text

    for seed in range(3):
        r = stub.Generate(pb.GenerateRequest(prompt="Yes or no?", grammar='start: "yes" | "no"', temperature=1.0,
                                             seed=seed, max_tokens=20))
        assert r.text in ("yes", "no") and r.finish_reason == "stop"
    for bad, field, words in ((dict(json_schema="{"), "json_schema", "not JSON"),
                              (dict(json_schema="[1]"), "json_schema", "an object"),
                              (dict(json_schema='{"type": "foo"}'), "json_schema", "foo"),
                              (dict(grammar="start: ("), "grammar", "grammar")):
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(prompt="x", **bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field) and words in info.value.details(), info.value.details()


def test_cancelled_calls_free_their_sequences(server, stub):
    call = stub.GenerateStream(pb.GenerateRequest(prompt="Hello", max_tokens=3000, temperature=0))
    for i, _ in enumerate(call):
        if i == 2:
            break
    call.cancel()
    wait_idle(server.base)
    with pytest.raises(grpc.RpcError) as info:          # a unary call whose deadline passes
        stub.Generate(pb.GenerateRequest(prompt="Hello", max_tokens=3000, temperature=0), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(server.base)


def test_sigint_stops_everything(server):
    """Last in this module: SIGINT (Ctrl-C) to deploy.serve shuts down Serve and the Ray cluster it started, no
    process left. (SIGTERM: tests/deploy/test_serve_safety.py.)"""
    tree = descendants(server.proc.pid)
    assert len(tree) >= 3                           # gcs, raylet, workers...
    assert server.stop(signal.SIGINT) == 0, server.tail()
    assert still_running(tree) == [], server.tail()
