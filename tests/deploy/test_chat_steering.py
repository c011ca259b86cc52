"""Steering chat templates: the variables transformers passes (bos/eos tokens, add_generation_prompt, tools,
documents), chat_template_kwargs per request over a server's default, --chat-template, and templates that
produce the released formats (tests/chat_templates.py) rendering history with reasoning."""
import argparse
import copy

import pytest

from chat_templates import GPTOSS, QWEN35
from raymoe.cluster.engine_args import EngineArgs, add_engine_flags
from raymoe.deploy.openai_api import APIError, parse_chat, parse_tokenize
from raymoe.deploy.protocol import ServedModel
from raymoe.stages.text.chat import MAX_TEMPLATE_KWARGS, check_template_kwargs, load_chat_template
from raymoe.stages.errors import RaymoeError, RequestError
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.answers import output_parser
from raymoe.stages.text.reasoning import CONTENT, REASONING, split_answer
from raymoe.stages.text.requests import chat_prompt, prompt_ids


@pytest.fixture(scope="module")
def qwen_model():
    return open_model("tiny-qwen35moe")


@pytest.fixture(scope="module")
def gptoss_model():
    return open_model("tiny-gptoss")


def tokenizer(files, template=None, defaults=None):
    """A copy of the model's tokenizer with another template and default template variables."""
    tok = copy.copy(files.tokenizer)
    EngineArgs("unused", chat_template=template,
               chat_template_kwargs=defaults).configure_chat(tok)
    return tok


HI = [{"role": "user", "content": "Hi"}]
PROBE = ("bos={{ bos_token }} eos={{ eos_token }} gen={{ add_generation_prompt }} tools={{ tools }} "
         "documents={{ documents }} thinking={{ enable_thinking | default('unset') }} n={{ messages | length }}")


def test_the_variables_transformers_passes(gptoss_model):
    tok = tokenizer(gptoss_model, PROBE)
    text = str(chat_prompt(HI, tok))
    assert text == ("bos=<|startoftext|> eos=<|return|> gen=True tools=None documents=None thinking=unset n=1")
    assert "gen=False" in chat_prompt(HI, tok, add_generation_prompt=False)


def test_request_kwargs_override_the_server_default(qwen_model):
    tok = tokenizer(qwen_model, PROBE, {"enable_thinking": False})
    assert "thinking=False" in chat_prompt(HI, tok)
    assert "thinking=True" in chat_prompt(HI, tok, {"enable_thinking": True})
    assert "eos=custom" in chat_prompt(HI, tok, {"eos_token": "custom"})     # as transformers: kwargs win
    # a JSONL line (the batch job, the coordinator) carries them the same way
    line_ids = prompt_ids({"messages": HI, "chat_template_kwargs": {"enable_thinking": True}}, tok)
    assert "thinking=True" in tok.decode(line_ids)


def test_enable_thinking_reaches_the_model_template(qwen_model):
    tok = qwen_model.tokenizer
    on = tok.decode(prompt_ids({"messages": HI}, tok))
    off = tok.decode(prompt_ids({"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}, tok))
    assert on.endswith("<|im_start|>assistant\n<think>\n") and off.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("kwargs, message", [
    ([1], "chat_template_kwargs must be an object"),
    ({"messages": []}, "'messages' is set by the server"),
    ({"add_generation_prompt": False}, "'add_generation_prompt' is set by the server"),
    ({"tools": []}, "'tools' is set by the server"),
    ({"raise_exception": 1}, "'raise_exception' is set by the server"),
    ({"not a name": 1}, "is not a template variable name"),
    ({"_private": 1}, "is not a template variable name"),
    ({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}, "at most 32 are allowed"),
    ({"big": "x" * 20000}, "bytes as JSON; at most 16384"),
])
def test_bad_template_kwargs(kwargs, message):
    with pytest.raises(RequestError, match=message):
        check_template_kwargs(kwargs)


def test_api_template_kwargs_and_reasoning_effort(gptoss_model):
    tok = tokenizer(gptoss_model, GPTOSS)
    cfg = gptoss_model.config

    served = ServedModel("m", tok, cfg.context_length, cfg.vocab)

    def rendered(**body):
        return tok.decode(parse_chat({"messages": HI, **body}, served).prompt_ids)

    assert "Reasoning: medium" in rendered()
    assert "Reasoning: high" in rendered(chat_template_kwargs={"reasoning_effort": "high"})
    assert "Reasoning: low" in rendered(reasoning_effort="low")                     # OpenAI's own field
    assert "Reasoning: high" in rendered(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    for body, param in (({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
                        ({"reasoning_effort": "extreme"}, "reasoning_effort")):
        with pytest.raises(APIError) as e:
            rendered(**body)
        assert e.value.status == 400 and e.value.param == param


# ---- --chat-template and --chat-template-kwargs ---------------------------------------------------

def test_chat_template_file_or_text(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}!")
    assert load_chat_template(str(f)) == "{{ messages[0].content }}!"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    assert load_chat_template(None) is None
    with pytest.raises(RaymoeError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(RaymoeError, match="syntax error"):
        load_chat_template("{% if %}")


def test_flags(tmp_path):
    p = argparse.ArgumentParser()
    add_engine_flags(p, ["model", "chat_template", "chat_template_kwargs"])
    f = tmp_path / "t.jinja"
    f.write_text("<{{ messages[0].content }}>")
    args = EngineArgs.from_flags(p.parse_args(["--model", "tiny-gptoss", "--chat-template", str(f),
                                               "--chat-template-kwargs", '{"reasoning_effort": "high"}']))
    assert args.chat_template_kwargs == {"reasoning_effort": "high"}
    resolved = args.resolved()
    assert resolved.chat_template == "<{{ messages[0].content }}>"         # the text travels, not the path
    tok = copy.copy(open_model("tiny-gptoss").tokenizer)
    resolved.configure_chat(tok)
    assert str(chat_prompt(HI, tok)) == "<Hi>" and tok.chat_template_kwargs == {"reasoning_effort": "high"}
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--chat-template-kwargs", "[1]"])
    with pytest.raises(RaymoeError, match="--chat-template-kwargs: 'tools' is set by the server"):
        EngineArgs("tiny-gptoss", chat_template_kwargs={"tools": 1}).validate()


# ---- the released formats, history with reasoning --------------------------------------------------

def test_qwen35_format_and_history_with_reasoning(qwen_model):
    tok = tokenizer(qwen_model, QWEN35)
    assert str(chat_prompt([{"role": "system", "content": "Be brief."}, *HI], tok)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4", "reasoning_content": "\nAdd them.\n"},
               {"role": "user", "content": "And 3+3?"},
               {"role": "assistant", "content": "\n\n6", "reasoning_content": "Add again."}]
    text = str(chat_prompt(history, tok, add_generation_prompt=False))
    # the earlier turn keeps its answer only; the one after the last user message shows its reasoning
    assert text == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n")
    # reasoning under the other names clients use reaches the template as reasoning_content too
    for name in ("reasoning", "thinking"):
        msgs = [*history[:3], {"role": "assistant", "content": "6", name: "Add again."}]
        assert str(chat_prompt(msgs, tok, add_generation_prompt=False)) == text
    # an answer sent back as this server split it: the next prompt renders it the way the model wrote it
    prompt = tok.encode(chat_prompt(history[:3], tok))
    output = tok.encode("Add again.\n</think>\n\n6<|im_end|>")
    answer = split_answer(output_parser(tok, prompt), output, tok.decode(output, skip_special_tokens=True))
    assert answer == {REASONING: "Add again.\n", CONTENT: "\n\n6"}
    sent_back = [*history[:3], {"role": "assistant", **answer}]
    assert str(chat_prompt(sent_back, tok, add_generation_prompt=False)) == text
    assert tok.decode(prompt + output) == text[:-1]        # (the template ends the turn with a newline)


def test_gptoss_format_and_history_with_reasoning(gptoss_model):
    tok = tokenizer(gptoss_model, GPTOSS, {"reasoning_effort": "low"})
    system = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
              "Knowledge cutoff: 2024-06\n\nReasoning: {}\n\n# Valid channels: analysis, commentary, final. "
              "Channel must be included for every message.<|end|>")
    msgs = [{"role": "system", "content": "Answer in French."}, *HI]
    assert str(chat_prompt(msgs, tok)) == (system.format("low") + "<|start|>developer<|message|># Instructions\n\n"
                                           "Answer in French.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert str(chat_prompt(msgs, tok, {"reasoning_effort": "high"})).startswith(system.format("high"))
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
               {"role": "user", "content": "And 3+3?"},
               {"role": "assistant", "content": "6", "reasoning_content": "Add again."}]
    text = str(chat_prompt(history, tok, add_generation_prompt=False))
    assert text == (system.format("low") + "<|start|>user<|message|>2+2?<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>4<|end|>"
                    "<|start|>user<|message|>And 3+3?<|end|>"
                    "<|start|>assistant<|channel|>analysis<|message|>Add again.<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>6<|return|>")
    # the answer as this server splits the model's output, sent back, renders as the model wrote it
    prompt = tok.encode(chat_prompt(history[:3], tok))
    output = tok.encode("<|channel|>analysis<|message|>Add again.<|end|><|start|>assistant<|channel|>final"
                        "<|message|>6<|return|>")
    answer = split_answer(output_parser(tok, prompt), output, tok.decode(output, skip_special_tokens=True))
    assert answer == {REASONING: "Add again.", CONTENT: "6"}
    assert str(chat_prompt([*history[:3], {"role": "assistant", **answer}], tok, add_generation_prompt=False)) == text
    assert tok.decode(prompt + output) == text
    # channel tags inside content are refused by the template, as gpt-oss's own does
    with pytest.raises(RequestError, match="thinking field"):
        chat_prompt([*HI, {"role": "assistant", "content": "<|channel|>analysis<|message|>x"}], tok)


@pytest.mark.cluster
def test_batch_job_template_flags_and_line_kwargs(tmp_path):
    """deploy.generate: --chat-template and --chat-template-kwargs reach the coordinator's rendering, a
    line's chat_template_kwargs override them, and a chat line's reasoning goes apart from its text."""
    import json

    from raymoe.deploy import generate
    template = tmp_path / "t.jinja"
    template.write_text("<|im_start|>user\n{{ messages[0].content }} ({{ mood }})<|im_end|>\n<|im_start|>assistant\n"
                        "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")
    lines = [{"id": "default", "messages": HI},
             {"id": "line", "messages": HI, "chat_template_kwargs": {"mood": "sad", "enable_thinking": True}},
             {"id": "bad", "messages": HI, "chat_template_kwargs": {"tools": []}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out), "--max-tokens", "4",
                          "--temperature", "0", "--chat-template", str(template),
                          "--chat-template-kwargs", '{"mood": "happy", "enable_thinking": false}']) == 0
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    tok = open_model("tiny-qwen35moe").tokenizer
    default = tok.decode(results["default"]["prompt_token_ids"])
    assert default == "<|im_start|>user\nHi (happy)<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert results["default"]["reasoning_content"] is None          # thinking off: all answer
    assert results["default"]["text"] == tok.decode(results["default"]["token_ids"], skip_special_tokens=True)
    line = tok.decode(results["line"]["prompt_token_ids"])
    assert line == "<|im_start|>user\nHi (sad)<|im_end|>\n<|im_start|>assistant\n<think>\n"
    generated = tok.decode(results["line"]["token_ids"], skip_special_tokens=True)
    if "</think>" not in generated:                                # thinking on, no end tag: all reasoning
        assert (results["line"]["reasoning_content"] or "") == generated and results["line"]["text"] == ""
    assert "'tools' is set by the server" in results["bad"]["error"]


def test_tokenize_renders_like_chat(gptoss_model):
    tok = tokenizer(gptoss_model, GPTOSS)
    cfg = gptoss_model.config
    body = {"messages": HI, "reasoning_effort": "high"}
    served = ServedModel("m", tok, cfg.context_length, cfg.vocab)
    chat = parse_chat(dict(body), served)
    assert parse_tokenize(dict(body), served)["tokens"] == chat.prompt_ids
    no_gen = parse_tokenize({**body, "add_generation_prompt": False}, served)
    assert chat.prompt_ids[:no_gen["count"]] == no_gen["tokens"] and no_gen["count"] < len(chat.prompt_ids)


def test_serve_flags_reach_the_app_args(tmp_path):
    """python -m raymoe.deploy.serve --chat-template FILE --chat-template-kwargs JSON: the app gets the template's text."""
    from raymoe.deploy.http_app import app_builder
    from raymoe.deploy.serve import parse_args
    from raymoe.deploy.serving import ServeArgs
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    args = ServeArgs.from_flags(parse_args(["--model", "tiny-gptoss", "--chat-template", str(f),
                                            "--chat-template-kwargs", '{"reasoning_effort": "high"}']))
    assert (args.chat_template, args.chat_template_kwargs) == (str(f), {"reasoning_effort": "high"})
    app = app_builder(args)
    bound = app._bound_deployment.init_args[0]
    assert bound["chat_template"] == "{{ messages[0].content }}"
    assert bound["chat_template_kwargs"] == {"reasoning_effort": "high"}
    with pytest.raises(RaymoeError, match="no such file"):
        app_builder(ServeArgs(model="tiny-gptoss", chat_template=str(tmp_path / "missing")))
