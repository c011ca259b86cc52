"""The Ray Serve application: an OpenAI-compatible HTTP API and the gRPC service of protos/, over each served
model's pipelines (a coordinator and its PP stage actors, optionally expert actors, each; docs/serving-replicas.md).

    python -m raymoe.deploy.serve --model MODEL [--pp N] [--host 127.0.0.1] [--port 8000] [--grpc-port 9000] [--api-key KEY]
    serve run raymoe.deploy.serve:app_builder model=tiny-qwen35moe pp=2      # the same app from Ray's CLI
    serve deploy deploy/configs/serve.yaml                              # or from a Serve config

HTTP: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream: true`: server-sent
events; reasoning apart from the answer as `reasoning_content`; function tools and `tool_calls`),
POST /tokenize and /detokenize (vLLM's),
GET /health, GET /metrics (Prometheus). docs/chat.md: reasoning, chat templates (--chat-template,
--chat-template-kwargs, a request's chat_template_kwargs), the request fields accepted. gRPC (a server of the ingress replica, on the host
HTTP binds): raymoe.Raymoe with Generate, GenerateStream, ListModels, Health. With an API key
(--api-key or RAYMOE_API_KEY), /v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY` and gRPC calls the same
metadata; /health and /metrics stay open (they show load, no content) for probes and scrapers.

The app tokenizes prompts itself and submits token ids, so a seeded request gives exactly the
tokens deploy.generate gives for the same line. A client that disconnects or cancels frees its
sequence at once; when more than `max_queued` sequences wait for a cache slot, new requests get
503 (HTTP) / RESOURCE_EXHAUSTED (gRPC). SIGTERM or SIGINT stops it within seconds: requests in flight end
with 503 "shutting_down" (a stream: an error event, then [DONE]; gRPC: UNAVAILABLE); docs/shutdown.md.

This module is the command line; the HTTP app is deploy/http_app.py, the serving core deploy/serving.py.
"""
import argparse
import dataclasses
import os
import signal
import sys
import time

import pydantic
from ray import serve

from raymoe.cluster.engine_args import add_engine_flags
from raymoe.deploy.http_app import _url_host, app_builder, is_loopback
from raymoe.deploy.replica_errors import PROXY_CALLBACK
from raymoe.deploy.serving import SERVER_FLAGS, ServeArgs, first_error
from raymoe.stages.errors import RaymoeError

APP_NAME = "raymoe"
# SIGTERM/SIGINT: how long the ingress gets to end its requests (RaymoeServer.stop), and
# Serve's controller to stop everything after that (serve.shutdown alone would wait up to 30 s); docs/shutdown.md
STOP_TIMEOUT_S = 6.0
SERVE_SHUTDOWN_TIMEOUT_S = 6.0
__all__ = ["app_builder", "ServeArgs", "main"]    # app_builder: `serve run raymoe.deploy.serve:app_builder`, Serve configs


# ---- python -m raymoe.deploy.serve -------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m raymoe.deploy.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True,
                   help="a .gguf file, an HF model directory, or tiny-qwen35moe / tiny-gptoss; repeated, one app serves "
                        "each (a pipeline each, the flags below for all), and a request's `model` picks one (none: "
                        "the first)")
    add_engine_flags(p, ["pp", "ep", "dtype", "device", "transport", "threads", "microbatches", "max_running",
                         "max_model_len", "prefix_cache_gb", "max_queued", "itl_target_ms", "chat_template",
                         "chat_template_kwargs", "steps_per_call", "placement_timeout", "speculative_config"], ServeArgs)
    add_engine_flags(p, SERVER_FLAGS, ServeArgs, SERVER_FLAGS)
    p.set_defaults(api_key=os.environ.get("RAYMOE_API_KEY") or None)
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--app-name", default=APP_NAME, help="the Serve application's name")
    args = p.parse_args(argv)
    args.model, args.more_models = args.model[0], args.model[1:]      # --model repeated: more models
    return args


def _deploy_failure(app_name: str) -> str:
    """Why the application's deployments failed, from Serve's status (the replica's own error last)."""
    try:
        status = serve.status().applications.get(app_name)
        messages = [d.message for d in status.deployments.values() if d.message] if status else []
    except Exception:
        return ""
    lines = [line for m in messages for line in m.strip().splitlines() if line.strip()]
    return f"\n  {lines[-1].strip()}" if lines else ""


class _Stop(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM."""


def stop_ingress(handle, timeout_s: float = STOP_TIMEOUT_S):
    """RaymoeServer.stop() on the ingress: the requests in flight end with 503 "shutting_down" (streams
    with an error event and [DONE]) while Serve's proxy still carries them, and the pipelines are left with none.
    Serve, left alone, would wait for them up to graceful_shutdown_timeout_s, kill the proxy at once and the
    ingress after that, cutting every stream."""
    try:
        handle.options(method_name="stop").remote().result(timeout_s=timeout_s)
    except Exception as e:
        print(f"warning: stopping the ingress: {type(e).__name__}: {e}", file=sys.stderr)


def shutdown_serve(timeout_s: float = SERVE_SHUTDOWN_TIMEOUT_S):
    """serve.shutdown(), waiting at most timeout_s for Serve's controller to stop its actors (serve.shutdown
    waits up to 30 s; ray.shutdown, which follows, stops whatever is left)."""
    try:
        from ray.serve.context import _disconnect, _get_global_client
        client = _get_global_client(raise_if_no_controller_running=False)
    except (ImportError, TypeError):        # a Ray whose internals differ: its own wait
        serve.shutdown()
        return
    if client is not None:
        client.shutdown(timeout_s=timeout_s)
    _disconnect()


def main(argv=None) -> int:
    args = parse_args(argv)
    several = [{"model": m} for m in (args.model, *args.more_models)] if args.more_models else None
    try:
        serve_args = ServeArgs.from_flags(args, models=several)
    except pydantic.ValidationError as e:
        where, what = first_error(e)
        print(f"error: --{where.split('.')[0].replace('_', '-')}: {what.removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    if not serve_args.api_key and not is_loopback(args.host):
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    try:                          # fail fast, before starting anything, on a bad setting or model
        from raymoe.stages.text.chat import load_chat_template
        from raymoe.stages.files.loader import open_model
        if several and args.served_model_name:
            raise RaymoeError("--served-model-name names one model: with several, each is served as its --model "
                              "(a Serve config's models list can name each)")
        for model_args in serve_args.per_model():
            model_args.validate()
            open_model(model_args.model).check_tensors()
        # read here, where the path means what the user meant; the replica gets the template's text
        serve_args = dataclasses.replace(serve_args, chat_template=load_chat_template(serve_args.chat_template))
    except RaymoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    stopping = []

    def on_signal(signum, frame):
        if not stopping:
            stopping.append(signum)
            raise _Stop()

    import ray

    from raymoe.cluster.engine import connect_ray
    ray_was_up = ray.is_initialized()
    if not (ray_was_up or os.environ.get("RAY_ADDRESS")):
        # the local cluster's HTTP proxy answers for an ingress that dies with a 503 (deploy/replica_errors.py)
        os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_CALLBACK)
    # interruptible from here on (Ray's own startup installs no handlers after this point)
    connect_ray(sum(a.pp * (1 + a.ep) * a.most_replicas for a in serve_args.per_model()))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    started_serve = False
    handle = None
    code = 0
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        started_serve = True
        handle = serve.run(app_builder(serve_args), name=args.app_name, route_prefix="/")
        host = _url_host(args.host)
        grpc_text = f", gRPC on {host}:{args.grpc_port}" if args.grpc_port else ""
        auth = "API key required" if serve_args.api_key else "no authentication"
        info = handle.options(method_name="pipeline_info").remote().result(timeout_s=60)    # one pipeline's
        if info["warning"]:
            print(f"warning: {info['warning']}", file=sys.stderr)
        transport = f", transport={info['transport']}" if args.pp > 1 else ""
        names = ", ".join(a.name for a in serve_args.per_model())
        print(f"serving {names} (pp={args.pp}{transport}) on http://{host}:{args.port}{grpc_text} ({auth}); "
              f"Ctrl-C or SIGTERM stops", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except _Stop:
        pass
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}{_deploy_failure(args.app_name)}", file=sys.stderr)
        code = 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):      # a second signal no longer interrupts the cleanup
            signal.signal(sig, signal.SIG_IGN)
        print("shutting down", file=sys.stderr, flush=True)
        steps = [("", time.monotonic())]       # how long each step took, in the last line
        if handle is None and started_serve and code == 0:
            # a signal inside serve.run, which can return well after the app answers requests on busy cores
            # (code 1: the app failed to deploy, so no replica serves and none is stopped)
            try:
                handle = serve.get_app_handle(args.app_name)
            except Exception:
                handle = None           # no application (it failed to deploy): nothing to stop
        if handle is not None:
            stop_ingress(handle)
            steps.append(("ingress", time.monotonic()))
        if started_serve:
            try:
                if ray_was_up or os.environ.get("RAY_ADDRESS"):
                    serve.delete(args.app_name)            # a shared cluster: remove only what we added
                else:
                    shutdown_serve()
            except Exception as e:
                print(f"warning: serve shutdown: {e}", file=sys.stderr)
            steps.append(("Serve", time.monotonic()))
        if not ray_was_up:
            ray.shutdown()
            steps.append(("Ray", time.monotonic()))
        each = ", ".join(f"{name} {t - before:.1f} s" for (_, before), (name, t) in zip(steps, steps[1:]))
        print(f"stopped in {steps[-1][1] - steps[0][1]:.1f} s" + (f" ({each})" if each else ""), file=sys.stderr,
              flush=True)
    return code


def _exit(code: int):
    """Exit now that everything is stopped: the exit handlers, then no interpreter teardown (with torch,
    Ray and gRPC loaded it takes 1-3 s on two busy cores, and there is nothing left to free)."""
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
