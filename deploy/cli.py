"""The `raymoe` command: `raymoe serve MODEL`, `raymoe generate`, `raymoe convert`, `raymoe perplexity`,
`raymoe bench`. Each subcommand is the module that `python -m raymoe.<module>` runs, with the same flags;
a model named first (`raymoe serve tiny-qwen35moe`) stands for `--model`."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {   # subcommand -> (module, what it does)
    "serve": ("raymoe.deploy.serve", "an OpenAI-compatible HTTP and gRPC server on Ray Serve"),
    "generate": ("raymoe.deploy.generate", "batch generation: JSONL prompts in, JSONL generations out"),
    "convert": ("raymoe.deploy.convert", "an HF safetensors checkpoint to GGUF"),
    "perplexity": ("raymoe.deploy.perplexity", "a model's perplexity on a text file"),
    "bench": ("raymoe.tools.bench", "the benchmark against transformers and llama.cpp"),
}
TAKES_MODEL = ("serve", "generate", "perplexity")   # their first word may be the model


def usage() -> str:
    lines = ["usage: raymoe COMMAND [flags]   (raymoe COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name:<11} {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"raymoe: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if command in TAKES_MODEL and rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0]] + rest[1:]
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
