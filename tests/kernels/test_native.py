"""The compiled kernels (kernels/csrc/few_rows.c) against float64 and integer references."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from raymoe.kernels.int8 import Int8Weight, quantize_rows
from raymoe.kernels.dense import _few_rows_f32
from raymoe.kernels.linear import grouped_linear, linear
from raymoe.kernels import dense
from raymoe.kernels.native import SOURCE, few_rows, int8_rows, load_source, with_few_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
lib = few_rows()
needs_lib = pytest.mark.skipif(lib is None, reason="no C compiler or neither AVX2 nor AVX-512 here (kernels/native.py)")
needs_int8 = pytest.mark.skipif(int8_rows() is None, reason="no C compiler or no AVX-512 VNNI here (kernels/native.py)")

# rows, inner, outer: tails in every dimension (K not a multiple of 16 or 64, N of 4, M of 4)
SHAPES = [(1, 1024, 4096), (2, 100, 37), (3, 64, 8), (4, 33, 5), (7, 1000, 130), (16, 512, 1024), (13, 2880, 9)]


def rows(x, w, threads=None):
    """x through one weight (float32 or Int8Weight) in the compiled kernel."""
    y = torch.empty(x.shape[0], w.shape[0])
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        groups = [(0, 0, x.shape[0])]
        assert w._few_rows(x, groups, y, single=True) if isinstance(w, Int8Weight) else \
            _few_rows_f32(x, w, groups, y, single=True)
    finally:
        torch.set_num_threads(old)
    return y


def int8_reference(x, q, scale):
    """x quantised to int8 per block of 32 as the kernel does it (the same float32 operations),
    then exact integer sums in float64."""
    k = x.shape[1]
    pad = -k % 32
    blocks = F.pad(x, (0, pad)).view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    wq = F.pad(q.float(), (0, pad)).view(q.shape[0], -1, 32)
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), wq.double())
    return (dots * d.squeeze(-1).double()[:, None, :]).sum(-1) * scale.double()


@needs_lib
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_float32_rows_match_float64(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    ref = x.double() @ w.double().T
    y = rows(x, w)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.skipif(load_source(SOURCE, "haswell") is None, reason="no C compiler for x86-64")
def test_avx2_build_of_float32_rows(monkeypatch):
    """The AVX2 kernel (what a CPU without AVX-512 runs) built here: against float64, tails in every
    dimension, and its bits independent of threads and neighbours."""
    avx2 = with_few_rows(load_source(SOURCE, "haswell"))
    assert avx2.raymoe_few_rows_available() == 1
    monkeypatch.setattr(dense, "few_rows", lambda: avx2)
    for m, k, n in SHAPES:
        g = torch.Generator().manual_seed(m * 1000 + k)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        ref = x.double() @ w.double().T
        assert (rows(x, w).double() - ref).abs().max() <= 1e-5 * ref.abs().max(), (m, k, n)
    x, w = torch.randn(9, 700, generator=g), torch.randn(301, 700, generator=g)
    y = rows(x, w, threads=2)
    assert torch.equal(y, rows(x, w, threads=1)) and torch.equal(y[5:6], rows(x[5:6], w))


@needs_lib
def test_float32_rows_do_not_depend_on_threads_or_neighbours():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 700, generator=g), torch.randn(301, 700, generator=g)
    y = rows(x, w, threads=2)
    assert torch.equal(y, rows(x, w, threads=1))
    assert torch.equal(y[5:6], rows(x[5:6], w))                   # a row alone gives the same bits


@needs_int8
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_int8_rows_match_integer_reference(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + 1)
    x = torch.randn(m, k, generator=g)
    x[0, :3] = 0                                                     # a zero run and an all-zero block
    x[-1, :32] = 0
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) / 50
    y = rows(x, Int8Weight(q, scale))
    ref = int8_reference(x, q, scale)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # and the activation rounding it adds stays small next to the float product
    exact = x.double() @ (q.double() * scale.double()[:, None]).T
    assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_lib
@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_int8)])
def test_groups_of_rows_through_their_own_weights(int8):
    """The tokens of each expert in one call: groups of 1-16 rows (in the kernel) and of 40 (not),
    each equal to its group's own product."""
    g = torch.Generator().manual_seed(4)
    experts, sizes = torch.randn(6, 72, 160, generator=g), [3, 1, 16, 40, 2]
    x = torch.randn(sum(sizes), 160, generator=g)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    groups = [(e, a, a + size) for e, a, size in zip([5, 0, 2, 3, 1], starts, sizes)]
    bias = torch.randn(6, 72, generator=g)
    weights = quantize_rows(experts) if int8 else experts
    y = grouped_linear(x, weights, groups, bias)
    for e, a, b in groups:
        if int8:
            ref = (int8_reference(x[a:b], weights.q[e], weights.scale[e]) if b - a <= 16 else
                   x[a:b].bfloat16().double() @ (weights.q[e].double() * weights.scale[e].double()[:, None]).T)
            ref = ref + bias[e].double()
        else:
            ref = x[a:b].double() @ experts[e].double().T + bias[e].double()
        # _weight_int8pack_mm (40 rows) returns bfloat16
        tol = 1e-2 if int8 and b - a > 16 else 1e-5
        assert (y[a:b].double() - ref).abs().max() <= tol * ref.abs().max(), (e, a, b)


@needs_lib
def test_linear_routes_rows_and_strided_views():
    """linear(): few-row kernel, BLAS from OpenMP threads, int8, into strided output slices."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 208, generator=g), torch.randn(96, generator=g)
    for rows in (1, 5, 16, 17, 300):
        x = torch.randn(rows, 416, generator=g)[:, ::2]               # rows with a stride != K
        out = torch.zeros(rows, 200)[:, 50:146]                       # a slice of a wider buffer
        linear(x, w, b, out=out)
        ref = x.double() @ w.double().T + b.double()
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    q = quantize_rows(w)
    x = torch.randn(3, 208, generator=g)
    ref = x.double() @ (q.q.double() * q.scale.double()[:, None]).T
    assert (linear(x, q).double() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_without_a_compiler_products_fall_back():
    """CC pointing at a failing compiler: one warning naming the problem, and products still right."""
    code = ("import gguf, torch; from raymoe.kernels.native import few_rows; from raymoe.kernels.linear import linear;"
            "from raymoe.kernels import blocks; from raymoe.kernels.weights import BlockWeight;"
            "assert few_rows() is None and blocks.library() is None; x, w = torch.randn(3, 64), torch.randn(8, 64);"
            "assert torch.allclose(linear(x, w), x @ w.T, atol=1e-5);"
            "q = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0));"
            "bw = BlockWeight(q, 8, 64, quantize_activations=True); d = bw.dequantize();"
            "assert torch.allclose(linear(x, bw), x @ d.T, atol=1e-5) and torch.equal(bw.rows(torch.tensor([2])), d[2:3]);"
            "print('ok')")
    env = {**os.environ, "CC": "false", "RAYMOE_CACHE": os.path.join(os.environ["RAYMOE_CACHE"], "nocc")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "native kernels unavailable (false failed" in proc.stderr
