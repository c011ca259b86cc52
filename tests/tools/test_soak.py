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


def test_a_ray_daemon_that_grows_fails_the_soak():
    def memory(gcs_mib: int) -> dict:
        return {"rss_bytes": 1000 << 20, "pss_bytes": 0, "processes": 3,
                "rss_by_process": {"gcs_server": gcs_mib << 20, "raylet": 50 << 20, "deploy.serve": 900 << 20}}

    def report(gcs_after: int) -> dict:
        return {"kills": [], "memory": {"after_warmup": memory(100), "end": memory(gcs_after), "rss_growth": 0.0}}
    assert soak.daemon_growth(report(104)["memory"]) == pytest.approx({"gcs_server": 0.04, "raylet": 0.0})
    assert not [f for f in soak.verdict(report(104), 0) if "gcs_server" in f]
    assert [f for f in soak.verdict(report(110), 0) if "gcs_server" in f] == ["gcs_server's RSS grew 10.0%"]
