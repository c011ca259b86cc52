"""How many torch operations one decode step dispatches, per layer, on the CPU (docs/compiled-step.md).

    python -m raymoe.tools.decode_ops [--model tiny-qwen35moe] [--mode float32] [--sequences 1] [--compiled]

Prefills `sequences` prompts of 8 tokens, runs one decode step to warm the caches up (the first stacks
the DeltaNet states), then profiles the next decode step layer by layer with torch.profiler. It prints,
per layer: `top`, the operations Python dispatched (events without an operator parent: an aten op, or
one custom op with everything it runs inside counted once), and `all`, every operator event (nested ones
too). --compiled also compiles each layer's decode step with torch.compile (fullgraph) twice: AOT-traced
and run eagerly (aot_eager), printing the operators in its graph (after functionalisation) and how many
are raymoe's; and by inductor, printing the calls its code makes in a step, profiled as above (fused C++
kernels, with inductor's kernel profiling on, count one each).
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from raymoe.kernels.linear import lookup_rows
from raymoe.stages.runtime.batch import StepBatch, StepContext
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.stage import Stage

PROMPT = 8


def _step(stage: Stage, seqs: int, start: int, length: int) -> StepBatch:
    ids = torch.arange(seqs * length) % stage.config.vocab
    return StepBatch(seq_ids=list(range(seqs)), start_pos=[start] * seqs, lengths=[length] * seqs,
                     token_ids=ids.tolist(), logit_rows=[])


def _is_operator(name: str) -> bool:
    """aten::*, raymoe::*, and inductor's fused kernels (graph_N_cpp_fused_*)."""
    return "::" in name or "_cpp_fused_" in name


def _profiled(fn, *args) -> tuple:
    """fn(*args), and its (top-level, all) operator events."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn(*args)
    ops = [e for e in prof.events() if _is_operator(e.name)]

    def top(e):
        parent = e.cpu_parent
        while parent is not None and not _is_operator(parent.name):
            parent = parent.cpu_parent
        return parent is None
    return out, sum(map(top, ops)), len(ops)


def _recording_backend(graphs: list):
    """aot_eager that keeps each forward graph AOT produced."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def keep(gm, example_inputs):
        graphs.append(gm)
        return boxed_nop(gm, example_inputs)
    return aot_autograd(fw_compiler=keep)


def _graph_ops(gm) -> tuple[int, int]:
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return len(calls), sum(str(n.target).startswith("raymoe.") for n in calls)


@torch.inference_mode()
def count(model: str, mode: str, seqs: int = 1, compiled: bool = False) -> list[dict]:
    """Per layer of one decode step of `seqs` sequences: {kind, top, all} and, compiled, {graph, raymoe,
    inductor}."""
    files = open_model(model)
    stage = Stage(files, range(files.n_layers), mode)
    stage.forward(_step(stage, seqs, 0, PROMPT))
    stage.forward(_step(stage, seqs, PROMPT, 1))
    rows = [{"kind": type(layer.mixer).__name__} for layer in stage.layers]
    # inductor twice: the first step compiles (and recompiles the caches' growing length as dynamic)
    runs = ("eager", "aot_eager", "inductor", "inductor") if compiled else ("eager",)
    inductor = {}
    for n, run in enumerate(runs):
        batch = _step(stage, seqs, PROMPT + 1 + n, 1)
        x = lookup_rows(stage.embed, torch.as_tensor(batch.token_ids))
        ctx = StepContext(batch=batch, positions=batch.positions(),
                          caches={sid: stage._caches_for(sid) for sid in batch.seq_ids})
        for i, layer in enumerate(stage.layers):
            if run == "eager":
                x, rows[i]["top"], rows[i]["all"] = _profiled(layer, x, ctx)
                continue
            inputs = layer.mixer.decode_inputs(ctx, i)
            if run == "aot_eager":
                graphs = []
                x = torch.compile(layer.decode, fullgraph=True, backend=_recording_backend(graphs))(x, inputs)
                rows[i]["graph"], rows[i]["raymoe"] = _graph_ops(graphs[-1])
            else:
                step = inductor.setdefault(i, torch.compile(layer.decode, fullgraph=True, dynamic=True))
                x, rows[i]["inductor"], _ = _profiled(step, x, inputs)
            layer.mixer.decode_done(ctx, i)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen35moe")
    parser.add_argument("--mode", default="float32")
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._inductor.config.cpp.enable_kernel_profile = True
    for i, row in enumerate(count(args.model, args.mode, args.sequences, args.compiled)):
        graph = f"; graph {row['graph']:4d} ops ({row['raymoe']} raymoe), inductor {row['inductor']:3d}" \
            if "graph" in row else ""
        print(f"layer {i} {row['kind']:>13}: eager {row['top']:4d} top-level ops, {row['all']:4d} in all{graph}")


if __name__ == "__main__":
    main()
