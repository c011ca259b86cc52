"""Issue 64: a model's pipelines as Serve replicas of its own deployment (docs/serving-replicas.md). The prefix
router keeps each conversation on the replica that caches its history (as one replica would), where Serve's
default router spreads its turns; the same model served three ways answers the same tokens; autoscaling grows a
model from 1 to 3 pipelines under load and back to 1, and a replica scaled down lets its streams end."""
import asyncio
import time

import aiohttp
import pytest
from serve_util import get_text, serve_apps

from raymoe.deploy.metrics import parse_metrics

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CONVERSATIONS, TURNS = 6, 3
TINY = "tiny-qwen35moe"


async def chat(session, base: str, body: dict) -> dict:
    async with session.post(base + "/v1/chat/completions", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data


async def conversations(base: str, model: str) -> list[list[dict]]:
    """CONVERSATIONS chats of TURNS turns, each with a long history of its own (its system prompt spans several
    prefix cache blocks), taking turns one request at a time: each finds every replica idle, so Serve's router picks
    at random (chats run at once in lockstep would each find their own replica the less busy one, just freed);
    per conversation, each turn's (answer, usage)."""
    histories = [[{"role": "system", "content": f"Conversation {c}. " + " ".join(f"fact{c}x{i}" for i in range(300))}]
                 for c in range(CONVERSATIONS)]
    turns = [[] for _ in range(CONVERSATIONS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for turn in range(TURNS):
            for c, messages in enumerate(histories):
                messages.append({"role": "user", "content": f"Question {turn} of conversation {c}: go on."})
                data = await chat(session, base, {"model": model, "messages": messages, "max_tokens": 6,
                                                  "temperature": 0})
                answer = data["choices"][0]["message"]["content"] or "."
                turns[c].append({"answer": answer, "usage": data["usage"]})
                messages.append({"role": "assistant", "content": answer})
    return turns


def later_turns_hit_rate(runs: list[list[dict]]) -> float:
    """Cached prompt tokens over prompt tokens, over the turns after the first."""
    later = [t["usage"] for turns in runs for t in turns[1:]]
    return sum(u["prompt_tokens_details"]["cached_tokens"] for u in later) / sum(u["prompt_tokens"] for u in later)


def test_prefix_routing_keeps_conversations_on_their_cached_replica():
    models = [{"model": TINY, "served_model_name": "routed", "replicas": 2},
              {"model": TINY, "served_model_name": "spread", "replicas": 2, "request_router": "default"},
              {"model": TINY, "served_model_name": "single", "replicas": 1}]
    with serve_apps({"/": {"models": models, "grpc_port": 0}}) as base:
        runs = {name: asyncio.run(conversations(base, name)) for name in ("routed", "spread", "single")}
        metrics = parse_metrics(get_text(base + "/metrics"))
    rates = {name: later_turns_hit_rate(run) for name, run in runs.items()}
    print("hit rates of turns 2-3:", {name: round(rate, 3) for name, rate in rates.items()})
    # greedy: each way of serving answers the same tokens
    answers = {name: [[t["answer"] for t in turns] for turns in run] for name, run in runs.items()}
    assert answers["routed"] == answers["single"] == answers["spread"]
    assert rates["single"] > 0.5, rates                  # one replica: the history is cached
    assert rates["routed"] >= 0.9 * rates["single"], rates
    assert rates["spread"] < rates["routed"], rates      # Serve's router sends some turns where nothing is cached
    decisions = {d: metrics.get(f'raymoe_routing_decisions_total{{decision="{d}",model="routed"}}', 0)
                 for d in ("new", "prefix", "balance")}
    assert decisions["new"] == CONVERSATIONS and decisions["prefix"] == CONVERSATIONS * (TURNS - 1), decisions
    assert not any(key.startswith("raymoe_routing_decisions_total") and 'model="spread"' in key for key in metrics)
    cached = metrics['raymoe_prompt_tokens_cached_total{model="routed"}']
    assert cached == sum(t["usage"]["prompt_tokens_details"]["cached_tokens"] for ts in runs["routed"] for t in ts)


def replicas_running(app: str, deployment: str) -> int:
    from ray import serve
    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


async def stream(session, base: str, max_tokens: int) -> tuple[int, str]:
    """(tokens streamed, finish_reason) of one streamed completion that ignores EOS."""
    body = {"model": TINY, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    tokens, reason = 0, None
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                import json
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    reason = chunk["choices"][0]["finish_reason"] or reason
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens, reason


def test_autoscaling_grows_to_three_and_back_to_one_without_cutting_a_stream():
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2, "upscale_delay_s": 0,
                   "downscale_delay_s": 2, "look_back_period_s": 11}     # > Serve's metrics interval (10 s)
    with serve_apps({"/": {"model": TINY, "autoscaling_config": autoscaling, "grpc_port": 0}}) as base:
        app, deployment = "app-", f"Pipeline-{TINY}"
        assert replicas_running(app, deployment) == 1
        seen = []

        async def load():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                # six long streams need three replicas; then three longer ones, which two can hold (one replica
                # goes, draining its stream); then none
                heavy = [asyncio.ensure_future(stream(session, base, 1200)) for _ in range(6)]
                start = time.monotonic()
                while replicas_running(app, deployment) < 3 and time.monotonic() - start < 120:
                    await asyncio.sleep(0.5)
                grew = time.monotonic() - start
                seen.append(replicas_running(app, deployment))
                light = [asyncio.ensure_future(stream(session, base, 2500)) for _ in range(3)]
                return grew, await asyncio.gather(*heavy), await asyncio.gather(*light)

        grew, heavy, light = asyncio.run(load())
        print(f"grew to 3 replicas in {grew:.1f} s")
        assert seen == [3], seen
        # every stream ended as it would have on an unchanging app: in full, none cut
        assert heavy == [(1200, "length")] * 6 and light == [(2500, "length")] * 3, (heavy, light)
        start = time.monotonic()
        while replicas_running(app, deployment) > 1 and time.monotonic() - start < 120:
            time.sleep(0.5)
        assert replicas_running(app, deployment) == 1
