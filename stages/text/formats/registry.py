"""The one registry of chat formats: a new format is its own module plus one line in FORMATS.

A model's format comes from the chat template it is served with (a format's template_marks: a template
that writes `<function=` calls is Qwen3.5's, whatever the family) and otherwise from its family
(Family.chat_format), never from which special tokens its tokenizer happens to have."""
from __future__ import annotations

from raymoe.stages.text.formats.base import ChatFormat
from raymoe.stages.text.formats.harmony import Harmony
from raymoe.stages.text.formats.hermes import Hermes
from raymoe.stages.text.formats.qwen_xml import QwenXML

FORMATS: tuple[ChatFormat, ...] = (Harmony(), QwenXML(), Hermes())     # the order template marks are looked for in
BY_NAME = {f.name: f for f in FORMATS}


def chat_format(tokenizer) -> ChatFormat | None:
    """The format of the tokenizer's chat template, else of its model's family; None for neither (plain text)."""
    template = tokenizer.chat_template or ""
    for candidate in FORMATS:
        if any(mark in template for mark in candidate.template_marks):
            return candidate
    return BY_NAME.get(getattr(tokenizer, "family_chat_format", None) or "")
