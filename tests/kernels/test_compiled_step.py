"""One layer's decode step traced whole (docs/compiled-step.md): the kernels as torch custom ops
(kernels/ops.py's mechanism; each op is defined in its kernel's module) and a decode step that is tensors in,
tensors out, with no host synchronisation.
torch.compile(fullgraph=True) refuses any graph break (a .tolist(), .item(), data-dependent branch), so
the compile itself is the check that no host sync sneaks into the step."""
import pytest
import torch
from gguf import GGMLQuantizationType as T

from raymoe.kernels import attention, blocks, deltanet, moe, norms, rope, weights
from raymoe.kernels.int8 import int8_linear_op, int8_slots_op, quantize_rows
from raymoe.kernels.linear import lookup_rows
from raymoe.stages.runtime.batch import StepBatch, StepContext
from raymoe.stages.layers.cache import KVCache
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.stage import Stage

MODELS = ["tiny-qwen35moe", "tiny-gptoss"]
SEQS, PROMPT, STEPS = 2, 8, 3


@pytest.fixture(autouse=True)
def _dynamo():
    """Every layer is its own compiled entry, and the caches grow each step: room for those recompiles."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        yield
    torch._dynamo.reset()


def _batch(stage: Stage, start: int, length: int) -> StepBatch:
    ids = (torch.arange(SEQS * length) * 7 + start) % stage.config.vocab
    return StepBatch(seq_ids=list(range(SEQS)), start_pos=[start] * SEQS, lengths=[length] * SEQS,
                     token_ids=ids.tolist(), logit_rows=[])


@torch.inference_mode()
def decode_steps(model: str, mode: str, decode_fns=None, layers=None) -> list[torch.Tensor]:
    """Prefill two sequences, then STEPS decode steps, each layer through decode_fns(layer) (default its own
    decode); returns every layer's output of every step, and the caches at the end."""
    files = open_model(model)
    stage = Stage(files, range(files.n_layers), mode)
    stage.forward(_batch(stage, 0, PROMPT))
    fns = {i: (decode_fns(layer) if decode_fns and (layers is None or i in layers) else layer.decode)
           for i, layer in enumerate(stage.layers)}
    outputs = []
    for step in range(STEPS):
        batch = _batch(stage, PROMPT + step, 1)
        x = lookup_rows(stage.embed, torch.as_tensor(batch.token_ids))
        ctx = StepContext(batch=batch, positions=batch.positions(),
                          caches={sid: stage._caches_for(sid) for sid in batch.seq_ids})
        for i, layer in enumerate(stage.layers):
            inputs = layer.mixer.decode_inputs(ctx, i)      # the host's part: caches as tensors
            x = fns[i](x, inputs)
            layer.mixer.decode_done(ctx, i)
            outputs.append(x.clone())
    for caches in stage.caches.values():
        for cache in caches.values():
            held = [t[:cache.length] for t in (cache.k, cache.v, cache.pos)] if isinstance(cache, KVCache) else \
                [cache.conv, cache.state]
            outputs += [t.clone() for t in held]
    return outputs


def recording_backend(graphs: list, backend: str):
    """A torch.compile backend that keeps each Dynamo graph, then hands it to `backend`."""
    from torch._dynamo.backends.registry import lookup_backend

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)
    return compile_graph


def raymoe_ops(graphs) -> set[str]:
    return {str(n.target).split(".")[1] for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("raymoe.")}


@pytest.mark.parametrize("mode", ["float32", "auto", "int8"])
@pytest.mark.parametrize("model", MODELS)
def test_decode_step_traces_whole_and_keeps_every_bit(model, mode):
    """Every layer's decode step compiled with fullgraph=True (no graph break, so no host sync) and run
    by aot_eager: the outputs and the caches equal the eager path's bit for bit, step after step."""
    graphs = []
    backend = recording_backend(graphs, "aot_eager")
    compiled = decode_steps(model, mode, lambda layer: torch.compile(layer.decode, fullgraph=True, backend=backend))
    eager = decode_steps(model, mode)
    assert len(compiled) == len(eager)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    # the kernels are in the graph as one call each, the routed experts as slot products
    products = {"int8_linear", "int8_slots"} if mode == "int8" else \
        {"dense_linear", "dense_slots"} if model == "tiny-qwen35moe" else {"dense_linear", "block_slots"}
    mixers = {"attention", "deltanet_decode"} if model == "tiny-qwen35moe" else {"attention"}
    assert products | mixers <= raymoe_ops(graphs)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_inductor_compiles_a_decode_step_of_each_layer_kind(model):
    """Inductor (C++ on the CPU) compiles a DeltaNet and an attention layer's step (qwen35moe), a sliding
    and a full attention layer's (gpt-oss), whole. It fuses the pointwise work between the kernels and
    sums its reductions (RMSNorm, softmax) in its own order, so outputs agree to float32 rounding."""
    layers = {0, 3} if model == "tiny-qwen35moe" else {0, 1}
    compiled = decode_steps(model, "float32", lambda layer: torch.compile(layer.decode, fullgraph=True), layers)
    eager = decode_steps(model, "float32")
    for a, b in zip(compiled, eager):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)


def test_a_host_sync_breaks_the_compile(monkeypatch):
    """Negative control: the routed experts planned on the host (the prefill path: ids.tolist()) cannot
    be traced whole, and fullgraph=True says so."""
    monkeypatch.setattr(moe, "CPU_SLOT_PRODUCTS", 0)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="in plan"):
        decode_steps("tiny-gptoss", "float32", lambda layer: torch.compile(layer.decode, fullgraph=True,
                                                                            backend="eager"), layers={0})


def test_decode_step_equals_the_general_path(monkeypatch):
    """The decode step (custom ops, slot products) gives the bits of the general path a batch of one-token
    chunks took before it: attention per segment, DeltaNet's row-indexed step, experts sorted on the host."""
    for model in MODELS:
        for mode in ("float32", "auto"):
            ours = generate_logits(model, mode)
            with monkeypatch.context() as m:
                m.setattr(StepBatch, "decoding", property(lambda self: False))
                m.setattr(moe, "CPU_SLOT_PRODUCTS", 0)
                m.setattr(moe, "GPU_SLOT_PRODUCTS", 0)
                general = generate_logits(model, mode)
            assert all(torch.equal(a, b) for a, b in zip(ours, general)), (model, mode)


def generate_logits(model: str, mode: str) -> list[torch.Tensor]:
    files = open_model(model)
    stage = Stage(files, range(files.n_layers), mode)
    logits = [stage.forward(StepBatch([0, 1], [0, 0], [PROMPT, 3], list(range(PROMPT + 3)), [PROMPT - 1, PROMPT + 2]))]
    for step in range(STEPS):
        logits.append(stage.forward(StepBatch([0, 1], [PROMPT + step, 3 + step], [1, 1], [5, 9], [0, 1])))
    return logits


# ---- the ops one by one ------------------------------------------------------------------------------

def _g():
    return torch.Generator().manual_seed(0)


def _blocks(t: T, experts: int, rows: int, k: int) -> torch.Tensor:
    return blocks._random_weight(t, experts * rows, k).view(experts, rows, -1)


def _deltanet_args(n: int = 2, nk: int = 1, nv: int = 2, dk: int = 16, dv: int = 16, kernel: int = 4):
    g = _g()
    c = 2 * nk * dk + nv * dv
    proj = torch.randn(n, c + nv * dv + 2 * nv, generator=g)          # one product's columns, as a layer has
    qkv, z, beta, alpha = proj.split([c, nv * dv, nv, nv], dim=-1)
    conv = torch.randn(c, kernel, generator=g) * 0.5
    return (qkv, z, beta, alpha, torch.randn(n, kernel - 1, c, generator=g), torch.randn(n, nv, dk, dv, generator=g),
            conv, conv.t().contiguous(), -torch.rand(nv, generator=g), torch.randn(nv, generator=g),
            torch.randn(dv, generator=g), 1e-6, nk, nv, dk, dv)


def op_cases():
    """(op, args) for each op: small inputs of the shapes the models give them."""
    g = _g()
    x, ids = torch.randn(3, 64, generator=g), torch.tensor([[2, 0], [1, 2], [3, 1]])
    q8, mx = _blocks(T.Q8_0, 4, 8, 64), _blocks(T.MXFP4, 4, 8, 64)
    gate_up, down, shared_down = _blocks(T.Q8_0, 4, 64, 64), _blocks(T.Q8_0, 4, 64, 32), _blocks(T.Q8_0, 1, 64, 32)[0]
    int8 = quantize_rows(torch.randn(4, 8, 64, generator=g))
    q, kv = torch.randn(1, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    dq, dk, dv = (torch.nn.functional.normalize(torch.randn(2, 3, 16, generator=g), dim=-1) for _ in range(3))
    return {
        "dense_linear": [(weights.dense_linear_op, (x, torch.randn(8, 64, generator=g)))],
        "dense_slots": [(weights.dense_slots_op, (x, ids, torch.randn(4, 8, 64, generator=g), None)),
                        (weights.dense_slots_op, (x, ids, torch.randn(4, 8, 64, generator=g),
                                                  torch.randn(4, 6, 64, generator=g)))],
        "block_linear": [(weights.block_linear_op, (x, q8[0], None, T.Q8_0, 64, quantize))
                         for quantize in (False, True)] + [(weights.block_linear_op, (x, mx[0], mx[1], T.MXFP4, 64, True))],
        "block_slots": [(weights.block_slots_op, (x, ids, q8, None, T.Q8_0, 64, False)),
                        (weights.block_slots_op, (x, ids, mx, mx.flip(0).contiguous(), T.MXFP4, 64, True))],
        "int8_linear": [(int8_linear_op, (x, int8.q[0], int8.scale[0]))],
        "int8_slots": [(int8_slots_op, (x, ids, int8.q, int8.scale))],
        "attention": [(attention.attention_op, (q, kv, kv.flip(0), torch.tensor([5]), torch.arange(6), 0.25, window,
                                                sinks))
                      for window, sinks in ((None, None), (3, torch.randn(4, generator=g)))],
        "causal_conv1d": [(deltanet.causal_conv1d_op, (torch.randn(2, 1, 16, generator=g),
                                                       torch.randn(16, 4, generator=g),
                                                       torch.randn(2, 3, 16, generator=g)))],
        "delta_rule_step": [(deltanet.delta_rule_step_op, (dq * 0.25, dk, dv, -torch.rand(2, 3, generator=g),
                                                           torch.rand(2, 3, generator=g),
                                                           torch.randn(2, 3, 16, 16, generator=g)))],
        "deltanet_decode": [(deltanet.deltanet_decode_op, _deltanet_args())],
        "route": [(moe.route_op, (torch.randn(3, 8, generator=g), 2, first, first)) for first in (True, False)],
        "moe_combine": [(moe.moe_combine_op, (torch.randn(6, 64, generator=g), torch.rand(3, 2, generator=g), None,
                                              None)),
                        (moe.moe_combine_op, (torch.randn(6, 64, generator=g), torch.rand(3, 2, generator=g),
                                              torch.randn(3, 1, generator=g), torch.randn(3, 64, generator=g)))],
        "moe_token": [(moe.moe_token_op, (x[:1], ids[:1], torch.rand(1, 2, generator=g), gate_up, None, T.Q8_0,
                                          quantize, torch.randn(4, 64, generator=g) if shared is None else None, down,
                                          T.Q8_0, quantize, torch.randn(4, 64, generator=g) if shared is None else None,
                                          kind, 1, 1.702, 7.0, shared, None if shared is None else shared_down, T.Q8_0,
                                          quantize, None if shared is None else torch.randn(1, 1, generator=g)))
                      for kind, quantize, shared in ((1, False, None), (0, True, torch.randn(1, 64, generator=g)))],
        "rope": [(rope.rope_op, (torch.randn(2, 3, 16, generator=g), torch.randn(2, 8, generator=g),
                                 torch.randn(2, 8, generator=g)))],
        "rms_norm": [(norms.rms_norm_op, (x, torch.randn(64, generator=g), 1e-6)),
                     (norms.rms_norm_op, (torch.randn(2, 3, 40, generator=g)[:, :, :37], torch.randn(37, generator=g),
                                          1e-5))],
    }


CASES = op_cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    """torch.library.opcheck: schema (mutations declared), fake shapes, and tracing through AOT dispatch."""
    for op, args in CASES[name]:
        torch.library.opcheck(op.op, args)


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"int8_linear", "int8_slots", "moe_token"}))
def test_cuda_implementation_in_the_triton_interpreter(name):
    """Each op's CUDA implementation (Triton kernels; int8 and moe_token are CPU-only), run on CPU tensors in Triton's
    interpreter, agrees with its CPU implementation, mutated caches included (the fast mode is a CPU one:
    the GPU multiplies exactly)."""
    for op, args in CASES[name]:
        exact = tuple(False if a is True else a for a in args) if name.startswith("block") else args
        cpu_args, gpu_args = _clone(exact), _clone(exact)
        want, got = op.kernels["cpu"](*cpu_args), op.kernels["cuda"](*gpu_args)
        for a, b in zip(torch.utils._pytree.tree_leaves((want, cpu_args)), torch.utils._pytree.tree_leaves((got, gpu_args))):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4), name


def test_ops_outside_tracing_call_their_implementation_directly():
    """Eager calls skip the dispatcher (tens of µs a call) but run the very function it would."""
    op, args = CASES["dense_linear"][0]
    assert torch.equal(op(*args), op.op(*args))
    with pytest.raises(NotImplementedError, match="no meta implementation"):
        int8_linear_op(torch.empty(1, 64, device="meta"), *CASES["int8_linear"][0][1][1:])
