"""The GPU check, one script for a CUDA machine (no Ray: it drives the kernels directly).

    python -m tests.gpu.run                  # from the repository root (or: python tests/gpu/run.py)
    python -m tests.gpu.run --compile-only   # no GPU needed: compile every kernel variant the cases launch

1. Every Triton kernel (kernels/triton) compiled for the GPU and compared with the CPU kernels, in the
   cases and bounds of tests/triton_cases.py (the CI runs the same cases in Triton's interpreter), and
   again at the models' head sizes (MODEL_SIZE_CASES, too slow for the interpreter).
2. Batch-1 products straight from GGML blocks on a 4096 x 4096 weight per type, MoE decode at two
   models' expert shapes and a few one-row tile choices: time per call and the weight bytes read per
   second, against the device's peak bandwidth when it is known.
3. Models (tests/gpu/model_checks.py): both embedded models on the GPU against the CPU, and PP=2/4 on the GPU
   against PP=1; the same through Ray (PP=1, and PP=2 sharing the GPU); decode steps replayed as CUDA graphs
   against eager ones; PP=2 with the second stage in
   another process, activations through CUDA IPC (tools/cuda_ipc.py); then full-size synthetic files
   (tools.make_synthetic, written to --folder): load time, batch-1 decode tok/s eager and with CUDA graphs
   against the HBM roofline, where a step's time goes, and the aggregate tok/s of 64 sequences.

    --sections kernels,bandwidth,outputs,ray,graphs,ipc,decode   (default: all; decode:MODEL for one model,
                                                             kernels:TEXT for the cases named with TEXT)
    --decode-models gpt-oss-20b,qwen3.5-35b-a3b

Without CUDA it says so and exits 0. Exit status 1 when a case fails.

--compile-only runs the cases in the interpreter (a child process) recording each kernel launch's
argument types and constants, then compiles each distinct variant to a cubin for --arch (default 90,
Hopper) with the ptxas that ships in the triton wheel: errors that only compilation finds (types,
layouts, unsupported operations) show up without a GPU. It proves nothing about the results.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

if "--record" not in sys.argv:      # compile for real: the interpreter must be off before triton is imported
    os.environ.pop("TRITON_INTERPRET", None)
# the bounds in tests/triton_cases.py allow fused multiply-adds (the dequantisation turns them off itself);
# setting the default silences Triton 3.9's warning that it will change
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu")]   # raymoe itself: installed

import torch  # noqa: E402

# peak HBM bandwidth by device name (vendor figures), for the bandwidth table's last column
PEAK_GB_S = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "A100-SXM4-80GB": 2039.0}


def check_kernels(only: str = "") -> int:
    import triton_cases

    failures = 0
    for name, check in triton_cases.CASES + triton_cases.MODEL_SIZE_CASES:
        if only not in name:
            continue
        start = time.perf_counter()
        try:
            check("cuda")
            torch.cuda.synchronize()
            print(f"  pass  {name} ({time.perf_counter() - start:.1f} s, compile included)", flush=True)
        except Exception as e:      # report every case, then fail
            failures += 1
            print(f"  FAIL  {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
    return failures


def _seconds_per_call(calls) -> float:
    """Mean time of the launches `calls` (functions of no arguments), replayed from one CUDA graph so that
    no host work sits between kernels (a batch-1 product takes microseconds, less than the Python around
    a launch); plain back-to-back launches if the capture fails."""
    for call in calls:                                # compile, and reach the steady state
        call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        replay = graph.replay
    except Exception as e:       # noqa: BLE001 - the timing must still come out
        print(f"    (CUDA graph capture failed, {type(e).__name__}: {e}; timing plain launches)")
        torch.cuda.synchronize()

        def replay():
            for call in calls:
                call()
    replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1000 / 5 / len(calls)


def _distinct_copies(raw: torch.Tensor, total_bytes: int) -> torch.Tensor:
    """[copies, *raw.shape] on the GPU, at least total_bytes together: calls that cycle through them read
    from HBM, not from the 50 MB L2 that one copy of a small weight would stay in."""
    copies = max(1, -(-total_bytes // raw.numel()))
    return raw.cuda()[None].repeat(copies, *([1] * raw.dim()))


def _report(label: str, seconds: float, nbytes: int, peak) -> None:
    rate = nbytes / seconds / 1e9
    print(f"  {label:>34}: {seconds * 1e6:8.1f} us  {rate:7.1f} GB/s" + (f"  {rate / peak:6.1%} of peak" if peak else ""),
          flush=True)


def bandwidth() -> None:
    """Batch-1 products on a 4096 x 4096 weight per type, MoE decode (one launch over the chosen experts,
    one row each) at gpt-oss-20b's and Qwen3.5-35B-A3B's expert shapes, and a few tile choices for
    the one-row products (blocks.FEW_TILES[1]) to tune from. GB/s: weight bytes read (for MoE, the chosen
    experts' only) per second. Each call reads weights no earlier call left in L2."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from triton_cases import random_blocks

    from raymoe.kernels.triton import blocks

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_GB_S.items() if k in name), None)
    print(f"batch-1 block products, 4096 x 4096 weight, on {name}" + (f" (peak {peak:.0f} GB/s)" if peak else ""))
    rng = np.random.default_rng(0)
    n = k = 4096
    x = torch.randn(1, k, device="cuda")
    out = torch.empty(1, n, device="cuda")
    weights = {}
    for t in (T.BF16, T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K, T.Q3_K, T.Q2_K, T.MXFP4):
        weights[t] = _distinct_copies(random_blocks(rng, t, n, k), 512 << 20)
    for t in blocks.SPLIT_QUANT_BYTES:          # Q8_0 and MXFP4 as the GPU keeps them
        weights[blocks.SPLIT + t] = blocks.split_blocks(weights[t], t, k)

    def name(t: int) -> str:
        return T(t % blocks.SPLIT).name + (" split" if t >= blocks.SPLIT else "")

    print("one-row tiles (weight rows a program, 16-value half-pieces a step, warps, unrolled), 4096 x 4096; "
          f"the first is the default, {blocks.FEW_TILES[1]}:")
    default = blocks.FEW_TILES[1]
    try:
        for tile in (default, (4, 32, 4, 4), (2, 32, 4, 2), (2, 32, 4, 4), (8, 16, 4, 2), (4, 32, 8, 4),
                     (4, 16, 4, 4)):
            blocks.FEW_TILES[1] = tile
            for t in weights if tile == default else (T.Q6_K, T.Q4_K, T.Q3_K,
                                                      *(blocks.SPLIT + q for q in blocks.SPLIT_QUANT_BYTES)):
                raw = weights[t]
                calls = [blocks.prepare_grouped_product(x, raw[c][None], t, k, [(0, 0, 1)], out)
                         for c in range(len(raw))]
                _report(f"{name(t)} {tile}", _seconds_per_call(calls), raw[0].numel(), peak)
    finally:
        blocks.FEW_TILES[1] = default

    print("MoE decode: slot products over the chosen experts' weights, one row each")
    moe_cases = [("gpt-oss-20b gate_up 32 x [5760, 2880]", T.MXFP4, 32, 5760, 2880, 4),
                 ("gpt-oss-20b down 32 x [2880, 2880]", T.MXFP4, 32, 2880, 2880, 4),
                 ("Qwen3.5-35B-A3B gate_up 256 x [1024, 2048]", T.Q3_K, 256, 1024, 2048, 8),
                 ("Qwen3.5-35B-A3B down 256 x [2048, 512]", T.Q3_K, 256, 2048, 512, 8)]
    for label, t, experts, n, k, chosen in moe_cases:
        # 4 distinct experts' bytes, repeated at their own addresses up to every expert
        few = random_blocks(rng, t, 4 * n, k).reshape(4, n, -1).cuda()
        x = torch.randn(chosen, k, device="cuda")
        out = torch.empty(chosen, n, device="cuda")
        draws = [torch.from_numpy(rng.choice(experts, chosen, replace=False)).cuda() for _ in range(16)]
        for layout in (t, blocks.SPLIT + t) if blocks.splits(t) else (t,):
            raw = (few if layout == t else blocks.split_blocks(few, t, k)).repeat(experts // 4, 1, 1)
            calls = [lambda d=d, raw=raw, layout=layout: blocks.slot_product(x, raw, layout, k, d, out) for d in draws]
            _report(f"{label}, {chosen} of them{' (split)' if layout != t else ''}", _seconds_per_call(calls),
                    chosen * raw[0].numel(), peak)


def record_launches(path: str) -> None:
    """(In the interpreter) run every case on CPU tensors, writing each distinct kernel launch's
    module, kernel, argument types, constants and options to `path` as JSON. The model-size cases are
    too slow for the interpreter: their launches are recorded but not run, and their comparisons skipped."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.interpreter import InterpretedFunction

    import triton_cases

    seen, execute = {}, True
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        constants = {k: v for k, v in kwargs.items() if k in names}
        options = {k: v for k, v in kwargs.items() if k not in names}
        # specialised as the JIT does: ints equal to 1 become constants, pointers and ints that are
        # multiples of 16 are marked so (the compiler vectorises loads from what it knows of alignment)
        signature, aligned = {}, []
        for index, (name, value) in enumerate(zip(names, args)):
            kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
            if kind == "constexpr":
                constants[name] = value
            else:
                signature[name] = kind
                if key == "D":
                    aligned.append(index)
        signature.update({name: "constexpr" for name in constants})
        entry = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": signature,
                 "constants": constants, "options": options, "aligned": aligned}
        seen[json.dumps(entry, sort_keys=True)] = entry
        return run(self, *args, grid=grid, warmup=warmup, **kwargs) if execute else None

    InterpretedFunction.run = recording_run
    for _, check in triton_cases.CASES:
        check("cpu")
    execute, triton_cases.assert_within = False, lambda *args: None
    for _, check in triton_cases.MODEL_SIZE_CASES:
        try:
            check("cpu")
        except AssertionError:
            pass
    with open(path, "w") as f:
        json.dump(list(seen.values()), f)


def compile_only(arch: int) -> int:
    import importlib
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "launches.json")
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--record", path], env=env, check=True)
    with open(path) as f:
        launches = json.load(f)
    print(f"compiling {len(launches)} kernel variants for sm_{arch} (registers a thread, spilled bytes: LOCAL):")
    failures = spills = 0
    for entry in launches:
        fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        label = f"{entry['kernel']} {entry['constants']}"
        start = time.perf_counter()
        try:
            attrs = {(index,): [["tt.divisibility", 16]] for index in entry["aligned"]}
            compiled = triton.compile(ASTSource(fn, entry["signature"], entry["constants"], attrs),
                                      target=GPUTarget("cuda", arch, 32), options=entry["options"])
            usage = _resource_usage(compiled.asm["cubin"], tmp)
            print(f"  ok    {label} ({time.perf_counter() - start:.1f} s, {len(compiled.asm['cubin'])} B cubin, "
                  f"{usage}, {compiled.metadata.shared} B shared)", flush=True)
            if "LOCAL:0" not in usage:
                spills += 1
        except Exception as e:
            failures += 1
            print(f"  FAIL  {label}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    shutil.rmtree(tmp)
    print(f"{failures} variant(s) failed to compile" if failures else "every variant compiled")
    if spills:
        print(f"{spills} variant(s) spill registers to local memory")
    return 1 if failures else 0


def _resource_usage(cubin: bytes, tmp: str) -> str:
    """REG (registers a thread) and LOCAL (bytes spilled a thread) of the kernel in a cubin, as the
    cuobjdump in the triton wheel reads them."""
    import re

    import triton

    path = os.path.join(tmp, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=False).stdout
    return " ".join(re.findall(r"(REG:\d+|LOCAL:\d+)", text)) or "no resource usage"


def _timings(measure) -> int:
    """Run a measurement; an error in it is printed and counts as no failure (it checks nothing)."""
    try:
        measure()
    except Exception:      # noqa: BLE001 - the checks' verdict still comes out
        traceback.print_exc()
        print("the timings stopped early (above); they are no check")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="compile every kernel variant; no GPU needed")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only")
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--sections", default="kernels,bandwidth,outputs,ray,graphs,ipc,decode")
    parser.add_argument("--decode-models", default="gpt-oss-20b,qwen3.5-35b-a3b")
    parser.add_argument("--folder", default="/tmp", help="where the synthetic files are written (12-16 GB each)")
    args = parser.parse_args()
    if args.record:
        record_launches(args.record)
        return 0
    if args.compile_only:
        return compile_only(args.arch)
    if not torch.cuda.is_available():
        print("tests/gpu/run.py: no CUDA device here (torch.cuda.is_available() is False): nothing to check. "
              "The kernels' logic is checked on CPU by tests/kernels/test_triton_kernels.py in Triton's interpreter.")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    import model_checks as models

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_GB_S.items() if k in name), None)
    sections = {
        "kernels": ("Triton kernels against the CPU kernels", check_kernels),
        "bandwidth": ("block products (timings: no check)", lambda: _timings(bandwidth)),
        "outputs": ("models on the GPU against the CPU", models.outputs),
        "ray": ("through Ray on the GPU against the GPU in process", models.through_ray),
        "graphs": ("decode steps as CUDA graphs against eager steps", models.graphs),
        "ipc": ("PP=2 across processes through CUDA IPC", models.ipc),
        "decode": ("full-size synthetic models", lambda: sum(models.decode(m, peak, args.folder)
                                                             for m in args.decode_models.split(","))),
    }
    failures = 0
    for key in args.sections.split(","):
        if key.startswith("kernels:"):     # the kernel cases whose names contain a string, e.g. kernels:slot
            title, run = f"Triton kernels against the CPU kernels, cases with {key[8:]!r}", \
                lambda only=key[8:]: check_kernels(only)
        elif key.startswith("decode:"):       # one model's decode, e.g. decode:gpt-oss-20b
            title, run = f"full-size synthetic {key[7:]}", lambda m=key[7:]: models.decode(m, peak, args.folder)
        else:
            title, run = sections[key]
        print(f"== {title}", flush=True)
        start = time.perf_counter()
        try:
            failures += run()
        except Exception:           # report, then go on with the other sections
            failures += 1
            traceback.print_exc()
        print(f"   ({key}: {time.perf_counter() - start:.0f} s)", flush=True)
    print(f"{failures} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
