"""Chat formats, one file each: how a family's chat template lays out reasoning, answers and tool calls,
with the parser that reads an output, the reader of its tool calls and the writer of its grammar
together (base.py: what a format provides; registry.py: which one a model uses)."""
