"""Text and requests: tokenizer, detokenizer, chat templates and formats (formats/: reasoning, tool calls and
grammars of each), structured outputs, request checks."""
