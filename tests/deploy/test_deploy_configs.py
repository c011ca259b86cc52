"""deploy/configs: the Serve config and the KubeRay RayService / RayJob manifests parse, carry the
required fields, and point at code that exists: the Serve import path builds an application object
(without running it) and the RayJob entrypoint is a valid deploy.generate command line."""
import os
import shlex

import pytest
import yaml
from ray.serve.deployment import Application
from ray.serve.schema import ServeDeploySchema

from raymoe.deploy import generate

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deploy", "configs")
SERVICER = "protos.raymoe_pb2_grpc.add_RaymoeServicer_to_server"


def load(name: str) -> dict:
    with open(os.path.join(CONFIGS, name)) as f:
        return yaml.safe_load(f)


def import_attr(path: str):
    import importlib
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def check_serve_config(config: dict) -> list:
    """Validates against Serve's own schema, imports every app and gRPC servicer; returns the built apps."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    schema = ServeDeploySchema.model_validate(config)
    assert schema.applications
    apps = []
    for app in schema.applications:
        assert app.import_path == "raymoe.deploy.serve:app_builder"
        built = call_user_app_builder_with_args_if_necessary(import_attr(app.import_path), app.args)
        assert isinstance(built, Application)
        apps.append((app, built))
    if config.get("grpc_options"):
        functions = config["grpc_options"]["grpc_servicer_functions"]
        assert functions == [SERVICER]
        assert callable(import_attr(SERVICER))
    return apps


def test_serve_config():
    config = load("serve.yaml")
    apps = check_serve_config(config)
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000} and "grpc_options" not in config
    assert config["applications"][0]["args"]["host"] == "127.0.0.1"
    (app, built), = apps
    assert app.route_prefix == "/" and app.args["model"] == "tiny-qwen35moe"
    from raymoe.deploy.serve import ServeArgs
    ServeArgs(**app.args)        # every arg is one the app knows


def check_cluster(spec: dict, stages: int):
    """Head + GPU worker group, one GPU per worker, enough workers for one stage actor each."""
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    head_container, = head["template"]["spec"]["containers"]
    assert head_container["image"]
    assert spec["rayVersion"].startswith("2.")
    groups = spec["workerGroupSpecs"]
    gpu_workers = 0
    for group in groups:
        assert group["groupName"] and group["replicas"] >= 1
        container, = group["template"]["spec"]["containers"]
        assert container["image"] == head_container["image"]
        resources = container["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1
        gpu_workers += group["replicas"]
    assert gpu_workers >= stages, f"{stages} stage actors need {stages} one-GPU workers, have {gpu_workers}"
    return head_container


def test_rayservice_manifest():
    manifest = load("rayservice.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert manifest["metadata"]["name"]
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (app, _), = check_serve_config(serve_config)
    assert app.args["device"] == "cuda"
    head = check_cluster(manifest["spec"]["rayClusterConfig"], stages=app.args["pp"] * (1 + app.args.get("ep", 0)))
    ports = {p["containerPort"] for p in head["ports"]}
    assert {8000, 9000, app.args["grpc_port"]} <= ports
    # every node's Serve proxy answers 503 for a replica that died (docs/faults.md)
    from raymoe.deploy.replica_errors import PROXY_CALLBACK
    cluster = manifest["spec"]["rayClusterConfig"]
    for container in [head] + [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]:
        assert {"name": "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "value": PROXY_CALLBACK} in container["env"]
    assert callable(import_attr(PROXY_CALLBACK))


def test_rayjob_manifest():
    manifest = load("rayjob.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] and spec["shutdownAfterJobFinishes"] is True
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "raymoe.deploy.generate"]
    args = generate.parse_args(argv[3:])          # exits (SystemExit) on a flag deploy.generate lacks
    assert args.device == "cuda"
    check_cluster(spec["rayClusterSpec"], stages=args.pp * (1 + args.ep))


@pytest.mark.parametrize("name", ["serve.yaml", "rayservice.yaml", "rayjob.yaml"])
def test_configs_are_plain_yaml(name):
    with open(os.path.join(CONFIGS, name)) as f:
        documents = list(yaml.safe_load_all(f))
    assert len(documents) == 1 and isinstance(documents[0], dict)
