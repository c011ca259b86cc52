"""Perplexity of a text under raymoe's modes, and their KL divergence from an exact reference: llama.cpp's
`llama-perplexity --kl-divergence` on the Ray cluster.

    python -m raymoe.deploy.perplexity --model MODEL --text FILE [--ctx 512] [--modes auto,int8] [--reference-mode float32]
        [--pp 1|2|4] [--batch 512] [--chunks N] [--json PATH]

The text's tokens are cut into chunks of --ctx tokens; each chunk is a fresh sequence, and only the tokens of
its second half are scored (each predicted from at least ctx/2 tokens of context), as llama-perplexity does.
Every mode runs in its own pipeline, one after the other, so only one copy of the weights is in memory at a
time. The reference mode runs first and writes the log-probabilities of the scored rows to a temporary file
(scored tokens x vocabulary x 4 bytes); each other mode reads them back chunk by chunk to compute its KL
divergence, so memory stays at one batch of logits whatever the text's length.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from raymoe.cluster.engine_args import EngineArgs, add_engine_flags
from raymoe.stages.runtime.batch import StepBatch
from raymoe.stages.errors import RaymoeError
from raymoe.stages.files.loader import MODES


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m raymoe.deploy.perplexity", description=__doc__.split("\n\n")[0])
    add_engine_flags(p, ["model"])
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (the context each chunk is scored in)")
    p.add_argument("--modes", default="auto", help=f"comma-separated --dtype modes to measure ({', '.join(MODES)})")
    p.add_argument("--reference-mode", default=None,
                   help="a mode to compare every mode with (KL divergence, top-1 agreement, delta perplexity); "
                        "float32 is the exact one")
    add_engine_flags(p, ["pp", "transport", "threads"])
    p.add_argument("--batch", type=int, default=512,
                   help="tokens per forward step: a longer chunk runs as several steps. The approximate modes' "
                        "numbers depend on it (auto computes expert groups of <= 16 rows with 8-bit activations)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


def parse_modes(text: str, what: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise RaymoeError(f"{what}: unknown mode {bad[0] if bad else text!r} (choose from {', '.join(MODES)})")
    return modes


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise RaymoeError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RaymoeError(f"{path}: cannot read the text ({e})") from None
    if not text.strip():
        raise RaymoeError(f"{path}: the text is empty")
    return text


@dataclass
class Piece:
    """One forward step: a slice of a chunk, with the rows to score and the tokens they predict."""
    batch: StepBatch
    targets: torch.Tensor
    last: bool           # the chunk's last step: its caches can be released after it


def pieces(ids: list[int], ctx: int, n_chunks: int, batch_tokens: int, bos: int | None):
    """Chunk c is sequence c (fresh in each pipeline). Rows ctx/2 .. ctx-2 are scored: row r predicts
    token r + 1. With `bos`, each chunk starts with it in place of its first token (llama-perplexity does
    so for models whose tokenizer adds BOS)."""
    first = ctx // 2
    for c in range(n_chunks):
        tokens = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            tokens[0] = bos
        for a in range(0, ctx, batch_tokens):
            b = min(a + batch_tokens, ctx)
            rows = range(max(a, first), min(b, ctx - 1))
            batch = StepBatch([c], [a], [b - a], torch.tensor(tokens[a:b]), [r - a for r in rows])
            yield Piece(batch, torch.tensor([tokens[r + 1] for r in rows], dtype=torch.long), b == ctx)


@dataclass
class ModeResult:
    mode: str
    nll: list = field(default_factory=list)        # float64 tensors, one per step
    kl: list = field(default_factory=list)
    same_top: int = 0

    def summary(self, reference: ModeResult | None) -> dict:
        nll = torch.cat(self.nll)
        out = {"mode": self.mode, "perplexity": math.exp(nll.mean().item()), "tokens": len(nll)}
        if reference is not None:
            kl = torch.cat(self.kl).numpy()
            out.update(delta_perplexity=out["perplexity"] - math.exp(torch.cat(reference.nll).mean().item()),
                       kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)), kl_max=float(kl.max()),
                       top1_agreement=self.same_top / len(kl))
        return out


def score(logits: torch.Tensor, piece: Piece, result: ModeResult, spill, reading: bool):
    """Accumulate one step's statistics. The reference writes its log-probabilities to `spill`; the other
    modes read the same rows back and compute KL(reference || mode) per token."""
    logp = torch.log_softmax(logits.float(), -1)
    result.nll.append(-logp.gather(1, piece.targets[:, None])[:, 0].double())
    n, vocab = logp.shape
    if not reading:
        spill.write(logp.numpy().tobytes())
        return
    ref = torch.from_numpy(np.fromfile(spill, dtype=np.float32, count=n * vocab).reshape(n, vocab))
    result.kl.append((ref.exp() * (ref - logp)).sum(-1, dtype=torch.float64))
    result.same_top += int((ref.argmax(-1) == logp.argmax(-1)).sum())


STAGE_DIED = "a stage actor died; the Ray logs say why"


def run_mode(args, files, path: str, mode: str, steps, n_chunks: int, on_logits, bar):
    """Start a pipeline in `mode`, run every step through it (up to 2 x PP steps in flight, so every stage
    has work) and hand each step's logits to on_logits(logits, piece), in order."""
    import ray

    from raymoe.cluster.engine import pipeline_spec, ray_errors
    from raymoe.cluster.pipeline import Pipeline

    window = 2 * args.pp
    # caches for a step's chunk and the chunks of those in flight, each of one chunk's length
    engine_args = EngineArgs.from_flags(args, model=path, dtype=mode, max_model_len=args.ctx,
                                        max_running=min(window, n_chunks), max_batch_tokens=args.batch,
                                        prefix_cache_gb=0).resolved()     # no requests: nothing to cache
    spec = pipeline_spec(engine_args, files)
    bar.set_description(f"{mode}: loading")
    with ray_errors(STAGE_DIED):
        pipeline = Pipeline(spec)
    bar.set_description(mode)
    in_flight = deque()

    def finish_one():
        piece, ref = in_flight.popleft()
        with ray_errors(STAGE_DIED):
            logits = ray.get(ref)
        on_logits(logits, piece)
        if piece.last:
            pipeline.release(piece.batch.seq_ids)
        bar.update(piece.batch.n_tokens)

    try:
        for piece in steps:
            in_flight.append((piece, pipeline.submit(piece.batch)[-1]))
            if len(in_flight) >= window:
                finish_one()
        while in_flight:
            finish_one()
    finally:
        pipeline.shutdown()


def measure(args) -> dict:
    """Every mode's statistics on the text (the reference first); raises RaymoeError for bad input."""
    from tqdm import tqdm

    from raymoe.cluster.engine import connect_ray
    from raymoe.stages.files.loader import open_model, resolve_model_path

    modes = parse_modes(args.modes, "--modes")
    reference = parse_modes(args.reference_mode, "--reference-mode") if args.reference_mode is not None else []
    if len(reference) > 1:
        raise RaymoeError(f"--reference-mode takes one mode, got {args.reference_mode!r}")
    if args.ctx < 4:
        raise RaymoeError(f"--ctx {args.ctx} is too short: a chunk needs at least 4 tokens to score its second half")
    if args.batch < 1 or (args.chunks is not None and args.chunks < 1):
        raise RaymoeError("--batch and --chunks must be at least 1")
    text = read_text(args.text)
    path = os.path.abspath(resolve_model_path(args.model))
    files = open_model(path, args.ctx)       # caches sized to one chunk; the context is min(file's, --ctx)
    if files.config.context_length < args.ctx:
        raise RaymoeError(f"--ctx {args.ctx} is longer than the model's context ({files.config.context_length})")
    tok = files.tokenizer
    ids = tok.encode(text)
    bos = tok.bos_token_id if tok.add_bos else None
    if bos is not None and ids[:1] == [bos]:
        ids = ids[1:]                        # each chunk gets its own BOS (see pieces)
    n_chunks = len(ids) // args.ctx
    if n_chunks == 0:
        raise RaymoeError(f"{args.text}: the text has {len(ids)} tokens, shorter than one chunk of --ctx {args.ctx}")
    if args.chunks is not None:
        n_chunks = min(n_chunks, args.chunks)
    scored = n_chunks * (args.ctx - 1 - args.ctx // 2)

    connect_ray(args.pp)
    results: list[ModeResult] = []
    with tempfile.TemporaryDirectory(prefix="raymoe-ppl-") as tmp:
        spill_path = os.path.join(tmp, "reference.f32")
        if reference:
            need = scored * files.config.vocab * 4
            free = shutil.disk_usage(tmp).free
            if need > free:
                raise RaymoeError(f"the reference's log-probabilities need {need / 2**30:.1f} GiB in {tmp} and "
                                  f"{free / 2**30:.1f} GiB are free; use --chunks, or set TMPDIR")
        for i, mode in enumerate(reference + modes):
            reading = bool(reference) and i > 0
            result = ModeResult(mode)
            with open(spill_path, "rb" if reading else "wb") as spill, \
                    tqdm(total=n_chunks * args.ctx, unit="tok", file=sys.stderr, disable=None, leave=False) as bar:
                run_mode(args, files, path, mode, pieces(ids, args.ctx, n_chunks, args.batch, bos), n_chunks,
                         partial(score, result=result, spill=spill, reading=reading), bar)
            results.append(result)
    ref = results[0] if reference else None
    summaries = [r.summary(ref if i > 0 else None) for i, r in enumerate(results)]
    if reference:
        summaries[0]["reference"] = True
    return {"model": args.model, "text": args.text, "text_tokens": len(ids), "ctx": args.ctx, "batch": args.batch,
            "chunks": n_chunks, "scored_tokens": scored, "pp": args.pp, "reference_mode": args.reference_mode,
            "results": summaries}


def table(report: dict) -> str:
    lines = [(f"{report['model']}: {report['chunks']} chunks of {report['ctx']} tokens, {report['scored_tokens']} "
              f"scored (the second half of each chunk), pp={report['pp']}, batch={report['batch']}"),
             f"{'mode':<10}{'PPL':>12}{'ΔPPL':>12}{'KL mean':>12}{'KL p99':>12}{'KL max':>12}{'top-1':>9}"]
    for r in report["results"]:
        if "kl_mean" in r:
            lines.append(f"{r['mode']:<10}{r['perplexity']:>12.4f}{r['delta_perplexity']:>+12.4f}{r['kl_mean']:>12.6f}"
                         f"{r['kl_p99']:>12.6f}{r['kl_max']:>12.6f}{100 * r['top1_agreement']:>8.2f}%")
        else:
            note = "(reference)" if r.get("reference") else ""
            lines.append(f"{r['mode']:<10}{r['perplexity']:>12.4f}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from raymoe.cluster.engine import disconnect_ray

    try:
        if args.json and not os.access(os.path.dirname(os.path.abspath(args.json)), os.W_OK):
            raise RaymoeError(f"{args.json}: cannot write there")
        report = measure(args)
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        disconnect_ray()
    print(table(report))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
        except OSError as e:
            print(f"error: {args.json}: cannot write the JSON ({e.strerror})", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
