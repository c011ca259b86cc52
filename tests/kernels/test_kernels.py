"""Kernel numerics against transformers' reference functions and naive formulas."""
import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from raymoe.kernels.attention import attention
from raymoe.kernels.deltanet import causal_conv1d, delta_rule_chunked, delta_rule_recurrent, delta_rule_step
from raymoe.kernels.int8 import Int8Weight, quantize_rows
from raymoe.kernels.linear import linear, lookup_rows
from raymoe.kernels.weights import ConcatWeight, cat_weights
from raymoe.kernels.moe import combine_slots, expert_slot_outputs, route_softmax_topk, run_experts
from raymoe.kernels.rope import apply_rope, inv_frequencies, rope_cos_sin, section_ids


def delta_inputs(T, H=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    state = torch.randn(H, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T", [1, 63, 64, 150])
def test_chunked_delta_rule_equals_recurrent(T):
    q, k, v, g, b, s = delta_inputs(T)
    y_rec, s_rec = delta_rule_recurrent(q, k, v, g, b, s.clone())
    y_chk, s_chk = delta_rule_chunked(q, k, v, g, b, s.clone())
    assert torch.allclose(y_rec, y_chk, atol=1e-5, rtol=0)
    assert torch.allclose(s_rec, s_chk, atol=1e-5, rtol=0)


def test_recurrent_delta_rule_matches_transformers():
    q, k, v, g, b, s = delta_inputs(40)
    ours, state = delta_rule_recurrent(q, k, v, g, b, s.clone())
    ref, ref_state = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], b[None],
                                                         initial_state=s[None], output_final_state=True)
    assert torch.allclose(ours, ref[0], atol=1e-5) and torch.allclose(state, ref_state[0], atol=1e-5)


def test_chunked_prefill_continues_from_carried_state():
    q, k, v, g, b, s = delta_inputs(100)
    whole, s_whole = delta_rule_chunked(q, k, v, g, b, s.clone())
    first, s_mid = delta_rule_chunked(q[:37], k[:37], v[:37], g[:37], b[:37], s.clone())
    second, s_end = delta_rule_chunked(q[37:], k[37:], v[37:], g[37:], b[37:], s_mid)
    assert torch.allclose(torch.cat((first, second)), whole, atol=1e-5) and torch.allclose(s_end, s_whole, atol=1e-5)


def test_batched_step_equals_one_sequence_at_a_time():
    seqs = [delta_inputs(1, seed=i) for i in range(3)]
    stacked = torch.stack([s[5] for s in seqs])
    y = delta_rule_step(*(torch.cat([s[i] for s in seqs]) for i in range(5)), stacked)
    for i, (q, k, v, g, b, s) in enumerate(seqs):
        one = delta_rule_step(q[0], k[0], v[0], g[0], b[0], s.clone())
        assert torch.allclose(y[i], one, atol=1e-6)


def test_causal_conv_with_carried_state_equals_full_conv():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(30, 12, generator=g), torch.randn(12, 4, generator=g)
    ref = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")[0].T
    state = torch.zeros(3, 12)
    parts = []
    for a, b in [(0, 1), (1, 11), (11, 12), (12, 30)]:
        y, state = causal_conv1d(x[a:b], w, state)
        parts.append(y)
    assert torch.allclose(torch.cat(parts), ref, atol=1e-6)
    batched, _ = causal_conv1d(x[None, 5:6].expand(2, 1, 12), w, torch.stack([x[2:5], x[2:5]]))
    assert torch.allclose(batched[0, 0], ref[5], atol=1e-6)


def naive_attention(q, k, v, q_pos, k_pos, scale, window=None, sinks=None):
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], hq, v.shape[-1])
    for t in range(q.shape[0]):
        for h in range(hq):
            kh = h // (hq // hkv)
            logits = []
            for j in range(k.shape[0]):
                visible = k_pos[j] <= q_pos[t] and (window is None or k_pos[j] > q_pos[t] - window)
                logits.append(float(q[t, h] @ k[j, kh]) * scale if visible else -math.inf)
            logits = torch.tensor(logits + ([float(sinks[h])] if sinks is not None else []))
            p = torch.softmax(logits, 0)[:k.shape[0]]
            out[t, h] = p @ v[:, kh]
    return out


@pytest.mark.parametrize("rows", [5, 1, 3])     # 5: torch's matrix products; 1 and 3: the compiled kernel
@pytest.mark.parametrize("window, with_sinks", [(None, False), (4, False), (None, True), (3, True)])
def test_attention_gqa_window_sinks(window, with_sinks, rows):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(rows, 6, 37, generator=g), torch.randn(9, 2, 37, generator=g), torch.randn(9, 2, 37, generator=g)
    q_pos, k_pos = torch.arange(9 - rows, 9), torch.arange(9)
    sinks = torch.randn(6, generator=g) if with_sinks else None
    ours = attention(q, k, v, q_pos, k_pos, 0.3, window=window, sinks=sinks)
    assert torch.allclose(ours, naive_attention(q, k, v, q_pos, k_pos, 0.3, window, sinks), atol=1e-5)


def test_compiled_attention_is_used_for_decode_and_is_thread_independent(monkeypatch):
    """A decode step's rows go through the compiled kernel (not torch's products: their results differ
    in the last bits), whatever the thread count; keys past a window and a cache ring's unordered
    positions are handled by position, as in torch."""
    from raymoe.kernels import attention as module
    assert module._library() is not None
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 8, 64, generator=g), torch.randn(300, 2, 64, generator=g), torch.randn(300, 2, 64, generator=g)
    q_pos, k_pos = torch.tensor([298, 299]), torch.randperm(300, generator=g)
    sinks = torch.randn(8, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention(q, k, v, q_pos, k_pos, 0.125, window=128, sinks=sinks)
        torch.set_num_threads(2)
        two = attention(q, k, v, q_pos, k_pos, 0.125, window=128, sinks=sinks)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    monkeypatch.setattr(module, "_library", lambda: None)
    products = attention(q, k, v, q_pos, k_pos, 0.125, window=128, sinks=sinks)
    assert not torch.equal(one, products) and torch.allclose(one, products, atol=1e-5)


def test_multi_section_rope_equals_partial_rope_for_text_positions():
    inv = inv_frequencies(1e6, 16)
    pos = torch.arange(7)
    plain = rope_cos_sin(pos, inv)
    multi = rope_cos_sin(torch.stack([pos, pos, pos]), inv, sections=section_ids([3, 3, 2], 8))
    assert torch.equal(plain[0], multi[0]) and torch.equal(plain[1], multi[1])
    different = rope_cos_sin(torch.stack([pos, pos * 2, pos * 3]), inv, sections=section_ids([3, 3, 2], 8))
    assert not torch.allclose(plain[0], different[0])
    # HF's interleaved M-RoPE layout, rebuilt from its recomposition rule
    x = torch.randn(7, 2, 32)
    cos, sin = plain
    ref_q, _ = hf.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.allclose(apply_rope(x, cos, sin), ref_q[0].transpose(0, 1), atol=1e-6)


def test_moe_grouped_experts_and_expert_slices():
    g = torch.Generator().manual_seed(2)
    T, H, Fe, E, k = 11, 8, 6, 5, 2
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * Fe, H, generator=g), torch.randn(E, H, Fe, generator=g)
    weights, ids = route_softmax_topk(torch.randn(T, E, generator=g), k)
    assert torch.allclose(weights.sum(-1), torch.ones(T))
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            gu = gate_up[ids[t, j]] @ x[t]
            ref[t] += weights[t, j] * (down[ids[t, j]] @ (F.silu(gu[:Fe]) * gu[Fe:]))
    full = run_experts(x, weights, ids, gate_up, down)
    assert torch.allclose(full, ref, atol=1e-5)
    # experts split over two holders (expert parallelism) give the identical result
    parts = [expert_slot_outputs(x, ids, gate_up[r.start:r.stop], down[r.start:r.stop], experts=r)
             for r in (range(0, 2), range(2, 5))]
    split = combine_slots(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), weights)
    assert torch.equal(split, full)
    # one token (decode) through the same code equals its row of the batch
    one = run_experts(x[3:4], weights[3:4], ids[3:4], gate_up, down)
    assert torch.allclose(one, full[3:4], atol=1e-6)


def test_moe_top_one_routing_takes_each_tokens_own_expert():
    """k = 1: the slots sorted by expert are tokens out of order, and each still meets its own expert."""
    g = torch.Generator().manual_seed(4)
    T, H, Fe, E = 5, 8, 6, 4
    x = torch.randn(T, H, generator=g)
    gate_up, down = torch.randn(E, 2 * Fe, H, generator=g), torch.randn(E, H, Fe, generator=g)
    ids, weights = torch.tensor([[3], [1], [2], [0], [1]]), torch.rand(T, 1, generator=g)
    ref = torch.stack([weights[t, 0] * (down[ids[t, 0]] @ (F.silu(gu[:Fe]) * gu[Fe:]))
                       for t in range(T) for gu in [gate_up[ids[t, 0]] @ x[t]]])
    assert torch.allclose(run_experts(x, weights, ids, gate_up, down), ref, atol=1e-5)


def test_int8_rows_quantise_and_multiply_within_their_error():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 64, generator=g) * torch.rand(3, 40, 1, generator=g)     # rows of different ranges
    q = quantize_rows(w)
    assert isinstance(q, Int8Weight) and q.q.dtype == torch.int8 and q.scale.shape == (3, 40)
    assert q.nbytes == w.numel() + 4 * 3 * 40                                         # a quarter of float32, plus scales
    back = q.q.float() * q.scale.float()[..., None]
    assert ((back - w).abs() <= 0.5 * q.scale.float()[..., None] * 1.01).all()        # half a step per element
    x = torch.randn(5, 64, generator=g)
    for e in range(3):                                                                 # an expert, as grouped code indexes it
        exact = x @ w[e].T
        ours = linear(x, q[e]).float()
        assert ours.dtype == torch.float32 and (ours - exact).abs().max() < 0.02 * exact.abs().max()
        # what's left is the activations' rounding (bfloat16, or int8 in the compiled kernel)
        assert (ours - x @ back[e].T).abs().max() < 0.01 * exact.abs().max()
    # concatenation (fused projections, gate and up of experts) keeps each row's own scale
    cat = cat_weights([q, quantize_rows(torch.randn(3, 8, 64, generator=g))], dim=1)
    assert cat.shape == (3, 48, 64) and torch.equal(cat.q[:, :40], q.q) and torch.equal(cat.scale[:, :40], q.scale)
    # weights of different kinds sit side by side, each computing its own columns
    dense = torch.randn(2, 64, generator=g)
    mixed = cat_weights([q[0], dense])
    assert isinstance(mixed, ConcatWeight) and mixed.shape == (42, 64)
    assert torch.equal(linear(x, mixed), torch.cat([linear(x, q[0]), linear(x, dense)], -1))
    # the kernel needs the inner size to be a multiple of 16 (measured: others give wrong sums)
    assert quantize_rows(torch.randn(4, 40, generator=g)) is None
    # an int8 embedding table gives its rows dequantised
    ids = torch.tensor([5, 0, 5, 39])
    assert torch.equal(lookup_rows(q[1], ids), back[1][ids])


def test_rope_in_c_keeps_torchs_bits():
    """kernels/csrc/rope.c (rope_op, what apply_rope runs on the CPU) gives torch's expression's bits: partial
    rotary (Qwen3.5: 64 of 256), whole heads (gpt-oss), one token and several, heads that are column views of a
    projection, and a YaRN-scaled table."""
    from raymoe.kernels.rope import rope_op, torch_rope
    g = torch.Generator().manual_seed(4)
    for T, H, D, rd, scale in ((1, 16, 256, 64, 1.0), (5, 8, 64, 64, 1.3), (3, 2, 12, 12, 1.0)):
        x = torch.randn(T, H, 2 * D, generator=g)[..., :D]          # a column view, as the gated q is
        cos, sin = rope_cos_sin(torch.arange(7, 7 + T), inv_frequencies(10000.0, rd), scale)
        assert torch.equal(rope_op(x, cos, sin), torch_rope(x, cos, sin))
        assert torch.equal(apply_rope(x, cos, sin), torch_rope(x, cos, sin))
