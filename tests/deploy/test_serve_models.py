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
