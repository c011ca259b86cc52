"""The JSON schemas, tools and prompt that the structured-output tests share (engine, cluster, HTTP, gRPC)."""


# three schemas with nested objects, arrays and enums; strings and numbers bounded, so that an answer
# sampled at temperature 1 ends within its max_tokens
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                             "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["kind", "legs"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "pet"], "additionalProperties": False}

ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"enum": ["x1", "x2", "y"]},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
    "status": {"enum": ["new", "paid", "sent"]},
    "note": {"type": ["string", "null"], "maxLength": 6}},
    "required": ["items", "status", "note"], "additionalProperties": False}

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"high": {"type": "integer", "minimum": -40, "maximum": 50},
                                         "sky": {"enum": ["sun", "rain"]}},
        "required": ["high", "sky"], "additionalProperties": False}},
    "alert": {"type": "boolean"}},
    "required": ["city", "days", "alert"], "additionalProperties": False}

SCHEMAS = {"person": PERSON, "order": ORDER, "weather": WEATHER}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]

ASK = [{"role": "user", "content": "Answer in JSON."}]


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def reasoning_end_bias(tok) -> dict:
    """logit_bias that makes the model end its reasoning: the tiny models, trained on Python's docs, seldom close
    a <think> block or a harmony analysis message by themselves (the grammar allows it at any point). Qwen's
    </think> comes after some reasoning; gpt-oss's <|end|>, which it never learnt, at once."""
    if "<|end|>" in tok.special_tokens:
        return {str(tok.special_tokens["<|end|>"]): 100}
    return {str(tok.token_to_id("</think>")): 12}
