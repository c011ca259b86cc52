"""deploy.perplexity on a real Ray cluster: float32 perplexity equals transformers' on the same tokens; the
KL divergence of the approximate modes equals one computed from the two modes' logits (Stage in process);
a mode against itself gives 0; PP=2 gives the numbers of PP=1; bad input is one line and exit status 2."""
import json
import math
import os

import pytest
import torch

from raymoe.tools.make_tiny import make_tiny
from raymoe.deploy.perplexity import main
from raymoe.stages.runtime.batch import StepBatch
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.stage import Stage

pytestmark = pytest.mark.slow     # the module's report runs three modes on the model (~1-2 min)

CTX, CHUNKS = 32, 3
FIRST = CTX // 2                # rows FIRST .. CTX-2 are scored, each predicting the next token


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny gpt-oss: MXFP4 experts, so `auto` (8-bit activations for small expert groups) and `int8` both
    differ from float32; its sliding window (16) is shorter than a chunk."""
    d = tmp_path_factory.mktemp("ppl")
    gguf = make_tiny("gptoss", str(d))
    words = "the model reads a text and predicts every next token from the ones before it".split()
    text = "\n".join(f"{i}: " + " ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 4)) for i in range(40))
    (d / "text.txt").write_text(text, encoding="utf-8")
    return gguf, str(d / "hf"), str(d / "text.txt")


def run(tmp_path, model_path, text, *flags):
    out = tmp_path / "report.json"
    assert main(["--model", model_path, "--text", text, "--ctx", str(CTX), "--batch", str(CTX),
                 "--chunks", str(CHUNKS), "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(model, tmp_path_factory):
    gguf, _, text = model
    return run(tmp_path_factory.mktemp("out"), gguf, text, "--reference-mode", "float32",
               "--modes", "float32,auto,int8")


def chunks(hf_dir, text):
    import tokenizers
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    with open(text, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False).ids
    return [torch.tensor(ids[c * CTX:(c + 1) * CTX]) for c in range(CHUNKS)]


def test_float32_perplexity_equals_transformers(model, report):
    from transformers import GptOssForCausalLM, Mxfp4Config

    _, hf_dir, text = model
    oracle = GptOssForCausalLM.from_pretrained(hf_dir, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.float32).float().eval()
    nll = []
    with torch.no_grad():
        for tokens in chunks(hf_dir, text):
            logp = torch.log_softmax(oracle(tokens[None]).logits[0].float(), -1)
            nll.append(-logp[FIRST:CTX - 1].gather(1, tokens[FIRST + 1:, None])[:, 0])
    nll = torch.cat(nll).double()
    reference = report["results"][0]
    assert reference["mode"] == "float32" and reference["tokens"] == len(nll) == report["scored_tokens"]
    assert reference["perplexity"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)


def test_a_mode_against_itself_has_no_divergence(report):
    again = report["results"][1]
    assert again["mode"] == "float32"
    assert again["kl_mean"] == again["kl_max"] == again["delta_perplexity"] == 0
    assert again["top1_agreement"] == 1


@pytest.mark.parametrize("mode", ["auto", "int8"])
def test_divergence_matches_the_modes_logits(model, report, mode):
    gguf, hf_dir, text = model
    files = open_model(gguf, CTX)

    def logprobs(mode):
        stage = Stage(files, range(files.n_layers), mode)
        rows = list(range(FIRST, CTX - 1))
        return [torch.log_softmax(stage.forward(StepBatch([c], [0], [CTX], tokens, rows)), -1)
                for c, tokens in enumerate(chunks(hf_dir, text))]

    exact, approx = torch.cat(logprobs("float32")), torch.cat(logprobs(mode))
    kl = (exact.exp() * (exact - approx)).sum(-1)
    got = next(r for r in report["results"] if r["mode"] == mode)
    assert got["kl_mean"] > 0
    assert got["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-3)
    assert got["kl_max"] == pytest.approx(kl.max().item(), rel=1e-3)
    assert got["top1_agreement"] == pytest.approx((exact.argmax(-1) == approx.argmax(-1)).float().mean().item(),
                                                  abs=1.5 / len(kl))      # a near tie may flip one token


@pytest.mark.cluster
def test_two_stages_give_the_numbers_of_one(model, report, tmp_path):
    gguf, _, text = model
    two = run(tmp_path, gguf, text, "--reference-mode", "float32", "--modes", "auto", "--pp", "2")
    one = report["results"]
    assert two["results"] == [one[0], next(r for r in one if r["mode"] == "auto")]


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"), ("empty", "the text is empty"), ("short", "shorter than one chunk"),
    ("bad-mode", "unknown mode 'fp8'"), ("bad-reference", "unknown mode 'exact'")])
def test_bad_input_is_one_line_and_status_2(model, tmp_path, capsys, case, message):
    gguf, _, text = model
    (tmp_path / "empty.txt").write_text(" \n\n", encoding="utf-8")
    (tmp_path / "short.txt").write_text("a few words", encoding="utf-8")
    flags = {"missing": ["--text", str(tmp_path / "nope.txt")], "empty": ["--text", str(tmp_path / "empty.txt")],
             "short": ["--text", str(tmp_path / "short.txt")], "bad-mode": ["--text", text, "--modes", "auto,fp8"],
             "bad-reference": ["--text", text, "--reference-mode", "exact"]}[case]
    assert main(["--model", gguf, "--ctx", str(CTX), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
