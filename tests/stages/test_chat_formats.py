"""Chat formats (stages/text/formats/): the format comes from the chat template, then the family; a forced call is
written in the form the template teaches; call tags are read by id, whatever the tokenizer calls special.

The model here is tiny-qwen35moe with `<tool_call>` and `</tool_call>` added as special tokens (they decode to
nothing), served with the Qwen3.5 template of examples/chat_templates/, as a real Qwen3.5 file would be."""
import json

import jsonschema
import pytest
from chat_templates import GPTOSS, QWEN35
from gguf_edit import add_special_tokens
from structured_cases import ASK, TOOLS, reasoning_end_bias

from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.text.answers import chat_parsers, split_chat_result
from raymoe.stages.text.formats.registry import chat_format
from raymoe.stages.text.grammar import llg_tokenizer, llguidance
from raymoe.stages.text.reasoning import SplitText
from raymoe.stages.text.requests import chat_prompt, line_grammar
from raymoe.stages.text.sampling_params import SamplingParams
from raymoe.stages.text.tool_calls import TOOL_CALLS
from raymoe.stages.text.tools import tool_request

HERMES_TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
                   "{%- if tools %}Call as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>{%- endif %}"
                   "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}")
FORCED = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """tiny-qwen35moe whose tokenizer has the call tags as special tokens, with the Qwen3.5 template."""
    path = add_special_tokens(open_model("tiny-qwen35moe").path, str(tmp_path_factory.mktemp("tags") / "m.gguf"),
                              ["<tool_call>", "</tool_call>"])
    model = open_model(path)
    model.tokenizer.chat_template = QWEN35
    return model


def test_the_format_comes_from_the_template_then_the_family():
    qwen, gptoss = open_model("tiny-qwen35moe").tokenizer, open_model("tiny-gptoss").tokenizer
    assert chat_format(qwen).name == "qwen_xml" and chat_format(gptoss).name == "harmony"    # their families'
    qwen.chat_template = HERMES_TEMPLATE
    assert chat_format(qwen).name == "hermes"
    qwen.chat_template = GPTOSS
    assert chat_format(qwen).name == "harmony"
    qwen.chat_template = QWEN35
    assert chat_format(qwen).name == "qwen_xml"
    qwen.chat_template, qwen.family_chat_format = None, None
    assert chat_format(qwen) is None


def forced_call_outputs(model, n: int):
    tok = model.tokenizer
    ids = tok.encode(chat_prompt(ASK, tok, tools=tool_request(FORCED).template_tools()))
    grammar = line_grammar(FORCED, tok, ids)
    engine = LocalEngine(model, 1, "float32")
    seqs = [engine.add_request(i, ids, SamplingParams(max_tokens=200, temperature=1.0, seed=i, grammar=grammar,
                                                      logit_bias=reasoning_end_bias(tok))) for i in range(n)]
    engine.run_until_done()
    return ids, grammar, seqs


def test_a_forced_call_through_the_qwen35_template_is_xml_and_comes_back_as_tool_calls(qwen35):
    """The grammar writes the XML form the template teaches (not hermes JSON); the tags, special tokens here,
    are read by id, so the answer is a call, not content; streamed in pieces, the same call."""
    tok = qwen35.tokenizer
    ids, grammar, seqs = forced_call_outputs(qwen35, 3)
    assert "<function=get_weather>" in grammar and '"name"' not in grammar
    schema = TOOLS[0]["function"]["parameters"]
    for seq in seqs:
        assert seq.output_ids.count(tok.token_to_id("<tool_call>")) == 1
        written = tok.decode(seq.output_ids, skip_special_tokens=False)
        assert "<function=get_weather>\n<parameter=city>\n" in written and '{"name"' not in written
        result = split_chat_result(seq.result(), tok, FORCED)
        assert result["finish_reason"] == "tool_calls" and result["text"] == "", result
        [call] = result["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        parser, reader = chat_parsers(tok, ids, tool_request(FORCED))
        split, events = SplitText(parser), []
        for token in seq.output_ids:
            events += reader.feed(split.update([token]))
        events += reader.feed(split.final([], seq.text)) + reader.finish()
        assert [e[1]["function"] for e in events if e[0] == TOOL_CALLS] == [call["function"]]


def test_call_tags_that_decode_to_nothing_are_read_by_id(qwen35):
    """A scripted answer: both call forms inside special-token tags are calls, the text around them content."""
    tok = qwen35.tokenizer
    open_tag, close_tag, end = (tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>"))
    xml = ("\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
           "</function>\n")
    hermes = '\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n'
    output = (tok.encode("Let me check.\n</think>\n\nChecking.\n\n") + [open_tag] + tok.encode(xml) + [close_tag]
              + tok.encode("\n") + [open_tag] + tok.encode(hermes) + [close_tag, end])
    request = {**FORCED, "tool_choice": "auto", "parallel_tool_calls": True}
    prompt = tok.encode(chat_prompt(ASK, tok, tools=tool_request(request).template_tools()))
    text = tok.decode(output, skip_special_tokens=True)
    result = split_chat_result({"prompt_token_ids": prompt, "token_ids": output, "text": text,
                                "finish_reason": "stop"}, tok, request)
    assert result["reasoning_content"] == "Let me check.\n" and result["text"] == "\n\nChecking."
    assert [json.loads(c["function"]["arguments"]) for c in result["tool_calls"]] == [
        {"city": "Paris", "days": 2}, {"city": "Rome", "days": 1}]


def test_a_hermes_template_forces_the_json_form():
    tok = open_model("tiny-qwen35moe").tokenizer
    tok.chat_template = HERMES_TEMPLATE
    ids = tok.encode(chat_prompt(ASK, tok, tools=tool_request(FORCED).template_tools()))
    grammar = line_grammar(FORCED, tok, ids)
    assert '"const": "get_weather"' in grammar and "<function=" not in grammar


def test_the_xml_grammar_takes_free_text_arguments_and_refuses_the_json_form(qwen35):
    """A string argument is text up to its line end and `</parameter>` (several lines allowed); an optional
    argument may be left out; the hermes JSON form is not the template's, so the grammar refuses it."""
    tok = qwen35.tokenizer
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}, "pin": {"type": "boolean"}},
        "required": ["text"]}}}
    request = {"messages": ASK, "tools": [note], "tool_choice": {"type": "function", "function": {"name": "note"}}}
    ids = tok.encode(chat_prompt(ASK, tok, {"enable_thinking": False}, tools=tool_request(request).template_tools()))
    grammar = line_grammar(request, tok, ids)
    end = tok.token_to_id("<|im_end|>")

    def accepted(body: str) -> bool:
        matcher = llguidance().LLMatcher(llg_tokenizer(tok), llguidance().LLMatcher.grammar_from_lark(grammar))
        output = [tok.token_to_id("<tool_call>")] + tok.encode(body) + [tok.token_to_id("</tool_call>"), end]
        return matcher.consume_tokens(output) and matcher.is_accepting()

    assert accepted("\n<function=note>\n<parameter=text>\nline 1\n\nline 2 < 3\n</parameter>\n</function>\n")
    assert accepted("\n<function=note>\n<parameter=text>\nx\n</parameter>\n<parameter=pin>\ntrue\n</parameter>\n"
                    "</function>\n")
    assert not accepted('\n{"name": "note", "arguments": {"text": "x"}}\n')
    assert not accepted("\n<function=note>\n</function>\n")          # text is required
