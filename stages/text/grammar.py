"""Writing grammars for llguidance: Lark text for one tokenizer (its added tokens by id), JSON schemas laid
out as the models write JSON, the checks that name what a request got wrong. The chat formats
(stages/text/formats/) write their parts of an output's grammar with these; stages/text/structured.py
puts them together."""
from __future__ import annotations

import json

from raymoe.stages.errors import RequestError
from raymoe.stages.text.tools import ToolRequest

# How the JSON is laid out: one space after ':' and ',' (as Python's json.dumps, and as models mostly
# write it), no other whitespace, so that a sampled answer cannot run on in spaces and newlines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FREE_TEXT = "/(.|\\n)*/"             # reasoning: any text (special tokens end it)
FREE_ANSWER = "answer: <[*]>*"       # an answer that no grammar constrains: any tokens
REASONING_RULE = "reasoning"         # the rule the formats' grammars write reasoning as (reasoning_rule)


def reasoning_rule(budget: int | None) -> str:
    """The Lark rule of the reasoning: free text, at most `budget` tokens when one is given (llguidance ends
    the rule there, so that the grammar then allows only what closes the reasoning: the budget is kept by
    the engine, whatever the model would write)."""
    if budget is None:
        return f"{REASONING_RULE}: {FREE_TEXT}"
    if budget == 0:
        return f'{REASONING_RULE}: ""'
    return f"{REASONING_RULE}[max_tokens={budget}]: {FREE_TEXT}"


def llguidance():
    import llguidance          # imported on use: only structured requests need it
    return llguidance


def llg_tokenizer(tokenizer):
    """llguidance's view of the model's tokenizer (built once per tokenizer: ~1 s for a 200k vocabulary)."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is None:
        end = end_token(tokenizer)
        cached = llguidance().LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=end)
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


def error_line(message: str) -> str:
    """llguidance's error, the line that says what is wrong (it adds the grammar's text and a caret)."""
    line = next((ln.strip() for ln in message.splitlines() if ln.strip()), message)
    if line.startswith("at ") and ": " in line:       # "at 1(8): ..." is a place in our Lark text
        line = line.split(": ", 1)[1]
    return line[:500]


def check_schema(schema: dict, tokenizer, field: str):
    """RequestError naming `field` when llguidance cannot compile the JSON schema (an unknown type or
    format, a bad $ref, a keyword it does not implement, ...)."""
    llg = llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(laid_out(schema))
    except (ValueError, TypeError) as e:
        raise RequestError(f"{field}: {error_line(str(e))}") from None
    error = llg.LLMatcher.validate_grammar(grammar, llg_tokenizer(tokenizer))
    if error:
        raise RequestError(f"{field}: {error_line(error)}")


# ---- grammars -------------------------------------------------------------------------------------

def laid_out(schema: dict) -> dict:
    """The schema with JSON_LAYOUT as its llguidance options (its own x-guidance, if any, wins)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_LAYOUT, **(own if isinstance(own, dict) else {})}}


def json_rule(schema: dict) -> str:
    return "%json " + json.dumps(laid_out(schema), ensure_ascii=False)


class Writer:
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


def call_schema(tools: ToolRequest, name: str) -> dict:
    return tools.parameters(name) or {"type": "object"}
