"""The soak test itself runs on demand (python -m raymoe.tools.soak), not here: this only checks that its
CLI starts and that its hostile requests still sit where the server's limits are."""
import json
import random

import pytest

from raymoe.tools import soak
from raymoe.deploy.protocol import MAX_MESSAGES
from raymoe.deploy.serving import MAX_BODY_BYTES, MAX_JSON_DEPTH
from raymoe.stages.text.sampling_params import MAX_STOP_CHARS, MAX_STOPS

pytestmark = pytest.mark.cluster


def test_help():
    with pytest.raises(SystemExit) as e:
        soak.main(["--help"])
    assert e.value.code == 0


def test_limits_match_the_server():
    assert (soak.MAX_BODY_BYTES, soak.MAX_JSON_DEPTH, soak.MAX_MESSAGES) == (MAX_BODY_BYTES, MAX_JSON_DEPTH,
                                                                             MAX_MESSAGES)
    assert (soak.MAX_STOPS, soak.MAX_STOP_CHARS) == (MAX_STOPS, MAX_STOP_CHARS)


def test_every_case_builds():
    cases, rng = soak.Cases("m", MAX_BODY_BYTES), random.Random(0)
    assert len(cases.near_limit) <= MAX_BODY_BYTES < len(cases.over_limit)
    for _, build in cases.mix:
        for _ in range(5):
            case = build(rng)
            assert case.expect
            if case.expect == {200}:
                json.loads(case.body)
