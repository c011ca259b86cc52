"""Chat templates written for this project that produce the released models' formats (the tiny models'
own templates, tools/tiny_tokenizer.py, are simplified): written here, not copied. They live in
examples/chat_templates/ (`deploy.serve --chat-template FILE` serves a tiny model with them); the tests read
them from there.

QWEN35: ChatML as Qwen3.5 renders it. An assistant turn after the last user message shows its
reasoning (`reasoning_content`, or a `<think>` block inside its content) as `<think>\\n...\\n</think>\\n\\n`
before the answer; earlier turns keep only their answer. The generation prompt opens a think block,
or holds an empty one when enable_thinking is false. Tools: listed as JSON lines inside `<tools></tools>`
in the system turn (the user's system message first), with the call format; an assistant's tool calls
follow its answer (after a blank line when it has one, one a line) as
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, a value
as text when it is a string, else as JSON; tool results (role `tool`) go in a user turn, each inside
`<tool_response></tool_response>`.

GPTOSS: harmony as gpt-oss renders it: a system message with the reasoning effort (reasoning_effort,
default medium) and the valid channels; the user's system message as the developer's instructions;
answers on the final channel; an assistant turn after the last user message shows its reasoning
(`thinking`, which the renderer fills from reasoning_content) on the analysis channel; the last
assistant turn without a generation prompt ends in <|return|>. Tools: the system message says calls go
to the commentary channel; the developer message lists them as TypeScript-like types in
`namespace functions { ... }`; an assistant's content beside tool calls is a commentary preamble, each
call `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`;
a tool result `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...<|end|>`, NAME
found by its tool_call_id (or its `name`).
"""

import os

_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "chat_templates")


def _read(name: str) -> str:
    with open(os.path.join(_FOLDER, name), encoding="utf-8") as f:
        return f.read()


QWEN35 = _read("qwen35.jinja")
GPTOSS = _read("gptoss.jinja")
