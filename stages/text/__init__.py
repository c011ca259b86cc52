"""Text and requests: tokenizer, detokenizer, chat templates, tools, reasoning and tool-call parsers, grammars, request checks."""
