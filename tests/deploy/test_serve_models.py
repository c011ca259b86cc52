"""Several models in one app (`models` in the app's arguments, `--model` repeated on the command line): a pipeline
each, a request routed by its `model` (none: the first), /v1/models and gRPC's ListModels listing them all, an
unknown name OpenAI's 404, one /metrics page labelled by model; under mixed load each answers as it does alone."""
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serve_util import get_json, get_text, serve_apps
from raymoe.deploy.metrics import parse_metrics
from raymoe.deploy.serving import ServeArgs
from raymoe.stages.errors import RaymoeError

pytestmark = pytest.mark.cluster

MODELS = ("tiny-qwen35moe", "tiny-gptoss")


@pytest.fixture(scope="module")
def server():
    with serve_apps({"/": {"models": [{"model": MODELS[0]}, {"model": MODELS[1], "max_running": 2}],
                           "max_running": 4, "grpc_port": 0}}) as base:
        yield base


def test_two_models_answer_as_alone_under_mixed_load(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
    assert [m.id for m in c.models.list().data] == list(MODELS)

    def tokens(key) -> list[int]:
        model, seed = key
        r = c.completions.create(model=model, prompt=f"The {seed} rivers of", max_tokens=10, temperature=1.0,
                                 seed=seed, extra_body={"return_token_ids": True})
        assert r.model == model
        return r.choices[0].model_extra["token_ids"]

    keys = [(model, seed) for model in MODELS for seed in range(3)]
    alone = {key: tokens(key) for key in keys}
    with ThreadPoolExecutor(len(keys)) as pool:
        mixed = dict(zip(keys, pool.map(tokens, keys)))
    assert mixed == alone
    assert all(alone[(MODELS[0], s)] != alone[(MODELS[1], s)] for s in range(3))    # two models, not one
    first = c.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert first.model == MODELS[0]
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and all(m in e.value.body["message"] for m in MODELS)
    status, health = get_json(server + "/health")
    assert status == 200 and set(health["models"]) == set(MODELS) and health["model"] == MODELS[0]
    assert health["models"][MODELS[1]]["slots"] == 2                   # its own max_running
    metrics = parse_metrics(get_text(server + "/metrics"))
    for model in MODELS:
        assert metrics[f'raymoe_requests_total{{endpoint="completions",model="{model}",status="200"}}'] >= 6


def test_models_are_checked_before_anything_starts():
    for models, says in (([{"model": "a"}, {"model": "a"}], "two models are served as 'a'"),
                         ([{"model": "a"}, {"model": "b", "grpc_port": 1}], "grpc_port is the server's"),
                         ([{"model": "a"}, {"model": "b", "pp_degree": 2}], "models[1].pp_degree: Unexpected")):
        with pytest.raises(RaymoeError, match=re.escape(says)):
            ServeArgs(models=models).per_model()
    named = ServeArgs(models=[{"model": "a", "served_model_name": "x"}, {"model": "a"}], pp=2).per_model()
    assert [(a.name, a.pp) for a in named] == [("x", 2), ("a", 2)]
