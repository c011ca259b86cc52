"""Structured outputs: a grammar that every sampled token must keep to, for OpenAI's `response_format`
(`json_object`, `json_schema`) and for a `tool_choice` that forces a call (`required`, a named function).

The grammar engine is llguidance (a Rust library with a Python wheel that needs neither torch nor a
GPU): it compiles JSON schemas and Lark grammars against the model's own tokenizer, and gives the
mask of the tokens allowed next in microseconds. A grammar is Lark text in llguidance's syntax,
written here for the whole output the model writes, in its chat format: reasoning first (free text,
ended by Qwen's `</think>` or a harmony analysis message, at most a reasoning budget's tokens when the
request sets one: thinking_token_budget), then the answer (the JSON, or the tool call in
the form the chat template teaches: stages/text/formats/), then the end token, after which the grammar
allows nothing more, so the sequence stops with finish_reason "stop". Special tokens are named by id
(`<[id]>`).

The mask is applied on the last stage, where sampling happens (stages/runtime/sampler.py): `Matchers` keeps
one matcher per sequence there and advances it with the tokens the batch says the sequence has
generated, rebuilding it from them whenever its state does not match (a restarted stage, steps
dropped by a restart), so the mask depends only on the grammar and the tokens: the same outputs at
every PP, EP and transport.
"""
from __future__ import annotations

from collections import OrderedDict

from raymoe.stages.errors import RequestError, check_json_size
from raymoe.stages.text.formats.hermes import Hermes
from raymoe.stages.text.formats.registry import chat_format
from raymoe.stages.text.grammar import (FREE_ANSWER, Writer, call_schema, check_schema, end_token, error_line,
                                        json_rule, llg_tokenizer, llguidance, reasoning_rule)
from raymoe.stages.text.tools import FUNCTION_NAME, ToolRequest

MAX_SCHEMA_BYTES = 256 * 1024        # one JSON schema (response_format), as JSON
MAX_GRAMMAR_BYTES = 1024 * 1024      # a whole grammar (with every forced tool's schema)
FORMATS = ("text", "json_object", "json_schema")
PLAIN = Hermes()                     # a forced call in a plain-text answer: the hermes JSON form


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


def check_grammar(grammar, tokenizer):
    """RequestError unless `grammar` is Lark text that llguidance compiles for this tokenizer."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise RequestError("grammar must be a non-empty string (a Lark grammar in llguidance's syntax)")
    if len(grammar.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise RequestError(f"grammar is larger than {MAX_GRAMMAR_BYTES} bytes")
    llg = llguidance()
    error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(grammar), llg_tokenizer(tokenizer))
    if error:
        raise RequestError(f"grammar: {error_line(error)}")


# ---- grammars -------------------------------------------------------------------------------------

def _forced(tools: ToolRequest | None) -> list[str]:
    """The names of the functions a call must be to (none when tool_choice does not force one)."""
    if tools is None or not tools.active or tools.choice not in ("required", "function"):
        return []
    return [tools.name] if tools.choice == "function" else [t["function"]["name"] for t in tools.tools]


def output_grammar(tokenizer, prompt_ids: list[int], schema: dict | None, tools: ToolRequest | None,
                   chat: bool = True, schema_field: str = "response_format",
                   reasoning_budget: int | None = None) -> str | None:
    """The grammar of the output to `prompt_ids`: its answer the JSON that `schema` describes, or a call
    that tool_choice forces (it wins over the schema); None when neither asks for one and no reasoning
    budget bounds the output. With `chat`, the output has the model's chat format (reasoning first, where the
    prompt leaves it to the model, at most `reasoning_budget` tokens of it); otherwise it is the answer alone,
    then the end token. schema_field: the request field an error about the schema names."""
    names = _forced(tools)
    if schema is None and not names and reasoning_budget is None:
        return None
    for name in names:           # each part alone first, for an error that names it
        check_schema(call_schema(tools, name), tokenizer, f"tools: the parameters of {name}")
    if schema is not None and not names:
        check_schema(schema, tokenizer, schema_field)
    w = Writer(tokenizer)
    fmt = chat_format(tokenizer) if chat else None
    parser = fmt.parser(tokenizer, prompt_ids, tool_calls=bool(names)) if fmt is not None else None
    end = f"<[{end_token(tokenizer)}]>"
    if schema is None and not names:     # a budget alone: where there is reasoning to bound, the answer is free
        if parser is None or not fmt.reasons(parser):
            return None
        rules = [FREE_ANSWER]
    elif parser is None:              # the answer alone (a forced call in the hermes form), then the end token
        rules = PLAIN.call_rules(w, tools, names) if names else [f"answer: {json_rule(schema)}"]
        return "\n".join([f"start: answer {end}", *rules])
    else:
        rules = fmt.call_rules(w, tools, names) if names else [f"answer: {json_rule(schema)}"]
    return "\n".join([fmt.grammar(w, parser, rules, bool(names), end), reasoning_rule(reasoning_budget)])


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
        llg = llguidance()
        matcher = self.compiled.get(grammar)
        if matcher is None:
            matcher = llg.LLMatcher(llg_tokenizer(self.tokenizer), llg.LLMatcher.grammar_from_lark(grammar),
                                    log_level=0)
            if matcher.is_error():
                raise RequestError(f"grammar: {error_line(matcher.get_error())}")
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
            raise RuntimeError(f"the output left its grammar: {error_line(matcher.get_error())}")
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
                    f"the grammar allows no token: {error_line(matchers[i].get_error()) or 'it has ended'}"
        return out

    def release(self, seq_id: int):
        self.state.pop(seq_id, None)

    def clear(self):
        self.state.clear()
