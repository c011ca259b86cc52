"""Request fields that schema fuzzing (tests/deploy/test_api_fuzz.py) found accepted where the OpenAPI document
refuses them, now refused: a field is checked whether or not it applies, values of the wrong JSON type are not
taken for the allowed ones (true is not 1), and chat roles are OpenAI's."""
import pytest

from raymoe.deploy.openai_api import APIError, parse_chat, parse_completion, parse_tokenize
from raymoe.deploy.protocol import ServedModel
from raymoe.stages.files.loader import open_model

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def model():
    files = open_model("tiny-qwen35moe")
    return ServedModel("m", files.tokenizer, files.config.context_length, files.config.vocab)


def refused(parse, body, model, param):
    with pytest.raises(APIError) as info:
        parse(body, model)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    return info.value


@pytest.mark.parametrize("field, value", [("suffix", []), ("suffix", {}), ("suffix", "x"), ("best_of", True),
                                          ("best_of", 2)])
def test_completion_fields_off_only_when_off(model, field, value):
    assert refused(parse_completion, {"prompt": "Hi", field: value}, model, field).code == "unsupported_parameter"


def test_completion_fields_that_ask_for_nothing(model):
    for body in ({"suffix": ""}, {"suffix": None}, {"best_of": 1}):
        parse_completion({"prompt": "Hi", **body}, model)


@pytest.mark.parametrize("field, value", [("tools", {}), ("tools", "none"), ("tool_choice", []), ("function_call", {}),
                                          ("functions", [{"name": "f"}])])
def test_chat_tools_off_only_when_off(model, field, value):
    refused(parse_chat, {"messages": HI, field: value}, model, field)


def test_chat_checks_max_tokens_beside_max_completion_tokens(model):
    for body in ({"max_completion_tokens": None, "max_tokens": 0}, {"max_completion_tokens": 5, "max_tokens": -1},
                 {"max_completion_tokens": 5, "max_tokens": True}):
        refused(parse_chat, {"messages": HI, **body}, model, "max_tokens")
    p = parse_chat({"messages": HI, "max_completion_tokens": None, "max_tokens": 3}, model)
    assert p.engine_request["max_tokens"] == 3


def test_chat_roles_are_openais(model):
    e = refused(parse_chat, {"messages": [{"role": "robot", "content": "Hi"}]}, model, "messages")
    assert e.message == ("messages[0].role: input should be 'system', 'developer', 'user', 'assistant' or 'tool', "
                         "got 'robot'")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "reasoning_effort": {}}, "reasoning_effort"),
    ({"prompt": "Hi", "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"prompt": "Hi", "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ({"messages": HI, "add_special_tokens": 1}, "add_special_tokens"),
])
def test_tokenize_checks_every_field(model, body, param):
    refused(parse_tokenize, body, model, param)


def test_reasoning_budget_of_the_server_and_of_a_request(model):
    """--reasoning-budget bounds every chat that reasons; a request's thinking_token_budget wins (-1: none)."""
    budgeted = ServedModel(model.name, model.tokenizer, model.context_length, model.vocab, reasoning_budget=8)
    assert "reasoning[max_tokens=8]" in parse_chat({"messages": HI}, budgeted).engine_request["grammar"]
    own = parse_chat({"messages": HI, "thinking_token_budget": 3}, budgeted).engine_request["grammar"]
    assert "reasoning[max_tokens=3]" in own
    assert "grammar" not in parse_chat({"messages": HI, "thinking_token_budget": -1}, budgeted).engine_request
    assert "grammar" not in parse_chat({"messages": HI}, model).engine_request
    refused(parse_chat, {"messages": HI, "thinking_token_budget": -2}, model, "thinking_token_budget")
    refused(parse_chat, {"messages": HI, "thinking_token_budget": True}, model, "thinking_token_budget")
