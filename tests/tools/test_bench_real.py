"""The real-size benchmark's own arithmetic, on the embedded models: the weight bytes a token reads,
and the decode speed it takes from deploy.generate's summary line."""
import subprocess
import sys

import gguf
import pytest

from raymoe.models import embedded_model_path
from raymoe.tools import bench_real


def test_bytes_per_token_counts_the_routed_share_of_the_experts():
    path = embedded_model_path("tiny-qwen35moe")
    reader = gguf.GGUFReader(path)
    share = 2 / 8                                  # the tiny model routes each token to 2 of 8 experts
    expected = sum(int(t.n_bytes * share) if "_exps." in t.name else int(t.n_bytes) for t in reader.tensors
                   if t.name != "token_embd.weight" or "output.weight" not in {u.name for u in reader.tensors})
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    assert experts > 0 and bench_real.bytes_per_token(path) == expected
    assert bench_real.bytes_per_token(path) < sum(int(t.n_bytes) for t in reader.tensors) - 0.5 * experts


@pytest.mark.cluster
@pytest.mark.parametrize("sequences", [1, 4])
def test_generate_is_timed_from_its_own_summary_line(sequences):
    r = bench_real.bench_generate("tiny-gptoss", n_decode=6, pp=1, sequences=sequences)
    assert r["decode_tok_s"] > 0 and r["load_s"] > 0


def test_a_child_killed_by_a_signal_is_reported_by_name():
    """A default llama.cpp build dies of SIGILL on some AMX hosts: the report names the signal, not the
    child's last log line."""
    proc = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    assert bench_real.child_failure(proc.returncode, "llama_kv_cache: a log line\n") == "killed by SIGILL"
    assert bench_real.child_failure(1, "Traceback\nValueError: bad file\n") == "ValueError: bad file"
    assert bench_real.child_failure(2, "") == "exit status 2"
