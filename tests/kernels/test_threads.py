"""Outputs do not depend on the thread count: both families, both modes, at 1, 2 and 3 torch threads,
give the same bits (tokens, logprobs, prompt logprobs). So the default may use every core, and a
stage may change its thread count from step to step, without changing what anyone gets."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from raymoe.kernels import pointwise
from thread_runs import full_width, generate

THREADS = (1, 2, 3)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["float32", "auto"])
@pytest.mark.parametrize("model", ["tiny-qwen35moe", "tiny-gptoss"])
def test_embedded_models_give_the_same_bits_at_any_thread_count(model, mode, threads):
    one, *others = [generate(model, mode, n) for n in THREADS]
    assert all(other == one for other in others)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3.5-35b-a3b", "gpt-oss-20b"])
def test_full_width_layers_give_the_same_bits_at_any_thread_count(model, tmp_path, threads):
    path = full_width(model, tmp_path / "model.gguf")
    for mode in ("float32", "auto"):
        one, *others = [generate(path, mode, n) for n in THREADS]
        assert all(other == one for other in others), mode


WITHOUT_FEW_ROWS = """
import json, torch
from raymoe.kernels import dense
dense.few_rows = lambda: None           # as on a CPU without AVX-512 VNNI, where that kernel is not built
import sys
sys.path.insert(0, 'tests')
from thread_runs import generate
print(json.dumps([generate("tiny-qwen35moe", "float32", n) for n in (2, 1, 2)]))
"""


def test_float32_without_the_few_row_kernel_keeps_its_bits():
    """Every float32 product then goes through the OpenBLAS path (raymoe_f32_gemm), from the first one of a fresh
    process on: OpenBLAS on its own threads gave other bits at one thread than at two, and so also before and after
    another library switched it to one thread (seen on an AVX2-only host)."""
    proc = subprocess.run([sys.executable, "-c", WITHOUT_FEW_ROWS], capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, one, again = json.loads(proc.stdout.splitlines()[-1])
    assert first == one == again


@pytest.mark.parametrize("op", [pointwise.silu, pointwise.sigmoid, pointwise.softplus])
def test_large_pointwise_ops_do_not_depend_on_the_thread_count(op, threads):
    """torch's own silu/sigmoid/softplus change last bits with the thread count above its grain
    (the reason kernels/pointwise.py exists); these keep every bit, and equal torch's at one thread."""
    x = torch.randn(2401, 1000, generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(1)
    reference = {pointwise.silu: F.silu, pointwise.sigmoid: torch.sigmoid, pointwise.softplus: F.softplus}[op](x)
    for n in THREADS:
        torch.set_num_threads(n)
        assert torch.equal(op(x), reference), n


def test_worker_environment(monkeypatch):
    """With BLAS's own threads, torch's workers sleep at once; otherwise libgomp's defaults stand."""
    from raymoe.kernels import threads
    monkeypatch.setattr(threads, "blas_has_own_threads", lambda: False)
    assert threads.process_env(None, "auto") == {}
    assert threads.process_env(2, "auto") == {"OPENBLAS_NUM_THREADS": "2"}
    monkeypatch.setattr(threads, "blas_has_own_threads", lambda: True)
    assert threads.process_env(None, "float32") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.process_env(None, "int8") == {}


RELEASE_CHECK = """
import os, time, torch
from raymoe.kernels.threads import release_openmp_workers
def os_threads():
    return len(os.listdir("/proc/self/task"))
torch.set_num_threads(3)
x = torch.randn(512, 4096)
assert release_openmp_workers(), "torch's OpenMP runtime has no omp_pause_resource_all"
alone = os_threads()
first = torch.exp(x)                    # large enough to be shared out: two workers start
with_workers = os_threads()
assert release_openmp_workers()
deadline = time.monotonic() + 5
while os_threads() > alone and time.monotonic() < deadline:
    time.sleep(0.01)
after = os_threads()
again = torch.exp(x)
print(alone, with_workers, after, os_threads(), torch.equal(again, first))
"""


def test_released_openmp_workers_end_and_come_back():
    """What a stage sharing its node does after each step: its OpenMP workers end (none is left to spin on
    the next stage's cores), the next parallel region starts them again, and the results stay the same. In a
    fresh process, where no other thread comes or goes."""
    proc = subprocess.run([sys.executable, "-c", RELEASE_CHECK], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    alone, with_workers, after, again, same = proc.stdout.split()
    assert (int(with_workers), int(after), int(again), same) == (int(alone) + 2, int(alone), int(alone) + 2, "True")
