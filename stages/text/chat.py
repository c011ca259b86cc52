"""Chat templates: render a model's Jinja2 template the way transformers' apply_chat_template does.

Templates ship inside model files, so they are untrusted: they run in Jinja's immutable sandbox,
with the same helpers transformers provides (and the same guards on `dict` and `namespace`).
"""
from __future__ import annotations

import json
import os
import re
import uuid
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from raymoe.stages.errors import RaymoeError, RequestError, check_json_size
from raymoe.stages.text.tools import history_tool_calls

# chat_template_kwargs (per request, or a server's default): extra variables of the template, such as
# enable_thinking (Qwen3.5) or reasoning_effort (gpt-oss). Bounded: they are rendered on every request.
MAX_TEMPLATE_KWARGS = 32                 # variables
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024    # as JSON
# Variables the renderer sets itself (transformers' apply_chat_template takes the same as named
# arguments), and the helpers it provides.
RESERVED_TEMPLATE_VARIABLES = frozenset(("messages", "tools", "documents", "add_generation_prompt",
                                         "continue_final_message", "raise_exception", "strftime_now",
                                         "namespace", "dict"))


class _TemplateError(Exception):
    """Raised by `raise_exception` inside a template; its message goes to the user as is."""


def _raise_exception(message):
    raise _TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    # `dict` without the type object behind it, so templates cannot reach class internals.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore names could overwrite the namespace's own (name-mangled) storage.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render its body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _one_line(text) -> str:
    return " ".join(str(text).split())


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def validate_messages(messages) -> list[dict]:
    """The messages as fresh dicts without None values (as transformers passes them), or RequestError.
    An assistant message with `tool_calls` may lack content (""); its calls' `arguments` become mappings."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        message = {key: value for key, value in message.items() if value is not None}
        if message.get("tool_calls") is not None:
            # an assistant turn that called tools: its content may be null, its calls' arguments become mappings
            message = {**message, "content": message.get("content", ""),
                       "tool_calls": history_tool_calls(message["tool_calls"], i)}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise RequestError(f"messages[{i}].{key} must be a string")
        # Reasoning arrives under several names; Qwen templates read `reasoning_content`, gpt-oss
        # templates `thinking`. transformers fills both, so do we.
        for key in _REASONING_FIELDS:
            if key in message and not isinstance(message[key], str):
                raise RequestError(f"messages[{i}].{key} must be a string")
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatPrompt(str):
    """A rendered chat prompt that can tell which special-token strings came from the messages.

    Message text (and the tools' text) is the user's: Tokenizer.encode encodes it as plain text, so
    `<|im_end|>` written in a message never becomes the control token that ends a turn (a faked system
    turn stays text). `protect(specials)` renders again with each such string in a message or a tool
    replaced by a placeholder
    that the user cannot write (it holds a random nonce); `restore` puts the strings back."""

    def __new__(cls, text: str, render, messages: list[dict], tools: list[dict] | None = None):
        self = super().__new__(cls, text)
        self._render, self._messages, self._tools = render, messages, tools
        self._nonce = uuid.uuid4().hex
        self._literals: list[str] = []
        return self

    def protect(self, specials: re.Pattern) -> str | None:
        """The prompt rendered with placeholders for the special strings in messages; None when there are none."""
        def hide(value):
            if isinstance(value, str):
                return specials.sub(lambda m: self._placeholder(m.group(0)), value)
            if isinstance(value, list):
                return [hide(v) for v in value]
            if isinstance(value, dict):
                return {hide(k): hide(v) for k, v in value.items()}
            return value

        self._literals = []
        hidden = [hide(m) for m in self._messages]
        tools = hide(self._tools)
        return self._render(hidden, tools) if self._literals else None

    def _placeholder(self, literal: str) -> str:
        self._literals.append(literal)
        return f"\ue000{self._nonce}:{len(self._literals) - 1}\ue001"

    def restore(self, text: str) -> str:
        return re.sub(f"\ue000{self._nonce}:(\\d+)\ue001", lambda m: self._literals[int(m.group(1))], text)


def check_template_kwargs(kwargs, name: str = "chat_template_kwargs") -> dict:
    """kwargs as template variables, or RequestError naming what is wrong: a JSON object of at most
    MAX_TEMPLATE_KWARGS names (identifiers, none of the renderer's own) and MAX_TEMPLATE_KWARGS_BYTES."""
    if not isinstance(kwargs, dict):
        raise RequestError(f"{name} must be an object, got {type(kwargs).__name__}")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"{name} has {len(kwargs)} entries; at most {MAX_TEMPLATE_KWARGS} are allowed")
    for key in kwargs:
        if not (isinstance(key, str) and key.isidentifier() and not key.startswith("_")):
            raise RequestError(f"{name}: {key!r} is not a template variable name")
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise RequestError(f"{name}: {key!r} is set by the server, not by {name}")
    check_json_size(kwargs, name, MAX_TEMPLATE_KWARGS_BYTES)
    return dict(kwargs)



def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself (text with `{{` or `{%`); RaymoeError
    when neither, or when it does not compile."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise RaymoeError(f"--chat-template {value}: cannot read it ({_one_line(e)})") from None
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise RaymoeError(f"--chat-template {value}: no such file (give a Jinja file, or the template itself)")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise RaymoeError(f"--chat-template: syntax error (line {e.lineno}): {_one_line(e.message)}") from None
    return template


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, **extra) -> ChatPrompt:
    """The prompt text for `messages`. `tools` (checked by stages.text.tools) is the template variable of that
    name, None when none are offered, as transformers passes it; `documents` is None. `extra` becomes
    template variables (e.g. bos_token, enable_thinking)."""
    if not isinstance(template, str):
        raise RequestError("the model has no chat template")
    messages = validate_messages(messages)
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"chat template syntax error (line {e.lineno}): {_one_line(e.message)}") from None

    def render(messages, tools):
        try:
            return compiled.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **extra
            )
        except _TemplateError as e:
            raise RequestError(f"chat template: {_one_line(e)}") from None
        except Exception as e:  # anything an untrusted template does wrong is the request's problem, not ours
            raise RequestError(f"chat template failed: {type(e).__name__}: {_one_line(e)}") from None

    tools = [dict(t) for t in tools] if tools else None
    return ChatPrompt(render(messages, tools), render, messages, tools)
