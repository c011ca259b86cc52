"""kernels.dequant against gguf-py's reference (numpy) dequantisation, bit for bit."""
from __future__ import annotations

import warnings

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from raymoe.kernels.dequant import dequantize

# Types gguf-py can quantise, so real blocks can be made from random floats.
QUANTISABLE = [T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]
# Byte offsets of every float16 field (d, dmin, m) in each block format.
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.MXFP4: [],
}
ROWS, BLOCKS = (2, 3), 4  # leading shape, blocks per row


def reference(data, qtype) -> torch.Tensor:
    with np.errstate(over="ignore"):  # MXFP4 with e8m0 = 255 overflows to inf, as it should
        out = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.array(out, dtype=np.float32))


def finite_f16_bits(rng, n) -> np.ndarray:
    """n random finite float16 bit patterns (subnormals and zeros included)."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    all_ones_exp = (bits & 0x7C00) == 0x7C00
    bits[all_ones_exp] &= np.uint16(0xFBFF)  # clear one exponent bit: no inf / NaN
    return bits


def random_blocks(rng, qtype) -> np.ndarray:
    """Random raw bytes of shape ROWS + (BLOCKS * type_size,) with finite float16 fields."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*ROWS, BLOCKS, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        bits = finite_f16_bits(rng, raw[..., 0].size).reshape(raw.shape[:-1])
        raw[..., off:off + 2] = bits[..., None].view(np.uint8)
    return raw.reshape(*ROWS, BLOCKS * type_size)


def check(data, qtype):
    got = dequantize(data, qtype)
    want = reference(np.asarray(data), qtype)
    assert got.dtype == torch.float32
    assert got.shape == want.shape
    assert not torch.isnan(want).any()
    assert torch.equal(got, want)
    return got


@pytest.mark.parametrize("qtype", [T.F32, T.F16, *QUANTISABLE], ids=lambda t: t.name)
def test_quantised_random_floats(qtype):
    rng = np.random.default_rng(int(qtype))
    block_size, _ = GGML_QUANT_SIZES[qtype]
    x = rng.standard_normal((*ROWS, BLOCKS * max(block_size, 32))).astype(np.float32)
    x[0, 0, :block_size] = 0.0  # an all-zero block
    x[0, 1] *= 1000.0
    data = gguf.quants.quantize(x, qtype)
    got = check(data, qtype)
    assert got.shape == x.shape


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda t: t.name)
def test_random_bytes(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    data = random_blocks(rng, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    got = check(data, qtype)
    assert got.shape == (*ROWS, BLOCKS * block_size)
    # a torch uint8 tensor and a plain int qtype give the same result
    assert torch.equal(dequantize(torch.from_numpy(data), int(qtype)), got)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern(qtype):
    """All 65536 bit patterns (inf and NaN included) convert exactly like gguf-py's."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)
    data = bits.view(np.float16) if qtype == T.F16 else bits.view(np.uint8)
    got = dequantize(data, qtype)
    want = reference(data, qtype)
    assert got.shape == want.shape == (256, 256)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_raw_bytes_for_float_types():
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    assert torch.equal(dequantize(x.view(np.uint8), T.F32), torch.from_numpy(x))
    h = x.astype(np.float16)
    want = torch.from_numpy(h.astype(np.float32))
    assert torch.equal(dequantize(h.view(np.uint8), T.F16), want)
    assert torch.equal(dequantize(torch.from_numpy(h.view(np.uint8)), T.F16), want)


def test_gguf_file_roundtrip(tmp_path):
    rng = np.random.default_rng(7)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.Q8_0)
    q4k = random_blocks(rng, T.Q4_K)  # shape (2, 3, 4 * 144) -> elements (2, 3, 1024)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    w.add_tensor("q8", q8, raw_dtype=T.Q8_0)
    w.add_tensor("q4k", q4k, raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(str(path), "r")
    tensors = {t.name: t for t in reader.tensors}
    expected = {"q8": (T.Q8_0, (4, 64)), "q4k": (T.Q4_K, (2, 3, 1024))}
    for name, (qtype, shape) in expected.items():
        t = tensors[name]
        assert t.tensor_type == qtype
        assert t.data.dtype == np.uint8 and not t.data.flags.writeable
        assert tuple(reversed(t.shape.tolist())) == shape
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "non-writable buffer" warning from torch
            got = dequantize(t.data, t.tensor_type)
        assert got.shape == shape
        assert torch.equal(got, reference(t.data, t.tensor_type))


def test_unsupported_type():
    data = np.zeros((1, GGML_QUANT_SIZES[T.IQ2_XXS][1]), dtype=np.uint8)
    with pytest.raises(NotImplementedError, match="unsupported GGML tensor type IQ2_XXS"):
        dequantize(data, T.IQ2_XXS)


def test_mxfp4_every_exponent():
    """All 256 e8m0 scales (the subnormal-scale cases e = 0, 1 and the overflowing e = 255)."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256, dtype=np.uint8)
    check(raw.reshape(8, 32 * 17), T.MXFP4)
