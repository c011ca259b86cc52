"""Rewrite a GGUF file with changes: the test's way to make damaged or odd model files."""
import gguf
import numpy as np


def rewrite_gguf(src: str, dst: str, *, drop=(), reshape=None, retype=None, set_kv=None, add_kv=None):
    """Copy src to dst, dropping tensors, giving tensors new shapes (first rows kept / zeros),
    storing tensors as another ggml type (raw zero bytes of that type), changing metadata, or adding
    metadata (add_kv: key -> (value, gguf.GGUFValueType))."""
    reshape, retype, set_kv, add_kv = reshape or {}, retype or {}, set_kv or {}, add_kv or {}
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, set_kv.get("general.architecture", arch))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, set_kv.get(name, field.contents()), vtype, sub_type=sub)
    for name, (value, vtype) in add_kv.items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if t.name in reshape:
            writer.add_tensor(t.name, np.zeros(reshape[t.name], dtype=np.float32))
        elif t.name in retype:
            qtype = retype[t.name]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(int(x) for x in reversed(t.shape))
            raw = np.zeros(shape[:-1] + (shape[-1] // block * size,), dtype=np.uint8)
            writer.add_tensor(t.name, raw, raw_dtype=qtype)
        else:
            typed = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=None if typed else t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def add_special_tokens(src: str, dst: str, tokens: list[str]):
    """Copy src (float32 embedding and output) to dst with `tokens` appended to its vocabulary as special
    (control) tokens, each with an embedding row and an output row (copies of the first token's)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    names = reader.fields["tokenizer.ggml.tokens"].contents() + list(tokens)
    types = reader.fields["tokenizer.ggml.token_type"].contents() + [gguf.TokenType.CONTROL] * len(tokens)
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = {"tokenizer.ggml.tokens": names, "tokenizer.ggml.token_type": types,
                 f"{arch}.vocab_size": len(names)}.get(name, field.contents())
        vtype = field.types[0]
        writer.add_key_value(name, value, vtype, sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name in ("token_embd.weight", "output.weight"):
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            data = np.concatenate([data, np.repeat(data[:1], len(tokens), 0)])
        typed = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        writer.add_tensor(t.name, data, raw_dtype=None if typed else t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
