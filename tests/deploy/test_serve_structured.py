"""Structured outputs and /v1/responses end to end: batch lines on the cluster (PP=1 and 2, a stage killed
mid-answer), and a real Ray Serve app of each embedded model driven by the official openai client: 100 of
100 json_schema answers at temperature 1 validate (jsonschema), a named tool_choice returns a call whose
arguments validate, and the Responses API gives reasoning, message and function_call items, whole and
streamed. The Responses tool-call tests script the model's output (EngineArgs.scripted_outputs, as
tests/deploy/test_serve_tools.py does): a random model never calls a tool by itself."""
import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from chat_templates import GPTOSS, QWEN35
from serve_util import get_json, get_text, serve_apps
from raymoe.deploy.metrics import parse_metrics
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.answers import split_chat_result
from tool_scripts import HARMONY_AFTER, HARMONY_CALL, QWEN_AFTER, QWEN_CALL
from structured_cases import ASK, SCHEMAS, TOOLS, reasoning_end_bias, response_format

pytestmark = pytest.mark.cluster

MODELS = {"qwen": "tiny-qwen35moe", "gptoss": "tiny-gptoss"}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def lines(tok) -> list:
    bias = {"logit_bias": reasoning_end_bias(tok)}
    out = [(f"{name}-{i}", {"messages": ASK, "response_format": response_format(name), "temperature": 1.0,
                            "seed": i, "max_tokens": 160, **bias, **(NO_THINKING if i % 2 else {})})
           for name in SCHEMAS for i in range(2)]
    out.append(("call", {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 5,
                         "max_tokens": 160, **bias}))
    out.append(("bad", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}}))
    return out


def run_lines(model: str, **kwargs) -> dict:
    from raymoe.cluster.engine import ClusterEngine, EngineArgs
    engine = ClusterEngine(EngineArgs(model, dtype="float32", prefill_chunk=32, max_batch_tokens=64, **kwargs))
    try:
        requests = lines(engine.tokenizer)
        outcomes = engine.submit_many(requests)
        results = {rid: o for (rid, _), o in zip(requests, outcomes) if not isinstance(o, int)}
        pending = {o: (rid, request) for (rid, request), o in zip(requests, outcomes) if isinstance(o, int)}
        while pending:
            for seq_id, result in engine.wait_finished(timeout=5):
                rid, request = pending.pop(seq_id)
                results[rid] = split_chat_result(result, engine.tokenizer, request)
        return results, engine.stats()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model", list(MODELS.values()))
def test_batch_lines_alike_at_every_pp_and_after_a_kill(model):
    """A batch job's lines with response_format and a forcing tool_choice: answers that validate, the same
    tokens at PP=1 and at PP=2 when a stage dies mid-answer (its matchers, or those of the live last stage
    that ran ahead of the dropped steps, are rebuilt from the tokens)."""
    reference, _ = run_lines(model, pp=1)
    assert "bogus" in reference.pop("bad")["error"]
    for rid, result in reference.items():
        if rid == "call":
            assert result["finish_reason"] == "tool_calls" and len(result["tool_calls"]) >= 1
        else:
            assert result["finish_reason"] == "stop", result
            jsonschema.validate(json.loads(result["text"]), SCHEMAS[rid.split("-")[0]])
    # the last stage dies (its matchers rebuilt) with one family, the first (the live last stage's matchers ran
    # ahead of the dropped steps) with the other
    stage = 1 if model == "tiny-qwen35moe" else 0
    again, stats = run_lines(model, pp=2, fault_injection={"stage": stage, "after_steps": 12})
    assert stats["restarts"] == 1
    again.pop("bad")
    assert {r: again[r]["token_ids"] for r in again} == {r: reference[r]["token_ids"] for r in reference}


SCRIPTS = {"qwen": {"<tool_response>": QWEN_AFTER, "weather in Paris": QWEN_CALL},
           "gptoss": {"to=assistant": HARMONY_AFTER, "weather in Paris": HARMONY_CALL}}


@pytest.fixture(scope="module")
def servers():
    """Both models in one app (a pipeline each: docs/models-in-one-app.md), requests naming theirs."""
    models = []
    for name, template in (("qwen", QWEN35), ("gptoss", GPTOSS)):
        tok = open_model(MODELS[name]).tokenizer
        scripts = {key: tok.encode(text) for key, text in SCRIPTS[name].items()}
        models.append({"model": MODELS[name], "chat_template": template, "scripted_outputs": scripts})
    with serve_apps({"/": {"models": models, "max_running": 16, "grpc_port": 0}}) as base:
        yield {name: base for name in MODELS}


def client(servers, name):
    return openai.OpenAI(base_url=servers[name] + "/v1", api_key="none", max_retries=0, timeout=600)


def bias(name: str) -> dict:
    return reasoning_end_bias(open_model(MODELS[name]).tokenizer)


def test_100_json_schema_answers_validate(servers):
    """100 answers at temperature 1, in requests of up to 16 choices run at once: the three schemas on both
    models, Qwen3.5 with and without thinking."""
    plan = [("qwen", "person", 16, NO_THINKING), ("qwen", "order", 16, NO_THINKING), ("qwen", "weather", 16, {}),
            ("qwen", "person", 4, {}), ("gptoss", "person", 16, {}), ("gptoss", "order", 16, {}),
            ("gptoss", "weather", 16, {})]
    assert sum(n for _, _, n, _ in plan) == 100

    def ask(entry):
        name, schema, n, extra = entry
        return schema, client(servers, name).chat.completions.create(
            model=MODELS[name], messages=ASK, response_format=response_format(schema), temperature=1.0, n=n,
            max_tokens=160, seed=len(schema) * n, logit_bias=bias(name), extra_body=extra)

    valid = 0
    with ThreadPoolExecutor(len(plan)) as pool:
        for schema, response in pool.map(ask, plan):
            for choice in response.choices:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.message.content), SCHEMAS[schema])
                valid += 1
    assert valid == 100


@pytest.mark.parametrize("name", list(MODELS))
def test_a_named_tool_choice_returns_a_valid_call(servers, name):
    c = client(servers, name)
    kw = dict(model=MODELS[name], messages=ASK, tools=TOOLS, temperature=1.0, seed=3, max_tokens=160,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, logit_bias=bias(name))
    whole = c.chat.completions.create(**kw).choices[0]
    state = ChatCompletionStreamState()
    for chunk in c.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        assert call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
    assert streamed.message.tool_calls[0].function.arguments == whole.message.tool_calls[0].function.arguments


@pytest.mark.parametrize("name", list(MODELS))
def test_a_reasoning_budget_brings_the_answer_within_max_tokens(servers, name):
    """thinking_token_budget 16 and no logit bias (the tiny models seldom end their reasoning by themselves):
    20 bounded JSON answers of 20 validate at temperature 1, and a forced call is a valid call."""
    c, budget = client(servers, name), {"thinking_token_budget": 16}
    choices = [choice for seed in (11, 12) for choice in c.chat.completions.create(
        model=MODELS[name], messages=ASK, response_format=response_format("weather"), temperature=1.0, n=10,
        max_tokens=160, seed=seed, extra_body=budget).choices]
    assert len(choices) == 20
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["weather"])
    call = c.chat.completions.create(model=MODELS[name], messages=ASK, tools=TOOLS, temperature=1.0, seed=5,
                                     max_tokens=160, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                     extra_body=budget).choices[0]
    assert call.finish_reason == "tool_calls", call
    jsonschema.validate(json.loads(call.message.tool_calls[0].function.arguments), TOOLS[0]["function"]["parameters"])


def test_json_streamed_as_whole_and_bad_schemas_refused(servers):
    c = client(servers, "qwen")
    kw = dict(model=MODELS["qwen"], messages=ASK, response_format=response_format("order"), temperature=1.0,
              seed=11, max_tokens=160, extra_body=NO_THINKING)
    whole = c.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in c.chat.completions.create(**kw, stream=True)
                       if chunk.choices)
    assert streamed == whole and jsonschema.validate(json.loads(whole), SCHEMAS["order"]) is None
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODELS["qwen"], messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}})
    assert e.value.body["param"] == "response_format" and "required" in e.value.body["message"]


# ---- /v1/responses ---------------------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "description": "Gets the weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                   "days": {"type": "integer"}}, "required": ["city"]}}]
REASONING = {"qwen": "Need the weather.\n", "gptoss": "Need the weather."}
ANSWER = {"qwen": "\n\nSunny in Paris.", "gptoss": "Sunny in Paris."}


def summary(response) -> list:
    """(type, text or (name, arguments)) of each output item."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(part.text for part in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(part.text for part in item.content)))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_responses_reasoning_calls_and_answers(servers, name):
    """A call (after reasoning), whole and streamed; its output sent back as input items; the answer."""
    c = client(servers, name)
    kw = dict(model=MODELS[name], input="What is the weather in Paris?", instructions="Be brief.",
              tools=RESPONSE_TOOLS, reasoning={"effort": "low"}, max_output_tokens=200, temperature=0)
    whole = c.responses.create(**kw)
    want = [("reasoning", REASONING[name]), ("function_call", "get_weather", {"city": "Paris", "days": 2})]
    assert whole.status == "completed" and summary(whole) == want and whole.usage.output_tokens > 0
    with c.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert summary(streamed) == want
    assert {"response.created", "response.reasoning_text.delta", "response.function_call_arguments.delta",
            "response.output_item.done", "response.completed"} <= set(kinds) and kinds[-1] == "response.completed"
    call = whole.output[1]
    history = [{"role": "user", "content": kw["input"]}, whole.output[0].model_dump(exclude_none=True),
               call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}]
    after = c.responses.create(**{**kw, "input": history})
    assert summary(after)[-1] == ("message", ANSWER[name]) and after.output_text == ANSWER[name]
    events = list(c.responses.create(**{**kw, "input": history}, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ANSWER[name] and events[-1].response.output_text == ANSWER[name]


def test_responses_refusals(servers):
    c = client(servers, "gptoss")
    for kw, param in (({"tools": [{"type": "web_search"}]}, "tools"), ({"previous_response_id": "resp_1"},
                                                                         "previous_response_id"),
                      ({"max_output_tokens": 0}, "max_output_tokens"),
                      ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text")):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=MODELS["gptoss"], input="Hi", **kw)
        assert e.value.body["param"] == param, e.value.body
        assert param != "tools" or "'web_search' tools are not supported" in e.value.body["message"]


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Gets the weather",
                    "input_schema": RESPONSE_TOOLS[0]["parameters"]}]


def blocks(message) -> list:
    """(type, text or (name, input)) of each content block."""
    return [(b.type, b.thinking) if b.type == "thinking" else (b.type, b.text) if b.type == "text"
            else (b.type, b.name, b.input) for b in message.content]


@pytest.mark.parametrize("name", list(MODELS))
def test_messages_thinking_tool_use_and_answer(servers, name):
    """/v1/messages with Anthropic's own client: a tool_use after thinking, whole and streamed; the tool_result
    sent back; the answer; a stop sequence; errors in Anthropic's shape."""
    c = anthropic.Anthropic(base_url=servers[name], api_key="none", max_retries=0, timeout=600)
    kw = dict(model=MODELS[name], max_tokens=200, system="Be brief.", tools=ANTHROPIC_TOOLS,
              extra_body={"temperature": 0}, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    whole = c.messages.create(**kw)
    want = [("thinking", REASONING[name]), ("tool_use", "get_weather", {"city": "Paris", "days": 2})]
    assert whole.stop_reason == "tool_use" and blocks(whole) == want and whole.usage.output_tokens > 0
    with c.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert blocks(streamed) == want and streamed.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and {"content_block_start",
                                                                            "content_block_stop"} <= set(kinds)
    history = kw["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": whole.content[-1].id,
                                      "content": '{"sky": "sunny"}'}]}]
    after = c.messages.create(**{**kw, "messages": history})
    assert after.stop_reason == "end_turn" and blocks(after)[-1] == ("text", ANSWER[name])
    with c.messages.stream(**{**kw, "messages": history}) as stream:
        assert "".join(stream.text_stream) == ANSWER[name]
    stopped = c.messages.create(model=MODELS[name], max_tokens=60, messages=[{"role": "user", "content": "Hi"}],
                                stop_sequences=[" "], thinking={"type": "disabled"})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " "), stopped
    assert all(b.type != "thinking" for b in stopped.content)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODELS[name], max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])


def test_two_models_in_one_app_answer_as_alone_under_mixed_load(servers):
    """The app above serves both models: /v1/models lists them, a request goes to the one it names (none: the
    first, unknown: 404 naming them), each one's seeded tokens are the same alone and under mixed load, and
    /health and /metrics cover both."""
    server = servers["qwen"]
    c = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
    names = tuple(MODELS.values())
    assert [m.id for m in c.models.list().data] == list(names)

    def tokens(key) -> list[int]:
        model, seed = key
        r = c.completions.create(model=model, prompt=f"The {seed} rivers of", max_tokens=10, temperature=1.0,
                                 seed=seed, extra_body={"return_token_ids": True})
        assert r.model == model
        return r.choices[0].model_extra["token_ids"]

    keys = [(model, seed) for model in names for seed in range(3)]
    alone = {key: tokens(key) for key in keys}
    with ThreadPoolExecutor(len(keys)) as pool:
        mixed = dict(zip(keys, pool.map(tokens, keys)))
    assert mixed == alone
    assert all(alone[(names[0], s)] != alone[(names[1], s)] for s in range(3))    # two models, not one
    first = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert first.model == names[0]
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and all(m in e.value.body["message"] for m in names)
    status, health = get_json(server + "/health")
    assert status == 200 and set(health["models"]) == set(names) and health["model"] == names[0]
    metrics = parse_metrics(get_text(server + "/metrics"))
    for model in names:
        assert metrics[f'raymoe_requests_total{{endpoint="completions",model="{model}",status="200"}}'] >= 6
