"""The mechanism of the kernels' torch custom ops (namespace `raymoe`), so that torch.compile traces a decode step
whole. Each op is declared with `custom_op` in the module that owns its numerics; this one imports none of them.

Each op has a CPU implementation, which is exactly what the eager code runs (the compiled C library
through ctypes, or torch where it can't be built: the same bits either way), a CUDA implementation over
the Triton kernels of kernels/triton (imported on first use), and a fake one that gives the output's
shape and dtype. Arguments are tensors and plain numbers: expert ids stay a tensor (no list of groups),
so a traced step has no host synchronisation. Outside tracing, calls skip the dispatcher (see _Op).

    dense_linear, block_linear, int8_linear     x [T, K] times one weight's rows -> [T, N]
    dense_slots, block_slots, int8_slots        row t*k+j = x[t] through expert ids[t, j] -> [T*k, N]
                                                (kernels/weights.py; the int8 ones kernels/int8.py)
    attention                                   one sequence's queries over its cache (sinks, window)
                                                (kernels/attention.py)
    causal_conv1d, delta_rule_step              the Gated DeltaNet conv and one recurrent step
    deltanet_decode                             a DeltaNet layer's whole decode step (conv, rule, norm)
                                                (kernels/deltanet.py)
    route                                       softmax-top-k / top-k-softmax routing (kernels/moe.py)
    moe_combine, moe_token                      the routed experts' weighted sum (and the gated shared
                                                expert); one token's whole MoE after its router, one call
                                                (kernels/moe.py)
    rms_norm                                    RMSNorm over the last dimension, float32 (kernels/norms.py)
    rope                                        NeoX rotary embedding of each head's leading values
                                                (kernels/rope.py)

In its module each op is the `_Op` named `<op>_op` (e.g. kernels.weights.dense_linear_op).

block_* take GGML blocks (uint8 [.., N, row bytes]) and, as raw2, optionally a second weight of the same
format whose rows follow the first's in the output (a GGUF file's gate and up experts: one product).
int8 is a CPU mode (no CUDA implementation). docs/compiled-step.md says what is left to do.
"""
import torch

LIB = "raymoe"


class _Op:
    """A custom op, called through torch's dispatcher while torch.compile traces (the graph holds one
    call), and otherwise straight to its implementation for the tensors' device: the same function,
    without the dispatcher's Python layers (measured: tens of µs a call, which doubled the embedded
    models' decode step; a real model's step makes hundreds of calls)."""

    def __init__(self, op, cpu):
        self.op, self.kernels = op, {"cpu": cpu}

    def register_kernel(self, device: str):
        def register(fn):
            self.op.register_kernel(device)(fn)
            self.kernels[device] = fn
            return fn
        return register

    def register_fake(self, fn):
        return self.op.register_fake(fn)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        kernel = self.kernels.get(args[0].device.type)
        if kernel is None:
            raise NotImplementedError(f"{self.op._qualname} has no {args[0].device.type} implementation")
        return kernel(*args)


def custom_op(name: str, mutates: tuple = ()):
    """Declares the op `raymoe::name`: the decorated function is its CPU implementation, and the `_Op` returned
    takes the others (`.register_kernel("cuda")`, `.register_fake`). mutates: the arguments it writes in place."""
    def register(cpu) -> _Op:
        return _Op(torch.library.custom_op(f"{LIB}::{name}", mutates_args=mutates, device_types="cpu")(cpu), cpu)
    return register
