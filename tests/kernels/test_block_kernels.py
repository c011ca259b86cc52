"""kernels.blocks (kernels/csrc/blocks.c): products straight from GGML blocks, against gguf-py's
dequantisation (bit for bit) and float64 products (within derived error bounds), on this
machine's build and on the AVX2 and portable builds."""
from __future__ import annotations

import ctypes
import mmap
import os

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from raymoe.kernels import blocks, native

if blocks.library() is None:
    pytest.skip("no C compiler: the block kernels are unavailable", allow_module_level=True)

TYPES = list(blocks.TYPES)
FLOATS = (T.F32, T.F16, T.BF16)
# Byte offsets of the float16 fields (d, dmin, m) in each block format.
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q2_K: [80, 82], T.Q3_K: [108],
    T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.MXFP4: [],
}
VARIANTS = {"native": (None, None), "avx2": ("haswell", 1), "portable": ("x86-64", 0)}
U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(params=list(VARIANTS))
def variant(request, monkeypatch):
    """Each build, made the library the module uses."""
    arch, code = VARIANTS[request.param]
    lib = blocks.load(arch)
    assert lib is not None
    if code is not None:
        assert lib.raymoe_blocks_arch() == code  # the build really takes that code path
    monkeypatch.setattr(blocks, "library", lambda: lib)
    return lib


def test_native_build_uses_vnni_where_the_cpu_has_it():
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    expected = 2 if {"avx512_vnni", "avx512bw", "avx512vbmi"} <= set(flags.split()) else 1 if "avx2" in flags else 0
    assert blocks.library().raymoe_blocks_arch() == expected


def test_avx512_without_vbmi_builds_the_avx2_kernels():
    """Cascade Lake has AVX-512 VNNI but not VBMI (byte permutes), which the AVX-512 code needs: its build
    takes the AVX2 code rather than failing (which left no block kernels at all)."""
    if not {"avx2", "fma", "f16c"} <= set(open("/proc/cpuinfo").read().split()):
        pytest.skip("the AVX2 build runs on an AVX2 CPU")
    lib = blocks.load("cascadelake")
    assert lib is not None and lib.raymoe_blocks_arch() == 1


def block_elems(t) -> int:
    return GGML_QUANT_SIZES[t][0]


def finite_f16_bits(rng, n) -> np.ndarray:
    """n random finite float16 bit patterns (subnormals and zeros included)."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xFBFF)
    return bits


def random_raw(rng, t, n, k, sane=True) -> torch.Tensor:
    """[n, row_bytes] random rows of type t. sane: scales of modest size (finite products);
    otherwise any finite float16 field (subnormals included) and any e8m0 scale."""
    if t in FLOATS:
        if t == T.F32:
            values = rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
        elif t == T.F16:
            values = (rng.standard_normal((n, k)).astype(np.float16) if sane
                      else finite_f16_bits(rng, n * k).reshape(n, k)).view(np.uint8)
        else:
            values = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).bfloat16()
            return values.view(torch.uint8).reshape(n, -1).clone()
        return torch.from_numpy(np.ascontiguousarray(values).reshape(n, -1))
    elems, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        if sane:
            scale = (rng.uniform(1e-3, 1e-2, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
        else:
            scale = finite_f16_bits(rng, n * (k // elems)).reshape(raw.shape[:2]).view(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    if t == T.MXFP4 and sane:
        raw[..., 0] = rng.integers(118, 131, raw.shape[:2])
    return torch.from_numpy(raw.reshape(n, -1))


def reference(raw: torch.Tensor, t, k) -> torch.Tensor:
    with np.errstate(over="ignore"):  # MXFP4 scales up to 2^127 overflow to inf, as they should
        out = gguf.quants.dequantize(raw.numpy(), t)
    return torch.from_numpy(np.array(out, dtype=np.float32).reshape(raw.shape[0], k))


# ---- dequantisation ------------------------------------------------------------------------------

@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_bit_exact(variant, t):
    rng = np.random.default_rng(int(t))
    k = 2 * max(block_elems(t), 256)
    raw = random_raw(rng, t, 5, k, sane=False)
    got = blocks.dequantize_rows(raw, t, k)
    want = reference(raw, t, k)
    assert not torch.isnan(want).any()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits, so -0 and +0 differ
    out = torch.empty_like(want)
    assert blocks.dequantize_rows(raw, t, k, out=out) is out and torch.equal(out.view(torch.int32), want.view(torch.int32))


# ---- products ------------------------------------------------------------------------------------

def exact_bound(x: torch.Tensor, w: torch.Tensor, chain: int) -> torch.Tensor:
    """|fl(x . w) - x . w| <= gamma_n sum |x_i w_i|, gamma_n = n u / (1 - n u), for a sum evaluated
    with at most n - 1 roundings in any term's path, plus the product's (none with an FMA)."""
    n = chain + 1
    return n * U / (1 - n * U) * (x.abs().double() @ w.abs().double().T) + 1e-300


def grouped_chain(k: int) -> int:
    """The longest chain of additions in a grouped exact product: every path sums k / 8 products
    per lane or fewer (8 lanes portable, 4 x 8 AVX2, 4 x 16 AVX-512), then at most 16 adds across
    lanes and accumulators, and 8 more for a scalar tail (AVX2)."""
    return k // 8 + 24


def fast_bound(x: torch.Tensor, w: torch.Tensor, qb: int) -> torch.Tensor:
    """Fast mode: each activation block of qb values is rounded to d * q with d = amax / 127, so
    |x - d q| <= d / 2 per element and |error| <= sum over blocks (d / 2) sum |w| there. On top,
    float32 rounding: the integer sums are exact; each block's scaling and the accumulation add
    at most ~48 roundings (k / 32 + 16 for the chains here), and the weights' own scale products
    differ from the dequantised values by 2 roundings: 1e-5 (about 170 u) of sum |x| |w| covers
    them with room."""
    m, k = x.shape
    d = x.view(m, k // qb, qb).abs().amax(-1) / np.float32(127)
    w_abs = w.abs().double().view(w.shape[0], k // qb, qb).sum(-1)
    magnitude = x.abs().double() @ w.abs().double().T
    return (d.double() / 2) @ w_abs.T * (1 + 1e-6) + 1e-5 * magnitude + 1e-300


SHAPES = {"decode": (7, 13, None), "one_block": (1, 1, 1), "tails": (5, 6, 3)}  # M, N, blocks of k


def shape(t, name):
    m, n, nb = SHAPES[name]
    return m, n, (nb * block_elems(t) if nb else 2 * max(block_elems(t), 256))


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_grouped_product(variant, t, shape_name):
    m, n, k = shape(t, shape_name)
    rng = np.random.default_rng(1000 + int(t))
    raw = torch.stack([random_raw(rng, t, n, k) for _ in range(2)])
    w = [reference(raw[g], t, k) for g in range(2)]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(int(t)))
    groups = [(1, 0, m // 2), (0, m // 2, m)] if m > 1 else [(1, 0, 1)]
    for fast in (False, True):
        out = torch.full((m, n), float("nan"))
        blocks.grouped_product(x, raw, t, k, groups, out, fast)
        for g, a, b in groups:
            want = x[a:b].double() @ w[g].double().T
            err = (out[a:b].double() - want).abs()
            exact = exact_bound(x[a:b], w[g], grouped_chain(k))
            if not fast or t in FLOATS:
                assert (err <= exact).all(), (err / exact).max()
                continue
            bound = fast_bound(x[a:b], w[g], 256 if block_elems(t) == 256 else 32)
            assert (err <= bound).all(), (err / bound).max()
            # the bound is far below the naive sum |x| |w| (so the check can fail), and the
            # activations really were quantised (the result is not exact)
            assert bound.sum() < 0.05 * (x[a:b].abs().double() @ w[g].abs().double().T).sum()
            if k >= 256:
                assert (err > exact).any()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_many_rows_product(variant, t):
    m, n, k = 37, 70, 2 * max(block_elems(t), 256)  # 70 rows: a whole tile of 64 and a tail
    rng = np.random.default_rng(2000 + int(t))
    raw = random_raw(rng, t, n, k)
    w = reference(raw, t, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(int(t)))
    out = torch.full((m, n), float("nan"))
    blocks.many_rows_product(x, raw, t, k, out)
    err = (out.double() - x.double() @ w.double().T).abs()
    # BLAS may sum the k products in one chain
    assert (err <= exact_bound(x, w, k + 16)).all()


QUANTISED = [t for t in TYPES if t not in FLOATS]


@pytest.mark.parametrize("t", QUANTISED, ids=lambda t: t.name)
def test_grouped_many_rows(variant, t):
    """The fast mode for many rows: tails in every dimension (rows past whole register tiles,
    weight rows past whole tiles of 16, an odd number of 32-blocks, three super-blocks), groups
    of several weights, an empty group; against float64 within the fast mode's bound."""
    m, n, k = 43, 21, 7 * 32 if block_elems(t) == 32 else 3 * 256
    rng = np.random.default_rng(5000 + int(t))
    raw = torch.stack([random_raw(rng, t, n, k) for _ in range(3)])
    w = [reference(raw[g], t, k) for g in range(3)]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(int(t)))
    groups = [(2, 0, 18), (0, 18, 18), (1, 18, 43)]
    out = torch.full((m, n), float("nan"))
    blocks.grouped_many_rows(x, raw, t, k, groups, out)
    for g, a, b in groups:
        if b == a:
            continue
        want = x[a:b].double() @ w[g].double().T
        err = (out[a:b].double() - want).abs()
        bound = fast_bound(x[a:b], w[g], 256 if block_elems(t) == 256 else 32)
        assert (err <= bound).all(), (err / bound).max()
        assert bound.sum() < 0.05 * (x[a:b].abs().double() @ w[g].abs().double().T).sum()
        assert (err > exact_bound(x[a:b], w[g], grouped_chain(k))).any()  # really quantised


@pytest.mark.parametrize("t", QUANTISED, ids=lambda t: t.name)
def test_two_weights_in_one_call_give_the_joined_weights_bits(variant, t):
    """A second weight stack whose rows follow the first's (a GGUF file's gate and up experts, kept
    apart in memory) gives, bit for bit, what the two joined into one stack give: few-row products
    in both modes, many-row ones in the fast mode, the split inside a register tile and inside a
    many-row tile (21 + 13 rows); through ConcatWeight too, with groups of both kinds."""
    from raymoe.kernels.weights import BlockWeight, ConcatWeight
    n1, n2, k = 21, 13, 7 * 32 if block_elems(t) == 32 else 3 * 256
    rng = np.random.default_rng(7000 + int(t))
    raw = torch.stack([random_raw(rng, t, n1, k) for _ in range(3)])
    raw2 = torch.stack([random_raw(rng, t, n2, k) for _ in range(3)])
    joined = torch.cat([raw, raw2], 1)
    x = torch.randn(43, k, generator=torch.Generator().manual_seed(int(t)))

    def same(product, groups):
        want, got = torch.full((43, n1 + n2), float("nan")), torch.full((43, n1 + n2), float("nan"))
        product(joined, groups, want, None)
        product(raw, groups, got, raw2)
        touched = torch.cat([torch.arange(a, b) for _, a, b in groups])
        assert not got[touched].isnan().any() and torch.equal(got.view(torch.int32), want.view(torch.int32))

    few, many = [(2, 0, 3), (0, 3, 3), (1, 3, 5)], [(2, 0, 18), (0, 18, 18), (1, 18, 43)]
    for quantize in (True, False):
        same(lambda w, g, out, w2: blocks.grouped_product(x, w, t, k, g, out, quantize, w2), few)
    same(lambda w, g, out, w2: blocks.grouped_many_rows(x, w, t, k, g, out, w2), many)
    mixed = [(2, 0, 3), (1, 3, 43)]
    for quantize in (True, False):
        pair = ConcatWeight([BlockWeight(raw, t, k, quantize), BlockWeight(raw2, t, k, quantize)], 1)
        assert pair.pair
        got, want = torch.empty(43, n1 + n2), torch.empty(43, n1 + n2)
        pair.grouped(x, mixed, got)
        BlockWeight(joined, t, k, quantize).grouped(x, mixed, want)
        if quantize:
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        else:       # exact many-row products multiply each weight's tiles apart: summed in another order
            for g, a, b in mixed:
                bound = exact_bound(x[a:b], reference(joined[g], t, k), grouped_chain(k))
                assert ((got[a:b] - want[a:b]).abs() <= 2 * bound).all()


class GuardedBytes:
    """A copy of raw whose last byte is the last one before an unreadable page: a kernel that reads
    past a buffer's end (as one reading past a row's last block would) dies with SIGSEGV."""

    def __init__(self, raw: torch.Tensor):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                 ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page, n = mmap.PAGESIZE, raw.numel()
        self.size = (n + page - 1) // page * page + page
        self.libc, self.base = libc, libc.mmap(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                                               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert libc.mprotect(self.base + self.size - page, page, 0) == 0    # PROT_NONE
        start = self.base + self.size - page - n
        self.tensor = torch.frombuffer((ctypes.c_uint8 * n).from_address(start), dtype=torch.uint8).view(raw.shape)
        self.tensor.copy_(raw)

    def free(self):
        del self.tensor
        self.libc.munmap(self.base, self.size)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_kernels_read_nothing_past_the_weights(variant, t):
    """Weight buffers may end exactly at a page's end (weights are read into buffers of their own
    size), so no kernel may load bytes past a row's last block, even a few it then ignores."""
    rng = np.random.default_rng(9000 + int(t))
    k = 3 * max(block_elems(t), 256)
    raw = torch.stack([random_raw(rng, t, 19, k) for _ in range(2)])
    guarded = GuardedBytes(raw)
    try:
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(int(t)))
        want = torch.empty(40, 19)
        got = torch.empty(40, 19)
        for fast in (False, True):
            blocks.grouped_product(x[:3], raw, t, k, [(1, 0, 3)], want[:3], fast)
            blocks.grouped_product(x[:3], guarded.tensor, t, k, [(1, 0, 3)], got[:3], fast)
            assert torch.equal(got[:3], want[:3])
        blocks.many_rows_product(x, guarded.tensor[1], t, k, got)
        blocks.many_rows_product(x, raw[1], t, k, want)
        assert torch.equal(got, want)
        if t not in FLOATS:
            blocks.grouped_many_rows(x, guarded.tensor, t, k, [(0, 0, 15), (1, 15, 40)], got)
            blocks.grouped_many_rows(x, raw, t, k, [(0, 0, 15), (1, 15, 40)], want)
            assert torch.equal(got, want)
        assert torch.equal(blocks.dequantize_rows(guarded.tensor[1], t, k), blocks.dequantize_rows(raw[1], t, k))
    finally:
        guarded.free()


def unit_rows(t, k) -> torch.Tensor:
    """[k, row_bytes] rows of type t whose row j is the unit vector e_j (scales 1): the fast
    product x . e_j is then d q_j exactly, the quantised activation itself."""
    raw = np.zeros((k, k // block_elems(t), GGML_QUANT_SIZES[t][1]), dtype=np.uint8)
    one = np.array([1], dtype=np.float16).view(np.uint8)
    for j in range(k):
        b, e = divmod(j, block_elems(t))
        if t == T.Q8_0:
            raw[j, :, 0:2] = one
            raw[j, b, 2 + e] = 1
        else:  # Q6_K: value (lo | hi << 4) - 32 with hi = 2 everywhere, scales 1, lo 1 at e
            raw[j, :, 208:210] = one
            raw[j, :, 192:208] = 1
            raw[j, :, 128:192] = 0xAA
            h, i = divmod(e, 128)
            raw[j, b, 64 * h + i % 64] |= 1 << (4 * (i // 64))
    return torch.from_numpy(raw.reshape(k, -1))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_fast_mode_quantises_activations_as_the_reference(variant, t):
    """Each activation block becomes d = amax / 127 and q = round(x / d) (ties to even, within
    +-127), as numpy computes it in float32: read back exactly through unit weight rows, for a
    block of ties (amax 127: x / d = x), a random block and a zero block; both kernels. (Powers
    of two for d: the kernels' float sums of integer lane sums times d are then exact.)"""
    qb = block_elems(t)
    k = 3 * qb
    rng = np.random.default_rng(6000 + int(t))
    x = np.zeros((2, k), dtype=np.float32)
    x[:, :qb] = rng.choice([0.5, 1.5, 2.5, 3.5, 126.5, -0.5, -1.5, -2.5, -126.5, 127.0], (2, qb))
    x[:, 0] = 127.0
    x[:, qb:2 * qb] = rng.uniform(-15.875, 15.875, (2, qb)).astype(np.float32)
    x[:, qb + 1] = 15.875  # amax 127 / 8: d = 1 / 8
    blocked = x.reshape(2, 3, qb)
    amax = np.abs(blocked).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocked * inv), -127, 127).astype(np.float32)
    want = torch.from_numpy((q * (amax / np.float32(127))).reshape(2, k))
    raw = unit_rows(t, k)[None]
    xt = torch.from_numpy(x)
    for product in (lambda out: blocks.grouped_product(xt, raw, t, k, [(0, 0, 2)], out, True),
                    lambda out: blocks.grouped_many_rows(xt, raw, t, k, [(0, 0, 2)], out)):
        out = torch.full((2, k), float("nan"))
        product(out)
        assert torch.equal(out, want)

@pytest.mark.parametrize("t", QUANTISED, ids=lambda t: t.name)
def test_amx_gives_the_same_bits_as_vnni(t):
    """Many-row products on AMX tiles against the same on VNNI registers, bit for bit, at 1 and 2
    threads: groups of AMX_MIN_ROWS rows or more go to AMX (37 and 33 rows: past whole blocks of
    16), a shorter group stays with VNNI, an empty one; 37 weight rows (past whole tiles of 16);
    an odd number of 32-blocks, three super-blocks."""
    lib = blocks.library()
    if not blocks.set_amx(True):
        pytest.skip("AMX unavailable here (no amx_int8 in the CPU, no -mamx-int8 in the compiler, or the "
                    "kernel refused the tile state); CI runs on a machine with AMX")
    threads = torch.get_num_threads()
    try:
        least = lib.raymoe_blocks_amx_min_rows()
        m, n, k = 2 * least + 19, 37, 7 * 32 if block_elems(t) == 32 else 3 * 256
        groups = [(2, 0, least + 5), (0, least + 5, least + 5), (1, least + 5, least + 18), (0, least + 18, m)]
        assert least + 5 >= least > 13 and m - (least + 18) >= least
        rng = np.random.default_rng(6000 + int(t))
        raw = torch.stack([random_raw(rng, t, n, k) for _ in range(3)])
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(int(t)))
        results = []
        for on, count in ((False, 2), (True, 1), (True, 2)):
            assert blocks.set_amx(on) == on
            torch.set_num_threads(count)
            out = torch.full((m, n), float("nan"))
            blocks.grouped_many_rows(x, raw, t, k, groups, out)
            assert not out.isnan().any()
            results.append(out.view(torch.int32))
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    finally:
        torch.set_num_threads(threads)
        blocks.set_amx(os.environ.get("RAYMOE_AMX", "1") != "0")


@pytest.mark.parametrize("t", QUANTISED, ids=lambda t: t.name)
def test_transposed_tiles_give_the_register_tiles_bits(t):
    """On AVX-512, many-row products take K-quant super-blocks and 32-blocks (but those with mins)
    transposed, so that each dpbusd lane sums one part (tile_kt, tile_at); the register tiles
    (tile_k, tile_a) remain for AMX hosts. Both, bit for bit: 32-blocks past one chunk of 16 and
    short of the next (23), K-quants over 3 super-blocks, 21 weight rows (tiles of 4 and a tail),
    groups past whole tiles of 4 rows, 1 and 2 threads. The native build: only AVX-512 has both."""
    lib = blocks.library()
    m, n, k = 43, 21, 23 * 32 if block_elems(t) == 32 else 3 * 256
    rng = np.random.default_rng(8000 + int(t))
    raw = torch.stack([random_raw(rng, t, n, k) for _ in range(2)])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(int(t)))
    groups = [(1, 0, 18), (0, 18, 43)]
    threads, results = torch.get_num_threads(), []
    try:
        for on, count in ((False, 2), (True, 1), (True, 2)):
            lib.raymoe_blocks_set_transposed(int(on))
            torch.set_num_threads(count)
            out = torch.full((m, n), float("nan"))
            blocks.grouped_many_rows(x, raw, t, k, groups, out)
            assert not out.isnan().any()
            results.append(out.view(torch.int32))
    finally:
        lib.raymoe_blocks_set_transposed(1)
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_gfni_unpack_gives_the_shift_and_mask_bits():
    """On AVX-512 with GFNI, a Q3_K super-block's bytes for the few-row kernel come from bit-matrix products
    (gf2p8affine); a build without GFNI takes them by shifts and masked adds.
    The same bytes, so the same bits: 1-5 activation rows, 2 and 3 super-blocks, one and several weights."""
    with open("/proc/cpuinfo") as f:
        flags = f.read().split()
    if "gfni" not in flags or blocks.library().raymoe_blocks_arch() != 2:
        pytest.skip("the GFNI path needs an AVX-512 VNNI CPU with GFNI")
    plain = native.load_source(blocks.SOURCE, None, (*blocks.EXTRA_FLAGS, "-mno-gfni"))
    assert plain is not None and plain.raymoe_blocks_arch() == 2
    plain.raymoe_blocks_grouped.argtypes = blocks.library().raymoe_blocks_grouped.argtypes
    plain.raymoe_blocks_grouped.restype = ctypes.c_int
    rng = np.random.default_rng(9000)
    for k in (512, 768):
        raw = torch.stack([random_raw(rng, T.Q3_K, 19, k) for _ in range(3)])
        for m in range(1, 6):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            groups = [(2, 0, m)] if m < 3 else [(2, 0, 1), (0, 1, m)]
            outs = []
            for lib in (blocks.library(), plain):
                out = torch.full((m, 19), float("nan"))
                lib.raymoe_blocks_grouped(int(T.Q3_K), 1, x.data_ptr(), m, x.stride(0), raw.data_ptr(),
                                          raw.stride(0), None, 0, 19, blocks._table(groups), len(groups), 19, k,
                                          out.data_ptr(), out.stride(0))
                assert not out.isnan().any()
                outs.append(out.view(torch.int32))
            assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("t", [T.Q3_K, T.Q4_K, T.Q8_0, T.MXFP4, T.F16], ids=lambda t: t.name)
def test_one_row_call_gives_the_ops_bits(t):
    """A decode step's one-row products through a block weight take a call whose weight arguments were made
    once (blocks.RowProduct, from BlockWeight.product and .linear). The op's bits: a weight alone, a pair in
    one call, a product into columns of a wider output; rows it does not take go the op's way."""
    from raymoe.kernels.weights import BlockWeight, ConcatWeight, block_linear_op
    rng = np.random.default_rng(9100 + int(t))
    k = 512
    a, b = (BlockWeight(random_raw(rng, t, n, k), t, k, True) for n in (24, 8))
    x = torch.randn(1, k)
    for w, raw2 in ((a, None), (ConcatWeight([a, b], 0), b.raw)):
        want = block_linear_op(x, a.raw, raw2, t, k, True).view(torch.int32)
        assert torch.equal(w.product(x).view(torch.int32), want)
    assert a._row is not None and a._row.tensors[1] is b.raw       # the pair's call was made and used
    out = torch.full((1, 40), float("nan"))
    a.linear(x, out[:, 8:32])
    assert torch.equal(out[:, 8:32].view(torch.int32), block_linear_op(x, a.raw, None, t, k, True).view(torch.int32))
    assert out[:, :8].isnan().all() and out[:, 32:].isnan().all()
    strided = torch.randn(1, 2 * k)[:, ::2]
    assert not a._row.takes(strided)
    assert torch.equal(a.product(strided), block_linear_op(strided.contiguous(), a.raw, None, t, k, True))


def test_strided_rows():
    """x and out with row strides larger than their rows (views into wider tensors)."""
    t, m, n, k = T.Q4_K, 5, 9, 512
    raw = random_raw(np.random.default_rng(7), t, n, k)
    x_wide, out_wide = torch.randn(m, k + 40), torch.zeros(m, n + 3)
    x, out = x_wide[:, 8:8 + k], out_wide[:, 1:1 + n]
    for fast in (False, True):
        blocks.grouped_product(x, raw[None], t, k, [(0, 0, m)], out, fast)
        want = torch.empty(m, n)
        blocks.grouped_product(x.contiguous(), raw[None], t, k, [(0, 0, m)], want, fast)
        assert torch.equal(out, want)
    assert (out_wide[:, 0] == 0).all() and (out_wide[:, n + 1:] == 0).all()
    blocks.many_rows_product(x, raw, t, k, out)
    want = torch.empty(m, n)
    blocks.many_rows_product(x.contiguous(), raw, t, k, want)
    assert torch.equal(out, want)


def test_one_weight_without_a_stack():
    """raw [N, row_bytes] is one weight (group 0): the same results as the stack raw[None]."""
    t, m, n, k = T.Q4_K, 5, 9, 512
    raw = random_raw(np.random.default_rng(8), t, n, k)
    x = torch.randn(m, k)
    for product in (lambda r, out: blocks.grouped_product(x, r, t, k, [(0, 0, 2), (0, 2, m)], out, True),
                    lambda r, out: blocks.grouped_product(x, r, t, k, [(0, 0, m)], out, False),
                    lambda r, out: blocks.grouped_many_rows(x, r, t, k, [(0, 0, m)], out)):
        one, stacked = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))
        product(raw, one)
        product(raw[None], stacked)
        assert torch.equal(one, stacked)
    with pytest.raises(ValueError):
        blocks.grouped_product(x, raw, t, k, [(1, 0, m)], torch.empty(m, n), True)  # only weight 0


# ---- determinism ---------------------------------------------------------------------------------

DETERMINISM_TYPES = [T.Q8_0, T.Q4_K, T.Q3_K, T.Q6_K, T.MXFP4, T.Q5_1, T.F16]


@pytest.mark.parametrize("t", DETERMINISM_TYPES, ids=lambda t: t.name)
def test_thread_count_does_not_change_results(t):
    m, n, k = 9, 150, 512
    rng = np.random.default_rng(3000 + int(t))
    raw = torch.stack([random_raw(rng, t, n, k) for _ in range(3)])
    x = torch.randn(m, k)
    groups = [(2, 0, 4), (0, 4, 5), (1, 5, 9)]
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            outs = []
            for fast in (False, True):
                out = torch.empty(m, n)
                blocks.grouped_product(x, raw, t, k, groups, out, fast)
                outs.append(out)
            out = torch.empty(m, n)
            blocks.many_rows_product(x, raw[0], t, k, out)
            outs.append(out)
            if t not in FLOATS:
                out = torch.empty(m, n)
                blocks.grouped_many_rows(x, raw, t, k, groups, out)
                outs.append(out)
            results.append(outs)
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


@pytest.mark.parametrize("t", DETERMINISM_TYPES, ids=lambda t: t.name)
def test_a_row_does_not_depend_on_the_others_in_its_group(variant, t):
    for k in ((512, 544) if block_elems(t) == 32 else (512,)):   # 544: an odd number of 32-blocks (a tail)
        _row_alone_equals_row_in_group(t, k)


def _row_alone_equals_row_in_group(t, k):
    m, n = 7, 21
    rng = np.random.default_rng(4000 + int(t))
    raw = random_raw(rng, t, n, k)[None]
    x = torch.randn(m, k)
    for fast in (False, True):
        together = torch.empty(m, n)
        blocks.grouped_product(x, raw, t, k, [(0, 0, m)], together, fast)
        for i in range(m):
            alone = torch.empty(1, n)
            blocks.grouped_product(x[i:i + 1], raw, t, k, [(0, 0, 1)], alone, fast)
            assert torch.equal(alone[0], together[i])
    if t in FLOATS:
        return
    # many rows: a row's result is the same whichever register tile (1-4 rows) it falls in
    together = torch.empty(m, n)
    blocks.grouped_many_rows(x, raw, t, k, [(0, 0, m)], together)
    for a, b in ((0, 1), (1, 3), (3, 6), (6, 7)):
        part = torch.empty(b - a, n)
        blocks.grouped_many_rows(x[a:b], raw, t, k, [(0, 0, b - a)], part)
        assert torch.equal(part, together[a:b])
    # and a weight row's, whichever tile of weight rows (1, 2 or 4 of them) it falls in
    for a, b in ((0, 1), (1, 3), (3, 7), (7, 21)):
        part = torch.empty(m, b - a)
        blocks.grouped_many_rows(x, raw[:, a:b].contiguous(), t, k, [(0, 0, m)], part)
        assert torch.equal(part, together[:, a:b])


# ---- errors --------------------------------------------------------------------------------------

def test_bad_arguments_raise_value_error():
    k = 256
    raw = random_raw(np.random.default_rng(0), T.Q4_K, 4, k)
    x, out = torch.randn(2, k), torch.empty(2, 4)
    assert blocks.supported(T.Q4_K) and not blocks.supported(T.IQ2_XS)
    assert blocks.row_bytes(T.Q4_K, 512) == 288 and blocks.row_bytes(T.F32, 3) == 12
    with pytest.raises(ValueError):
        blocks.row_bytes(T.Q4_K, 100)  # not whole blocks
    with pytest.raises(ValueError):
        blocks.row_bytes(T.IQ2_XS, 256)
    with pytest.raises(ValueError):
        blocks.dequantize_rows(raw[:, :-1].contiguous(), T.Q4_K, k)
    with pytest.raises(ValueError):
        blocks.dequantize_rows(raw.float(), T.Q4_K, k)
    with pytest.raises(ValueError):
        blocks.grouped_product(x, raw[None], T.Q4_K, k, [(1, 0, 2)], out, True)  # no weight 1
    with pytest.raises(ValueError):
        blocks.grouped_product(x, raw[None], T.Q4_K, k, [(0, 0, 3)], out, True)  # past the rows
    with pytest.raises(ValueError):
        blocks.grouped_product(x.t().contiguous().t(), raw[None], T.Q4_K, k, [(0, 0, 2)], out, True)
    with pytest.raises(ValueError):
        blocks.grouped_product(x, raw[None], T.Q4_K, k, [(0, 0, 2)], torch.empty(2, 5), True)
    with pytest.raises(ValueError):
        blocks.many_rows_product(x.double(), raw, T.Q4_K, k, out)
    with pytest.raises(ValueError):
        blocks.grouped_many_rows(x, raw[None], T.Q4_K, k, [(0, 1, 3)], out)  # past the rows
    with pytest.raises(ValueError):
        blocks.grouped_many_rows(x, torch.zeros(1, 4, 2 * k, dtype=torch.uint8), T.F16, k, [(0, 0, 2)], out)


@pytest.mark.parametrize("t", [T.Q4_K, T.Q3_K, T.MXFP4, T.Q8_0, T.F16], ids=lambda t: t.name)
def test_slot_product_gives_grouped_products_bits(variant, t):
    """A decode step's slots (one token's distinct experts, or one row per slot) through slot_product,
    which reads the token's row in place for every slot, give grouped_product's bits over the row
    repeated, in both modes and with a second weight; bad expert ids and row counts are refused."""
    n1, n2, k = 11, 5, 2 * 256
    rng = np.random.default_rng(9100 + int(t))
    raw = torch.stack([random_raw(rng, t, n1, k) for _ in range(6)])
    raw2 = torch.stack([random_raw(rng, t, n2, k) for _ in range(6)])
    experts = [4, 0, 5, 2]
    groups = [(e, s, s + 1) for s, e in enumerate(experts)]
    x = torch.randn(len(experts), k, generator=torch.Generator().manual_seed(int(t)))
    for quantize in (True, False):
        for second, n in ((None, n1), (raw2, n1 + n2)):
            for rows in (x[:1], x):
                want, got = torch.empty(len(experts), n), torch.empty(len(experts), n)
                blocks.grouped_product(rows.expand(len(experts), k).contiguous(), raw, t, k, groups, want, quantize,
                                       second)
                blocks.slot_product(rows, raw, t, k, experts, got, quantize, second)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    out = torch.empty(len(experts), n1)
    with pytest.raises(ValueError, match="out of range"):
        blocks.slot_product(x[:1], raw, t, k, [0, 6, 1, 2], out, True)
    with pytest.raises(ValueError, match="rows for 4 slots"):
        blocks.slot_product(x[:2], raw, t, k, experts, out, True)


ACTIVATIONS = [(0, 0.0, 0.0), (1, 1.702, 7.0)]     # swiglu; gpt-oss's clamped swiglu


def _torch_activation(kind, alpha, limit):
    from functools import partial
    from raymoe.kernels.moe import clamped_swiglu, swiglu
    return swiglu if kind == 0 else partial(clamped_swiglu, alpha=alpha, limit=limit)


@pytest.mark.parametrize("kind, alpha, limit", ACTIVATIONS)
def test_moe_activation_in_c_gives_torchs_bits(variant, kind, alpha, limit):
    """The library's MoE activations (its exp is the one torch's vector kernels use) give torch's bits for
    any float32 gate and up: random bit patterns (NaN, infinities and subnormals among them) and the
    ranges where exp under- and overflows. (Checked once over all 2^32 gate values with up = 1: no
    difference.) Where torch has vector kernels, the library takes that exp."""
    g = torch.Generator().manual_seed(17 + kind)
    bits = torch.randint(-2 ** 31, 2 ** 31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.linspace(-110, 110, 1 << 16)
    values = torch.cat([bits.view(torch.float32), edges, torch.randn(1 << 16, generator=g) * 6]).view(-1, 128)
    gate_up = torch.cat([values, values.roll(1, 0)], 1)
    activation = _torch_activation(kind, alpha, limit)
    exp_kind = blocks.activation_exp(activation, kind, alpha, limit)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert exp_kind == 1
    got = torch.empty_like(values)
    variant.raymoe_moe_activation(kind, exp_kind, alpha, limit, gate_up.data_ptr(), values.shape[0], 128,
                                  got.data_ptr())
    want = activation(gate_up)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values differ"


@pytest.mark.parametrize("t, shared_t", [(T.Q3_K, T.Q4_K), (T.MXFP4, T.Q8_0), (T.Q8_0, T.F16)], ids=lambda t: t.name)
def test_moe_token_gives_the_separate_calls_bits(variant, t, shared_t):
    """One token's MoE after its router in one call (moe.moe_token_op, a decode step's MoE: gate/up products with
    gpt-oss's biases or without, the activation, down products, shared expert, weighted sum) equals
    block_slots, the bias, the activation in torch, block_slots, block_linear and moe_combine one after
    another, bit for bit, in both modes, for both activations, gate and up as one weight or two, with and
    without a shared expert; bad expert ids, a shared expert without its gate and a bad bias are refused."""
    from raymoe.kernels.moe import moe_combine_op, moe_token_op
    from raymoe.kernels.weights import block_linear_op, block_slots_op
    h, ff, sff, k = 256, 256, 512, 4
    rng = np.random.default_rng(9300 + int(t))
    gate, up = (torch.stack([random_raw(rng, t, ff, h) for _ in range(6)]) for _ in range(2))
    down = torch.stack([random_raw(rng, t, h, ff) for _ in range(6)])
    shared_down = random_raw(rng, shared_t, h, sff)
    g = torch.Generator().manual_seed(int(t))
    x, shared_gate_up = torch.randn(1, h, generator=g), torch.randn(1, 2 * sff, generator=g) * 3
    ids, weights, shared_gate = torch.tensor([[5, 1, 3, 0]]), torch.rand(1, k, generator=g), torch.randn(1, 1, generator=g)
    for kind, alpha, limit in ACTIVATIONS:
        activation = _torch_activation(kind, alpha, limit)
        exp_kind = blocks.activation_exp(activation, kind, alpha, limit)
        for quantize, biases in ((True, None), (False, None),
                                 (True, (torch.randn(6, 2 * ff, generator=g), torch.randn(6, h, generator=g)))):
            up_bias, down_bias = biases or (None, None)
            for gate_up in ((gate, up), (torch.cat([gate, up], 1), None)):
                hidden = block_slots_op(x, ids, *gate_up, t, h, quantize)
                if up_bias is not None:
                    hidden.add_(up_bias.index_select(0, ids.reshape(-1)))   # kernels.linear.slot_linear's bias
                rows = block_slots_op(activation(hidden), ids.reshape(-1, 1), down, None, t, ff, quantize)
                if down_bias is not None:
                    rows.add_(down_bias.index_select(0, ids.reshape(-1)))
                shared = block_linear_op(activation(shared_gate_up), shared_down, None, shared_t, sff, quantize)
                args = (x, ids, weights, *gate_up, t, quantize, up_bias, down, t, quantize, down_bias, kind, exp_kind,
                        alpha, limit)
                for want, shared_args in (
                        (moe_combine_op(rows, weights, shared_gate, shared),
                         (shared_gate_up, shared_down, shared_t, quantize, shared_gate)),
                        (moe_combine_op(rows, weights, None, None), (None, None, 0, False, None))):
                    got = moe_token_op(*args, *shared_args)
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    args = [x, ids, weights, gate, up, t, True, None, down, t, True, None, 0, 1, 0.0, 0.0, None, None, 0, False, None]
    with pytest.raises(ValueError, match="out of range"):
        moe_token_op(*args[:1], torch.tensor([[5, 1, 6, 0]]), *args[2:])
    with pytest.raises(ValueError, match="come together"):
        moe_token_op(*args[:16], shared_gate_up, shared_down, shared_t, True, None)
    with pytest.raises(ValueError, match="bias must be"):
        moe_token_op(*args[:11], torch.randn(5, h), *args[12:])


def test_moe_combine_sums_slots_in_order():
    """The weighted sum adds each token's slots in slot order (each product rounded first) and then the
    gated shared expert, for any width (torch's own sum reorders some, e.g. 8 slots of 100 values);
    within float32 rounding of torch's formula."""
    from raymoe.kernels.moe import moe_combine_op
    g = torch.Generator().manual_seed(5)
    for T_, k, h in ((1, 8, 2048), (3, 8, 100), (2, 4, 2880), (5, 1, 7)):
        rows, weights = torch.randn(T_ * k, h, generator=g) * 10, torch.rand(T_, k, generator=g)
        gate, shared = torch.randn(T_, 1, generator=g), torch.randn(T_, h, generator=g)
        products = rows.view(T_, k, h) * weights[..., None]
        want = products[:, 0]
        for j in range(1, k):
            want = want + products[:, j]
        assert torch.equal(moe_combine_op(rows, weights, None, None), want)
        got = moe_combine_op(rows, weights, gate, shared)
        assert torch.allclose(got, want + torch.sigmoid(gate) * shared, rtol=1e-6, atol=1e-5)
