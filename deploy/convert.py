"""Convert an HF checkpoint to GGUF, with every convention change of docs/model-formats.md (qwen35moe §2,
gpt-oss §4, qwen3next §7).

    python -m raymoe.deploy.convert HF_DIR OUT.gguf [--type f32|f16|bf16|q8_0]

The tensors come from the same reader the engine uses for HF directories, so a converted
file computes exactly what the directory does. 1-D tensors (norms, gates), biases and the
conv kernel stay float32, as llama.cpp's converter keeps them. Tensors the checkpoint already holds
in a GGML type (gpt-oss's MXFP4 experts, via the source's `raw`) are repacked bit for bit,
never requantised, whatever `--type` says.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from raymoe.stages.errors import RaymoeError
from raymoe.stages.families.contract import global_tensor_shapes

TYPES = ("f32", "f16", "bf16", "q8_0")


def _ggml_type(kind: str):
    from gguf import GGMLQuantizationType as Q
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[kind]


def _add_metadata(writer, arch: str, values: dict):
    for key, value in values.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        else:
            raise TypeError(f"metadata {full}: {type(value).__name__}")


def _encode(tensor, kind: str, name: str):
    """(array, raw ggml type or None) for one tensor; small or odd-shaped tensors stay float32."""
    import gguf

    data = tensor.float().numpy()
    qtype = _ggml_type(kind)
    if (data.ndim == 1 or name.endswith(("ssm_conv1d.weight", ".bias"))
            or qtype == gguf.GGMLQuantizationType.F32):
        return data, None
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16), None
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if data.shape[-1] % block:
        return data, None
    return gguf.quants.quantize(data, qtype), qtype


def convert(hf_dir: str, out_path: str, kind: str = "f32", progress: bool = True) -> str:
    import gguf
    from tqdm import tqdm

    from raymoe.stages.files.loader import open_model
    from raymoe.stages.text.tokenizer import write_tokenizer_to_gguf

    if not os.path.isdir(hf_dir):
        raise RaymoeError(f"{hf_dir}: not a directory (convert takes an HF checkpoint directory)")
    model = open_model(hf_dir, max_model_len=None)     # the file keeps the checkpoint's whole context
    family, cfg = model.family, model.config
    names = global_tensor_shapes(cfg)
    if not model.source.has("output.weight"):
        del names["output.weight"]       # tied head: llama.cpp falls back to token_embd
    for i in range(cfg.n_layers):
        names.update(family.layer_tensor_shapes(cfg, i))
    if getattr(cfg, "mtp_layers", 0):       # the MTP head (its first layer: the one a drafter runs)
        names.update(family.mtp_tensor_shapes(cfg))

    tmp = out_path + ".partial"
    writer = gguf.GGUFWriter(tmp, family.arch)
    writer.add_name(os.path.basename(os.path.normpath(hf_dir)))
    writer.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[kind])
    _add_metadata(writer, family.arch, family.gguf_metadata(cfg))
    write_tokenizer_to_gguf(writer, model.tokenizer, family.tokenizer_pre, vocab_size=cfg.vocab)
    for name, shape in tqdm(names.items(), desc="converting", unit="tensor", file=sys.stderr,
                            disable=not progress or None):
        packed = model.source.raw(name)     # a tensor the checkpoint already holds in a GGML type
        if packed is not None:
            data, raw = packed[0].numpy(), packed[1]
            if tuple(gguf.quant_shape_from_byte_shape(data.shape, raw)) != tuple(shape):
                raise RaymoeError(f"{hf_dir}: tensor {name} repacks to shape "
                                  f"{list(gguf.quant_shape_from_byte_shape(data.shape, raw))}, expected {list(shape)}")
        else:
            data, raw = _encode(model.tensor(name, shape), kind, name)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m raymoe.deploy.convert", description="HF checkpoint -> GGUF")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="f32", choices=TYPES)
    args = p.parse_args(argv)
    try:
        convert(args.hf_dir, args.out, args.type)
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
