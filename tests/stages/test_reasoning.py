"""Reasoning kept apart from the answer (stages/text/reasoning.py), on scripted outputs encoded with the tiny
models' tokenizers (which have the real formats' special tokens): Qwen3.5's think tags and gpt-oss's
harmony messages, whole and streamed. The engine is simulated by stages.runtime.sequence.Sequence itself (its
text, stop strings and finish), fed the scripted tokens in every grouping into updates."""
import random

import pytest

from engine_updates import engine_updates

from raymoe.deploy.openai_api import Prepared, StreamFormatter, TokenText, chat_message
from raymoe.stages.text.chat import render_chat
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.answers import output_parser, split_result
from raymoe.stages.text.formats.harmony import MAX_HEADER_TOKENS
from raymoe.stages.text.reasoning import CONTENT, REASONING, SplitText, split_answer


@pytest.fixture(scope="module")
def qwen():
    return open_model("tiny-qwen35moe").tokenizer


@pytest.fixture(scope="module")
def gptoss():
    return open_model("tiny-gptoss").tokenizer


HI = [{"role": "user", "content": "Hi"}]


def prompt(tok, messages=HI, **kwargs):
    return tok.encode(render_chat(tok.chat_template, messages, **tok.special_tokens_map, **kwargs))


def split(tok, prompt_ids, output: str):
    ids = tok.encode(output)
    return split_answer(output_parser(tok, prompt_ids), ids, tok.decode(ids, skip_special_tokens=True))


# ---- Qwen3.5: <think> ... </think> ---------------------------------------------------------------

def test_qwen_reasoning_then_answer(qwen):
    p = prompt(qwen)
    assert qwen.decode(p).endswith("<|im_start|>assistant\n<think>\n")
    got = split(qwen, p, "The user greets me.\n</think>\n\nHello! 🙂<|im_end|>")
    assert got == {REASONING: "The user greets me.\n", CONTENT: "\n\nHello! 🙂"}      # newlines kept, as vLLM


def test_qwen_thinking_off_is_all_answer(qwen):
    p = prompt(qwen, enable_thinking=False)
    assert qwen.decode(p).endswith("<think>\n\n</think>\n\n")
    assert split(qwen, p, "Hello!<|im_end|>") == {REASONING: None, CONTENT: "Hello!"}


def test_qwen_cut_short_while_thinking_is_all_reasoning(qwen):
    assert split(qwen, prompt(qwen), "Let me think about") == {REASONING: "Let me think about", CONTENT: ""}


def test_qwen_model_that_opens_its_own_block(qwen):
    """A prompt without an open block (a template of Qwen3's older kind): <think> in the output opens one."""
    p = qwen.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert split(qwen, p, "<think>\nHmm.\n</think>\n\nHi!") == {REASONING: "\nHmm.\n", CONTENT: "\n\nHi!"}
    assert split(qwen, p, "Hi!") == {REASONING: None, CONTENT: "Hi!"}


def test_qwen_history_with_closed_blocks_does_not_open_one(qwen):
    """Earlier turns' think blocks are closed; the state comes from the last turn (since <|im_start|>)."""
    p = qwen.encode("<|im_start|>assistant\n<think>\nold\n</think>\n\nA<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")
    assert split(qwen, p, "new</think>B") == {REASONING: "new", CONTENT: "B"}
    p = qwen.encode("<|im_start|>assistant\n<think>\nunclosed<|im_end|>\n<|im_start|>assistant\n")
    assert split(qwen, p, "B") == {REASONING: None, CONTENT: "B"}


# ---- gpt-oss: harmony ----------------------------------------------------------------------------

ANALYSIS_FINAL = ("<|channel|>analysis<|message|>The user says hi. Reply politely.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")


def test_harmony_analysis_is_reasoning_final_is_answer(gptoss):
    p = prompt(gptoss)
    assert gptoss.decode(p).endswith("<|start|>assistant")
    got = split(gptoss, p, ANALYSIS_FINAL)
    assert got == {REASONING: "The user says hi. Reply politely.", CONTENT: "Hello! How can I help?"}


def test_harmony_decoded_without_parser_shows_the_problem(gptoss):
    """What the engine's own text holds (special tokens dropped): channel names and roles run into the text."""
    ids = gptoss.encode(ANALYSIS_FINAL)
    assert gptoss.decode(ids, skip_special_tokens=True).startswith("analysisThe user")


@pytest.mark.parametrize("output, want", [
    # cut off inside the second header: neither the role nor the channel name leaks
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>fin", ("Think.", "")),
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant", ("Think.", "")),
    ("<|channel|>analy", (None, "")),
    ("<|channel|>analysis<|message|>Still thinking", ("Still thinking", "")),
    # a tool call (commentary, a recipient, a constrained type): its arguments are the answer, the header not
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     ("Need weather.", "{\"city\": \"Paris\"}")),
    # the recipient before the channel, as harmony also allows
    ("<|channel|>analysis<|message|>A<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     "<|message|>{}<|call|>", ("A", "{}")),
    # a preamble on commentary, then the final answer: both answer
    ("<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
     (None, "Checking. Done.")),
    # not harmony at all (a model that ignores the format): plain answer
    ("Hello there.<|return|>", (None, "Hello there.")),
    ("Hello there.", (None, "Hello there.")),
])
def test_harmony_transcripts(gptoss, output, want):
    got = split(gptoss, prompt(gptoss), output)
    assert (got[REASONING], got[CONTENT]) == want


def test_harmony_long_plain_text_is_answer(gptoss):
    text = " ".join(["word"] * (MAX_HEADER_TOKENS + 10))
    assert split(gptoss, prompt(gptoss), text) == {REASONING: None, CONTENT: text}


def test_harmony_prompt_that_opens_a_message(gptoss):
    """A prompt ending inside a message (a prefilled final channel) continues that message."""
    base = gptoss.decode(prompt(gptoss))
    final = gptoss.encode(base + "<|channel|>final<|message|>")
    assert split(gptoss, final, "Sure.<|return|>") == {REASONING: None, CONTENT: "Sure."}
    analysis = gptoss.encode(base + "<|channel|>analysis<|message|>")
    assert split(gptoss, analysis, "Hmm<|end|><|start|>assistant<|channel|>final<|message|>Yes<|return|>") == {
        REASONING: "Hmm", CONTENT: "Yes"}


def test_formats_are_told_by_the_tokenizer(qwen, gptoss):
    assert type(output_parser(qwen, [1])).__name__ == "ThinkParser"
    assert type(output_parser(gptoss, [1])).__name__ == "HarmonyParser"


# ---- streams: every grouping of tokens into updates, stop strings across markers ----------------

def groupings(n: int, rng: random.Random):
    yield set(range(n))                                   # one token an update
    yield set()                                           # all in the final update
    for cut in range(n):                                  # two updates, cut everywhere
        yield {cut}
    for _ in range(6):
        yield {i for i in range(n) if rng.random() < 0.4}


def prepared(tok, prompt_ids, stops, stream=True):
    return Prepared("chat", "chatcmpl-x", "m", prompt_ids, {"prompt_token_ids": prompt_ids, "stop": stops},
                    stream=stream, parser=output_parser(tok, prompt_ids))


def stream_fields(tok, prompt_ids, updates, stops):
    formatter = StreamFormatter(prepared(tok, prompt_ids, stops), TokenText(tok))
    fields = {REASONING: "", CONTENT: ""}
    chunks = [c for update in updates for c in formatter.update(update)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == updates[-1]["finished"]["finish_reason"]
    for chunk in chunks[1:]:
        delta = chunk["choices"][0]["delta"]
        assert set(delta) <= {REASONING, CONTENT} and len(delta) <= 1    # one field a chunk
        for key, text in delta.items():
            assert text                                                  # no empty pieces
            fields[key] += text
    return fields


CASES = [
    ("qwen", "The user greets me. Let me think: 2+2=4.\n</think>\n\nHello! 🙂 The answer is 4.<|im_end|>",
     [[], ["</th"], ["4.\n</think>\n\nHe"], ["answer"], ["🙂"], ["think: 2", "never"], ["\n\n"]]),
    ("gptoss", ANALYSIS_FINAL + "",
     [[], ["analysis"], ["final"], ["politely.H"], ["assistant"], ["How"], [" hi", "xyz"], ["Reply", "can"]]),
    ("gptoss", "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
               "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     [[], ["json"], ["Paris"], ["weather.commentary"]]),
    ("gptoss", "Plain text from a model that ignores harmony, ünïcødé too.<|return|>", [[], ["ünï"]]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_streams_equal_the_whole_answer(qwen, gptoss, case):
    family, output, stop_sets = CASES[case]
    tok = qwen if family == "qwen" else gptoss
    prompt_ids = prompt(tok)
    output_ids = tok.encode(output)
    rng = random.Random(case)
    for stops in stop_sets:
        whole = None
        for bounds in groupings(len(output_ids), rng):
            updates = engine_updates(tok, prompt_ids, output_ids, bounds, stops)
            result = updates[-1]["finished"]
            if whole is None:
                whole = chat_message(prepared(tok, prompt_ids, stops, stream=False), result)
                full = tok.decode(output_ids, skip_special_tokens=True)
                cut = min([full.find(s) for s in stops if s in full] or [len(full)])
                assert result["text"] == full[:cut]        # the engine cut it there
            got = stream_fields(tok, prompt_ids, updates, stops)
            assert got == {REASONING: whole[REASONING] or "", CONTENT: whole[CONTENT]}, (stops, bounds)


def test_stop_string_inside_reasoning_cuts_the_answer_away(qwen):
    p = prompt(qwen)
    ids = qwen.encode("Step one. Step two.</think>Answer.<|im_end|>")
    updates = engine_updates(qwen, p, ids, set(range(len(ids))), ["two"])
    result = updates[-1]["finished"]
    assert result["finish_reason"] == "stop"
    assert chat_message(prepared(qwen, p, ["two"], stream=False), result) == {
        "role": "assistant", CONTENT: "", REASONING: "Step one. Step "}
    assert stream_fields(qwen, p, updates, ["two"]) == {REASONING: "Step one. Step ", CONTENT: ""}


def test_split_text_holds_back_a_possible_stop_across_fields(gptoss):
    """A stop string may span the hidden markup between two messages: what could begin it waits."""
    p = prompt(gptoss)
    ids = gptoss.encode(ANALYSIS_FINAL)
    s = SplitText(output_parser(gptoss, p), ["politely.assistantfinalHello"])
    sent = []
    for token in ids:
        sent += s.update([token])
    assert "".join(t for f, t in sent if f == REASONING) == "The user says hi. Reply "
    assert not any(f == CONTENT for f, _ in sent)
    text = gptoss.decode(ids, skip_special_tokens=True)
    rest = s.final([], text[:text.find("politely.assistantfinalHello")])
    assert rest == []


def test_logprobs_and_token_ids_ride_with_the_chunks(gptoss):
    p = prompt(gptoss)
    ids = gptoss.encode(ANALYSIS_FINAL)
    entries = [{"token_id": t, "logprob": -0.5, "top": [(t, -0.5)]} for t in ids]
    prep = Prepared("chat", "x", "m", p, {"prompt_token_ids": p}, stream=True, logprobs=1, return_token_ids=True,
                    parser=output_parser(gptoss, p))
    formatter = StreamFormatter(prep, TokenText(gptoss))
    updates = engine_updates(gptoss, p, ids, set(range(len(ids))))
    for update, entry in zip(updates, entries):
        update["logprobs"] = [entry]
    chunks = [c for u in updates for c in formatter.update(u)]
    ids_seen = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    lps = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert ids_seen == ids and len(lps) == len(ids)


# ---- the batch job's lines ------------------------------------------------------------------------

def test_split_result_for_chat_lines(qwen, gptoss):
    p = prompt(gptoss)
    ids = gptoss.encode(ANALYSIS_FINAL)
    result = {"id": 1, "prompt_token_ids": p, "token_ids": ids, "text": gptoss.decode(ids, skip_special_tokens=True),
              "finish_reason": "stop", "usage": {}}
    out = split_result(result, gptoss)
    assert list(out)[:5] == ["id", "prompt_token_ids", "token_ids", "text", "reasoning_content"]
    assert out["text"] == "Hello! How can I help?" and out["reasoning_content"] == "The user says hi. Reply politely."
    assert split_result({"id": 2, "error": "bad"}, gptoss) == {"id": 2, "error": "bad"}
    p = prompt(qwen, enable_thinking=False)
    ids = qwen.encode("Hi!")
    out = split_result({"id": 3, "prompt_token_ids": p, "token_ids": ids, "text": "Hi!"}, qwen)
    assert out == {"id": 3, "prompt_token_ids": p, "token_ids": ids, "text": "Hi!", "reasoning_content": None}


def test_every_choice_is_split_from_the_start(qwen):
    """n > 1: the choices share the request's parser as a pattern; each answer starts in the prompt's state."""
    p = prompt(qwen)
    ids = qwen.encode("Think.</think>Answer")
    result = {"token_ids": ids, "text": qwen.decode(ids, skip_special_tokens=True)}
    prep = prepared(qwen, p, [], stream=False)
    assert chat_message(prep, result) == chat_message(prep, result) == {
        "role": "assistant", CONTENT: "Answer", REASONING: "Think."}
    stream = prepared(qwen, p, [])
    updates = engine_updates(qwen, p, ids + [qwen.token_to_id("<|im_end|>")], set())
    formatters = [StreamFormatter(stream, TokenText(qwen), index=i) for i in range(2)]
    for f in formatters:
        text = "".join(c["choices"][0]["delta"].get(CONTENT, "") for u in updates for c in f.update(u))
        assert text == "Answer"
