"""Random GGUFs with the shapes of released models, to measure raymoe and llama.cpp at real size
without downloading weights.

    python -m raymoe.tools.make_synthetic --model qwen3.5-35b-a3b|qwen3-next-80b-a3b|gpt-oss-20b --out PATH
        [--layers N] [--vocab N] [--type T | --mix q3_k_m|q4_k_m|mxfp4] [--seed S] [--dry-run]

Quantised blocks are random bytes whose scale fields are set so that every matrix's elements have a
mean of about 0 and a standard deviation of about 1/sqrt(row length): activations keep a unit size
through any number of layers. Nothing is quantised, and one chunk of one tensor is in memory at a time,
so a full-size file is written about as fast as the disk takes it. The tokenizer is the tiny test
tokenizer (tools.tiny_tokenizer) padded with unused tokens to the real vocabulary size.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, LlamaFileType as FT

from raymoe.stages.families import gptoss, qwen35moe, qwen3next
from raymoe.stages.families.contract import Family, global_tensor_shapes

CHUNK_BYTES = 32 << 20      # bytes generated and written at a time


@dataclass(frozen=True)
class ModelSpec:
    family: Family
    make_config: Callable            # (n_layers, vocab) -> the family's config
    n_layers: int
    vocab: int                       # the released embedding rows (the tokenizer's size, padded)
    tokenizer_family: str            # tools.tiny_tokenizer family
    default_mix: str


def qwen35_35b_a3b(n_layers: int, vocab: int) -> qwen35moe.Qwen35MoeConfig:
    return qwen35moe.Qwen35MoeConfig(
        n_layers=n_layers, hidden=2048, vocab=vocab, n_head=16, n_kv_head=2, head_dim=256, rope_dim=64,
        rope_base=1e7, rope_sections=[11, 11, 10, 0], rms_eps=1e-6, n_expert=256, n_expert_used=8,
        expert_ff=512, shared_ff=512, conv_kernel=4, k_head_dim=128, n_k_heads=16, n_v_heads=32,
        v_head_dim=128, full_attention_interval=4, context_length=262144)


def qwen3_next_80b_a3b(n_layers: int, vocab: int) -> qwen3next.Qwen3NextConfig:
    return qwen3next.Qwen3NextConfig(
        n_layers=n_layers, hidden=2048, vocab=vocab, n_head=16, n_kv_head=2, head_dim=256, rope_dim=64,
        rope_base=1e7, rms_eps=1e-6, n_expert=512, n_expert_used=10, expert_ff=512, shared_ff=512, conv_kernel=4,
        k_head_dim=128, n_k_heads=16, n_v_heads=32, v_head_dim=128, full_attention_interval=4, context_length=262144)


def gpt_oss_20b(n_layers: int, vocab: int) -> gptoss.GptOssConfig:
    return gptoss.GptOssConfig(
        n_layers=n_layers, hidden=2880, vocab=vocab, n_head=64, n_kv_head=8, head_dim=64, rms_eps=1e-5,
        n_expert=32, n_expert_used=4, expert_ff=2880, context_length=131072, sliding_window=128,
        sliding_layers=gptoss.llama_cpp_sliding_layers(n_layers), rope_base=150000.0, rope_scaling="yarn",
        rope_factor=32.0, rope_original_context=4096, rope_beta_fast=32.0, rope_beta_slow=1.0)


MODELS = {
    "qwen3.5-35b-a3b": ModelSpec(qwen35moe.FAMILY, qwen35_35b_a3b, 40, 248320, "qwen35moe", "q3_k_m"),
    "qwen3-next-80b-a3b": ModelSpec(qwen3next.FAMILY, qwen3_next_80b_a3b, 48, 151936, "qwen3next", "q3_k_m"),
    "gpt-oss-20b": ModelSpec(gptoss.FAMILY, gpt_oss_20b, 24, 201088, "gptoss", "mxfp4"),
}

TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
         "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q2_k": Q.Q2_K, "q3_k": Q.Q3_K, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K,
         "q6_k": Q.Q6_K, "mxfp4": Q.MXFP4}
# q3_k_m: Q3_K experts, Q4_K other matrices, Q6_K head; q4_k_m: Q4_K, with Q6_K for the head and for
# ffn_down / attn_v in llama.cpp's more-bits layers; mxfp4: MXFP4 experts, Q8_0 other matrices
MIXES = ("q3_k_m", "q4_k_m", "mxfp4")

# general.file_type, as llama-quantize names a file of each type or mix
FILE_TYPES = {Q.F32: FT.ALL_F32, Q.F16: FT.MOSTLY_F16, Q.BF16: FT.MOSTLY_BF16, Q.Q8_0: FT.MOSTLY_Q8_0,
              Q.Q4_0: FT.MOSTLY_Q4_0, Q.Q4_1: FT.MOSTLY_Q4_1, Q.Q5_0: FT.MOSTLY_Q5_0, Q.Q5_1: FT.MOSTLY_Q5_1,
              Q.Q2_K: FT.MOSTLY_Q2_K, Q.Q3_K: FT.MOSTLY_Q3_K_S, Q.Q4_K: FT.MOSTLY_Q4_K_S,
              Q.Q5_K: FT.MOSTLY_Q5_K_S, Q.Q6_K: FT.MOSTLY_Q6_K, Q.MXFP4: FT.MOSTLY_MXFP4_MOE,
              "q3_k_m": FT.MOSTLY_Q3_K_M, "q4_k_m": FT.MOSTLY_Q4_K_M, "mxfp4": FT.MOSTLY_MXFP4_MOE}

# llama.cpp's substitutes for a K-quant whose rows are not whole super-blocks; where it takes IQ4_NL
# (for Q2_K, Q3_K), raymoe cannot read that, so Q4_0, of the same size, stands in.
K_QUANT_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple          # torch order (slowest first)
    qtype: Q

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


def keeps_f32(name: str, shape: tuple) -> bool:
    """Vectors (norms, ssm_a, sinks), biases, the conv kernel and the MoE routers stay F32, as in
    llama.cpp's files (its converter keeps them so, and llama-quantize never quantises a router)."""
    return len(shape) == 1 or name.endswith((".bias", "ssm_conv1d.weight", "ffn_gate_inp.weight"))


def fitting_type(qtype: Q, row: int) -> Q:
    """qtype, or what llama.cpp uses instead when a row is not a whole number of its blocks."""
    if row % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = K_QUANT_FALLBACK.get(qtype, Q.F16)
    return qtype if row % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's pick of the ffn_down / attn_v tensors that the _M mixes give more bits."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mix_type(mix: str, name: str, layer: int, n_layers: int, attn_v_index: dict) -> Q:
    """The type a llama.cpp-style mix gives one weight matrix."""
    expert = "_exps." in name
    if mix == "mxfp4":
        return Q.MXFP4 if expert else Q.Q8_0
    if name == "output.weight":
        return Q.Q6_K
    if mix == "q3_k_m":
        return Q.Q3_K if expert else Q.Q4_K
    if "ffn_down" in name and use_more_bits(layer, n_layers):
        return Q.Q6_K
    if name in attn_v_index and use_more_bits(attn_v_index[name], len(attn_v_index)):
        return Q.Q6_K
    return Q.Q4_K


def tensor_plan(family: Family, cfg, qtype: Q | None = None, mix: str | None = None) -> list[PlannedTensor]:
    """Every tensor in file order (embedding, layers, head) with its type: `qtype` for every weight
    matrix, else the types of `mix`."""
    glob = global_tensor_shapes(cfg)
    layers = [(i, name, shape) for i in range(cfg.n_layers) for name, shape in family.layer_tensor_shapes(cfg, i).items()]
    if getattr(cfg, "mtp_layers", 0):       # the MTP head: the block after the layers (stages/runtime/mtp.py)
        layers += [(cfg.n_layers, name, shape) for name, shape in family.mtp_tensor_shapes(cfg).items()]
    named = [(-1, "token_embd.weight", glob["token_embd.weight"]), *layers,
             (-1, "output_norm.weight", glob["output_norm.weight"]), (-1, "output.weight", glob["output.weight"])]
    attn_v_index = {name: k for k, name in enumerate(n for _, n, _ in layers if n.endswith("attn_v.weight"))}
    plan = []
    for layer, name, shape in named:
        if keeps_f32(name, shape):
            kind = Q.F32
        else:
            kind = qtype if qtype is not None else mix_type(mix, name, layer, cfg.n_layers, attn_v_index)
            kind = fitting_type(kind, shape[-1])
        plan.append(PlannedTensor(name, tuple(shape), kind))
    return plan


# --- tensor contents ----------------------------------------------------------------------------


def _levels_std(levels: int) -> float:
    """Standard deviation of a code drawn uniformly from `levels` consecutive integers."""
    return math.sqrt((levels * levels - 1) / 12)


# e2m1 magnitudes as ggml stores them (doubled); every code equally likely
MXFP4_STD = math.sqrt(sum(v * v for v in (0, 1, 2, 3, 4, 6, 8, 12)) / 8)


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def _pack_q3_k_scales(scales: list[int]) -> bytes:
    """16 six-bit scales: low nibbles in bytes 0-7 (scale i in byte i%8, nibble i//8), the top two
    bits in bytes 8-11 (byte 8+i%4, bit pair i//4)."""
    out = bytearray(12)
    for i, s in enumerate(scales):
        out[i % 8] |= (s & 0x0F) << (4 * (i // 8))
        out[8 + i % 4] |= (s >> 4) << (2 * (i // 4))
    return bytes(out)


def _pack_k_scales(scales: list[int], mins: list[int]) -> bytes:
    """Q4_K/Q5_K: 8 six-bit scales and mins in 12 bytes; entries 4-7 keep their top two bits in
    bits 6-7 of bytes 0-7 and their low nibbles in bytes 8-11."""
    out = bytearray(12)
    for j in range(4):
        out[j] = scales[j] | (scales[j + 4] >> 4) << 6
        out[4 + j] = mins[j] | (mins[j + 4] >> 4) << 6
        out[8 + j] = (scales[j + 4] & 0x0F) | (mins[j + 4] & 0x0F) << 4
    return bytes(out)


def fixed_block_fields(qtype: Q, std: float) -> list[tuple[int, bytes]]:
    """(offset, bytes) of the scale fields that every block of qtype gets, so that its random codes
    decode to elements of mean ~0 and standard deviation ~std. Offsets as in kernels/dequant.py.
    Where a block has a minimum, it cancels the codes' mean; sub-block scales are modest so that the
    f16 super-block scale stays a normal number for rows of up to ~10k elements."""
    if qtype == Q.Q8_0:
        return [(0, _f16(std / _levels_std(256)))]
    if qtype in (Q.Q4_0, Q.Q5_0):
        return [(0, _f16(std / _levels_std(16 if qtype == Q.Q4_0 else 32)))]
    if qtype in (Q.Q4_1, Q.Q5_1):
        levels = 16 if qtype == Q.Q4_1 else 32
        d = std / _levels_std(levels)
        return [(0, _f16(d) + _f16(-d * (levels - 1) / 2))]
    if qtype == Q.Q2_K:
        # sub-scale 8, min 12, dmin = d: 8·d·q − 12·d has mean 0 for q uniform in 0..3
        d = std / (8 * _levels_std(4))
        return [(0, bytes([8 | 12 << 4]) * 16), (80, _f16(d) + _f16(d))]
    if qtype == Q.Q3_K:
        # codes −4..3; sub-scales +16 and −16 (stored +32) alternate, turning the codes' mean of −0.5
        # into spread
        d = std / (16 * math.sqrt(_levels_std(8) ** 2 + 0.25))
        return [(96, _pack_q3_k_scales([48, 16] * 8) + _f16(d))]
    if qtype == Q.Q4_K:
        # scale 16, min 60, dmin = 2d: 16·d·q − 120·d has mean 0 for q uniform in 0..15
        d = std / (16 * _levels_std(16))
        return [(0, _f16(d) + _f16(2 * d) + _pack_k_scales([16] * 8, [60] * 8))]
    if qtype == Q.Q5_K:
        # scale 16, min 62, dmin = 4d: 16·d·q − 248·d has mean 0 for q uniform in 0..31
        d = std / (16 * _levels_std(32))
        return [(0, _f16(d) + _f16(4 * d) + _pack_k_scales([16] * 8, [62] * 8))]
    if qtype == Q.Q6_K:
        d = std / (8 * _levels_std(64))
        return [(192, bytes([8]) * 16 + _f16(d))]
    if qtype == Q.MXFP4:
        # a power-of-two scale 2^(e−128): the nearest one
        return [(0, bytes([128 + round(math.log2(std / MXFP4_STD))]))]
    raise ValueError(f"no block layout for {qtype.name}")


def float_values(name: str, shape: tuple, z: np.ndarray) -> np.ndarray:
    """Plain-float contents from standard normals z, by what the tensor does."""
    if name.endswith("ssm_a"):
        return -np.exp(0.5 * z)             # DeltaNet decay rates: negative
    if "norm" in name:
        return 1 + 0.1 * z                   # RMSNorm weights (the +1 baked in, as GGUF stores them)
    if name.endswith(".bias"):
        return 0.1 * z
    if "sinks" in name:
        return z
    return z / math.sqrt(shape[-1])          # matrices, gate vectors, the conv kernel


def tensor_chunks(t: PlannedTensor, seed: int) -> Iterator[np.ndarray]:
    """The tensor's bytes in chunks of at most CHUNK_BYTES, from a generator seeded by (seed, name)
    so that a tensor does not depend on the others."""
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    if t.qtype in (Q.F32, Q.F16, Q.BF16):
        total = math.prod(t.shape)
        per_chunk = CHUNK_BYTES // 4
        for start in range(0, total, per_chunk):
            z = rng.standard_normal(min(per_chunk, total - start), dtype=np.float32)
            x = float_values(t.name, t.shape, z).astype(np.float32)
            if t.qtype == Q.F16:
                x = x.astype(np.float16)
            elif t.qtype == Q.BF16:
                x = (x.view(np.uint32) >> 16).astype(np.uint16)     # the top half of each float32
            yield x.view(np.uint8)
        return
    fields = fixed_block_fields(t.qtype, 1 / math.sqrt(t.shape[-1]))
    n_blocks = math.prod(t.shape) // block
    per_chunk = CHUNK_BYTES // type_size
    for start in range(0, n_blocks, per_chunk):
        n = min(per_chunk, n_blocks - start)
        # full-range 64-bit draws are numpy's fastest source of random bytes
        words = rng.integers(0, 2**64 - 1, -(-n * type_size // 8), dtype=np.uint64, endpoint=True)
        blocks = words.view(np.uint8)[:n * type_size].reshape(n, type_size)
        for offset, value in fields:
            blocks[:, offset:offset + len(value)] = np.frombuffer(value, dtype=np.uint8)
        yield blocks.reshape(-1)


# --- the file -----------------------------------------------------------------------------------


def synthetic_tokenizer(family: str):
    """The tiny test tokenizer of `family`, with its special tokens and chat template."""
    from raymoe.tools.tiny_tokenizer import CONFIGS, train_tokenizer
    from raymoe.stages.text.tokenizer import Tokenizer

    backend = train_tokenizer(family)
    conf = CONFIGS[family]

    def token_id(key):
        return None if conf[key] is None else backend.token_to_id(conf[key])

    return Tokenizer(backend, eos_token_id=token_id("eos_token"), bos_token_id=token_id("bos_token"),
                     pad_token_id=token_id("pad_token"), chat_template=conf["chat_template"])


def _padded(n: int) -> int:
    return gguf.GGUFWriter.ggml_pad(n, gguf.GGUF_DEFAULT_ALIGNMENT)


def _start_file(path: str, model: str, family: Family, cfg, plan, tokenizer, file_type: int, seed: int):
    """A GGUFWriter on `path` with header, metadata and tensor table written; the data comes next."""
    from raymoe.deploy.convert import _add_metadata
    from raymoe.stages.text.tokenizer import write_tokenizer_to_gguf

    writer = gguf.GGUFWriter(path, family.arch)
    writer.add_name(f"{model} (synthetic)")
    writer.add_description(f"random weights from tools.make_synthetic, seed {seed}")
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_metadata(writer, family.arch, family.gguf_metadata(cfg))
    write_tokenizer_to_gguf(writer, tokenizer, family.tokenizer_pre, vocab_size=cfg.vocab)
    for t in plan:
        # with raw_dtype given, a non-uint8 dtype makes the writer take `shape` as element counts
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer


def planned_size(model: str, cfg, plan, tokenizer, file_type: int, seed: int = 0) -> int:
    """The file's exact size in bytes: its header is written to a scratch file, the data only counted."""
    spec = MODELS[model]
    with tempfile.TemporaryDirectory() as scratch:
        writer = _start_file(os.path.join(scratch, "header.gguf"), model, spec.family, cfg, plan, tokenizer,
                             file_type, seed)
        header = writer.fout[0].tell()
        writer.close()
    return _padded(header) + sum(_padded(t.n_bytes) for t in plan)


def write_synthetic(out: str, model: str, cfg, plan, tokenizer, file_type: int, seed: int = 0,
                    progress: bool = True) -> int:
    """Write the file through `out`.partial, renamed into place when complete; returns its size."""
    from tqdm import tqdm

    spec = MODELS[model]
    tmp = out + ".partial"
    writer = None
    try:
        writer = _start_file(tmp, model, spec.family, cfg, plan, tokenizer, file_type, seed)
        fout = writer.fout[0]
        bar = tqdm(total=sum(t.n_bytes for t in plan), unit="B", unit_scale=True, file=sys.stderr,
                   desc=os.path.basename(out), disable=not progress or None)
        with bar:
            for t in plan:
                writer.write_padding(fout, fout.tell())
                for chunk in tensor_chunks(t, seed):
                    fout.write(chunk)
                    bar.update(chunk.nbytes)
            writer.write_padding(fout, fout.tell())
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        if writer is not None:
            writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return os.path.getsize(out)


def _type_totals(plan) -> str:
    totals: dict = {}
    for t in plan:
        count, size = totals.get(t.qtype.name, (0, 0))
        totals[t.qtype.name] = (count + 1, size + t.n_bytes)
    return "\n".join(f"  {name:6s} {count:5d} tensors {size / 1e9:9.3f} GB"
                     for name, (count, size) in sorted(totals.items(), key=lambda kv: -kv[1][1]))


def _bounded_int(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.tools.make_synthetic",
                                description="write a random GGUF with the shapes of a released model")
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--out", help="output GGUF path (not needed with --dry-run)")
    p.add_argument("--layers", type=_bounded_int(1), help="a shorter stack (default: the model's layer count)")
    p.add_argument("--vocab", type=_bounded_int(1), help="embedding rows (default: the model's padded vocabulary)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--type", choices=sorted(TYPES), help="one type for every weight matrix")
    kind.add_argument("--mix", choices=MIXES,
                      help="llama.cpp-style mix (default: q3_k_m for the Qwens, mxfp4 for gpt-oss)")
    p.add_argument("--seed", type=_bounded_int(0), default=0)
    p.add_argument("--mtp", action="store_true", help="with an MTP head after the layers (the Qwens), as llama.cpp "
                                                      "writes it: blk.N.nextn.*, nextn_predict_layers 1")
    p.add_argument("--dry-run", action="store_true", help="print the file's size and types; write nothing")
    args = p.parse_args(argv)

    spec = MODELS[args.model]
    if args.out is None and not args.dry_run:
        p.error("--out is required (or use --dry-run)")
    if args.out is not None and os.path.isdir(args.out):
        p.error(f"--out {args.out}: is a directory")
    if args.out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out {args.out}: no such directory {os.path.dirname(os.path.abspath(args.out))}")
    n_layers = spec.n_layers if args.layers is None else args.layers
    if n_layers > spec.n_layers:
        p.error(f"--layers {n_layers}: {args.model} has {spec.n_layers} layers")
    tokenizer = synthetic_tokenizer(spec.tokenizer_family)
    vocab = spec.vocab if args.vocab is None else args.vocab
    if vocab < tokenizer.vocab_size:
        p.error(f"--vocab {vocab}: the tokenizer has {tokenizer.vocab_size} tokens")

    cfg = spec.make_config(n_layers, vocab)
    if args.mtp:
        if spec.family.mtp_mixer is None:
            p.error(f"--mtp: {args.model} has no MTP head")
        cfg.mtp_layers = 1
    qtype = TYPES[args.type] if args.type else None
    mix = None if args.type else args.mix or spec.default_mix
    plan = tensor_plan(spec.family, cfg, qtype, mix)
    file_type = FILE_TYPES[qtype if qtype is not None else mix]
    label = (f"{args.model} {args.type or mix}, {n_layers} layers{' and an MTP head' if args.mtp else ''}, "
             f"vocab {vocab}, {len(plan)} tensors")
    if args.dry_run:
        size = planned_size(args.model, cfg, plan, tokenizer, file_type, args.seed)
        print(f"{label}: {size} bytes ({size / 1e9:.2f} GB)\n{_type_totals(plan)}")
        return 0
    started = time.monotonic()
    try:
        size = write_synthetic(args.out, args.model, cfg, plan, tokenizer, file_type, args.seed)
    except OSError as e:      # an unwritable directory, a full disk: the old file, if any, is untouched
        print(f"error: {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {label}, {size} bytes ({size / 1e9:.2f} GB) in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
