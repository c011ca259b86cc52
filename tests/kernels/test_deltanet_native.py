"""The compiled DeltaNet glue (kernels/csrc/deltanet.c) against the torch code it replaces
(kernels/deltanet.py with the library switched off) and transformers' conv."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import raymoe.kernels.deltanet as dn

# The C computes exp with its own polynomial (torch: Sleef), each within ~1 ulp, and sums vectors
# in another order than torch's reductions and BLAS: outputs agree to a few float32 ulps of values
# of order 1-10. Copies (the conv states) are exact.
CONV_TOL = dict(atol=2e-6, rtol=1e-6)
STEP_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture
def torch_glue(monkeypatch):
    """Calls inside the fixture's users run the torch fallback: as when no compiler is found."""
    def run(f, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(dn, "library", lambda: None)
            return f(*args, **kwargs)
    return run


def test_library_builds_here():
    assert dn.library() is not None


@pytest.mark.parametrize("C,K", [(1030, 4), (40, 3), (24, 1)])   # 1030: channel chunks of 1024 and a tail
def test_conv_matches_torch_and_transformers(torch_glue, C, K):
    g = torch.Generator().manual_seed(C)
    wide = torch.randn(60, C + 7, generator=g)
    x, w = wide[:, 3:3 + C], torch.randn(C, K, generator=g)       # rows of a wider matrix, as a projection's
    full = hf.causal_conv1d_fn(x.T[None].contiguous(), w, None, activation="silu")[0].T
    state = torch.zeros(K - 1, C)
    ref_state = state.clone()
    parts = []
    # T below, at and above K - 1 and the 8-token work items, from a carried state
    for a, b in [(0, 1), (1, 3), (3, 20), (20, 21), (21, 60)]:
        y, new = dn.causal_conv1d(x[a:b], w, state)
        ref_y, ref_new = torch_glue(dn.causal_conv1d, x[a:b], w, ref_state)
        assert torch.allclose(y, ref_y, **CONV_TOL) and torch.equal(new, ref_new)
        assert new.shape == (K - 1, C)
        parts.append(y)
        state, ref_state = new, ref_new
    assert torch.allclose(torch.cat(parts), full, **CONV_TOL)


def test_batched_conv_of_several_sequences(torch_glue):
    g = torch.Generator().manual_seed(1)
    x, w, states = torch.randn(3, 5, 70, generator=g), torch.randn(70, 4, generator=g), torch.randn(3, 3, 70, generator=g)
    y, new = dn.causal_conv1d(x, w, states)
    ref_y, ref_new = torch_glue(dn.causal_conv1d, x, w, states)
    assert torch.allclose(y, ref_y, **CONV_TOL) and torch.equal(new, ref_new)
    one, _ = dn.causal_conv1d(x[1], w, states[1])
    assert torch.equal(one, y[1])
    # one token of each, the rows broadcast (stride 0), as the decode step's input
    y, new = dn.causal_conv1d(x[None, 0, 2:3].expand(3, 1, 70), w, states)
    ref_y, ref_new = torch_glue(dn.causal_conv1d, x[None, 0, 2:3].expand(3, 1, 70), w, states)
    assert torch.allclose(y, ref_y, **CONV_TOL) and torch.equal(new, ref_new)


def layer(nk=2, nv=6, dk=20, dv=24, K=4, seed=0):
    """A small layer: V heads repeat K heads 3 times; dk and dv not multiples of the vector width."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    return dn.GatedDeltaNet(torch.randn(C, K, generator=g) * 0.5, -torch.rand(nv, generator=g) * 2,
                            torch.randn(nv, generator=g), torch.rand(dv, generator=g) + 0.5, 1e-6, nk, nv, dk, dv)


def projections(net, rows, seed):
    """Input projections of `rows` tokens, as column slices of one matrix (the stacked product)."""
    g = torch.Generator().manual_seed(seed)
    C, vd = net.conv.shape[0], net.n_v_heads * net.v_head_dim
    proj = torch.randn(rows, C + vd + 2 * net.n_v_heads, generator=g)
    proj[:, C + vd:] *= 3                       # gates far into both tails of sigmoid / softplus
    return proj.split([C, vd, net.n_v_heads, net.n_v_heads], dim=-1)


def caches(net, n, seed):
    g = torch.Generator().manual_seed(seed)
    C, K = net.conv.shape
    return (torch.randn(n, K - 1, C, generator=g),
            torch.randn(n, net.n_v_heads, net.k_head_dim, net.v_head_dim, generator=g) * 0.3)


def test_decode_steps_match_torch(torch_glue):
    """Three sequences in rows 4, 0, 2 of a five-row batch, for several steps: outputs, and the
    caches updated in place, as the torch code computes them."""
    net, rows = layer(), [4, 0, 2]
    conv, state = caches(net, 3, 1)
    ref_conv, ref_state = conv.clone(), state.clone()
    for step in range(5):
        parts = projections(net, 5, 10 + step)
        out, ref_out = torch.full((5, 6 * 24), 7.0), torch.full((5, 6 * 24), 7.0)
        net.decode(*parts, rows, conv, state, out)
        torch_glue(net.decode, *parts, rows, ref_conv, ref_state, ref_out)
        assert torch.equal(out[[1, 3]], ref_out[[1, 3]])          # other rows untouched
        assert torch.allclose(out, ref_out, **STEP_TOL), (out - ref_out).abs().max()
        assert torch.equal(conv, ref_conv)
        assert torch.allclose(state, ref_state, **STEP_TOL), (state - ref_state).abs().max()


def test_decode_steps_equal_the_prefill_form():
    """Token-by-token decode of one sequence carries the same caches as the prefill form (conv over
    the whole sequence, the recurrent delta rule) computes: the semantics, not just the torch code."""
    net = layer(nk=1, nv=2, dk=16, dv=32, seed=3)
    T = 9
    qkv, z, beta, alpha = projections(net, T, 4)
    conv, state = caches(net, 1, 5)
    conv0, state0 = conv[0].clone(), state[0].clone()
    outs = torch.empty(T, 2 * 32)
    for t in range(T):
        net.decode(qkv[t:t + 1], z[t:t + 1], beta[t:t + 1], alpha[t:t + 1], [0], conv, state, outs[t:t + 1])
    mixed, ref_conv = dn.causal_conv1d(qkv, net.conv, conv0)
    q, k, v = net.heads(mixed)
    g, b = net.gates(beta, alpha)
    y, ref_state = dn.delta_rule_recurrent(q, k, v, g, b, state0)
    assert torch.equal(conv[0], ref_conv)
    assert torch.allclose(state[0], ref_state, **STEP_TOL)
    assert torch.allclose(outs, net.output(y, z), **STEP_TOL)


def test_results_do_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    net = layer(nk=4, nv=8, dk=32, dv=32)
    g = torch.Generator().manual_seed(0)
    x, states = torch.randn(45, net.conv.shape[0], generator=g), torch.randn(3, net.conv.shape[0], generator=g)
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            conv, state = caches(net, 3, 1)
            out = torch.empty(3, 8 * 32)
            net.decode(*projections(net, 3, 2), [0, 1, 2], conv, state, out)
            results.append((*dn.causal_conv1d(x, net.conv, states), out, conv, state))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_decode_rejects_caches_of_the_wrong_shape():
    net = layer()
    conv, state = caches(net, 2, 0)
    with pytest.raises(ValueError):
        net.decode(*projections(net, 3, 0), [0, 1, 2], conv, state, torch.empty(3, 6 * 24))


@pytest.mark.parametrize("T,chunk,strength", [(1, 64, 2), (37, 16, 2), (64, 64, 2), (150, 64, 2), (150, 64, 40)])
def test_chunked_delta_rule_matches_torch_and_recurrent(torch_glue, T, chunk, strength):
    """The compiled chunked form (one thread per head, partial last chunk) against the torch
    chunked form and the token-by-token recurrence; v as rows of a wider matrix, as the model's.
    Strength 40: decays far into float32's underflow, where the C flushes denormals to zero."""
    g = torch.Generator().manual_seed(T)
    H, dk, dv = 4, 16, 24
    q = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, H * dv + 5, generator=g)[:, 5:].view(T, H, dv)
    decay, beta = -torch.rand(T, H, generator=g) * strength, torch.rand(T, H, generator=g)
    state = torch.randn(H, dk, dv, generator=g)
    y, s = dn.delta_rule_chunked(q, k, v, decay, beta, state, chunk)
    ref_y, ref_s = torch_glue(dn.delta_rule_chunked, q, k, v, decay, beta, state, chunk)
    rec_y, rec_s = dn.delta_rule_recurrent(q, k, v, decay, beta, state.clone())
    for a, b in [(y, ref_y), (s, ref_s), (y, rec_y), (s, rec_s)]:
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()


def test_chunked_delta_rule_does_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    T, H, d = 100, 6, 32
    q, k = (F.normalize(torch.randn(T, H, d, generator=g), dim=-1) for _ in range(2))
    v, decay, beta = torch.randn(T, H, d, generator=g), -torch.rand(T, H, generator=g), torch.rand(T, H, generator=g)
    state = torch.randn(H, d, d, generator=g)
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(dn.delta_rule_chunked(q, k, v, decay, beta, state))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_prefill_heads_and_output_norm_match_torch(torch_glue):
    """A prefill's q/k L2 norm with the V-head repeat, and the gated output norm (z: columns of the
    projections' matrix)."""
    net = layer()
    g = torch.Generator().manual_seed(7)
    mixed = torch.randn(13, net.conv.shape[0], generator=g) * 2
    for got, want in zip(net.heads(mixed), torch_glue(net.heads, mixed)):
        assert got.shape == want.shape and torch.allclose(got, want, **STEP_TOL)
    y, z = torch.randn(13, 6, 24, generator=g), torch.randn(13, 6 * 24 + 3, generator=g)[:, 3:]
    got, want = net.output(y, z), torch_glue(net.output, y, z)
    assert got.shape == want.shape == (13, 6 * 24) and torch.allclose(got, want, **STEP_TOL)


def test_calls_leave_the_threads_floating_point_mode_alone():
    """The kernels flush denormals only while they run: torch's arithmetic after them keeps them,
    on the calling thread and on OpenMP's workers."""
    threads = torch.get_num_threads()
    net = layer()
    conv, state = caches(net, 2, 0)
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(40, 6, 16, generator=g), dim=-1) for _ in range(2))
    try:
        torch.set_num_threads(2)
        net.decode(*projections(net, 2, 0), [0, 1], conv, state, torch.empty(2, 6 * 24))
        dn.delta_rule_chunked(q, k, torch.randn(40, 6, 8, generator=g), -torch.rand(40, 6, generator=g) * 40,
                              torch.rand(40, 6, generator=g), torch.zeros(6, 16, 8))
        for n in (1, 2):
            torch.set_num_threads(n)
            assert (torch.full((1 << 16,), 1e-30) * 1e-10 != 0).all()     # 1e-40: a denormal
    finally:
        torch.set_num_threads(threads)
