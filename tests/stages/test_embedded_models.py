"""The shipped embedded models (models/*.gguf): the files are the recorded ones, load as their family's real
architecture, and are trained (an in-domain sentence is far likelier than under a random model)."""
import hashlib
import math

import gguf
import pytest

from raymoe.models import EMBEDDED, embedded_model_path
from raymoe.stages.families import gptoss, qwen35moe
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.files.loader import open_model
from raymoe.stages.text.sampling_params import SamplingParams

ARCHS = {"tiny-qwen35moe": qwen35moe, "tiny-gptoss": gptoss}
SENTENCE = "The interpreter reads a line of input and executes it, and the result is printed to standard output."


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_file_matches_recorded_hash(name):
    with open(embedded_model_path(name), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == EMBEDDED[name][1]


@pytest.mark.parametrize("name", sorted(EMBEDDED))
def test_loads_with_the_real_architecture_and_is_trained(name):
    files = open_model(name)
    assert files.family is ARCHS[name].FAMILY and files.path == embedded_model_path(name)
    tensors = files.source.tensors
    if name == "tiny-qwen35moe":
        full = [i for i in range(files.n_layers) if f"blk.{i}.attn_q.weight" in tensors]
        assert full == [i for i in range(files.n_layers) if (i + 1) % 4 == 0]           # Gated DeltaNet elsewhere
        assert "blk.0.ssm_a" in tensors and "blk.0.ffn_down_shexp.weight" in tensors    # linear attention, shared expert
    else:
        assert tensors["blk.0.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.MXFP4
        assert "blk.0.attn_sinks.weight" in tensors
    ids = files.tokenizer.encode(SENTENCE)
    engine = LocalEngine(files, mode="float32")
    seq = engine.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    engine.run_until_done()
    nll = -sum(e["logprob"] for e in seq.result()["prompt_logprobs"][1:]) / (len(ids) - 1)
    assert math.exp(nll) < files.config.vocab / 20        # a random model scores about the vocabulary size
