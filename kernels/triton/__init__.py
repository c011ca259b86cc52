"""Triton kernels for the GPU stages: the hot ops of kernels/*.py, same contracts, same numerics up to
summation order and the GPU's float rounding (the tests say how close, and why).

    blocks      products straight from GGML blocks (few-row, grouped-expert, many-row) and row dequantisation
    norms       RMSNorm, gated RMSNorm
    rope        rotary embedding applied from cos/sin tables (normal, YaRN, partial: kernels/rope.py makes them)
    moe         routing: softmax-top-k (renormalised or not), top-k-softmax
    attention   GQA over the cache: sinks, sliding window, output gate (online softmax)
    deltanet    gated delta rule (recurrent/step and chunked), causal depthwise conv1d with state

Every entry point takes tensors on one device: CUDA tensors compile the kernels for the GPU; CPU tensors
run them in Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is first imported
(the CI tests do this).
"""
