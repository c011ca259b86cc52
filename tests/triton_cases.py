"""Each Triton kernel (kernels/triton) against the CPU kernels (kernels/*.py), on small shapes, with the
error bound each comparison allows and why. Shared by tests/kernels/test_triton_kernels.py (CPU tensors in
Triton's interpreter, in CI) and tests/gpu/run.py (CUDA tensors, the kernels compiled for real): every
case takes the device to run the Triton side on; inputs are made and references computed on the CPU.

Bounds are first-order rounding-error bounds in units of U, float32's unit roundoff, scaled by the
magnitudes the computation sums: a wrong index, mask or formula shows up as an error of the size of the
values themselves, orders of magnitude above them.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from raymoe.kernels import attention as cpu_attention, deltanet as cpu_deltanet, moe as cpu_moe, norms as cpu_norms
from raymoe.kernels import rope as cpu_rope
from raymoe.kernels.dequant import dequantize
from raymoe.kernels.triton import attention, blocks, deltanet, moe, norms, rope

U = 2.0 ** -24
# byte offsets of the float16 fields (d, dmin, m) in each block format
F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q2_K: [80, 82],
              T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str) -> None:
    """|got - want| <= bound everywhere (bound a number or a tensor shaped like want)."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    err = (got - want).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(err)
    bad = ~(err <= bound)
    if bad.any():
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"{what}: |error| {err[i]:.3g} > bound {bound[i]:.3g} at {i} "
                             f"(got {got[i]:.6g}, expected {want[i]:.6g}); {int(bad.sum())} of {err.numel()} over")


def _finite_bits(rng: np.random.Generator, shape, bits: int, exponent_mask: int) -> np.ndarray:
    """Random `bits`-wide float bit patterns, any finite value (subnormals and zeros included)."""
    dtype = {16: np.uint16, 32: np.uint32}[bits]
    x = rng.integers(0, 1 << bits, size=shape, dtype=np.uint64).astype(dtype)
    x[(x & exponent_mask) == exponent_mask] &= dtype(~(exponent_mask & -exponent_mask) & ((1 << bits) - 1))
    return x


def random_blocks(rng: np.random.Generator, t: T, rows: int, k: int, sane: bool = True) -> torch.Tensor:
    """uint8 [rows, row_bytes] of type t, random bytes. sane: float16 fields of modest size and MXFP4
    scales near 1 (finite products), float types normal random values; otherwise any finite float16
    field or value and any e8m0 scale (subnormals, zeros and extremes: for bit-exact decoding)."""
    qk, size = GGML_QUANT_SIZES[t]
    if t in (T.F32, T.F16, T.BF16):
        if not sane:
            bits, mask = {T.F32: (32, 0x7F800000), T.F16: (16, 0x7C00), T.BF16: (16, 0x7F80)}[t]
            return torch.from_numpy(_finite_bits(rng, (rows, k), bits, mask).view(np.uint8).reshape(rows, -1))
        values = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32))
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[t]
        return values.to(dtype).view(torch.uint8).reshape(rows, -1).clone()
    raw = rng.integers(0, 256, size=(rows, k // qk, size), dtype=np.uint8)
    for offset in F16_FIELDS.get(t, []):
        if sane:
            scale = (rng.standard_normal((rows, k // qk, 1)) * 0.01).astype(np.float16)
        else:
            scale = _finite_bits(rng, (rows, k // qk, 1), 16, 0x7C00)
        raw[..., offset:offset + 2] = scale.view(np.uint8)
    if t == T.MXFP4 and sane:
        raw[..., 0] = rng.integers(120, 128, size=(rows, k // qk))
    return torch.from_numpy(raw.reshape(rows, -1))


def block_row_length(t: T) -> int:
    """K of the test rows: every sub-block of a K-quant super-block; for float types a length that is not
    a whole number of the kernel's 32-value pieces."""
    return {256: 256, 32: 64, 1: 48}[GGML_QUANT_SIZES[t][0]]


# --------------------------------------------------------------------------------------------- GGML blocks

def check_dequantize(t: T, device: str) -> None:
    """Bit for bit against kernels/dequant.py (itself bit-exact against gguf-py), on any finite scales and
    values: the decoder does the same float32 operations in the same order (the GPU build runs with fused
    multiply-adds off), and the float16/e8m0 scale conversions are exact."""
    rng = np.random.default_rng(int(t))
    k = block_row_length(t)
    raw = random_blocks(rng, t, 5, k, sane=False)
    want = dequantize(raw, t)
    got = blocks.dequantize_rows(raw.to(device), t, k).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{t.name}: dequantisation not bit-exact"
    ids = torch.tensor([4, 0, 4, 2])
    got = blocks.dequantize_rows(raw.to(device), t, k, ids.to(device)).cpu()
    assert torch.equal(got.view(torch.int32), want[ids].view(torch.int32)), f"{t.name}: rows by id differ"


def check_grouped_product(t: T, device: str) -> None:
    """Few-row groups of different experts (multiply-and-sum) and one many-row group (tl.dot tiles) in one
    call, against float64 products of the exactly dequantised weights (the kernels decode with fused
    multiply-adds off, as dequantize_rows). Each output sums K products in float32: the many-row tiles 32
    at a time (a product's rounding, any order within a piece, then piece after piece: <= 32 + K/32 + 1
    roundings a term); the few-row kernel in steps of 16 H values (blocks.FEW_TILES), one fused
    multiply-add per step into each of the step's lanes, then 16 lanes in any order, then H of those sums:
    <= K/(16 H) + 1 + 15 + H - 1 roundings, no more than 32 + K/32 + 2 for any K when H <= 32.
    |error| <= (32 + K/32 + 2) U sum|x||w|. The compiled CPU kernel (kernels/blocks.py, exact mode) must
    meet the same bound."""
    rng = np.random.default_rng(100 + int(t))
    k, n, experts = block_row_length(t), 24, 3
    raw = random_blocks(rng, t, experts * n, k).reshape(experts, n, -1)
    x = torch.from_numpy(rng.standard_normal((24, k), dtype=np.float32))
    groups = [(2, 0, 1), (0, 1, 3), (1, 4, 24)]       # row 3 is in no group: left as it was
    out = torch.full((24, n), 7.0, device=device)
    blocks.grouped_product(x.to(device), raw.to(device), t, k, groups, out)
    w = dequantize(raw, t).double()
    want, mag = torch.full((24, n), 7.0, dtype=torch.float64), torch.zeros(24, n, dtype=torch.float64)
    for g, a, b in groups:
        want[a:b] = x[a:b].double() @ w[g].T
        mag[a:b] = x[a:b].double().abs() @ w[g].abs().T
    bound = (32 + k / 32 + 2) * U * mag
    assert_within(out, want, bound, f"{t.name} grouped product")
    from raymoe.kernels import blocks as cpu_blocks
    if cpu_blocks.library() is not None:
        cpu = torch.full((24, n), 7.0)
        cpu_blocks.grouped_product(x, raw, t, k, groups, cpu, False)
        assert_within(cpu, want, bound, f"{t.name} CPU kernel")


def check_slot_product(t: T, device: str) -> None:
    """Each row through the expert its id names, the ids a device tensor (routed decode tokens, repeats
    included): the bound of check_grouped_product. 6 rows (a launch with a row per slot) and 40 (sorted
    by expert on the device: 20 rows of one expert, so more than one FEW_ROWS pass, and one expert unused)."""
    rng = np.random.default_rng(300 + int(t))
    k, n, experts = block_row_length(t), 40, 5
    raw = random_blocks(rng, t, experts * n, k).reshape(experts, n, -1)
    many = torch.tensor([3] * 20 + [0, 1, 4] * 6 + [0, 1])[torch.from_numpy(rng.permutation(40))]
    for ids in (torch.tensor([3, 0, 3, 1, 2, 0]), many):
        m = len(ids)
        x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
        out = torch.empty(m, n, device=device)
        blocks.slot_product(x.to(device), raw.to(device), t, k, ids.to(device), out)
        w = dequantize(raw, t).double()[ids]
        want = torch.einsum("mk,mnk->mn", x.double(), w)
        mag = torch.einsum("mk,mnk->mn", x.double().abs(), w.abs())
        assert_within(out, want, (32 + k / 32 + 2) * U * mag, f"{t.name} slot product, {m} rows")


def check_split(t: T, device: str) -> None:
    """A split weight (blocks.SPLIT: Q8_0 and MXFP4 on a GPU) decodes to the file's bits (any finite
    scales), and its few- and many-row groups and slot products (a row per slot, and sorted by expert) meet
    check_grouped_product's bound, at K = 96 (rows of 102 and 51 bytes: the split rows end in padding). Not
    bits against the file's layout: compiled, the tiles' layouts follow the loads' widths, and with them
    the order of the final sums. join_blocks gives the file's bytes back."""
    rng = np.random.default_rng(400 + int(t))
    k, n, experts = 96, 24, 3
    raw = random_blocks(rng, t, experts * n, k).reshape(experts, n, -1)
    split = blocks.split_blocks(raw, t, k)
    assert split.shape[-1] % 16 == 0 and torch.equal(blocks.join_blocks(split, t, k), raw), f"{t.name}: round trip"
    st = blocks.SPLIT + t
    wild = random_blocks(rng, t, 5, k, sane=False)
    ids = torch.tensor([4, 0, 2])
    got = blocks.dequantize_rows(blocks.split_blocks(wild, t, k).to(device), st, k, ids.to(device)).cpu()
    assert torch.equal(got.view(torch.int32), dequantize(wild, t)[ids].view(torch.int32)), f"{t.name} split: rows"
    w = dequantize(raw, t).double()
    x = torch.from_numpy(rng.standard_normal((40, k), dtype=np.float32))
    bound = (32 + k / 32 + 2) * U
    groups = [(2, 0, 1), (0, 1, 3), (1, 4, 24)]                 # few-row groups and a many-row one
    out = blocks.grouped_product(x[:24].to(device), split.to(device), st, k, groups, torch.zeros(24, n, device=device))
    want, mag = torch.zeros(24, n, dtype=torch.float64), torch.zeros(24, n, dtype=torch.float64)
    for g, a, b in groups:
        want[a:b], mag[a:b] = x[a:b].double() @ w[g].T, x[a:b].double().abs() @ w[g].abs().T
    assert_within(out, want, bound * mag, f"{t.name} split grouped product")
    slots = torch.from_numpy(rng.permutation([0, 1, 2] * 13 + [1]))       # 40: sorted by expert
    for m in (6, 40):
        out = blocks.slot_product(x[:m].to(device), split.to(device), st, k, slots[:m].to(device),
                                  torch.empty(m, n, device=device))
        want = torch.einsum("mk,mnk->mn", x[:m].double(), w[slots[:m]])
        mag = torch.einsum("mk,mnk->mn", x[:m].double().abs(), w[slots[:m]].abs())
        assert_within(out, want, bound * mag, f"{t.name} split slot product, {m} rows")


def check_linear(device: str) -> None:
    """One decode row and one prefill-sized batch through `linear` (a single group): Q4_K over 768 values
    (two steps of the one-row kernel, the second partial), and F16 rows of 40 values (not whole 16-value
    half-pieces: masked value by value); the bound of check_grouped_product."""
    rng = np.random.default_rng(7)
    # n = 40: two 32-column tiles, the second partial
    for t, k, n, m in ((T.Q4_K, 768, 40, 1), (T.Q4_K, 256, 40, 33), (T.F16, 40, 6, 1), (T.F16, 40, 6, 33)):
        raw = random_blocks(rng, t, n, k)
        w = dequantize(raw, t).double()
        x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
        out = blocks.linear(x.to(device), raw.to(device), t, k, torch.empty(m, n, device=device))
        assert_within(out, x.double() @ w.T, (32 + k / 32 + 2) * U * (x.double().abs() @ w.abs().T),
                      f"{t.name} linear, {m} rows")


# --------------------------------------------------------------------------------------------- norms, RoPE

def check_rms_norm(device: str) -> None:
    """Plain and gated, against kernels/norms.py. The mean of D squares differs by the summation order
    (<= D U relative), rsqrt, the weight and gate multiplies and the GPU's approximate rsqrt/sigmoid add a
    few U each: |error| <= (D + 16) U |y|, plus a floor of 16 U for values near zero."""
    g = torch.Generator().manual_seed(1)
    x, gate = torch.randn(3, 5, 96, generator=g), torch.randn(3, 5, 96, generator=g)
    w = torch.randn(96, generator=g)
    want = cpu_norms.rms_norm(x, w, 1e-6)
    got = norms.rms_norm(x.to(device), w.to(device), 1e-6)
    assert_within(got, want, (96 + 16) * U * (want.abs() + 1), "rms_norm")
    want = cpu_norms.gated_rms_norm(x, gate, w, 1e-6)
    got = norms.rms_norm(x.to(device), w.to(device), 1e-6, gate.to(device))
    assert_within(got, want, (96 + 16) * U * (want.abs() + 1), "gated rms_norm")


def check_rope(device: str) -> None:
    """Plain full-width RoPE, YaRN (gpt-oss's parameters, attention factor in the tables) and partial RoPE
    (a quarter of each head rotated, the rest passed through), from kernels/rope.py's tables. Each value
    is a*c + b*s: two products and a sum (or one fused multiply-add on the GPU), <= 2 U (|a c| + |b s|)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, 64, generator=g)
    positions = torch.tensor([0, 1, 2, 900, 4095, 131071])
    tables = {
        "plain": cpu_rope.rope_cos_sin(positions, cpu_rope.inv_frequencies(10000.0, 64)),
        "yarn": cpu_rope.rope_cos_sin(positions, *cpu_rope.yarn_inv_frequencies(150000.0, 64, 32.0, 4096,
                                                                                 truncate=False)),
        "partial": cpu_rope.rope_cos_sin(positions, cpu_rope.inv_frequencies(10000000.0, 16)),
    }
    for name, (cos, sin) in tables.items():
        want = cpu_rope.apply_rope(x, cos, sin)
        got = rope.apply_rope(x.to(device), cos.to(device), sin.to(device))
        rd = cos.shape[-1]
        pair = torch.cat((x[..., rd // 2:rd], x[..., :rd // 2]), -1)         # the other value of each pair
        bound = torch.cat((2 * U * (x[..., :rd].abs() * cos[:, None].abs() + pair.abs() * sin[:, None].abs()),
                           torch.zeros_like(x[..., rd:])), -1)              # the pass-through part is exact
        assert_within(got, want, bound, f"rope {name}")


# --------------------------------------------------------------------------------------------- MoE routing

def check_routing(device: str) -> None:
    """Qwen's softmax-top-k (renormalised, and not), gpt-oss's top-k-softmax, against kernels/moe.py.
    The picked experts must be identical, in the same order (random logits have no ties). Each weight
    (at most 1) is a ratio of exps of logit differences: exp(a) is off by up to |a| U relative (the GPU's
    exp scales a by log2(e) first) plus a few U, the sum of E terms by E U, so with `spread` the largest
    difference of a row's logits: |error| <= (2 spread + E + 16) U."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 32, generator=g) * 3
    cases = {
        "softmax-top-k, renormalised": (cpu_moe.route_softmax_topk(logits, 8),
                                        moe.route_softmax_topk(logits.to(device), 8)),
        "softmax-top-k": (cpu_moe.route_softmax_topk(logits, 4, False),
                          moe.route_softmax_topk(logits.to(device), 4, False)),
        "top-k-softmax": (cpu_moe.route_topk_softmax(logits, 4), moe.route_topk_softmax(logits.to(device), 4)),
    }
    for name, ((want_w, want_ids), (got_w, got_ids)) in cases.items():
        assert torch.equal(got_ids.cpu(), want_ids), f"{name}: experts {got_ids.cpu()} != {want_ids}"
        spread = (logits.max(-1, keepdim=True).values - logits.min(-1, keepdim=True).values)
        assert_within(got_w, want_w, (2 * spread + 32 + 16) * U, f"{name} weights")


# --------------------------------------------------------------------------------------------- attention

def check_attention(device: str, d: int = 16) -> None:
    """Decode (1 query) and a prefill chunk (20 queries, more than one 16-row tile) over a 70-key cache,
    GQA 4:2; plain, sliding window with sinks (gpt-oss), and the output gate (Qwen), against
    kernels/attention.py (times sigmoid(gate)). A score's dot product of D terms is off by <= D U |q||k|
    scale, which exp turns into a relative error of each probability; the online softmax's rescaling and
    the sums over Tk keys add (Tk + 16) U: |error| <= 2 U max|v| (D max|q||k| scale + Tk + 16)."""
    g = torch.Generator().manual_seed(4)
    tk, scale = 70, d ** -0.5
    k, v = torch.randn(tk, 2, d, generator=g), torch.randn(tk, 2, d, generator=g)
    k_pos = torch.arange(tk)
    sinks = torch.randn(4, generator=g)
    for tq in (1, 20):
        q, gate = torch.randn(tq, 4, d, generator=g), torch.randn(tq, 4, d, generator=g)
        q_pos = k_pos[-tq:]
        qk = q.norm(dim=-1).max() * k.norm(dim=-1).max() * scale
        bound = 2 * U * v.abs().max() * (d * qk + tk + 16)
        on = [t.to(device) for t in (q, k, v, q_pos, k_pos)]
        want = cpu_attention.attention(q, k, v, q_pos, k_pos, scale)
        assert_within(attention.attention(*on, scale), want, bound, f"attention, {tq} queries")
        want = cpu_attention.attention(q, k, v, q_pos, k_pos, scale, window=8, sinks=sinks)
        got = attention.attention(*on, scale, window=8, sinks=sinks.to(device))
        assert_within(got, want, bound, f"attention with window and sinks, {tq} queries")
        want = cpu_attention.attention(q, k, v, q_pos, k_pos, scale) * torch.sigmoid(gate)
        got = attention.attention(*on, scale, gate=gate.to(device))
        assert_within(got, want, bound + 16 * U * want.abs(), f"gated attention, {tq} queries")


# --------------------------------------------------------------------------------------------- DeltaNet

def _delta_inputs(t: int, h: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v = torch.randn(t, h, dv, generator=g)
    decay_log = -torch.rand(t, h, generator=g) * 0.5      # g = a * softplus(...) <= 0, as the model's
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, dk, dv, generator=g)
    return q, k, v, decay_log, beta, state


def check_delta_rule(device: str, dk: int = 16, dv: int = 32, chunk: int = 16) -> None:
    """Recurrent (prefill token by token) and chunked (37 tokens: two full 16-token chunks and a padded
    one) against kernels/deltanet.py's recurrent form, and the batched decode step against
    delta_rule_step. With |k| = 1, 0 <= beta <= 1 and decay <= 1 a token's update is a contraction, so
    rounding errors add up rather than grow: per token <= (dk + 8) U max|S| (the reads of dk products, the
    update's few operations), and the chunked form's triangular solve and chunk products add C U more:
    |error| <= T (dk + C + 8) U max(|S|, |v|) for outputs and state."""
    t, h = 37, 2
    q, k, v, g, beta, state = _delta_inputs(t, h, dk, dv, 5)
    want_y, want_s = cpu_deltanet.delta_rule_recurrent(q, k, v, g, beta, state.clone())
    size = max(want_s.abs().max(), v.abs().max(), state.abs().max())
    on = [x.to(device) for x in (q, k, v, g, beta)]
    got_y, got_s = deltanet.delta_rule_recurrent(*on, state.clone().to(device))
    assert_within(got_y, want_y, t * (dk + 8) * U * size, "delta rule, recurrent: outputs")
    assert_within(got_s, want_s, t * (dk + 8) * U * size, "delta rule, recurrent: state")
    got_y, got_s = deltanet.delta_rule_chunked(*on, state.clone().to(device), chunk=chunk)
    assert_within(got_y, want_y, t * (dk + chunk + 8) * U * size, "delta rule, chunked: outputs")
    assert_within(got_s, want_s, t * (dk + chunk + 8) * U * size, "delta rule, chunked: state")
    # decode: 3 sequences x h heads, states stacked [3, h, dk, dv], q pre-scaled as the model passes it
    q1, k1, v1, g1, b1 = (x[:3] for x in (q, k, v, g, beta))
    states = torch.randn(3, h, dk, dv, generator=torch.Generator().manual_seed(6))
    want_states = states.clone()
    want = cpu_deltanet.delta_rule_step(q1 * dk ** -0.5, k1, v1, g1, b1, want_states)
    got_states = states.clone().to(device)
    got = deltanet.delta_rule_step(*(x.to(device) for x in (q1 * dk ** -0.5, k1, v1, g1, b1)), got_states)
    size = max(states.abs().max(), v1.abs().max())
    assert_within(got, want, (dk + 8) * U * size, "delta rule step: outputs")
    assert_within(got_states, want_states, (dk + 8) * U * size, "delta rule step: states")


def check_causal_conv1d(device: str, c: int = 80) -> None:
    """Prefill (2 sequences x 6 tokens) and decode (1 token, so the new state keeps old state rows),
    kernel 4, c channels (80: two channel tiles, the second partial), against kernels/deltanet.py. The new
    state is a copy: exact. Each output sums K products, <= (K + 2) U sum|x||w|, then applies silu (slope
    < 1.1) whose sigmoid's exp(-a) is off by up to (|a| + 4) U relative on the GPU, |a| <= sum|x||w|:
    |error| <= (K + 8) U sum|x||w| + (sum|x||w| + 8) U |y|."""
    g = torch.Generator().manual_seed(8)
    kernel = 4
    weight = torch.randn(c, kernel, generator=g)
    for t in (6, 1):
        x, state = torch.randn(2, t, c, generator=g), torch.randn(2, kernel - 1, c, generator=g)
        want_y, want_state = cpu_deltanet.causal_conv1d(x, weight, state)
        got_y, got_state = deltanet.causal_conv1d(x.to(device), weight.to(device), state.to(device))
        history = torch.cat((state, x), 1).abs().unfold(1, kernel, 1)      # [2, t, c, kernel]
        mag = (history * weight.abs()).sum(-1)
        bound = (kernel + 8) * U * mag + (mag + 8) * U * want_y.abs()
        assert_within(got_y, want_y, bound, f"conv1d, {t} tokens")
        assert torch.equal(got_state.cpu(), want_state), f"conv1d, {t} tokens: new state differs"


BLOCK_TYPES = list(blocks.TYPES)
# every case as (name, function of the device)
CASES = ([(f"dequantize {t.name}", lambda device, t=t: check_dequantize(t, device)) for t in BLOCK_TYPES]
         + [(f"grouped product {t.name}", lambda device, t=t: check_grouped_product(t, device)) for t in BLOCK_TYPES]
         + [(f"slot product {t.name}", lambda device, t=t: check_slot_product(t, device)) for t in (T.Q4_K, T.MXFP4)]
         + [(f"split {t.name}", lambda device, t=t: check_split(t, device)) for t in blocks.SPLIT_QUANT_BYTES]
         + [("linear", check_linear), ("rms_norm", check_rms_norm), ("rope", check_rope),
            ("routing", check_routing), ("attention", check_attention), ("delta rule", check_delta_rule),
            ("causal conv1d", check_causal_conv1d)])
# the models' own sizes (gpt-oss head 64, Qwen3.5 head 256, DeltaNet heads 128 x 128 in 64-token chunks,
# Qwen3.5-35B-A3B's 8192 conv channels): slower in the interpreter, run by tests/gpu/run.py
MODEL_SIZE_CASES = [("attention, head 64", lambda device: check_attention(device, 64)),
                    ("attention, head 256", lambda device: check_attention(device, 256)),
                    ("delta rule, 128 x 128, chunk 64", lambda device: check_delta_rule(device, 128, 128, 64)),
                    ("causal conv1d, 8192 channels", lambda device: check_causal_conv1d(device, 8192))]
