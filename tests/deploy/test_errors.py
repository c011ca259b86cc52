"""Bad input gets a one-line error naming the problem; in a batch a bad request fails alone."""
import json
import os
import subprocess
import sys

import gguf
import pytest

from raymoe.deploy import generate
from gguf_edit import rewrite_gguf
from raymoe.stages.errors import ModelFormatError
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.stage import Stage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny_gguf():
    return open_model("tiny-qwen35moe").path


def load_all(path):
    model = open_model(path)
    return Stage(model, range(model.n_layers))


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        open_model(str(bad))


def test_missing_path():
    with pytest.raises(ModelFormatError, match="no such file or directory"):
        open_model("/nonexistent/model.gguf")


def test_truncated_gguf(tiny_gguf, tmp_path):
    data = open(tiny_gguf, "rb").read()
    for cut in (len(data) // 2, 200):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match="truncated"):
            open_model(str(bad))


def test_unknown_architecture(tiny_gguf, tmp_path):
    bad = rewrite_gguf(tiny_gguf, str(tmp_path / "llama.gguf"), set_kv={"general.architecture": "mamba9"})
    with pytest.raises(ModelFormatError, match="unknown architecture 'mamba9'"):
        open_model(bad)


def test_unsupported_tensor_type(tiny_gguf, tmp_path):
    bad = rewrite_gguf(tiny_gguf, str(tmp_path / "iq.gguf"),
                       retype={"blk.0.attn_qkv.weight": gguf.GGMLQuantizationType.IQ4_NL})
    with pytest.raises(ModelFormatError, match="tensor blk.0.attn_qkv.weight has ggml type IQ4_NL, which raymoe cannot "
                                               "compute with"):
        load_all(bad)


def test_missing_tensor(tiny_gguf, tmp_path):
    bad = rewrite_gguf(tiny_gguf, str(tmp_path / "missing.gguf"), drop={"blk.3.attn_k.weight"})
    with pytest.raises(ModelFormatError, match="missing tensor blk.3.attn_k.weight"):
        load_all(bad)


@pytest.mark.parametrize("name", ["blk.3.attn_k.weight", "blk.2.attn_norm.weight", "output_norm.weight"])
def test_missing_tensor_is_found_from_the_table(tiny_gguf, tmp_path, name):
    """check_tensors (run before a pipeline or server starts) finds a missing tensor without reading weights,
    a vector (a norm) as well as a matrix; the complete file passes."""
    open_model(tiny_gguf).check_tensors()
    files = open_model(rewrite_gguf(tiny_gguf, str(tmp_path / "missing.gguf"), drop={name}))
    with pytest.raises(ModelFormatError, match=f"missing tensor {name}"):
        files.check_tensors()


def test_misshaped_tensor(tiny_gguf, tmp_path):
    bad = rewrite_gguf(tiny_gguf, str(tmp_path / "shape.gguf"), reshape={"blk.1.ssm_out.weight": (128, 64)})
    with pytest.raises(ModelFormatError, match=r"blk.1.ssm_out.weight has shape \[128, 64\], expected \[128, 128\]"):
        load_all(bad)
    with pytest.raises(ModelFormatError, match=r"blk.1.ssm_out.weight has shape \[128, 64\], expected \[128, 128\]"):
        open_model(bad).check_tensors()         # from the tensor table, before any weight is read


def test_hf_dir_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ModelFormatError):
        open_model(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    from safetensors.torch import save_file
    import torch
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelFormatError, match="unknown architecture.*'bert'"):
        open_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="invalid JSON"):
        open_model(str(tmp_path))


BAD_REQUESTS = [
    ({"prompt": "x" * 40000}, "prompt has \\d+ tokens; the model's context is 4096"),
    ({"prompt_token_ids": [1, 2, 999999]}, "token id 999999 is outside the vocabulary"),
    ({"prompt_token_ids": []}, "the prompt is empty"),
    ({"prompt": "hi", "temperature": -1}, "temperature must be"),
    ({"prompt": "hi", "top_p": 0}, "top_p must be"),
    ({"prompt": "hi", "top_k": 1.5}, "top_k must be"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs must be"),
    ({"prompt": "hi", "seed": "abc"}, "seed must be"),
    ({"prompt": "hi", "stop": [1]}, "stop must be"),
    ({"prompt": "hi", "stop": ["x"] * 17}, "stop has 17 strings; at most 16 are allowed"),
    ({"prompt": "hi", "stop": ["x" * 257]}, "stop strings may have at most 256 characters, got one of 257"),
    ({"prompt": "hi", "max_tokens": 10 ** 12}, r"max_tokens must be at most the model's context \(4096 tokens\)"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": "hello"}, "messages"),
]


@pytest.mark.cluster
def test_bad_requests_fail_alone(tmp_path):
    lines = [json.dumps({"id": "good-0", "prompt": "Hello", "max_tokens": 4, "temperature": 0})]
    for i, (req, _) in enumerate(BAD_REQUESTS):
        lines.append(json.dumps({"id": f"bad-{i}", **req}))
    lines += ["{not json", "[1, 2]", json.dumps({"id": "good-1", "prompt_token_ids": [5, 6, 7], "max_tokens": 3})]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert generate.main(["--model", "tiny-qwen35moe", "--input", str(src), "--output", str(out)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == len(lines)
    assert results[0]["id"] == "good-0" and len(results[0]["token_ids"]) == 4 and "error" not in results[0]
    assert results[-1]["id"] == "good-1" and len(results[-1]["token_ids"]) == 3
    import re
    for i, (_, pattern) in enumerate(BAD_REQUESTS):
        r = results[1 + i]
        assert r["id"] == f"bad-{i}" and re.search(pattern, r["error"]), r
        assert "\n" not in r["error"]
    assert "not valid JSON" in results[-3]["error"] and "not a JSON object" in results[-2]["error"]


@pytest.mark.parametrize("args, message", [
    (["--model", "/nope.gguf"], "no such file or directory"),
    (["--model", "tiny-qwen35moe", "--temperature", "-2"], "bad sampling flag: temperature"),
    (["--model", "tiny-qwen35moe", "--input", "/nope.jsonl"], "cannot read input"),
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    argv = ["--input", str(src), "--output", str(tmp_path / "o.jsonl")] + args
    proc = subprocess.run([sys.executable, "-m", "raymoe.deploy.generate"] + argv, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ}, timeout=300)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_device_cuda_without_a_gpu_is_refused_in_one_line(tiny_gguf):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is visible here"):
        Stage(open_model(tiny_gguf), range(1), device="cuda")
    with pytest.raises(ValueError, match="--device tpu: not supported"):
        Stage(open_model(tiny_gguf), range(1), device="tpu")
