"""The GPU check, one script for a CUDA machine (no Ray: it drives the kernels directly).

    python -m tests.gpu.run                  # from the repository root (or: python tests/gpu/run.py)
    python -m tests.gpu.run --compile-only   # no GPU needed: compile every kernel variant the cases launch

1. Every Triton kernel (kernels/triton) compiled for the GPU and compared with the CPU kernels, in the
   cases and bounds of tests/triton_cases.py (the CI runs the same cases in Triton's interpreter), and
   again at the models' head sizes (MODEL_SIZE_CASES, too slow for the interpreter).
2. Batch-1 products straight from GGML blocks on a 4096 x 4096 weight per type: time per call and the
   weight bytes read per second, against the device's peak bandwidth when it is known.
3. Models (tests/gpu/model_checks.py): both embedded models on the GPU against the CPU, and PP=2/4 on the GPU
   against PP=1; PP=2 with the second stage in another process, activations through CUDA IPC
   (cluster/cuda_ipc.py); then full-size synthetic files (deploy.make_synthetic, written to --folder): load time,
   batch-1 decode tok/s against the HBM roofline, and the aggregate tok/s of 64 sequences.

    --sections kernels,bandwidth,outputs,ipc,decode   (default: all)   --decode-models gpt-oss-20b,qwen3.5-35b-a3b

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
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu")]

import torch  # noqa: E402

# peak HBM bandwidth by device name (vendor figures), for the bandwidth table's last column
PEAK_GB_S = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "A100-SXM4-80GB": 2039.0}


def check_kernels() -> int:
    import triton_cases

    failures = 0
    for name, check in triton_cases.CASES + triton_cases.MODEL_SIZE_CASES:
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


def bandwidth() -> None:
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from triton_cases import random_blocks

    from kernels.triton import blocks

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_GB_S.items() if k in name), None)
    print(f"batch-1 block products, 4096 x 4096 weight, on {name}"
          + (f" (peak {peak:.0f} GB/s)" if peak else ""))
    rng = np.random.default_rng(0)
    n = k = 4096
    x = torch.randn(1, k, device="cuda")
    out = torch.empty(1, n, device="cuda")
    for t in (T.BF16, T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K, T.Q3_K, T.Q2_K, T.MXFP4):
        raw = random_blocks(rng, t, n, k).cuda()
        blocks.linear(x, raw, t, k, out)              # compile
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            blocks.linear(x, raw, t, k, out)
        stop.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(stop) / 1000 / 20
        rate = raw.numel() / seconds / 1e9
        print(f"  {t.name:>6}: {seconds * 1e6:8.1f} us  {rate:7.1f} GB/s" + (f"  {rate / peak:6.1%} of peak" if peak else ""))


POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.uint8: "*u8",
                 torch.int32: "*i32", torch.int64: "*i64"}


def _argument_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def record_launches(path: str) -> None:
    """(In the interpreter) run every case on CPU tensors, writing each distinct kernel launch's
    module, kernel, argument types, constants and options to `path` as JSON. The model-size cases are
    too slow for the interpreter: their launches are recorded but not run, and their comparisons skipped."""
    from triton.runtime.interpreter import InterpretedFunction

    import triton_cases

    seen, execute = {}, True
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        constants = {k: v for k, v in kwargs.items() if k in names}
        options = {k: v for k, v in kwargs.items() if k not in names}
        signature = {name: _argument_type(value) for name, value in zip(names, args)}
        signature.update({name: "constexpr" for name in constants})
        entry = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": signature,
                 "constants": constants, "options": options}
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

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--record", path], env=env, check=True)
        with open(path) as f:
            launches = json.load(f)
    print(f"compiling {len(launches)} kernel variants for sm_{arch}:")
    failures = 0
    for entry in launches:
        fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        label = f"{entry['kernel']} {entry['constants']}"
        start = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn, entry["signature"], entry["constants"]),
                                      target=GPUTarget("cuda", arch, 32), options=entry["options"])
            print(f"  ok    {label} ({time.perf_counter() - start:.1f} s, {len(compiled.asm['cubin'])} B cubin)",
                  flush=True)
        except Exception as e:
            failures += 1
            print(f"  FAIL  {label}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    print(f"{failures} variant(s) failed to compile" if failures else "every variant compiled")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="compile every kernel variant; no GPU needed")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability for --compile-only")
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--sections", default="kernels,bandwidth,outputs,ipc,decode")
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
              "The kernels' logic is checked on CPU by tests/test_triton_kernels.py in Triton's interpreter.")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    import model_checks as models

    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_GB_S.items() if k in name), None)
    sections = {
        "kernels": ("Triton kernels against the CPU kernels", check_kernels),
        "bandwidth": ("block products", lambda: bandwidth() or 0),
        "outputs": ("models on the GPU against the CPU", models.outputs),
        "ipc": ("PP=2 across processes through CUDA IPC", models.ipc),
        "decode": ("full-size synthetic models", lambda: sum(models.decode(m, peak, args.folder)
                                                             for m in args.decode_models.split(","))),
    }
    failures = 0
    for key in args.sections.split(","):
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
