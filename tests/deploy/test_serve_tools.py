"""Tool calling end to end: the openai client against a real Ray Serve app (both embedded models, the test
templates of tests/chat_templates.py) and the batch job. A random model never calls a tool, so the
outputs are scripted with the engine's test hook (EngineArgs.scripted_outputs: a prompt holding a key
gets that key's tokens in place of the sampled ones, while the model still runs every step): what is
tested is everything after sampling, the parsing, the response bodies and the stream over HTTP."""
import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from chat_templates import GPTOSS, QWEN35
from serve_util import serve_apps
from tool_scripts import HARMONY_AFTER, HARMONY_CALL, QWEN_AFTER, QWEN_CALL, QWEN_TWO
from raymoe.stages.files.loader import open_model

pytestmark = pytest.mark.cluster

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Gets the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TWO = [{"role": "user", "content": "Weather in two cities?"}]


def scripts(model: str) -> dict:
    """{prompt text: token ids}; the first key the prompt holds wins (the tool result's turn first)."""
    tok = open_model(model).tokenizer
    if model == "tiny-qwen35moe":
        texts = {"<tool_response>": QWEN_AFTER, "weather in Paris": QWEN_CALL, "two cities": QWEN_TWO}
    else:
        texts = {"to=assistant": HARMONY_AFTER, "weather in Paris": HARMONY_CALL}
    return {key: tok.encode(text) for key, text in texts.items()}


@pytest.fixture(scope="module")
def servers():
    apps = {f"/{name}": {"model": model, "max_running": 4, "grpc_port": 0, "chat_template": template,
                         "scripted_outputs": scripts(model)}
            for name, model, template in (("qwen", "tiny-qwen35moe", QWEN35), ("gptoss", "tiny-gptoss", GPTOSS))}
    with serve_apps(apps) as base:
        yield {name: f"{base}/{name}" for name in ("qwen", "gptoss")}


def client(servers, name):
    return openai.OpenAI(base_url=servers[name] + "/v1", api_key="none", max_retries=0, timeout=120)


MODELS = {"qwen": "tiny-qwen35moe", "gptoss": "tiny-gptoss"}


def assembled(stream):
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    return state.get_final_completion().choices[0]


def calls_of(message):
    return [(c.type, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
def test_a_call_whole_and_streamed(servers, name):
    c = client(servers, name)
    kw = dict(model=MODELS[name], messages=ASK, tools=TOOLS, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert calls_of(whole.message) == [("function", "get_weather", {"city": "Paris", "days": 2})]
    assert whole.message.tool_calls[0].id.startswith("call_") and whole.message.content is None
    assert whole.message.model_extra["reasoning_content"] == ("Need the weather.\n" if name == "qwen"
                                                               else "Need the weather.")
    streamed = assembled(c.chat.completions.create(**kw, stream=True))
    assert streamed.finish_reason == "tool_calls" and calls_of(streamed.message) == calls_of(whole.message)
    assert not streamed.message.content
    assert streamed.message.model_extra["reasoning_content"] == whole.message.model_extra["reasoning_content"]


def test_parallel_calls_in_both_qwen_forms(servers):
    c = client(servers, "qwen")
    kw = dict(model=MODELS["qwen"], messages=TWO, tools=TOOLS, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0]
    want = [("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Rome"})]
    assert calls_of(whole.message) == want and whole.message.content == "\n\nChecking both."
    streamed = assembled(c.chat.completions.create(**kw, stream=True))
    assert calls_of(streamed.message) == want and streamed.message.content == "\n\nChecking both."
    single = c.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert calls_of(single.message) == want[:1]


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
def test_tool_choice_none_gives_the_text(servers, name):
    r = client(servers, name).chat.completions.create(model=MODELS[name], messages=ASK, tools=TOOLS,
                                                      tool_choice="none", temperature=0).choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert ("<tool_call>" if name == "qwen" else '{"city": "Paris", "days": 2}') in r.message.content


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
def test_the_result_sent_back(servers, name):
    """The call and its result go back in the history: the model answers (the scripted reply)."""
    c = client(servers, name)
    first = c.chat.completions.create(model=MODELS[name], messages=ASK, tools=TOOLS, temperature=0).choices[0].message
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"sky": "sunny"}'}]
    r = c.chat.completions.create(model=MODELS[name], messages=history, tools=TOOLS, temperature=0,
                                  extra_body={"return_token_ids": True}).choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert r.message.content == ("\n\nSunny in Paris." if name == "qwen" else "Sunny in Paris.")
    prompt = open_model(MODELS[name]).tokenizer.decode(r.model_extra["prompt_token_ids"])
    if name == "qwen":
        assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                "</parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
                '{"sky": "sunny"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n') in prompt
    else:
        assert prompt.endswith(HARMONY_CALL + "<|start|>functions.get_weather to=assistant<|channel|>commentary"
                               '<|message|>{"sky": "sunny"}<|end|><|start|>assistant')


def test_bad_tools_are_refused_by_name(servers):
    c = client(servers, "qwen")
    for kw, param in (({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
                       "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODELS["qwen"], messages=ASK, **kw)
        assert e.value.body["param"] == param


def test_batch_lines_with_tools(tmp_path, monkeypatch):
    """deploy.generate: a `messages` line with tools gets tool_calls (and finish_reason tool_calls); one
    without keeps the output it had."""
    from raymoe.cluster.engine_args import EngineArgs
    from raymoe.deploy import generate

    scripted = scripts("tiny-qwen35moe")
    real = EngineArgs.from_flags.__func__
    monkeypatch.setattr(EngineArgs, "from_flags", classmethod(
        lambda cls, parsed, **kw: real(cls, parsed, scripted_outputs=scripted, **kw)))
    lines = [{"id": "tools", "messages": ASK, "tools": TOOLS}, {"id": "plain", "messages": ASK},
             {"id": "bad", "messages": ASK, "tools": "x"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    template = tmp_path / "t.jinja"
    template.write_text(QWEN35)
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out),
                          "--chat-template", str(template), "--temperature", "0", "--max-tokens", "256"]) == 0
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    tools = results["tools"]
    assert list(tools)[3:6] == ["text", "reasoning_content", "tool_calls"]
    assert tools["text"] == "" and tools["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tools["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    plain = results["plain"]
    assert "tool_calls" not in plain and plain["finish_reason"] == "stop" and "<tool_call>" in plain["text"]
    assert "tools must be a list" in results["bad"]["error"]
