"""Chat as users run it, through a real Ray Serve app over HTTP (tiny-gptoss, an API key, a template
override producing gpt-oss's harmony format with a default reasoning effort): /tokenize and /detokenize,
reasoning_content beside content in whole and streamed answers, chat_template_kwargs, history with
reasoning, and the request-field policy."""
import json
import urllib.error
import urllib.request

import openai
import pytest

from chat_templates import GPTOSS
from serve_util import serve_apps
from raymoe.stages.files.loader import open_model

pytestmark = pytest.mark.cluster

MODEL, KEY = "tiny-gptoss", "secret-key"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    with serve_apps({"/": {"model": MODEL, "api_key": KEY, "max_running": 4, "chat_template": GPTOSS,
                           "chat_template_kwargs": {"reasoning_effort": "low"}}}) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok():
    return open_model(MODEL).tokenizer


def post(url: str, body, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_a_prompt_and_detokenize_it(server, client, tok):
    max_model_len = client.models.list().data[0].model_extra["max_model_len"]
    status, body = post(server + "/tokenize", {"model": MODEL, "prompt": "Hello, world! 🙂"})
    assert status == 200
    assert body == {"count": len(tok.encode("Hello, world! 🙂")), "max_model_len": max_model_len,
                    "tokens": tok.encode("Hello, world! 🙂")}
    status, back = post(server + "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "Hello, world! 🙂"}
    status, body = post(server + "/tokenize", {"prompt": "<|start|>x", "return_token_strs": True})   # model optional
    assert status == 200 and body["tokens"][0] == tok.token_to_id("<|start|>") and body["token_strs"][0] == "<|start|>"
    status, back = post(server + "/detokenize", {"tokens": body["tokens"]})
    assert back == {"prompt": "<|start|>x"}                          # special tokens written out
    assert post(server + "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


def test_tokenize_a_chat_as_the_chat_endpoint_renders_it(server, client, tok):
    status, body = post(server + "/tokenize", {"model": MODEL, "messages": HI})
    assert status == 200
    text = tok.decode(body["tokens"])
    assert "Reasoning: low" in text and text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] == body["tokens"]
    status, high = post(server + "/tokenize", {"messages": HI, "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert "Reasoning: high" in tok.decode(high["tokens"])
    status, effort = post(server + "/tokenize", {"messages": HI, "reasoning_effort": "medium"})
    assert "Reasoning: medium" in tok.decode(effort["tokens"])
    status, bare = post(server + "/tokenize", {"messages": HI, "add_generation_prompt": False})
    assert bare["tokens"] == body["tokens"][:bare["count"]] and tok.decode(bare["tokens"]).endswith("Hi<|end|>")


def test_history_with_reasoning_renders_on_the_analysis_channel(server, tok):
    history = [*HI, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}]
    status, body = post(server + "/tokenize", {"messages": history, "add_generation_prompt": False})
    assert status == 200
    assert tok.decode(body["tokens"]).endswith("<|start|>user<|message|>Hi<|end|>"
                                               "<|start|>assistant<|channel|>analysis<|message|>Greet back.<|end|>"
                                               "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")


@pytest.mark.parametrize("path, body, param, message", [
    ("/tokenize", {"prompt": "a", "messages": HI}, "messages", "exactly one of prompt"),
    ("/tokenize", {}, "prompt", "exactly one of prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt", "prompt: input should be a valid string"),
    ("/tokenize", {"messages": []}, "messages", "messages: list should have at least 1 item"),
    ("/tokenize", {"messages": HI, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs",
     "'messages' is set by the server"),
    ("/tokenize", {"messages": HI, "add_generation_prompt": "yes"}, "add_generation_prompt", "input should be a valid boolean"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model", "does not exist"),
    ("/detokenize", {"tokens": "1 2"}, "tokens", "tokens: input should be a valid list"),
    ("/detokenize", {"tokens": [1, True]}, "tokens", "tokens[1]: input should be a valid integer"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens", "tokens[1]: token id 1000000000 is outside the vocabulary"),
    ("/detokenize", {}, "tokens", "tokens: field required"),
])
def test_tokenizer_endpoints_refuse_bad_input(server, path, body, param, message):
    status, error = post(server + path, body)
    assert status == (404 if param == "model" else 400), error
    assert error["error"]["param"] == param and message in error["error"]["message"]


def test_tokenizer_endpoints_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        status, error = post(server + path, body, key=None)
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
        assert post(server + path, body, key="wrong")[0] == 401
    assert post(server + "/tokenize", b"{not json")[0] == 400


def test_reasoning_fields_streamed_or_not(client):
    """Whatever the tiny model writes, the streamed fields concatenate to the whole answer's fields."""
    for messages in (HI, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a joke"}]):
        kw = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message
        assert "reasoning_content" in whole.model_extra
        fields = {"content": "", "reasoning_content": ""}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for choice in chunk.choices:
                fields["content"] += choice.delta.content or ""
                fields["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        assert fields == {"content": whole.content or "", "reasoning_content": whole.model_extra["reasoning_content"] or ""}
        for text in fields.values():
            assert "analysis" not in text and "assistantfinal" not in text


def test_unknown_fields_are_refused_by_name_everywhere(server, client):
    """The request-field policy: a field an endpoint does not know is a 400 naming it (code
    unknown_parameter); OpenAI's bookkeeping fields are accepted and ignored."""
    def refused(path, body, param):
        status, error = post(server + path, body)
        assert status == 400 and error["error"]["code"] == "unknown_parameter", error
        assert error["error"]["param"] == param and repr(param) in error["error"]["message"]
        return error["error"]["message"]

    refused("/v1/chat/completions", {"messages": HI, "max_token": 4}, "max_token")
    message = refused("/v1/completions", {"prompt": "x", "max_tokens": 2, "temprature": 0, "frobnicate": 1},
                      "temprature")
    assert message.startswith("Unrecognized request arguments supplied: 'temprature', 'frobnicate'")
    refused("/v1/chat/completions", {"messages": HI, "stream": True,
                                     "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            "continuous_usage_stats")
    refused("/v1/chat/completions", {"messages": HI, "echo": True}, "echo")       # a completions field, not chat's
    refused("/v1/completions", {"prompt": "x", "messages": HI}, "messages")
    refused("/tokenize", {"prompt": "x", "add_bos": True}, "add_bos")
    refused("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, extra_body={"min_tokens": 2})
    assert e.value.body["code"] == "unknown_parameter" and e.value.body["param"] == "min_tokens"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, user="u-1", metadata={"a": "b"},
                                       store=False, service_tier="auto", parallel_tool_calls=False)
    assert r.choices[0].finish_reason in ("stop", "length")
