"""EngineArgs: one settings object from the command line, the Serve config and Python, checked in one
place with one-line errors naming the flag. No Ray needed."""
import os
import subprocess
import sys

import pytest

from raymoe.cluster.engine_args import EngineArgs
from raymoe.cluster.engine_args import TRANSPORTS
from raymoe.cluster.pipeline import gpu_share
from raymoe.deploy import generate, perplexity, serve
from raymoe.kernels.threads import PARALLEL_MIN_BYTES, share_of_cores
from raymoe.stages.errors import RaymoeError
from raymoe.stages.files.loader import resolve_model_path

MODEL = "tiny-qwen35moe"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = ["--input", "in.jsonl", "--output", "out.jsonl"]


@pytest.mark.parametrize("changes, flag", [
    ({"pp": 0}, "--pp"), ({"ep": -1}, "--ep"), ({"dtype": "fp8"}, "--dtype"), ({"device": "tpu"}, "--device"),
    ({"device": "cuda", "dtype": "int8"}, "--dtype"), ({"transport": "nccl"}, "--transport"),
    ({"transport": "carrier-pigeon"}, "--transport"),
    ({"placement": "scatter"}, "--placement"), ({"threads": 0}, "--threads"), ({"split": [3, 0]}, "--split"),
    ({"pp": 2, "split": [8]}, "--split"), ({"pp": 2, "microbatches": 1}, "--microbatches"),
    ({"max_batch_tokens": 0}, "--max-batch-tokens"), ({"prefill_chunk": 0}, "--prefill-chunk"),
    ({"max_running": 0}, "--max-running"), ({"max_model_len": 0}, "--max-model-len"),
    ({"stall_timeout": 0}, "--stall-timeout"), ({"pp": "2"}, "--pp"),
    ({"scripted_outputs": {"hi": ["x"]}}, "--scripted-outputs"),
    ({"prefix_cache_gb": -1}, "--prefix-cache-gb"), ({"prefix_cache_gb": "1"}, "--prefix-cache-gb"),
    ({"prefix_cache_gb": float("nan")}, "--prefix-cache-gb"),
    ({"itl_target_ms": 0}, "--itl-target-ms"), ({"itl_target_ms": "500"}, "--itl-target-ms"),
    ({"itl_target_ms": float("inf")}, "--itl-target-ms"), ({"steps_per_call": 0}, "--steps-per-call"),
    ({"steps_per_call": 2.5}, "--steps-per-call"),
])
def test_a_bad_value_is_one_line_naming_its_flag(changes, flag):
    with pytest.raises(RaymoeError) as e:
        EngineArgs(**{"model": MODEL, **changes}).validate()
    message = str(e.value)
    assert message.startswith(flag + " ") and "\n" not in message, message


@pytest.mark.parametrize("changes, flag, count", [({"pp": 9}, "--pp", "8 layers"),
                                                  ({"pp": 2, "split": [3, 4]}, "--split", "8 layers"),
                                                  ({"ep": 3}, "--ep", "16 experts")])
def test_what_the_model_cannot_take_names_its_flag(changes, flag, count):
    args = EngineArgs(MODEL, microbatches=None, **changes)
    args.validate()                                   # fine without the model's counts
    with pytest.raises(RaymoeError) as e:
        args.validate(n_layers=8, n_experts=16)
    assert str(e.value).startswith(flag) and count in str(e.value), str(e.value)
    EngineArgs(MODEL, pp=8, microbatches=None, ep=4).validate(n_layers=8, n_experts=16)


def test_the_generate_command_line_gives_the_python_api_values():
    argv = ["--model", MODEL, *JOB, "--pp", "2", "--ep", "2", "--transport", "gloo", "--placement", "spread",
            "--split", "3,5", "--microbatches", "6", "--threads", "3", "--dtype", "int8", "--max-model-len", "512",
            "--max-running", "7"]
    assert EngineArgs.from_flags(generate.parse_args(argv)) == EngineArgs(
        MODEL, pp=2, ep=2, transport="gloo", placement="spread", split=[3, 5], microbatches=6, threads=3,
        dtype="int8", max_model_len=512, max_running=7)


def test_defaults_are_the_same_from_every_front():
    """Batch jobs keep 4 micro-batch groups and run 4 steps a call for a lone sequence; the server defaults to one
    group per stage, a bounded queue and a step a call (each token streamed as sampled), from its command line and
    from a Serve config alike."""
    assert EngineArgs.from_flags(generate.parse_args(["--model", MODEL, *JOB])) == EngineArgs(MODEL)
    assert EngineArgs(MODEL).microbatches == 4 and EngineArgs(MODEL).max_queued is None
    assert EngineArgs(MODEL).steps_per_call == 4
    from_cli = serve.ServeArgs.from_flags(serve.parse_args(["--model", MODEL]))
    from_config = serve.ServeArgs(**{"model": MODEL})
    assert from_cli == from_config
    assert from_cli.engine_args() == EngineArgs(MODEL, microbatches=None, max_queued=256, steps_per_call=1)
    ppl = perplexity.parse_args(["--model", MODEL, "--text", "t.txt"])
    assert EngineArgs.from_flags(ppl) == EngineArgs(MODEL)


def test_the_serve_config_takes_the_same_values_as_the_command_line():
    """Serve passes `key=value` arguments as text: they convert to the same settings."""
    config = serve.ServeArgs(**{"model": MODEL, "pp": "2", "split": ["3", "5"], "transport": "gloo",
                                "max_queued": "-1", "threads": "2", "steps_per_call": "3"})
    cli = serve.ServeArgs.from_flags(serve.parse_args(["--model", MODEL, "--pp", "2", "--transport", "gloo",
                                                       "--max-queued", "-1", "--threads", "2", "--grpc-port", "0",
                                                       "--steps-per-call", "3"]))
    assert config.engine_args() == EngineArgs(MODEL, pp=2, split=[3, 5], transport="gloo", threads=2,
                                              microbatches=None, max_queued=None, steps_per_call=3)
    assert cli.engine_args() == EngineArgs(MODEL, pp=2, transport="gloo", threads=2, microbatches=None,
                                           steps_per_call=3)
    with pytest.raises(ValueError, match="unexpected_keyword_argument|Unexpected keyword"):
        serve.ServeArgs(**{"model": MODEL, "pipeline_parallel": 2})      # a misspelt setting is refused


def test_resolved_fills_in_what_the_defaults_stand_for():
    args = EngineArgs(MODEL, pp=2, microbatches=None).resolved()
    assert args.microbatches == 2 and args.threads is None      # each actor takes its node's share per step
    assert args.model == os.path.abspath(resolve_model_path(MODEL))
    assert EngineArgs(MODEL, threads=3).resolved().threads == 3


@pytest.mark.parametrize("cores, here, computing, threads", [
    (2, 1, 1, 2), (2, 2, 1, 2), (2, 2, 2, 1), (2, 2, 4, 1), (16, 4, 2, 8), (16, 4, 4, 4), (3, 2, 2, 1), (1, 4, 4, 1)])
def test_stages_computing_at_once_share_the_cores(cores, here, computing, threads):
    """A stage alone takes every core of its node; stages that compute at once on a node split them;
    a step too small to share out takes one."""
    assert share_of_cores(cores, here, computing) == threads
    assert share_of_cores(cores, here, computing, work_bytes=PARALLEL_MIN_BYTES) == threads
    assert share_of_cores(cores, here, computing, work_bytes=PARALLEL_MIN_BYTES - 1) == 1


def test_the_transports_are_the_pipelines():
    for transport in TRANSPORTS:
        EngineArgs(MODEL, transport=transport, device="cuda" if transport == "nccl" else "cpu").validate()
    assert generate.parse_args(["--model", MODEL, *JOB, "--transport", TRANSPORTS[-1]]).transport == TRANSPORTS[-1]


def test_a_bad_flag_ends_the_job_with_one_line(tmp_path, capsys):
    """Before any work: no Ray is started, nothing is read."""
    out = tmp_path / "out.jsonl"
    code = generate.main(["--model", MODEL, "--input", str(tmp_path / "missing.jsonl"), "--output", str(out),
                          "--pp", "2", "--microbatches", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: --microbatches 1 must be >= --pp 2 to keep every stage busy"]
    assert not out.exists()


def cuda_pipeline(gpus: int, **args) -> str:
    """What ClusterEngine(EngineArgs(MODEL, device='cuda', **args)) says on a fresh Ray cluster of `gpus` GPUs (Ray's
    resources only: this machine has none, so a stage that gets as far as loading fails to find CUDA)."""
    code = ("import ray, sys; from raymoe.cluster.engine import ClusterEngine, EngineArgs\n"
            "from raymoe.stages.errors import RaymoeError\n"
            f"ray.init(address='local', num_cpus=4, num_gpus={gpus}, include_dashboard=False, logging_level='ERROR')\n"
            f"try:\n    ClusterEngine(EngineArgs(sys.argv[1], device='cuda', placement_timeout=30, **{args!r}))\n"
            "except RaymoeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code, MODEL], cwd=ROOT, capture_output=True, text=True, timeout=180)
    return proc.stdout.strip() + ("" if proc.stdout.strip() else proc.stderr[-2000:])


@pytest.mark.cluster
def test_device_cuda_on_a_cluster_without_gpus_is_refused_at_once():
    """One line naming the need and what Ray has, before any actor starts or any weight is read."""
    assert cuda_pipeline(0, pp=2) == "--device cuda: the Ray cluster has no GPU; use --device cpu or a cluster with GPUs"


@pytest.mark.cluster
def test_stages_share_a_gpu_when_there_are_fewer_gpus_than_actors():
    """PP=2 on one GPU: two stage actors of half a GPU each are placed together (with a whole GPU each, Ray would
    find no room and say so after the placement timeout); here they then find no CUDA device, which is the first
    thing a stage checks. NCCL cannot pair two ranks on one GPU: that transport is refused at once."""
    out = cuda_pipeline(1, pp=2, transport="object_store")
    assert "no CUDA device is visible" in out and "no room" not in out, out
    assert cuda_pipeline(1, pp=2, transport="nccl").startswith(
        "--transport nccl: the 2 actors share 1 GPU(s), and NCCL cannot pair two ranks on one device")


def test_gpu_shares():
    assert gpu_share(2, 2) == gpu_share(1, 1) == gpu_share(2, 4) == 1.0
    assert gpu_share(2, 1) == 0.5 and gpu_share(3, 1) == 1 / 3
    assert gpu_share(8, 2) == 0.25 and gpu_share(5, 2) == 1 / 3     # ceil(5 / 2) actors on a GPU
