"""The OpenAI-compatible Serve endpoint, through the official `openai` client against a local server:
outputs equal deploy.generate's for the same seed, streamed text equals non-streamed text, 32
concurrent streams, disconnects free their sequences, back-pressure (503) and every error status,
and /metrics. (`python -m raymoe.deploy.serve` as a real process: tests/deploy/test_grpc.py, tests/deploy/test_serve_safety.py.)"""
import asyncio
import json

import aiohttp
import openai
import pytest

from raymoe.deploy import generate
from raymoe.deploy.metrics import parse_metrics
from raymoe.deploy.openai_api import TextDeltas
from serve_util import get_json, get_text, post_raw, serve_apps, wait_idle

pytestmark = pytest.mark.cluster

MODEL = "tiny-qwen35moe"
MAX_RUNNING, MAX_QUEUED = 32, 8          # small, so that back-pressure is reachable in a test


def reference_lines() -> list[dict]:
    """deploy.generate JSONL lines; the server gets the same requests through the OpenAI API."""
    lines = []
    for i in range(32):
        line = {"id": f"r{i}", "max_tokens": 6 + i % 7}
        if i % 3 == 0:
            line["prompt"] = f"Request number {i} says"
        elif i % 3 == 1:
            line["messages"] = [{"role": "user", "content": f"Tell me about {i}"}]
        else:
            line["prompt_token_ids"] = [5 + i, 17, 200 + i, 33]
        if i % 2:
            line.update(temperature=0.8, top_p=0.95, top_k=40, seed=1000 + i)
        else:
            line.update(temperature=0)
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The batch job's outputs for reference_lines(), by id."""
    d = tmp_path_factory.mktemp("serve-ref")
    src, out = d / "in.jsonl", d / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in reference_lines()))
    assert generate.main(["--model", MODEL, "--input", str(src), "--output", str(out)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert all("error" not in r for r in results)
    return {r["id"]: r for r in results}


@pytest.fixture(scope="module")
def server():
    """The Serve app on the suite's Ray cluster (HTTP on a free localhost port); shut down after the module."""
    # the batch job's micro-batch groups, so that the server's outputs equal deploy.generate's
    with serve_apps({"/": {"model": MODEL, "max_running": MAX_RUNNING, "max_queued": MAX_QUEUED, "microbatches": 4,
                           "grpc_port": 0}}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(server):
    """A client per event loop (its connections belong to the loop that opened them)."""
    return openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def api_kwargs(line: dict) -> tuple[str, dict]:
    """("chat" | "completions", keyword arguments of the openai client) for a reference line."""
    kw = {k: line[k] for k in ("max_tokens", "temperature", "top_p", "seed") if k in line}
    extra = {"return_token_ids": True}
    if "top_k" in line:
        extra["top_k"] = line["top_k"]
    kw["extra_body"] = extra
    if "messages" in line:
        return "chat", {**kw, "messages": line["messages"]}
    return "completions", {**kw, "prompt": line.get("prompt", line.get("prompt_token_ids"))}


def create(client, line, **more):
    kind, kw = api_kwargs(line)
    api = client.chat.completions if kind == "chat" else client.completions
    return kind, api.create(model=MODEL, **kw, **more)


def text_of(kind, choice) -> str:
    return choice.message.content if kind == "chat" else choice.text


def collect_stream(kind, stream) -> dict:
    text, reasoning, ids, finish, usage, first = "", "", [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if kind == "chat":
                if first is None:
                    first = choice.delta.role
                text += choice.delta.content or ""
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            else:
                text += choice.text
            ids += (choice.model_extra or {}).get("token_ids") or []
            finish = choice.finish_reason or finish
    return {"text": text, "reasoning": reasoning, "token_ids": ids, "finish_reason": finish, "usage": usage,
            "role": first}


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, body = get_json(server + "/health")
    assert status == 200 and body["status"] == "ok" and body["slots"] == MAX_RUNNING


@pytest.mark.parametrize("index", [0, 1, 2, 3, 4, 5])
def test_output_equals_deploy_generate_streamed_or_not(client, reference, index):
    """Text prompt, chat and token-id prompt, greedy and seeded sampling: the server's tokens and text equal
    the batch job's; the streamed text and tokens equal the non-streamed ones."""
    line = reference_lines()[index]
    want = reference[line["id"]]
    kind, response = create(client, line)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == want["token_ids"]
    assert choice.model_extra["prompt_token_ids"] == want["prompt_token_ids"]
    assert text_of(kind, choice) == want["text"]
    if kind == "chat":     # the batch job's chat lines split reasoning from the answer as the server does
        assert choice.message.model_extra["reasoning_content"] == want["reasoning_content"]
    assert choice.finish_reason == want["finish_reason"]
    assert response.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert response.usage.completion_tokens == want["usage"]["completion_tokens"]
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens

    _, stream = create(client, line, stream=True, stream_options={"include_usage": True})
    got = collect_stream(kind, stream)
    assert got["text"] == want["text"] and got["token_ids"] == want["token_ids"]
    assert got["finish_reason"] == want["finish_reason"]
    assert got["usage"].completion_tokens == want["usage"]["completion_tokens"]
    if kind == "chat":
        assert got["role"] == "assistant"
        assert got["reasoning"] == (want["reasoning_content"] or "")


def test_stop_strings_stream_exactly_the_final_text(client):
    """A stop string cuts the text; the streamed deltas never show text that the final text drops."""
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 24, "temperature": 0}
    free = client.completions.create(**base).choices[0].text
    for stop in (free[5:7], free[9:10], [free[12:15], "never there"]):
        stopped = client.completions.create(**base, stop=stop).choices[0]
        first = stop if isinstance(stop, str) else stop[0]
        assert stopped.finish_reason == "stop" and stopped.text == free[:free.find(first)]
        streamed = collect_stream("completions", client.completions.create(**base, stop=stop, stream=True))
        assert streamed["text"] == stopped.text and streamed["finish_reason"] == "stop"


ALL_FIELDS = dict(temperature=0.9, top_p=0.95, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
                  logit_bias={"13": 2.0, "257": -1.5},
                  extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.2, "stop_token_ids": [2052],
                              "return_token_ids": True})


def test_every_sampling_field_is_accepted_and_n_gives_independent_reproducible_choices(client):
    """Every sampling field of docs/sampling.md through the openai client. n=2 answers two choices whose
    usage sums (the prompt counted once); with a seed they are reproducible, and choice 0 is what n=1 gives."""
    base = dict(model=MODEL, prompt="Hello", max_tokens=8)
    two = client.completions.create(**base, **ALL_FIELDS, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    ids = [c.model_extra["token_ids"] for c in two.choices]
    assert ids[0] != ids[1]
    assert two.usage.completion_tokens == len(ids[0]) + len(ids[1])
    assert two.usage.prompt_tokens == len(two.choices[0].model_extra["prompt_token_ids"])
    again = client.completions.create(**base, **ALL_FIELDS, n=2)
    assert [c.model_extra["token_ids"] for c in again.choices] == ids
    one = client.completions.create(**base, **ALL_FIELDS)
    assert len(one.choices) == 1 and one.choices[0].model_extra["token_ids"] == ids[0]
    assert one.choices[0].text == two.choices[0].text

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, **ALL_FIELDS)
    whole = client.chat.completions.create(**chat, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    streamed = {}
    usage = None
    for chunk in client.chat.completions.create(**chat, n=3, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert usage is None and not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            got = streamed.setdefault(c.index, {"text": "", "ids": [], "finish": None})
            got["text"] += c.delta.content or ""
            got["ids"] += (c.model_extra or {}).get("token_ids") or []
            got["finish"] = c.finish_reason or got["finish"]
    for c in whole.choices:
        assert streamed[c.index] == {"text": c.message.content, "ids": c.model_extra["token_ids"],
                                     "finish": c.finish_reason}
    assert usage.completion_tokens == whole.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in whole.choices)


def test_a_client_leaving_a_stream_of_n_choices_frees_them_all(client, server):
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2000, temperature=1.0, n=4,
                                       stream=True, extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        if len(seen) == 4:
            break
    stream.close()
    wait_idle(server)


def test_logit_bias_and_stop_token_ids_over_http(client):
    forced = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=1.0, seed=1,
                                       logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [42] * 5
    stopped = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=1.0, seed=1,
                                        logit_bias={"42": 100},
                                        extra_body={"return_token_ids": True, "stop_token_ids": [42]})
    assert stopped.choices[0].model_extra["token_ids"] == [42] and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"), ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"), ({"n": 17}, "n"), ({"n": "2"}, "n")])
def test_bad_sampling_fields_are_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, **fields)
    error = info.value.response.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value" and "\n" not in error["message"]


def test_text_deltas_hold_back_what_may_change():
    d = TextDeltas(["END"])
    pieces = [d.update("ab"), d.update("E"), d.update("N"), d.update("x"), d.update("é"), d.final("abENxé!")]
    assert pieces == ["ab", "", "", "ENx", "é", "!"]
    d = TextDeltas(["END"])
    assert d.update("abE") == "ab" and d.update("N") == "" and d.final("ab") == ""
    assert d.sent == "ab"


def test_logprobs_and_echo(client):
    prompt = "Logprobs please"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    n_prompt = r.usage.prompt_tokens
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 5 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    greedy = lp.token_logprobs[n_prompt:]
    assert all(g == max(top.values()) for g, top in zip(greedy, lp.top_logprobs[n_prompt:]))   # greedy = best
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_32_concurrent_streams_and_a_disconnect(server, reference):
    """32 clients stream at once (and one more leaves mid-stream): every output equals the batch job's;
    the one that left frees its sequence, and 32 more requests run afterwards."""
    lines = reference_lines()

    async def stream_one(aclient, line):
        kind, kw = api_kwargs(line)
        api = aclient.chat.completions if kind == "chat" else aclient.completions
        stream = await api.create(model=MODEL, stream=True, **kw)
        text, ids = "", []
        async for chunk in stream:
            for choice in chunk.choices:
                text += (choice.delta.content or "") if kind == "chat" else choice.text
                ids += (choice.model_extra or {}).get("token_ids") or []
        return line["id"], text, ids

    async def leave_early(aclient):
        stream = await aclient.completions.create(model=MODEL, prompt="I will leave", max_tokens=3000,
                                                  temperature=0, stream=True)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        return seen

    async def run():
        async with async_client(server) as aclient:
            return await asyncio.gather(leave_early(aclient), *[stream_one(aclient, line) for line in lines])

    left, *results = asyncio.run(run())
    assert left == 3
    for rid, text, ids in results:
        assert ids == reference[rid]["token_ids"] and text == reference[rid]["text"], rid
    wait_idle(server)                       # the client that left holds nothing any more

    async def again():
        async def one(aclient, line):
            kind, kw = api_kwargs(line)
            api = aclient.chat.completions if kind == "chat" else aclient.completions
            r = await api.create(model=MODEL, **kw)
            return line["id"], r.choices[0].model_extra["token_ids"]
        async with async_client(server) as aclient:
            return await asyncio.gather(*[one(aclient, line) for line in lines])

    for rid, ids in asyncio.run(again()):
        assert ids == reference[rid]["token_ids"], rid
    wait_idle(server)
    metrics = parse_metrics(get_text(server + "/metrics"))
    assert metrics[f'raymoe_requests_finished_total{{finish_reason="abort",model="{MODEL}"}}'] >= 1


def test_queue_full_is_503_and_capacity_comes_back(client, server):
    """Streams that don't end (ignore_eos) fill the 32 cache slots and the 8 queue places; the next request gets
    503 with OpenAI's error JSON. Closing the streams frees everything: 32 requests run afterwards."""
    held, rejected = [], None
    try:
        for i in range(MAX_RUNNING + MAX_QUEUED + 4):
            try:
                held.append(client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hold {i}"}], max_tokens=3000,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
            except openai.APIStatusError as e:
                rejected = e
                break
        assert rejected is not None, "the bounded queue never filled"
        assert rejected.status_code == 503
        error = rejected.response.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "server_error" and "busy" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        metrics = parse_metrics(get_text(server + "/metrics"))
        assert metrics[f'raymoe_cache_slots_used{{model="{MODEL}"}}'] == MAX_RUNNING
        assert metrics[f'raymoe_queue_limit{{model="{MODEL}"}}'] == MAX_QUEUED
        assert metrics[f'raymoe_requests_total{{endpoint="chat",model="{MODEL}",status="503"}}'] >= 1
        assert len(held) == MAX_RUNNING + MAX_QUEUED
    finally:
        for stream in held:
            stream.close()
    wait_idle(server)

    async def after():
        async with async_client(server) as aclient:
            rs = await asyncio.gather(*[aclient.completions.create(model=MODEL, prompt=f"after {i}", max_tokens=4,
                                                                   temperature=0) for i in range(32)])
        return [r.choices[0].finish_reason for r in rs]

    assert all(f in ("stop", "length") for f in asyncio.run(after()))
    wait_idle(server)


def test_error_statuses(client, server):
    def error_of(call, status):
        with pytest.raises(openai.APIStatusError) as info:
            call()
        assert info.value.status_code == status
        body = info.value.response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return body["error"]

    e = error_of(lambda: client.completions.create(model="no-such-model", prompt="x", max_tokens=2), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"
    error_of(lambda: client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}]),
             404)
    e = error_of(lambda: client.completions.create(model=MODEL, prompt="x", temperature=-1), 400)
    assert e["param"] == "temperature" and e["type"] == "invalid_request_error"
    e = error_of(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=0), 400)
    assert e["param"] == "max_tokens"
    e = error_of(lambda: client.completions.create(model=MODEL, prompt="x", n=0), 400)
    assert e["param"] == "n"
    e = error_of(lambda: client.completions.create(model=MODEL, prompt=[1, 10 ** 9]), 400)
    assert "vocabulary" in e["message"]
    e = error_of(lambda: client.completions.create(model=MODEL, prompt=[1] * 4096, max_tokens=1), 400)
    assert e["code"] == "context_length_exceeded" and "4096" in e["message"]
    e = error_of(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "word " * 5000}], max_tokens=1), 400)
    assert e["code"] == "context_length_exceeded" and e["param"] == "messages"
    error_of(lambda: client.chat.completions.create(model=MODEL, messages=[]), 400)
    error_of(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                    stream_options={"include_usage": True}), 400)
    status, body = post_raw(server + "/v1/completions", b"{not json")
    assert status == 400 and (body["error"]["type"], body["error"]["code"]) == ("invalid_request_error", "invalid_body")
    wait_idle(server)


def test_every_error_has_openai_json_and_a_code(client, server):
    """400s carry a code (the status's default "invalid_value", or a more precise one), and the framework's
    own 404 (unknown path) and 405 (wrong method) answer the same JSON as every other error."""
    def error_of(call, status):
        with pytest.raises(openai.APIStatusError) as info:
            call()
        assert info.value.status_code == status
        return info.value.response.json()["error"]

    e = error_of(lambda: client.completions.create(model=MODEL, prompt="x", temperature=-1), 400)
    assert (e["code"], e["param"]) == ("invalid_value", "temperature")
    e = error_of(lambda: client.completions.create(model=MODEL, prompt="x", n=1000), 400)
    assert (e["code"], e["param"]) == ("invalid_value", "n")
    e = error_of(lambda: client.completions.create(model=MODEL, prompt="x", best_of=2), 400)
    assert (e["code"], e["param"]) == ("unsupported_parameter", "best_of")
    e = error_of(lambda: client.completions.create(model=MODEL, prompt=[1, 10 ** 9]), 400)
    assert (e["code"], e["param"]) == ("invalid_value", "prompt")
    e = error_of(lambda: client.chat.completions.create(model=MODEL, messages=[]), 400)
    assert (e["code"], e["param"]) == ("invalid_value", "messages")
    status, body = post_raw(server + "/v1/completions", b"[1, 2]")
    assert status == 400 and body["error"]["code"] == "invalid_body"

    async def raw(method: str, path: str):
        async with aiohttp.ClientSession() as s:
            async with s.request(method, server + path) as r:
                return r.status, r.headers.get("allow"), await r.json()

    for method, path, status, code in [("GET", "/v1/completions", 405, "method_not_allowed"),
                                       ("DELETE", "/v1/chat/completions", 405, "method_not_allowed"),
                                       ("POST", "/health", 405, "method_not_allowed"),
                                       ("GET", "/v1/nothing", 404, "not_found"),
                                       ("POST", "/", 404, "not_found")]:
        got, allow, body = asyncio.run(raw(method, path))
        assert got == status and set(body) == {"error"}, (method, path, got, body)
        e = body["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["type"] == "invalid_request_error", e
        assert e["code"] == code and path in e["message"], e
        assert (allow is not None) == (status == 405), allow


def test_metrics(client, server):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3, temperature=0)
    text = get_text(server + "/metrics")
    m = parse_metrics(text)
    label = f'{{model="{MODEL}"}}'
    assert m[f'raymoe_requests_total{{endpoint="completions",model="{MODEL}",status="200"}}'] >= 1
    assert m["raymoe_prompt_tokens_total" + label] > 0 and m["raymoe_generation_tokens_total" + label] > 0
    assert m["raymoe_time_to_first_token_seconds_count" + label] > 0
    assert m["raymoe_inter_token_latency_seconds_count" + label] > 0
    assert m["raymoe_cache_slots_total" + label] == MAX_RUNNING
    for gauge in ("raymoe_queue_length", "raymoe_cache_slots_used", "raymoe_requests_in_flight"):
        assert m[gauge + label] == 0
    assert "# TYPE raymoe_time_to_first_token_seconds histogram" in text


def test_usage_counts_the_prompt_tokens_the_prefix_cache_gave(client):
    """prompt_tokens_details.cached_tokens, as OpenAI and vLLM report it: 0 for a new prompt, whole 256-token
    blocks for one that starts like it (its last token always runs)."""
    history = [{"role": "user", "content": "remember these words: " + "alpha beta gamma delta " * 120}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=MODEL, messages=history + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}], max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 256 and cached % 256 == 0 and cached < again.usage.prompt_tokens, again.usage
