"""The events of one answer, built from its pieces as they come (reasoning, text, tool calls:
stages/text/reasoning.py, stages/text/tool_calls.py), for the APIs that stream named events: /v1/responses
(deploy/responses_api.py) and /v1/messages (deploy/messages_api.py). A subclass says what each piece makes
(`_text`, `_call`), how the part being written closes (`_close`) and how the answer ends (`_end`)."""
from __future__ import annotations

from raymoe.deploy.openai_api import Prepared, check_result
from raymoe.stages.text.answers import tool_calls_reader
from raymoe.stages.text.reasoning import CONTENT, REASONING, SplitText
from raymoe.stages.text.tool_calls import TOOL_CALLS


class AnswerEvents:
    def __init__(self, p: Prepared):
        self.p = p
        self.stops = p.engine_request.get("stop") or []
        parser = p.parser.fresh()
        self.split = SplitText(parser, self.stops)
        self.calls = tool_calls_reader(parser, p.tools) if p.tools is not None else None

    @property
    def called(self) -> bool:
        """Whether the answer so far holds a tool call."""
        return bool(self.calls and self.calls.calls)

    def _text(self, field: str, text: str) -> list[dict]:
        raise NotImplementedError

    def _call(self, call: dict) -> list[dict]:
        raise NotImplementedError

    def _close(self) -> list[dict]:
        raise NotImplementedError

    def _end(self, result: dict) -> list[dict]:
        raise NotImplementedError

    def _pieces(self, pieces, final: bool = False) -> list[dict]:
        if self.calls is not None:
            pieces = self.calls.feed(pieces) + (self.calls.finish() if final else [])
        out = []
        for kind, value in pieces:
            if kind == TOOL_CALLS:
                out += self._call(value)
            elif value and kind in (REASONING, CONTENT):
                out += self._text(kind, value)
        return out

    def update(self, update: dict) -> list[dict]:
        """The events of one engine update (the last, with "finished", ends the answer)."""
        if "finished" not in update:
            return self._pieces(self.split.update(update["token_ids"]))
        result = update["finished"]
        check_result(result)
        return (self._pieces(self.split.final(update["token_ids"], result["text"]), final=True) + self._close()
                + self._end(result))
