"""Several models in one app: the arguments are checked before anything starts (`ServeArgs.per_model`). The app
itself serving two models is tested in tests/deploy/test_serve_structured.py, whose server is one."""
import re

import pytest

from raymoe.deploy.serving import ServeArgs
from raymoe.stages.errors import RaymoeError


def test_models_are_checked_before_anything_starts():
    for models, says in (([{"model": "a"}, {"model": "a"}], "two models are served as 'a'"),
                         ([{"model": "a"}, {"model": "b", "grpc_port": 1}], "grpc_port is the server's"),
                         ([{"model": "a"}, {"model": "b", "pp_degree": 2}], "models[1].pp_degree: Unexpected")):
        with pytest.raises(RaymoeError, match=re.escape(says)):
            ServeArgs(models=models).per_model()
    named = ServeArgs(models=[{"model": "a", "served_model_name": "x"}, {"model": "a"}], pp=2).per_model()
    assert [(a.name, a.pp) for a in named] == [("x", 2), ("a", 2)]


def test_each_model_sets_its_own_replicas_and_router():
    models = ServeArgs(models=[{"model": "a", "replicas": 3, "request_router": "default"},
                               {"model": "b", "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}],
                       replicas=2).per_model()
    assert [(a.replicas, a.most_replicas, a.request_router) for a in models] == [(3, 3, "default"), (2, 4, "prefix")]
    for bad, says in (({"autoscaling_config": {"max_replica": 2}}, "autoscaling_config: unknown field 'max_replica'"),
                      ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}}, "must be greater than or equal"),
                      ({"request_router": "random"}, "request_router must be one of prefix, default")):
        with pytest.raises(RaymoeError, match=re.escape(says)):
            ServeArgs(models=[{"model": "a", **bad}]).per_model()


def test_flags_and_serve_config_args_share_one_definition(monkeypatch):
    """Every flag of deploy.serve but --model, --port and --app-name is a ServeArgs field, that is an arg of a Serve
    config, under the same name and with the same default; the fields with no flag are named here."""
    import dataclasses

    from raymoe.deploy.serve import parse_args
    monkeypatch.delenv("RAYMOE_API_KEY", raising=False)
    flags = vars(parse_args(["--model", "m"]))
    fields = {f.name: f.default for f in dataclasses.fields(ServeArgs)}
    for name, value in flags.items():
        if name not in ("model", "more_models", "port", "app_name"):
            assert name in fields and value == fields[name], (name, value)
    assert set(fields) - set(flags) == {"split", "placement", "max_batch_tokens", "prefill_chunk", "stall_timeout",
                                        "fault_injection", "scripted_outputs", "models"}
