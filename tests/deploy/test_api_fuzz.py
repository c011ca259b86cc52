"""Schema fuzzing: schemathesis against a live `python -m raymoe.deploy.serve` (tiny-qwen35moe, an API key, a 64-token
context so that every generation is short), from the OpenAPI document the server publishes at /openapi.json
(deploy/api_schema.py). Every endpoint gets valid and invalid requests, with the key (schemathesis' ignored_auth
check sends each secured operation's requests again without it and with a wrong one, expecting 401); no
response may be a 5xx, each must have a status, content type, headers and body that the document gives (the
events of a stream too: every chunk against its schema, then [DONE]), and what the document refuses must be
refused (negative_data_rejection; a 413 for a body over the size limit counts). At least MIN_CASES requests in all; the server is healthy and idle after.

Not checked: that what the document allows is accepted (positive_data_acceptance), as a prompt can be too long
for the context once tokenized, which no schema can say (deploy/api_schema.py).
"""
import json
import time

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from serve_util import get_json, running_server, wait_idle

from raymoe.deploy.api_schema import MESSAGE_EVENTS, RESPONSE_EVENTS

pytestmark = pytest.mark.cluster

MODEL = "tiny-qwen35moe"
KEY = "fuzz-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 64                   # --max-model-len: no generation is longer
MAX_EXAMPLES = 250             # per operation (schemathesis adds its coverage phase's cases): about 2,500 in all
DEADLINE_MS = 20_000           # per request (hypothesis' deadline): a long one is a failure, not a wait
MIN_CASES = 2000
REQUEST_TIMEOUT_S = 60
MAX_STREAM_EVENTS = 1000       # schemathesis stops reading a stream after 20 events by default; ours end within CONTEXT
SENT: list[tuple[str, int]] = []        # (operation, status) of every case sent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("fuzz") / "serve.log", "--api-key", KEY, "--max-model-len",
                        str(CONTEXT), "--grpc-port", "0") as proc:
        yield proc


def document() -> dict:
    """The document the server publishes, built here from the app object, as the replica builds it (schemathesis
    needs it before the server runs; test_the_server_publishes_this_document checks they agree)."""
    from raymoe.deploy.api_schema import openapi_document
    from raymoe.deploy.http_app import api
    from raymoe.deploy.protocol import ServedModel
    from raymoe.stages.files.loader import open_model
    files = open_model(MODEL, CONTEXT)
    served = ServedModel(MODEL, files.tokenizer, files.config.context_length, files.config.vocab)
    return openapi_document(api, [served], api_key=True)


DOCUMENT = document()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.max_stream_events = MAX_STREAM_EVENTS     # read every stream to its end, so its last event is checked


def test_the_server_publishes_this_document(server):
    status, published = get_json(server.base + "/openapi.json")
    assert status == 200 and published == json.loads(json.dumps(DOCUMENT))


def negative_data_refused(ctx, response, case):
    """schemathesis's negative_data_rejection, with 413 counted as a refusal too: a schema-violating body (say,
    more messages than allowed) that is also over --max-body-bytes is refused for its size before it is read."""
    if response.status_code == 413:
        return None
    return negative_data_rejection(ctx, response, case)


def event_stream_conforms(ctx, response, case):
    """A text/event-stream response: `data: {json}` events, each a chunk of the operation's kind (or an
    error), then `data: [DONE]` and nothing after it; of /v1/responses, named events (`event: TYPE`) whose
    data are the documented events of that type, the last one response.completed, response.incomplete or
    error."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return None
    assert not response.stream_cut_short, f"the client stopped reading after {MAX_STREAM_EVENTS} events"
    components = case.operation.schema.raw_schema["components"]
    if case.operation.path in NAMED_EVENTS:
        return named_events_conform(response, components, *NAMED_EVENTS[case.operation.path])
    kind = "ChatCompletionChunk" if case.operation.path == "/v1/chat/completions" else "CompletionChunk"
    validators = [jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})
                  for name in (kind, "ErrorResponse")]
    blocks = [block.strip() for block in response.text.split("\n\n") if block.strip()]
    assert all(block.startswith("data: ") for block in blocks), f"not an event: {response.text[:300]!r}"
    events = [block[len("data: "):] for block in blocks]
    assert events and events[-1] == "[DONE]", f"the stream does not end with [DONE]: {response.text[-300:]!r}"
    for event in events[:-1]:
        chunk = json.loads(event)
        errors = [e for v in validators for e in [next(iter(v.iter_errors(chunk)), None)] if e]
        assert len(errors) < len(validators), f"an event matches no schema ({errors[0].message}): {event[:300]}"
    return True


def named_events_conform(response, components, events: list, last: tuple) -> bool:
    """Named events (/v1/responses, /v1/messages), each of a documented event type, the last one of `last`."""
    validator = jsonschema.Draft202012Validator(
        {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"} for m in events], "components": components})
    blocks = [block.strip() for block in response.text.split("\n\n") if block.strip()]
    types = []
    for block in blocks:
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block[:300]
        event = json.loads(lines[1][len("data: "):])
        assert event["type"] == lines[0][len("event: "):], block[:300]
        error = next(iter(validator.iter_errors(event)), None)
        assert error is None, f"an event matches no schema ({error.message}): {block[:300]}"
        types.append(event["type"])
    assert types and types[-1] in last, types
    return True


NAMED_EVENTS = {"/v1/responses": (RESPONSE_EVENTS, ("response.completed", "response.incomplete", "error")),
                "/v1/messages": (MESSAGE_EVENTS, ("message_stop", "error"))}


GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
SHORT = {"max_tokens": 2, "max_completion_tokens": 2, "max_output_tokens": 2, "n": 2}


def keep_short(case):
    """Generations stay short: max_tokens, max_completion_tokens and n that the document allows are lowered
    to SHORT (a valid case stays valid, an invalid one stays invalid: its invalid value is left as it is),
    and a valid case without a limit gets max_tokens SHORT."""
    body = case.body
    if case.operation.path not in GENERATION or not isinstance(body, dict):
        return
    for name, cap in SHORT.items():
        value = body.get(name)
        if type(value) is int and 1 <= value <= CONTEXT:
            body[name] = min(value, cap)
    limit = "max_output_tokens" if case.operation.path == "/v1/responses" else "max_tokens"
    if case.meta.generation.mode.is_positive and body.get(limit) is None \
            and body.get("max_completion_tokens") is None:
        body[limit] = SHORT[limit]


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=DEADLINE_MS, suppress_health_check=list(HealthCheck))
def test_every_endpoint_keeps_to_its_schema(case, server):
    keep_short(case)
    response = case.call_and_validate(base_url=server.base, headers=AUTH, timeout=REQUEST_TIMEOUT_S,
                                      excluded_checks=[positive_data_acceptance, negative_data_rejection],
                                      additional_checks=[negative_data_refused, event_stream_conforms])
    SENT.append((case.operation.label, response.status_code))
    assert response.status_code < 500, response.text[:1000]


def test_healthy_and_idle_after_fuzzing(server):
    """Last: enough cases were sent, and the server answers and holds no sequence."""
    by_operation = {}
    for label, status in SENT:
        by_operation.setdefault(label, {}).setdefault(status, 0)
        by_operation[label][status] += 1
    print(f"{len(SENT)} requests: " + "; ".join(f"{label} {dict(sorted(s.items()))}"
                                                for label, s in sorted(by_operation.items())))
    assert len(SENT) >= MIN_CASES, by_operation
    assert all(status < 500 for _, status in SENT)
    wait_idle(server.base, timeout=60)
    status, body = get_json(server.base + "/health")
    assert status == 200 and body["status"] == "ok" and body["restarts"] == 0, body
    time.sleep(0.1)
    assert server.proc.poll() is None, server.tail()
