"""Structured outputs (stages/text/structured.py): response_format json_object / json_schema and a tool_choice that
forces a call, as grammars masked on the last stage. Checked against jsonschema's validation of what the
embedded models write at temperature 1, through the engine, the cluster (PP=1 and 2, a stage killed
mid-answer) and the HTTP server with the openai client."""
import json

import jsonschema
import pytest
import torch

from structured_cases import ASK, PERSON, SCHEMAS, TOOLS, WEATHER, reasoning_end_bias, response_format

from raymoe.deploy.openai_api import APIError, parse_chat
from raymoe.deploy.protocol import ServedModel
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.errors import RequestError
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.answers import output_parser
from raymoe.stages.text.reasoning import split_answer
from raymoe.stages.text.requests import chat_prompt, line_grammar
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.text.structured import Matchers, output_grammar
from raymoe.stages.text.tools import tool_request


@pytest.fixture(scope="module", params=["tiny-qwen35moe", "tiny-gptoss"])
def model(request):
    return open_model(request.param)


def answers(model, prompt_ids, grammar, n, seed=0, max_tokens=160, **params):
    engine = LocalEngine(model, 1, "float32")
    seqs = [engine.add_request(i, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i,
                                                             grammar=grammar, **params)) for i in range(n)]
    engine.run_until_done()
    return seqs


def test_the_mask_depends_only_on_the_tokens(model):
    """A matcher advanced step by step, one rebuilt from the tokens (a new stage) and one out of step (a
    step dropped by a restart: it has consumed a token the sequence no longer has) give the same masks;
    once the JSON is whole only the end token is allowed. An output that left its grammar fails alone."""
    tok = model.tokenizer
    ids = tok.encode(chat_prompt(ASK, tok, {"enable_thinking": False}))
    grammar = output_grammar(tok, ids, PERSON, None)
    head = (tok.encode("<|channel|>final<|message|>") if "<|channel|>" in tok.special_tokens else [])
    out = head + tok.encode('{"name": "Ann", "age": 7, "tags": ["a"], "pet": {"kind": "cat", "legs": 4}}')
    stepped, vocab = Matchers(tok, model.config.vocab), model.config.vocab
    for n in range(len(out) + 1):
        [mask] = stepped.masks([(1, grammar, out[:n])])
        assert torch.equal(mask, Matchers(tok, vocab).masks([(1, grammar, out[:n])])[0])
        if n < len(out):
            assert mask[out[n]], (n, tok.decode(out[:n + 1]))
    assert mask.nonzero().flatten().tolist() == [tok.special_tokens.get("<|return|>", tok.eos_token_id)]
    ahead = Matchers(tok, vocab)
    ahead.masks([(2, grammar, out[:6])])
    bad, behind, fresh = ahead.masks([(1, grammar, out[:3] + tok.encode(" x")), (2, grammar, out[:4]),
                                      (3, grammar, out[:4])])
    assert "left its grammar" in bad and torch.equal(behind, fresh)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_answers_validate_at_temperature_1(model, name):
    """In the model's chat format: Qwen3.5 with thinking off, and with it on (reasoning, </think>, the
    JSON); gpt-oss with its analysis message (then the final one). finish_reason stop: the grammar ends in
    the end token."""
    tok = model.tokenizer
    for kwargs in ([{"enable_thinking": False}, {}] if "<think>" in tok.backend.get_vocab() else [{}]):
        ids = tok.encode(chat_prompt(ASK, tok, kwargs))
        grammar = output_grammar(tok, ids, SCHEMAS[name], None)
        for seq in answers(model, ids, grammar, 4, logit_bias=reasoning_end_bias(tok)):
            assert seq.finish_reason == "stop" and seq.output_ids[-1] in tok.eos_token_ids
            fields = split_answer(output_parser(tok, ids), seq.output_ids, seq.text)
            jsonschema.validate(json.loads(fields["content"]), SCHEMAS[name])


def test_a_forced_call_is_a_call_with_valid_arguments(model):
    from raymoe.stages.text.answers import split_chat_result
    tok = model.tokenizer
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        line = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
        ids = tok.encode(chat_prompt(ASK, tok, tools=tool_request(line).template_tools()))
        for seq in answers(model, ids, line_grammar(line, tok, ids), 3, logit_bias=reasoning_end_bias(tok)):
            result = split_chat_result(seq.result(), tok, line)
            assert result["finish_reason"] == "tool_calls" and len(result["tool_calls"]) == 1
            function = result["tool_calls"][0]["function"]
            arguments = json.loads(function["arguments"])
            if function["name"] == "get_weather":
                jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])
            else:
                assert choice == "required" and function["name"] == "get_time" and isinstance(arguments, dict)


def reasoned(tok, output_ids: list[int]) -> int | None:
    """How many tokens of reasoning an output holds: before Qwen's </think> (None when it never comes), in
    harmony's analysis message (0 when the output has none)."""
    if "<|end|>" not in tok.special_tokens:
        end = tok.token_to_id("</think>")
        return output_ids.index(end) if end in output_ids else None
    channel, message, end = (tok.special_tokens[t] for t in ("<|channel|>", "<|message|>", "<|end|>"))
    if output_ids[:1] != [channel] or message not in output_ids:
        return 0
    body = output_ids.index(message) + 1
    return output_ids.index(end) - body if tok.decode(output_ids[1:body - 1]) == "analysis" else 0


def test_a_reasoning_budget_ends_the_reasoning(model):
    """thinking_token_budget, with no bias: the tiny models, which seldom end their reasoning, reason at most
    the budget, then the engine ends it (Qwen's </think>; harmony's final channel), and a forced call still
    comes whole within max_tokens; a budget alone leaves the answer free, and 0 skips the reasoning."""
    from raymoe.stages.text.answers import split_chat_result
    tok = model.tokenizer
    line = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "thinking_token_budget": 12}
    ids = tok.encode(chat_prompt(ASK, tok, tools=tool_request(line).template_tools()))
    seqs = answers(model, ids, line_grammar(line, tok, ids), 3)
    assert max(reasoned(tok, s.output_ids) for s in seqs) == 12        # the budget, reached
    for seq in seqs:
        result = split_chat_result(seq.result(), tok, line)
        assert result["finish_reason"] == "tool_calls", result
        jsonschema.validate(json.loads(result["tool_calls"][0]["function"]["arguments"]),
                            TOOLS[0]["function"]["parameters"])
    ids = tok.encode(chat_prompt(ASK, tok))
    for budget in (5, 0):
        grammar = line_grammar({"messages": ASK, "thinking_token_budget": budget}, tok, ids)
        for seq in answers(model, ids, grammar, 2, max_tokens=30):
            assert reasoned(tok, seq.output_ids) <= budget, tok.decode(seq.output_ids)
    assert line_grammar({"messages": ASK, "thinking_token_budget": -1}, tok, ids) is None
    with pytest.raises(RequestError, match="thinking_token_budget must be an integer >= 0"):
        line_grammar({"messages": ASK, "thinking_token_budget": 1.5}, tok, ids)


def test_a_split_pipeline_samples_the_same(model):
    """Two stages (the matchers on the last) give the tokens one gives."""
    tok = model.tokenizer
    ids = tok.encode(chat_prompt(ASK, tok, {"enable_thinking": False}))
    grammar = output_grammar(tok, ids, WEATHER, None)
    one = [s.output_ids for s in answers(model, ids, grammar, 3, seed=7, logit_bias=reasoning_end_bias(tok))]
    engine = LocalEngine(model, 2, "float32")
    seqs = [engine.add_request(i, ids, SamplingParams(max_tokens=160, temperature=1.0, seed=7 + i, grammar=grammar,
                                                      logit_bias=reasoning_end_bias(tok))) for i in range(3)]
    engine.run_until_done()
    assert [s.output_ids for s in seqs] == one


BAD = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
       ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "json_schema.name"),
       ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "nowhere"),
       ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
        "response_format.json_schema.schema: input should be a valid dictionary"),
       ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}},
        "supplied: response_format.json_schema.'extra'"),
       ({"type": "xml"}, "response_format.type: input should be 'text' or 'json_object', got 'xml'"),
       ("json", "response_format: input should be a valid dictionary")]


def served(m) -> ServedModel:
    return ServedModel("m", m.tokenizer, m.config.context_length, m.config.vocab)


@pytest.mark.parametrize("fmt, says", BAD)
def test_bad_response_formats_are_400_naming_the_problem(fmt, says):
    m = open_model("tiny-qwen35moe")
    with pytest.raises(APIError) as e:
        parse_chat({"messages": ASK, "response_format": fmt}, served(m))
    param = "extra" if "Unrecognized" in e.value.message else "response_format"      # an unknown field names itself
    assert e.value.status == 400 and e.value.param == param and says in e.value.message, e.value.message


def test_other_refusals():
    m = open_model("tiny-qwen35moe")
    args = (served(m),)
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]
    for body, param, says in (
            ({"tools": bad_tool, "tool_choice": "required"}, "tools", "the parameters of f"),
            ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos cannot"),
    ):
        with pytest.raises(APIError) as e:
            parse_chat({"messages": ASK, **body}, *args)
        assert e.value.param == param and says in e.value.message, e.value.message
    # tool_choice auto with a bad schema asks for no grammar: accepted, as before
    parse_chat({"messages": ASK, "tools": bad_tool}, *args)
    with pytest.raises(RequestError, match="grammar or response_format"):
        line_grammar({"messages": ASK, "response_format": {"type": "json_object"}, "grammar": "start: \"x\""},
                     m.tokenizer, [1])


def test_json_object_and_responses_text_format():
    """json_object takes any object (here nested), then only the end token; /v1/responses' text.format
    reaches the same grammar as the chat's response_format."""
    from raymoe.deploy.responses_api import parse_responses
    m = open_model("tiny-qwen35moe")
    tok, args = m.tokenizer, (served(m),)
    chat = parse_chat({"messages": ASK, "response_format": {"type": "json_object"},
                       "chat_template_kwargs": {"enable_thinking": False}}, *args)
    out = tok.encode('{"a": [1, {"b": null}], "c": "x"}')
    matchers = Matchers(tok, m.config.vocab)
    for n in range(len(out)):
        assert matchers.masks([(0, chat.engine_request["grammar"], out[:n])])[0][out[n]]
    [end] = matchers.masks([(0, chat.engine_request["grammar"], out)])
    assert end.nonzero().flatten().tolist() == [tok.eos_token_id]
    fmt = response_format("weather")
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "response_format": fmt}, *args)
    response = parse_responses({"input": "Hi", "text": {"format": {"type": "json_schema", **fmt["json_schema"]}}},
                               *args)
    assert response.engine_request["grammar"] == chat.engine_request["grammar"]
