"""Structured outputs: a grammar that every sampled token must keep to, for OpenAI's `response_format`
(`json_object`, `json_schema`) and for a `tool_choice` that forces a call (`required`, a named function).

The grammar engine is llguidance (a Rust library with a Python wheel that needs neither torch nor a
GPU): it compiles JSON schemas and Lark grammars against the model's own tokenizer, and gives the
mask of the tokens allowed next in microseconds. A grammar is Lark text in llguidance's syntax,
written here for the whole output the model writes, in its chat format: reasoning first (free text,
ended by Qwen's `</think>` or a harmony analysis message), then the answer (the JSON, or the tool
call in the family's own form), then the end token, after which the grammar allows nothing more,
so the sequence stops with finish_reason "stop". Special tokens are named by id (`<[id]>`).

The mask is applied on the last stage, where sampling happens (stages/runtime/sampler.py): `Matchers` keeps
one matcher per sequence there and advances it with the tokens the batch says the sequence has
generated, rebuilding it from them whenever its state does not match (a restarted stage, steps
dropped by a restart), so the mask depends only on the grammar and the tokens: the same outputs at
every PP, EP and transport.
"""
from __future__ import annotations

import json
from collections import OrderedDict

from raymoe.stages.errors import RequestError, check_json_size
from raymoe.stages.text.reasoning import REASONING, HarmonyParser, ThinkParser, output_parser
from raymoe.stages.text.tools import FUNCTION_NAME, ToolRequest

MAX_SCHEMA_BYTES = 256 * 1024        # one JSON schema (response_format), as JSON
MAX_GRAMMAR_BYTES = 1024 * 1024      # a whole grammar (with every forced tool's schema)
FORMATS = ("text", "json_object", "json_schema")
# How the JSON is laid out: one space after ':' and ',' (as Python's json.dumps, and as models mostly
# write it), no other whitespace, so that a sampled answer cannot run on in spaces and newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FREE_TEXT = "/(.|\\n)*/"             # reasoning: any text (special tokens end it)


def response_schema(fmt) -> dict | None:
    """The JSON schema a `response_format` asks for ({} is any JSON object's), or None for text.
    RequestError naming the field for a bad value."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in FORMATS:
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise RequestError(f"response_format.type must be one of {', '.join(FORMATS)}, got {repr(got)[:60]}")
    kind = fmt["type"]
    extra = [k for k in fmt if k not in ("type", "json_schema" if kind == "json_schema" else "type")]
    if extra:
        raise RequestError(f"response_format: unknown field {extra[0]!r} for type {kind}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("response_format.json_schema must be an object {\"name\", \"schema\", \"strict\"}")
    unknown = [k for k in spec if k not in ("name", "schema", "strict", "description")]
    if unknown:
        raise RequestError(f"response_format.json_schema: unknown field {unknown[0]!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise RequestError(f"response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-', "
                           f"got {repr(name)[:60]}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise RequestError("response_format.json_schema.strict must be a boolean")
    if not isinstance(spec.get("description", ""), (str, type(None))):
        raise RequestError("response_format.json_schema.description must be a string")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema must be a JSON schema (an object)")
    check_json_size(schema, "response_format.json_schema.schema", MAX_SCHEMA_BYTES)
    return schema


def _llg():
    import llguidance          # imported on use: only structured requests need it
    return llguidance


def llg_tokenizer(tokenizer):
    """llguidance's view of the model's tokenizer (built once per tokenizer: ~1 s for a 200k vocabulary)."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is None:
        end = end_token(tokenizer)
        cached = _llg().LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=end)
        tokenizer._llg_tokenizer = cached
    return cached


def end_token(tokenizer) -> int:
    """The token that ends an answer: ChatML's <|im_end|>, else the model's end-of-sequence token."""
    end = tokenizer.special_tokens.get("<|im_end|>", tokenizer.eos_token_id)
    if end is None and tokenizer.eos_token_ids:
        end = tokenizer.eos_token_ids[0]
    if end is None:
        raise RequestError("this model has no end-of-sequence token: structured outputs need one")
    return end


def _error_line(message: str) -> str:
    """llguidance's error, the line that says what is wrong (it adds the grammar's text and a caret)."""
    line = next((ln.strip() for ln in message.splitlines() if ln.strip()), message)
    if line.startswith("at ") and ": " in line:       # "at 1(8): ..." is a place in our Lark text
        line = line.split(": ", 1)[1]
    return line[:500]


def check_schema(schema: dict, tokenizer, field: str):
    """RequestError naming `field` when llguidance cannot compile the JSON schema (an unknown type or
    format, a bad $ref, a keyword it does not implement, ...)."""
    llg = _llg()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(_laid_out(schema))
    except (ValueError, TypeError) as e:
        raise RequestError(f"{field}: {_error_line(str(e))}") from None
    error = llg.LLMatcher.validate_grammar(grammar, llg_tokenizer(tokenizer))
    if error:
        raise RequestError(f"{field}: {_error_line(error)}")


def check_grammar(grammar, tokenizer):
    """RequestError unless `grammar` is Lark text that llguidance compiles for this tokenizer."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise RequestError("grammar must be a non-empty string (a Lark grammar in llguidance's syntax)")
    if len(grammar.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise RequestError(f"grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
    llg = _llg()
    error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(grammar), llg_tokenizer(tokenizer))
    if error:
        raise RequestError(f"grammar: {_error_line(error)}")


# ---- grammars -------------------------------------------------------------------------------------

def _laid_out(schema: dict) -> dict:
    """The schema with JSON_LAYOUT as its llguidance options (its own x-guidance, if any, wins)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_LAYOUT, **(own if isinstance(own, dict) else {})}}


def _json(schema: dict) -> str:
    return "%json " + json.dumps(_laid_out(schema), ensure_ascii=False)


class _Writer:
    """Lark pieces for one tokenizer: a marker text is its token when the tokenizer has it as an added
    token (llguidance matches those only by id), else the text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()}

    def text(self, text: str) -> str:
        """`text` as the model would write it: the added tokens in it by id, the rest as strings."""
        out, rest = [], text
        while rest:
            at, token = min(((rest.find(t), t) for t in self.added if t in rest), default=(-1, None))
            if token is None:
                out.append(json.dumps(rest, ensure_ascii=False))
                break
            if at:
                out.append(json.dumps(rest[:at], ensure_ascii=False))
            out.append(f"<[{self.added[token]}]>")
            rest = rest[at + len(token):]
        return " ".join(out)

    def token(self, name: str) -> str:
        return f"<[{self.tokenizer.special_tokens[name]}]>"


def _call_schema(tools: ToolRequest, name: str) -> dict:
    return tools.parameters(name) or {"type": "object"}


def _forced(tools: ToolRequest | None) -> list[str]:
    """The names of the functions a call must be to (none when tool_choice does not force one)."""
    if tools is None or not tools.active or tools.choice not in ("required", "function"):
        return []
    return [tools.name] if tools.choice == "function" else [t["function"]["name"] for t in tools.tools]


def _text_calls(w: _Writer, tools: ToolRequest, names: list[str]) -> list[str]:
    """Qwen's `<tool_call>` with the JSON form {"name", "arguments"} (stages/text/tool_calls.py reads both
    forms; this one a JSON schema says whole), one call, or one or more with parallel_tool_calls."""
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": _call_schema(tools, n)},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    more = f" ({w.text(chr(10))} call)*" if tools.parallel and tools.choice == "required" else ""
    return [f"answer: call{more}",
            f"call: {w.text('<tool_call>' + chr(10))} {_json(schema)} {w.text(chr(10) + '</tool_call>')}"]


def _harmony_calls(w: _Writer, tools: ToolRequest, names: list[str]) -> list[str]:
    """A harmony message to functions.NAME on the commentary channel, its body the arguments (gpt-oss
    ends its turn at <|call|>: one call)."""
    rules = [f"answer: {' | '.join(f'call_{i}' for i in range(len(names)))}"]
    for i, n in enumerate(names):
        rules.append(f"call_{i}: {w.token('<|channel|>')} {w.text(f'commentary to=functions.{n} ')} "
                     f"{w.token('<|constrain|>')} {w.text('json')} {w.token('<|message|>')} "
                     f"{_json(_call_schema(tools, n))} {w.token('<|call|>')}")
    return rules


def output_grammar(tokenizer, prompt_ids: list[int], schema: dict | None, tools: ToolRequest | None,
                   chat: bool = True, schema_field: str = "response_format") -> str | None:
    """The grammar of the output to `prompt_ids`: its answer the JSON that `schema` describes, or a call
    that tool_choice forces (it wins over the schema); None when neither asks for one. With `chat`, the
    output has the model's chat format (reasoning first, where the prompt leaves it to the model);
    otherwise it is the answer alone, then the end token. schema_field: the request field an error about
    the schema names."""
    names = _forced(tools)
    if schema is None and not names:
        return None
    for name in names:           # each part alone first, for an error that names it
        check_schema(_call_schema(tools, name), tokenizer, f"tools: the parameters of {name}")
    if schema is not None and not names:
        check_schema(schema, tokenizer, schema_field)
    w = _Writer(tokenizer)
    parser = output_parser(tokenizer, prompt_ids, tool_calls=bool(names)) if chat else None
    if isinstance(parser, HarmonyParser):
        return _harmony(w, parser, schema, tools, names)
    rules = _text_calls(w, tools, names) if names else [f"answer: {_json(schema)}"]
    end = f"<[{end_token(tokenizer)}]>"
    if isinstance(parser, ThinkParser) and parser.field == REASONING:
        # Qwen3.5's generation prompt opened <think>: free reasoning, </think>, then the answer
        start = f"start: {FREE_TEXT} <[{parser.end}]> /\\n{{0,2}}/ answer {end}"
    else:
        start = f"start: answer {end}"
    return "\n".join([start, *rules])


def _harmony(w: _Writer, parser: HarmonyParser, schema, tools, names) -> str:
    """gpt-oss: an optional analysis message, then a final message holding the JSON, ended by <|return|>
    (or the call, ended by <|call|>), whatever state the prompt leaves the output in."""
    start, message, channel, end = (w.token(t) for t in ("<|start|>", "<|message|>", "<|channel|>", "<|end|>"))
    next_message = f"{end} {start} {w.text('assistant')}"
    if names:
        rules = _harmony_calls(w, tools, names)
        body = "answer"
    else:
        constrain = f"({w.text(' ')} {w.token('<|constrain|>')} {w.text('json')})?"
        rules = [f"answer: {_json(schema)}"]
        body = f"{channel} {w.text('final')} {constrain} {message} answer {w.token('<|return|>')}"
    analysis = f"{channel} {w.text('analysis')} {message} {FREE_TEXT} {next_message}"
    if parser.header is not None:          # at a header: the prompt ended in <|start|>assistant (or a message's end)
        opening = "" if parser.header else f"{start} {w.text('assistant')} "
        top = f"start: {opening}({analysis})? {body}"
    elif parser.field == REASONING:        # inside an analysis message
        top = f"start: {FREE_TEXT} {next_message} {body}"
    elif names:                            # inside another message: end it, then call
        top = f"start: {FREE_TEXT} {next_message} {body}"
    else:                                  # inside the final message: the JSON continues it
        top = f"start: answer {w.token('<|return|>')}"
    return "\n".join([top, *rules])


# ---- the last stage's matchers ----------------------------------------------------------------------

class Matchers:
    """Per sequence, the llguidance matcher of its grammar and the tokens it has consumed; `masks` gives the
    masks of a step's next tokens. Lives on the last stage (stages/runtime/stage.py)."""

    MAX_COMPILED = 64       # compiled grammars kept (a request's choices share one)

    def __init__(self, tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab
        self.state: dict[int, tuple] = {}                    # seq_id -> (grammar, matcher, tokens consumed)
        self.compiled: OrderedDict[str, object] = OrderedDict()   # grammar -> a fresh matcher to copy

    def _fresh(self, grammar: str):
        llg = _llg()
        matcher = self.compiled.get(grammar)
        if matcher is None:
            matcher = llg.LLMatcher(llg_tokenizer(self.tokenizer), llg.LLMatcher.grammar_from_lark(grammar),
                                    log_level=0)
            if matcher.is_error():
                raise RequestError(f"grammar: {_error_line(matcher.get_error())}")
            self.compiled[grammar] = matcher
            if len(self.compiled) > self.MAX_COMPILED:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(grammar)
        return matcher.deep_copy()

    def _advance(self, seq_id: int, grammar: str, output_ids: list[int]):
        """The sequence's matcher after `output_ids` (its output so far): it goes on from where it was when
        its tokens begin output_ids; otherwise (a new stage, a step dropped by a restart) a fresh one
        consumes them all."""
        state = self.state.get(seq_id)
        if state is None or state[0] != grammar or output_ids[:len(state[2])] != state[2]:
            state = (grammar, self._fresh(grammar), [])
        _, matcher, consumed = state
        new = output_ids[len(consumed):]
        if new and not matcher.consume_tokens(new):
            raise RuntimeError(f"the output left its grammar: {_error_line(matcher.get_error())}")
        self.state[seq_id] = (grammar, matcher, list(output_ids))
        return matcher

    def masks(self, requests: list[tuple]) -> list:
        """Per (seq_id, grammar, output_ids), a bool tensor [vocab] of the tokens its grammar allows next, or
        the message of what went wrong with that sequence (it alone fails)."""
        import numpy as np
        import torch
        matchers, out = [], []
        for seq_id, grammar, output_ids in requests:
            try:
                matchers.append(self._advance(seq_id, grammar, output_ids))
                out.append(None)
            except Exception as e:
                matchers.append(None)
                out.append(f"{type(e).__name__}: {e}")
        words = (llg_tokenizer(self.tokenizer).vocab_size + 31) // 32
        bitmask = np.zeros((len(requests), words), np.int32)
        for i, matcher in enumerate(matchers):    # a few microseconds each: threads would cost more
            if matcher is not None:
                matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * words * 4, words * 4)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab]
        if bits.shape[1] < self.vocab:         # the model's rows past the tokenizer's: never allowed
            bits = np.pad(bits, ((0, 0), (0, self.vocab - bits.shape[1])))
        allowed = torch.from_numpy(bits.view(np.bool_))
        for i, some in enumerate(bits.any(axis=1).tolist()):
            if out[i] is None:
                out[i] = allowed[i] if some else \
                    f"the grammar allows no token: {_error_line(matchers[i].get_error()) or 'it has ended'}"
        return out

    def release(self, seq_id: int):
        self.state.pop(seq_id, None)

    def clear(self):
        self.state.clear()
