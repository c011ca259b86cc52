"""Every engine setting, under one name each: built from the command line (`add_engine_flags`,
`EngineArgs.from_flags`), from a Serve config (deploy.serve.ServeArgs extends it) or in Python, checked
by `validate()` and passed whole to ClusterEngine, the coordinator and the pipeline.

    engine = ClusterEngine(EngineArgs("tiny-qwen35moe", pp=2))
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

from raymoe.stages.text.chat import check_template_kwargs, load_chat_template
from raymoe.stages.runtime.engine import split_layers
from raymoe.stages.runtime.speculation import SpeculativeConfig
from raymoe.stages.errors import RaymoeError, RequestError
from raymoe.stages.files.loader import (DEFAULT_MAX_MODEL_LEN, MODES, ModelFiles, mode_device_error, open_mtp_head,
                                        resolve_model_path)

DEVICES = ("cpu", "cuda")
TRANSPORTS = ("auto", "object_store", "gloo", "nccl", "shm")      # how activations move (cluster/pipeline.py)
# pack: as few nodes as possible; spread: each bundle on a different node while there are nodes (best effort)
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}
STALL_TIMEOUT = 120.0      # seconds without a completed step, while work waits, before the health check fails
PLACEMENT_TIMEOUT = 120.0  # seconds for Ray to place a pipeline's actors (at start, or again after a node was lost)


@dataclass
class EngineArgs:
    model: str                               # a .gguf file, an HF model directory, or an embedded model's name
    pp: int = 1                              # pipeline stages, one actor each
    ep: int = 0                              # expert actors per stage (0: experts run in the stage)
    dtype: str = "auto"                      # a key of stages.files.loader.MODES
    device: str = "cpu"
    transport: str = "auto"                  # one of TRANSPORTS
    placement: str = "pack"                  # a key of PLACEMENTS
    threads: int | None = None               # torch threads per actor (None: a share of its node's cores per step)
    split: list[int] | None = None           # layers per stage (None: even)
    microbatches: int | None = 4             # micro-batch groups (None: pp); 4 gives the same outputs at every pp
    max_batch_tokens: int = 512              # tokens per micro-batch
    prefill_chunk: int = 256                 # a long prompt's tokens per step
    itl_target_ms: float | None = None       # while sequences decode, prompt chunks shrink to keep tokens this close
    steps_per_call: int = 4                  # decode steps a call sent ahead runs (pp 1, or shm)
    max_running: int | None = None           # sequences holding caches (None: as many as fit, at most 64)
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN   # context bound that sizes each cache (None: the model's)
    max_queued: int | None = None            # sequences waiting for a slot before QueueFullError (None, < 0: no bound)
    prefix_cache_gb: float | None = None     # GiB of prefix cache, all stages (None: a share of free memory; 0: off)
    stall_timeout: float = STALL_TIMEOUT
    placement_timeout: float = PLACEMENT_TIMEOUT
    chat_template: str | None = None         # a Jinja file, or the template itself, in place of the model's
    chat_template_kwargs: dict | None = None  # default template variables of chat requests (theirs override)
    speculative_config: dict | None = None   # speculative decoding (stages.runtime.speculation.SpeculativeConfig)
    fault_injection: dict | None = None      # test hook: see Coordinator._maybe_inject_fault
    scripted_outputs: dict | None = None     # test hook: see Coordinator.script_for

    def __post_init__(self):
        if self.max_queued is not None and self.max_queued < 0:
            self.max_queued = None

    @classmethod
    def from_flags(cls, parsed: argparse.Namespace, **overrides):
        """The settings a parser with add_engine_flags (and any of its own that share a field's name) read;
        fields it lacks keep their defaults."""
        names = [f.name for f in dataclasses.fields(cls) if hasattr(parsed, f.name)]
        return cls(**{**{name: getattr(parsed, name) for name in names}, **overrides})

    @property
    def step_chunk(self) -> int:
        """The most tokens of one sequence a step holds (what a sliding-window cache must have room for)."""
        return min(self.prefill_chunk, self.max_batch_tokens)

    def engine_args(self) -> EngineArgs:
        """Only the engine's fields (of a subclass such as ServeArgs)."""
        return EngineArgs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineArgs)})

    def validate(self, n_layers: int | None = None, n_experts: int | None = None):
        """Raise RaymoeError, one line naming the flag, for a bad value; with the model's layer and expert
        counts, also for a --pp, --split or --ep the model cannot take."""
        def fail(name: str, what: str):
            raise RaymoeError(f"--{name.replace('_', '-')} {what}")

        for name, choices in (("dtype", MODES), ("device", DEVICES), ("transport", TRANSPORTS),
                              ("placement", PLACEMENTS)):
            if getattr(self, name) not in choices:
                fail(name, f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.transport == "nccl" and self.device != "cuda":
            fail("transport", "nccl moves GPU tensors: it needs --device cuda (on CPU use gloo, shm or object_store)")
        if mode_device_error(self.dtype, self.device):
            raise RaymoeError(mode_device_error(self.dtype, self.device))
        for name, low, none_ok in (("pp", 1, False), ("ep", 0, False), ("threads", 1, True),
                                   ("max_batch_tokens", 1, False), ("prefill_chunk", 1, False),
                                   ("steps_per_call", 1, False),
                                   ("max_running", 1, True), ("max_model_len", 1, True), ("max_queued", 0, True)):
            value = getattr(self, name)
            if not ((none_ok and value is None) or (type(value) is int and value >= low)):
                fail(name, f"must be an integer of at least {low}, got {value!r}")
        if self.microbatches is not None and not (type(self.microbatches) is int and self.microbatches >= self.pp):
            fail("microbatches", f"{self.microbatches!r} must be >= --pp {self.pp} to keep every stage busy")
        if self.split is not None and not (isinstance(self.split, list) and len(self.split) == self.pp
                                           and all(type(n) is int and n >= 1 for n in self.split)):
            fail("split", f"{self.split!r} must give --pp {self.pp} layer counts of at least 1")
        if self.prefix_cache_gb is not None and not (isinstance(self.prefix_cache_gb, (int, float))
                                                     and not isinstance(self.prefix_cache_gb, bool)
                                                     and 0 <= self.prefix_cache_gb < float("inf")):
            fail("prefix_cache_gb", f"must be a number of GiB of at least 0, got {self.prefix_cache_gb!r}")
        for name, unit, none_ok in (("stall_timeout", "seconds", False), ("placement_timeout", "seconds", False),
                                    ("itl_target_ms", "milliseconds", True)):
            value = getattr(self, name)
            if not ((none_ok and value is None) or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                    and 0 < value < float("inf"))):
                fail(name, f"must be a positive number of {unit}, got {value!r}")
        if self.chat_template_kwargs is not None:
            try:
                check_template_kwargs(self.chat_template_kwargs, "--chat-template-kwargs")
            except RequestError as e:
                raise RaymoeError(str(e)) from None
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)
        if self.scripted_outputs is not None and not (
                isinstance(self.scripted_outputs, dict) and all(
                    isinstance(k, str) and k and isinstance(v, list) and all(type(t) is int for t in v)
                    for k, v in self.scripted_outputs.items())):
            fail("scripted_outputs", "must map prompt texts to lists of token ids")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            fail("chat_template", f"must be a file name or a template, got {self.chat_template!r}")
        if n_layers is not None:
            try:
                split_layers(n_layers, self.pp, self.split)
            except ValueError as e:
                fail("split" if self.split else "pp", f"does not fit the model: {e}")
        if n_experts is not None and self.ep and n_experts % self.ep:
            fail("ep", f"{self.ep} must divide the model's {n_experts} experts")

    def mtp_head(self, files: ModelFiles) -> ModelFiles | None:
        """The files of the MTP head the last stage runs (speculative method mtp), or None; refused in one line
        where the model has none."""
        config = SpeculativeConfig.parse(self.speculative_config)
        if config is None or config.method != "mtp":
            return None
        return open_mtp_head(files, config.model)

    def resolved(self) -> EngineArgs:
        """Validated, with what the defaults stand for filled in: the model's absolute path (for actors
        anywhere) and the micro-batch groups."""
        self.validate()
        speculative = self.speculative_config
        if speculative and speculative.get("model"):        # the MTP head's own file, for actors anywhere too
            speculative = {**speculative, "model": os.path.abspath(speculative["model"])}
        return dataclasses.replace(self.engine_args(), model=os.path.abspath(resolve_model_path(self.model)),
                                   microbatches=self.microbatches or self.pp, speculative_config=speculative,
                                   chat_template=load_chat_template(self.chat_template))

    def configure_chat(self, tokenizer):
        """Give the model's tokenizer the chat template and default template variables of these settings."""
        if self.chat_template is not None:
            tokenizer.chat_template = load_chat_template(self.chat_template)
        tokenizer.chat_template_kwargs = dict(self.chat_template_kwargs or {})


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def parse_split(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated layer counts, got {text!r}") from None


# The command-line flags of the settings: every tool that takes one takes it under this name, with this default.
FLAGS = {
    "model": dict(required=True, help="a .gguf file, an HF model directory, or tiny-qwen35moe / tiny-gptoss"),
    "pp": dict(type=int, help="pipeline stages, one Ray actor each (at most the layer count)"),
    "ep": dict(type=int, help="expert actors per stage (0: experts run in the stage)"),
    "split": dict(type=parse_split, help="layers per stage, e.g. 3,5 (default: even)"),
    "transport": dict(choices=TRANSPORTS, help="how activations move between stages (auto: shm where every stage "
                                                              "is on one CPU node, else object_store)"),
    "placement": dict(choices=tuple(PLACEMENTS),
                      help="a pipeline's stages on as few nodes as possible, or on different nodes"),
    "microbatches": dict(type=int, help="micro-batch groups (>= --pp; none: --pp, the fewest, largest batches; 4, "
                                        "deploy.generate's default, gives the same outputs at every --pp)"),
    "threads": dict(type=int, help="torch threads per actor (default: the node's cores, shared by the stages that "
                                   "compute at once; outputs do not depend on it)"),
    "dtype": dict(choices=tuple(MODES), help="auto: weights compute in their file's format, quantised ones with 8-bit "
                                             "activations (as llama.cpp); float32: exact; int8: every weight matrix "
                                             "requantised to int8 rows"),
    "device": dict(choices=DEVICES, help="cuda: each stage actor takes one GPU and keeps weights, caches and "
                                         "activations on it"),
    "max_model_len": dict(type=int, help="context bound: sizes each sequence's cache (default %(default)s, or the "
                                         "model's if shorter)"),
    "max_running": dict(type=int, help="sequences holding caches at once (default: as many as memory allows, at "
                                       "most 64)"),
    "chat_template": dict(metavar="FILE", help="a Jinja chat template to use instead of the model's (a file, or the "
                                               "template itself)"),
    "chat_template_kwargs": dict(type=parse_json_object, metavar="JSON",
                                 help='default variables of the chat template, e.g. \'{"enable_thinking": false}\' '
                                      "(Qwen3.5) or '{\"reasoning_effort\": \"high\"}' (gpt-oss); a request's "
                                      "chat_template_kwargs override them"),
    "prefix_cache_gb": dict(type=float, metavar="GIB",
                            help="memory for cached prompt prefixes over all stages, so that a prompt that starts "
                                 "like an earlier one (a chat's history, a shared preamble) computes only the rest "
                                 "(default: 10%% of the memory the plan leaves free; 1 GiB with --device cuda; 0: "
                                 "off; docs/prefix-cache.md)"),
    "itl_target_ms": dict(type=float, metavar="MS",
                          help="while sequences decode, cut the prompt tokens of the steps ahead of their next token "
                               "to what keeps it within MS milliseconds (measured step costs; shorter inter-token "
                               "latency for a longer time to first token; default: no bound)"),
    "steps_per_call": dict(type=int, metavar="N",
                           help="while only running sequences decode (at --pp 1, or over the shm transport), each "
                                "call runs up to N decode steps of them and returns their tokens together: fewer "
                                "calls through Ray a token, tokens streamed N at a time (default %(default)s; the "
                                "outputs are the same at any N)"),
    "placement_timeout": dict(type=float, metavar="S",
                              help="seconds to wait for the Ray cluster to place the pipeline's actors, at start and "
                                   "again after a node is lost; then it fails, saying so (default %(default)g)"),
    "max_queued": dict(type=int, help="sequences that may wait for a slot; beyond that requests get 503 "
                                      "(-1: unbounded)"),
    "speculative_config": dict(type=parse_json_object, metavar="JSON",
                               help='speculative decoding, as vLLM spells it: \'{"method": "ngram", '
                                    '"num_speculative_tokens": 3}\' (also prompt_lookup_max, default 4, and '
                                    "prompt_lookup_min, default 1): each decoding sequence sends the tokens that "
                                    "followed its last n tokens earlier in its text, and one step checks them all; "
                                    '\'{"method": "mtp"}\' drafts with the model\'s MTP head (Qwen3.5, Qwen3-Next; '
                                    '"model": a GGUF of the head alone). Greedy outputs stay the same '
                                    "(docs/speculative-decoding.md; default: off)"),
}


def add_engine_flags(parser: argparse.ArgumentParser, names, args_class=EngineArgs, flags: dict = FLAGS):
    """Add the flags of the settings `names` (keys of `flags`), each defaulting to its field's default in
    `args_class` (EngineArgs, or a subclass with defaults of its own)."""
    defaults = {f.name: f.default for f in dataclasses.fields(args_class)}
    for name in names:
        options = dict(flags[name])
        if not options.get("required"):
            options["default"] = defaults[name]
        parser.add_argument("--" + name.replace("_", "-"), **options)
