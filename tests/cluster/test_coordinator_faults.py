"""Issue 26: the coordinator actor dies (SIGKILL of its process) and nothing is lost. ClusterEngine replaces it
with a coordinator and pipeline of its own and hands it every open sequence from what outlives it: the batch
job's driver's table of requests in flight, a server's ingress replica's streams with the tokens they have
given. docs/faults.md."""
import json
import os
import signal
import threading
import time

import pytest
from batch_cases import batch_lines
from serve_util import ServerProcess, cmdline, descendants, get_json

from raymoe.deploy import generate

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

KILLS_AT = (30, 90, 150)        # output lines written when each kill comes


def coordinator_pids(root: int) -> list[int]:
    """The coordinator actors' processes below `root` (a Ray cluster's starter)."""
    return [pid for pid in descendants(root) if cmdline(pid).startswith(b"ray::Coordinator")]


def lines_in(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def test_three_coordinator_kills_during_a_batch_job_change_no_byte(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in batch_lines()))
    flags = ["--model", "tiny-qwen35moe", "--input", str(src), "--max-running", "32"]
    reference = tmp_path / "reference.jsonl"
    started = time.monotonic()
    assert generate.main([*flags, "--output", str(reference)]) == 0
    uninterrupted_s = time.monotonic() - started

    out = tmp_path / "killed.jsonl"
    kills, stop = [], threading.Event()

    def killer():
        """SIGKILL the live coordinator once the output has KILLS_AT[k] lines, each time a new one."""
        for at in KILLS_AT:
            while lines_in(out) < at and not stop.is_set():
                time.sleep(0.02)
            while not stop.is_set():
                # this session's Ray cluster is a child of this process
                pids = [p for p in coordinator_pids(os.getpid()) if p not in [k[0] for k in kills]]
                if pids:
                    assert len(pids) == 1, pids
                    kills.append((pids[0], lines_in(out)))
                    os.kill(pids[0], signal.SIGKILL)
                    break
                time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        code = generate.main([*flags, "--output", str(out)])
    finally:
        stop.set()
        thread.join(10)
    killed_s = time.monotonic() - started
    err = capsys.readouterr().err
    print(f"200 lines: {uninterrupted_s:.1f} s uninterrupted, {killed_s:.1f} s with the coordinator killed at "
          f"lines {[n for _, n in kills]}")
    assert code == 0, err[-3000:]
    assert len(kills) == 3 and all(n < 200 for _, n in kills), kills      # each kill came mid-run
    assert "the coordinator died and was replaced 3 times" in err, err[-3000:]
    assert out.read_bytes() == reference.read_bytes()


# ---- serving: the ingress replica's streams go on ------------------------------------------------------

STREAMS = [dict(prompt="The import statement", temperature=0),
           dict(prompt="A list is", temperature=0.9, top_p=0.9, seed=5),
           dict(prompt="Penalised", temperature=0.8, seed=9, presence_penalty=0.5, frequency_penalty=0.4,
                repetition_penalty=1.3),
           dict(messages=[{"role": "user", "content": "What is a dict?"}], temperature=0.7, seed=3)]
LONG = {"max_tokens": 160, "ignore_eos": True}


async def http_call(session, base: str, case: dict, stream: bool, out: dict | None = None) -> dict:
    """One request: the tokens and text it gave, in order (streamed: every chunk's, joined into `out` as they
    come), and how it ended."""
    path = "/v1/chat/completions" if "messages" in case else "/v1/completions"
    body = {**case, **LONG, "stream": stream, "return_token_ids": True}
    async with session.post(base + path, json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            choice = (await r.json())["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return {"token_ids": choice["token_ids"], "text": text, "finish_reason": choice["finish_reason"]}
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                out["token_ids"] += choice.get("token_ids", [])
                delta = choice.get("delta", choice)
                out["text"] += delta.get("content") or delta.get("text") or ""
                out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
        return out


async def grpc_call(stub, case: dict, stream: bool, out: dict | None = None) -> dict:
    from raymoe.protos import raymoe_pb2 as pb
    fields = {k: v for k, v in {**case, **LONG}.items() if k != "messages"}
    if "messages" in case:
        fields["messages"] = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in case["messages"]])
    request = pb.GenerateRequest(**fields)
    if not stream:
        r = await stub.Generate(request)
        return {"token_ids": list(r.token_ids), "text": r.text, "finish_reason": r.finish_reason}
    async for message in stub.GenerateStream(request):
        out["token_ids"] += message.token_ids
        out["text"] += message.text
        out["finish_reason"] = message.finish_reason or out["finish_reason"]
    return out


def test_a_coordinator_killed_under_streams_continues_them_without_a_gap(tmp_path):
    """HTTP and gRPC streams (greedy, seeded, penalised, chat) in flight when the coordinator is SIGKILLed
    end as the same requests end uninterrupted: every token once, in order, the same text."""
    import asyncio

    import aiohttp
    import grpc

    from raymoe.protos import raymoe_pb2_grpc as pb_grpc

    server = ServerProcess(tmp_path / "serve.log", "--max-running", "16")
    try:
        server.wait_ready()

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as session, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                stub = pb_grpc.RaymoeStub(channel)
                reference = ([await http_call(session, server.base, c, False) for c in STREAMS]
                             + [await grpc_call(stub, c, False) for c in STREAMS])
                streamed = [{"token_ids": [], "text": "", "finish_reason": None} for _ in range(2 * len(STREAMS))]
                calls = ([http_call(session, server.base, c, True, streamed[i]) for i, c in enumerate(STREAMS)]
                         + [grpc_call(stub, c, True, streamed[len(STREAMS) + i]) for i, c in enumerate(STREAMS)])
                tasks = [asyncio.ensure_future(c) for c in calls]
                deadline = time.monotonic() + 120
                while min(len(s["token_ids"]) for s in streamed) < 20 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                pids = coordinator_pids(server.proc.pid)
                assert len(pids) == 1, pids
                os.kill(pids[0], signal.SIGKILL)
                killed, at_kill = time.monotonic(), [len(s["token_ids"]) for s in streamed]
                await asyncio.wait(tasks, timeout=180)
                for t in tasks:
                    t.result()      # raises for one that failed, or did not end
                return reference, streamed, at_kill, time.monotonic() - killed

        reference, streamed, at_kill, after_s = asyncio.run(go())
        print(f"{len(streamed)} streams at {at_kill} tokens when the coordinator was killed; all ended "
              f"{after_s:.1f} s after it")
        assert all(0 < n < LONG["max_tokens"] for n in at_kill), at_kill      # each one in flight
        for want, got in zip(reference, streamed):
            assert len(got["token_ids"]) == LONG["max_tokens"] and got["finish_reason"] == "length"
            assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
        status, health = get_json(server.base + "/health")
        assert status == 200 and health["sequences"] == 0, health
        assert "Traceback" not in server.tail(100000)
    finally:
        server.kill()
