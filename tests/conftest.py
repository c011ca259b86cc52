import os
import sys

# before torch loads: the suite runs Ray actors beside itself on few cores, so idle OpenMP workers sleep
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# the Triton kernels (kernels/triton) run in Triton's interpreter on CPU tensors: set before anything imports
# triton (torch and transformers may), since @triton.jit reads it when triton's modules load
os.environ["TRITON_INTERPRET"] = "1"

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Built artefacts (native kernels, benchmark models) go into a per-run cache, never the user's."""
    os.environ["RAYMOE_CACHE"] = str(tmp_path_factory.mktemp("raymoe-cache"))
    import raymoe.tools.make_tiny as make_tiny
    make_tiny.CACHE_DIR = os.environ["RAYMOE_CACHE"]


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    """oracle(family) -> hf_models.Oracle, built once per session (the family tests share them)."""
    from hf_models import build_oracle
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_oracle(family, str(tmp_path_factory.mktemp(f"oracle-{family}")))
        return built[family]
    return get


@pytest.fixture(scope="session")
def ray_session(_isolated_cache):
    """One local Ray cluster for every test marked `cluster`, started by the first of them, with CPU slots
    for PP=4 x EP=2 plus the coordinator."""
    import ray
    ray.init(address="local", num_cpus=12, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("cluster"):
            item.fixturenames.insert(0, "ray_session")
        # schemathesis gives every operation's test the function's bare node id; pytest-xdist (pytest -n) tells
        # the items apart by id, so without the operation in it a worker would run the first one only
        label = getattr(item, "operation_label", None)
        if label and not item.nodeid.endswith("]"):
            unique = f"{item.nodeid}[{label}]"
            if hasattr(item, "_id"):        # pytest 9 keeps a parsed NodeId, pytest 8 the string
                item._id = type(item._id).parse(unique)
            else:
                item._nodeid = unique


@pytest.fixture(autouse=True)
def _ray_only_when_marked(request, monkeypatch):
    """A test that is not marked `cluster` may not start Ray in this process: say so, rather than let
    it start a cluster of its own (slow, and unmarked for `make test-fast`)."""
    if request.node.get_closest_marker("cluster"):
        return
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts Ray: mark it @pytest.mark.cluster")
    monkeypatch.setattr(ray, "init", refuse)
