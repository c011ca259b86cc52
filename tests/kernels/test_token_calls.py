"""kernels/token_calls.py: the routing in C against torch's (the layers' bits: tests/stages/test_families.py)."""
import ctypes

import pytest
import torch

from raymoe.kernels import token_calls


@pytest.mark.parametrize("kind, experts, k", [(0, 256, 8), (1, 128, 8), (2, 32, 4), (0, 60, 4)])
def test_routing_in_c_gives_torch_bits(kind, experts, k):
    """The library's routing (raymoe_route, a decode token's feed-forward in one call) is torch_route's, bit for bit:
    ATen's softmax reduced over the lanes of this torch's vector kernels (16 with AVX-512, 8 with AVX2), the top k,
    Qwen's renormalisation; the lanes found at load are this torch's, and the other count gives other bits."""
    from raymoe.kernels.moe import torch_route
    lib = token_calls.library()
    capability = torch.backends.cpu.get_cpu_capability()
    lanes = token_calls.route_lanes(kind, experts, k)
    if capability not in ("AVX2", "AVX512"):
        assert lanes is None        # torch's generic kernels: the routing stays torch's
        return
    assert lanes == (16 if capability == "AVX512" or kind == 2 else 8)
    g = torch.Generator().manual_seed(kind)
    logits = torch.cat([torch.randn(300, experts, generator=g) * scale for scale in (0.3, 3, 30)])
    logits[5, 7] = float("-inf")
    softmax_first, renormalise = next(key for key, value in token_calls.ROUTES.items() if value == kind)
    for lane_count, same in ((lanes, True), (24 - lanes, kind == 2)):
        w, ids = torch.empty(len(logits), k), torch.empty(len(logits), k, dtype=torch.int64)
        assert lib.raymoe_route(kind, lane_count, logits.data_ptr(), len(logits), experts, k, w.data_ptr(),
                                ids.data_ptr()) == 0
        rows = [torch_route(logits[i:i + 1], k, softmax_first, renormalise) for i in range(len(logits))]
        want_w, want_ids = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        assert torch.equal(ids, want_ids)
        # gpt-oss's softmax over its k < 8 chosen logits reduces them one after another with either lane count
        assert torch.equal(w.view(torch.int32), want_w.view(torch.int32)) == same


@pytest.mark.parametrize("kind, experts, k", [(0, 256, 8), (2, 32, 4)])
def test_routing_in_c_reports_tied_scores(kind, experts, k):
    """torch.topk orders equal scores as its std::nth_element leaves them, which the library does not reproduce: a
    row whose k + 1 best scores hold two equal ones (the first, the k-th against the one left out), or a NaN, makes
    raymoe_route answer TIES, and a decode token's feed-forward then takes the separate calls. Ties below those
    leave the routing torch's."""
    from raymoe.kernels.moe import torch_route
    lanes = token_calls.route_lanes(kind, experts, k)
    if lanes is None:
        return
    softmax_first, renormalise = next(key for key, value in token_calls.ROUTES.items() if value == kind)
    row = torch.randn(experts, generator=torch.Generator().manual_seed(9))
    order = row.argsort(descending=True)

    def route(logits: torch.Tensor):
        w, ids = torch.empty(1, k), torch.empty(1, k, dtype=torch.int64)
        status = token_calls.library().raymoe_route(kind, lanes, logits.data_ptr(), 1, experts, k, w.data_ptr(),
                                                    ids.data_ptr())
        return status, w, ids

    for a, b in ((0, 1), (k - 1, k), (0, 5)):          # ties among the k + 1 best
        tied = row.clone()
        tied[order[b]] = tied[order[a]]
        assert route(tied)[0] == token_calls.TIES, (a, b)
    nan = row.clone()
    nan[order[-1]] = float("nan")
    assert route(nan)[0] == token_calls.TIES
    low = row.clone()
    low[order[-1]] = low[order[-2]]                     # a tie among the scores left out
    status, w, ids = route(low)
    want_w, want_ids = torch_route(low[None], k, softmax_first, renormalise)
    assert status == 0 and torch.equal(ids, want_ids) and torch.equal(w.view(torch.int32), want_w.view(torch.int32))


def test_output_gate_in_c_gives_torch_bits():
    """Qwen's attention output gate in C (`x * sigmoid(g)`, token_calls.TokenAttention) has torch's bits on this
    torch's vector kernels, over the whole range of gates (their load-time check, gate_matches, compares the same)."""
    from raymoe.kernels.pointwise import sigmoid
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return
    assert token_calls.gate_matches()
    g = torch.Generator().manual_seed(5)
    gate = torch.cat([torch.randn(20000, generator=g) * 50, torch.linspace(-110, 110, 20000)])
    x = torch.randn(gate.shape, generator=g)
    got = torch.empty_like(x)
    token_calls.library().raymoe_gate_rows(x.data_ptr(), gate.data_ptr(), x.numel(), got.data_ptr())
    assert torch.equal(got.view(torch.int32), (x * sigmoid(gate)).view(torch.int32))


def test_c_time_splits_a_decode_step(tmp_path):
    """tools/c_time.py times every compiled call of a decode step: a tiny Qwen3.5 file's batch-1 step makes one
    mixer call and one feed-forward call a layer (--separate: the calls of the pieces instead), and the libraries'
    functions are theirs again afterwards."""
    from raymoe.kernels import blocks
    from raymoe.tools import c_time
    from raymoe.tools.make_tiny import make_tiny
    path = make_tiny("qwen35moe", str(tmp_path), gguf_type="q8_0")
    layers = 8         # tools/make_tiny.py's qwen35moe
    fused = c_time.measure(path, 3, threads=1)
    calls = {name: n for name, (_, n) in fused["calls"].items()}
    assert calls["raymoe_token_ffn"] == layers and calls["raymoe_token_deltanet"] + calls["raymoe_token_attention"] \
        == layers and fused["step_s"] > 0 and fused["outside_s"] < fused["step_s"]
    separate = c_time.measure(path, 3, threads=1, separate=True)
    calls = {name: n for name, (_, n) in separate["calls"].items() if n}
    assert "raymoe_token_ffn" not in calls and calls["raymoe_moe_token"] == layers
    assert isinstance(blocks.library().raymoe_blocks_grouped, ctypes._CFuncPtr)
