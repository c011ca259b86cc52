"""The Triton kernels (kernels/triton) in Triton's interpreter on CPU tensors, against the CPU kernels,
within the bounds tests/triton_cases.py derives (TRITON_INTERPRET is set in tests/conftest.py); tests/gpu/run.py runs the same cases compiled on a GPU."""
import pytest
import torch
import triton_cases
from gguf import GGMLQuantizationType as T

from raymoe.kernels.triton import attention, blocks, deltanet, launch     # in the interpreter: tests/conftest.py


@pytest.mark.parametrize("check", [fn for _, fn in triton_cases.CASES], ids=[name for name, _ in triton_cases.CASES])
def test_kernel_matches_cpu(check):
    check("cpu")


def test_bad_inputs_get_one_line_errors(monkeypatch):
    x, out = torch.randn(2, 256), torch.empty(2, 4)
    with pytest.raises(ValueError, match="raw rows of 100 bytes, expected 144 for Q4_K"):
        blocks.linear(x, torch.zeros(4, 100, dtype=torch.uint8), T.Q4_K, 256, out)
    with pytest.raises(ValueError, match="unsupported GGML type"):
        blocks.linear(x, torch.zeros(4, 144, dtype=torch.uint8), T.IQ2_XS, 256, out)
    with pytest.raises(ValueError, match="out of range"):
        blocks.grouped_product(x, torch.zeros(1, 4, 144, dtype=torch.uint8), T.Q4_K, 256, [(1, 0, 2)], out)
    with pytest.raises(ValueError, match="row ids out of range"):
        blocks.dequantize_rows(torch.zeros(4, 144, dtype=torch.uint8), T.Q4_K, 256, torch.tensor([4]))
    with pytest.raises(ValueError, match="head size must be a power of two"):
        q = torch.randn(1, 2, 24)
        attention.attention(q, q, q, torch.zeros(1), torch.zeros(1), 1.0)
    with pytest.raises(ValueError, match="state .* does not fit"):
        v = torch.randn(3, 2, 16)
        deltanet.delta_rule_recurrent(v, v, v, v[..., 0], v[..., 0], torch.zeros(2, 16, 8))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        launch.check_device(x)


def test_a_split_weight_computes_as_the_files_bytes_and_moves_back_whole():
    """kernels/weights.py's BlockWeight over split bytes (what `to("cuda")` makes of Q8_0 and MXFP4) gives the
    Triton kernels' bits for the file's bytes, and `to("cpu")` gives the file's bytes back."""
    import numpy as np

    from raymoe.kernels.weights import BlockWeight

    rng = np.random.default_rng(0)
    for t in (T.Q8_0, T.MXFP4):
        raw = triton_cases.random_blocks(rng, t, 3 * 8, 64).reshape(3, 8, -1)
        weight = BlockWeight(blocks.split_blocks(raw, t, 64), t, 64, False, split=True)
        x = torch.randn(4, 64)
        want = blocks.grouped_product(x, raw, t, 64, [(2, 0, 1), (0, 1, 4)], torch.empty(4, 8))
        assert torch.equal(weight.grouped(x, [(2, 0, 1), (0, 1, 4)], torch.empty(4, 8)), want)
        assert torch.equal(weight[1].rows(torch.tensor([5, 0])), blocks.dequantize_rows(raw[1], t, 64)[[5, 0]])
        back = weight.to("cpu")
        assert not back.split and torch.equal(back.raw, raw)


@pytest.mark.parametrize("d", [16, 64])
def test_decode_attention_past_the_cache_end_changes_no_bit(d):
    """A decode step replayed as a CUDA graph reads a KV cache's whole storage (stages/runtime/decode_graph.py): the
    rows past the end (EMPTY_POSITION; zeros, or keys a window has passed) leave every bit as it was."""
    from raymoe.stages.layers.cache import EMPTY_POSITION

    g = torch.Generator().manual_seed(0)
    held, storage = 70, 256
    k, v = torch.randn(storage, 2, d, generator=g), torch.randn(storage, 2, d, generator=g)
    k_pos = torch.arange(storage)
    k_pos[held:] = EMPTY_POSITION
    q, gate, sinks = torch.randn(1, 4, d, generator=g), torch.randn(1, 4, d, generator=g), torch.randn(4, generator=g)
    q_pos = torch.tensor([held - 1])
    for options in ({}, {"window": 8, "sinks": sinks}, {"gate": gate}):
        want = attention.attention(q, k[:held], v[:held], q_pos, k_pos[:held], d ** -0.5, **options)
        got = attention.attention(q, k, v, q_pos, k_pos, d ** -0.5, **options)
        assert torch.equal(got, want), options
