"""What an HTTP client gets when the ingress replica serving its request dies (docs/faults.md). Only Serve's
HTTP proxy, which outlives the replica, can answer then. Left to itself it answers a request whose response
had not started with a bare 500 "Internal Server Error" (text/plain), and cuts a stream off mid-body (the
client reads a truncated chunked body). This ASGI middleware of the proxy makes the first a 503 in the API's
error shape with code "replica_unavailable" and Retry-After, and ends the second as a stream ends when the
server stops: an error event with that code, then [DONE].

`deploy.serve` installs it in the proxy of the Ray cluster it starts, through Serve's
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (read where Ray starts: on a cluster of your own, set it for `ray
start`). It runs in the proxy's process: the standard library and Starlette only.
"""
import json

from starlette.middleware import Middleware

PROXY_CALLBACK = "raymoe.deploy.replica_errors.middlewares"
CODE = "replica_unavailable"
MESSAGE = "the replica serving this request stopped before it finished; retry (new requests go to the others)"
RETRY_AFTER_S = 1


def error_body() -> bytes:
    return json.dumps({"error": {"message": MESSAGE, "type": "server_error", "param": None, "code": CODE}}).encode()


class ReplicaErrors:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = events = False

        async def watched(message):
            nonlocal started, ended, events
            if message["type"] == "http.response.start":
                started = True
                events = dict(message.get("headers") or []).get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        await self.app(scope, receive, watched)
        # The proxy returns without ending the response only when the replica's call failed (its exception is
        # logged there); a client that went away ignores what follows.
        if ended:
            return
        if not started:
            body = error_body()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"retry-after", str(RETRY_AFTER_S).encode())]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif events:
            await send({"type": "http.response.body", "body": b"data: " + error_body() + b"\n\ndata: [DONE]\n\n"})


def middlewares() -> list:
    """Serve's proxy callback: the middlewares its HTTP server wraps the proxy in."""
    return [Middleware(ReplicaErrors)]
