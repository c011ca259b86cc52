"""Speculative decoding through the cluster: greedy outputs with n-gram drafts, and with the embedded model's MTP head,
are those of the in-process engine without them at PP=1 (n-gram: steps chained and merged), PP=2 over the object store
with expert actors, and PP=4 over shared memory (the chained ring); a Serve app reports the drafts per request (usage) and
in /metrics, and answers as without them. Both families at 1, 2 and 4 stages in process:
tests/stages/test_speculation.py and tests/stages/test_mtp.py."""
import openai
import pytest

from raymoe.cluster.engine import ClusterEngine, EngineArgs
from raymoe.deploy.metrics import parse_metrics
from raymoe.stages.files.loader import open_model
from raymoe.stages.runtime.engine import LocalEngine
from raymoe.stages.text.sampling_params import SamplingParams
from serve_util import get_text, serve_apps

pytestmark = pytest.mark.cluster

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
PROMPTS = ["1 2 3 1 2 3 1 2 3 1 2", "the cat sat on the mat and the cat sat on the", "hello world", "a b a b a b a"]


def reference(model_name: str) -> dict:
    model = open_model(model_name)
    engine = LocalEngine(model, mode="float32")
    out = {}
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"r{i}", model.tokenizer.encode(text), SamplingParams(temperature=0, max_tokens=48,
                                                                                ignore_eos=True))
    engine.run_until_done(lambda s: out.__setitem__(s.request_id, s.output_ids))
    return out


@pytest.mark.parametrize("speculative", [NGRAM, MTP], ids=["ngram", "mtp"])
def test_greedy_outputs_with_drafts_through_every_pipeline_shape(speculative):
    model = "tiny-qwen35moe"
    want = reference(model)
    shapes = [{"pp": 2, "transport": "object_store", "ep": 1}, {"pp": 4, "transport": "shm"}]
    # the MTP head runs on the last stage: PP=1 in process (tests/stages/test_mtp.py) is the same code
    for shape in ([{"pp": 1}] if speculative is NGRAM else []) + shapes:
        engine = ClusterEngine(EngineArgs(model, dtype="float32", speculative_config=speculative, **shape))
        try:
            lines = [(f"r{i}", {"prompt": text, "temperature": 0, "max_tokens": 48, "ignore_eos": True})
                     for i, text in enumerate(PROMPTS)]
            engine.submit_many(lines)
            got = {}
            while len(got) < len(lines):
                for _, result in engine.wait_finished(timeout=5):
                    got[result["id"]] = result
            stats = engine.stats()
        finally:
            engine.shutdown()
        assert {rid: r["token_ids"] for rid, r in got.items()} == want, shape
        spec = stats["speculation"]
        assert 0 < spec["accepted_tokens"] < spec["draft_tokens"], (shape, spec)
        assert sum(r["usage"]["speculation"]["accepted_tokens"] for r in got.values() if "speculation" in r["usage"]) \
            == spec["accepted_tokens"]


def test_serve_reports_drafts_in_usage_and_metrics():
    want = reference("tiny-qwen35moe")
    with serve_apps({"/": {"model": "tiny-qwen35moe", "dtype": "float32", "speculative_config": NGRAM}}) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        tok = open_model("tiny-qwen35moe").tokenizer
        answer = client.completions.create(model="tiny-qwen35moe", prompt=PROMPTS[0], temperature=0, max_tokens=48,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].text == tok.decode(want["r0"])
        spec = answer.usage.model_extra["speculation"]
        assert spec["accepted_tokens"] > 0 and spec["draft_tokens"] >= spec["accepted_tokens"]
        assert spec["mean_accepted_length"] == round(1 + spec["accepted_tokens"] / spec["verify_steps"], 4)
        stream = client.completions.create(model="tiny-qwen35moe", prompt=PROMPTS[3], temperature=0, max_tokens=48,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(want["r3"])
        streamed = chunks[-1].usage.model_extra["speculation"]
        metrics = parse_metrics(get_text(base + "/metrics"))
        label = '{model="tiny-qwen35moe"}'
        assert metrics["raymoe_spec_decode_accepted_tokens_total" + label] == \
            spec["accepted_tokens"] + streamed["accepted_tokens"]
        assert metrics["raymoe_spec_decode_draft_tokens_total" + label] == \
            spec["draft_tokens"] + streamed["draft_tokens"]
