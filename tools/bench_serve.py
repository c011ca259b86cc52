"""Serving benchmark: streaming completions against the OpenAI-compatible endpoint at 1, 8 and 32
concurrent clients; prints requests/s, generated tokens/s, and TTFT and inter-token latency p50/p99.

    python -m raymoe.tools.bench_serve [--model tiny-qwen35moe] [--pp 1] [--max-tokens 32]   # starts a local server
    python -m raymoe.tools.bench_serve --url http://127.0.0.1:8000                           # or measures a running one
    python -m raymoe.tools.bench_serve --turns 6 --concurrency 8 [--compare-cache]            # multi-turn chats
    python -m raymoe.tools.bench_serve --turns 4 --concurrency 16 --replicas 4 --compare-router  # routing

With --turns, each client holds a chat conversation of that many turns over /v1/chat/completions: a shared
system preamble (--history-words), then its own user messages, each turn sending the whole history back
with the previous answer, as chat clients and agents do. Per turn it prints TTFT p50/p99; --compare-cache
(local server only) runs it with the prefix cache at its default and off, and prints the ratios. --compare-router
(local server, --replicas N) runs it with the prefix router, Serve's default router and one replica, each
conversation with a history of its own (--own-history), and prints the later turns' TTFT and prefix cache hit rates.

TTFT is from sending the request to the first chunk that carries a token; inter-token latency is the
gap between consecutive token-carrying chunks of a request (per token). Every client sends its next
request as soon as the previous one finished (closed loop).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import socket
import sys
import time


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def one_request(session, url: str, body: dict, path: str = "/v1/completions") -> dict:
    start = time.perf_counter()
    ttft, gaps, tokens, last, text, usage = None, [], 0, None, [], None
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            pieces = [c.get("delta", {}).get("content") or c.get("text") or "" for c in chunk.get("choices", [])]
            text += pieces
            # token_ids where the server returns them (return_token_ids); else (llama-server) a chunk per token,
            # its text possibly empty, until the one that carries the finish_reason
            choices = chunk.get("choices", [])
            n = sum(len(c["token_ids"] or []) if "token_ids" in c else c.get("finish_reason") is None for c in choices)
            if not n:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                gaps.extend([(now - last) / n] * n)
            last = now
            tokens += n
    return {"ttft": ttft, "itl": gaps, "tokens": tokens, "text": "".join(text), "usage": usage}


async def run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int, prompt_words: int,
                    tag: str):
    """n_requests streaming completions from `concurrency` clients. Each prompt starts with its own words
    (`tag` and its index), so no request of the run finds another's prompt in a server's prompt cache."""
    import aiohttp

    queue = list(range(n_requests))
    results = []

    async def client(session):
        while queue:
            i = queue.pop()
            words = [f"run{tag} request{i}"] + [f"word{(i * 7 + j) % 50}" for j in range(prompt_words - 2)]
            body = {"model": model, "prompt": " ".join(words),
                    "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stream": True,
                    "return_token_ids": True}
            results.append(await one_request(session, url, body))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        start = time.perf_counter()
        await asyncio.gather(*[client(session) for _ in range(concurrency)])
        elapsed = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    itls = [g for r in results for g in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "seconds": elapsed,
            "requests_per_s": len(results) / elapsed, "tokens_per_s": tokens / elapsed,
            "ttft_p50_ms": 1000 * percentile(ttfts, 50), "ttft_p99_ms": 1000 * percentile(ttfts, 99),
            "itl_p50_ms": 1000 * percentile(itls, 50), "itl_p99_ms": 1000 * percentile(itls, 99)}


async def run_conversations(url: str, model: str, clients: int, turns: int, max_tokens: int, prompt_words: int,
                            history_words: int, own_history: bool = False) -> dict:
    """`clients` conversations of `turns` turns at once; TTFT per turn, generated tokens/s over the run, and the share
    of the later turns' prompt tokens that the prefix cache held. own_history: each conversation's preamble is its own
    (no prefix shared between conversations)."""
    import aiohttp

    preamble = "You answer questions about words. " + " ".join(f"rule{j % 97} says word{j % 53}"
                                                              for j in range(history_words // 4))
    per_turn = [[] for _ in range(turns)]
    tokens = 0
    later_prompt = later_cached = 0

    async def conversation(session, c: int):
        nonlocal tokens, later_prompt, later_cached
        messages = [{"role": "system", "content": f"Conversation {c}. {preamble}" if own_history else preamble}]
        for turn in range(turns):
            messages.append({"role": "user", "content": " ".join(f"word{(c * 31 + turn * 7 + j) % 50}"
                                                                 for j in range(prompt_words))})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 1.0,
                    "seed": c * 100 + turn, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}
            result = await one_request(session, url, body, "/v1/chat/completions")
            per_turn[turn].append(result["ttft"])
            if turn and result["usage"]:
                later_prompt += result["usage"]["prompt_tokens"]
                later_cached += (result["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            tokens += result["tokens"]
            messages.append({"role": "assistant", "content": result["text"]})

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        start = time.perf_counter()
        await asyncio.gather(*[conversation(session, c) for c in range(clients)])
        elapsed = time.perf_counter() - start
    return {"clients": clients, "turns": turns, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "later_hit_rate": later_cached / later_prompt if later_prompt else float("nan"),
            "ttft_ms": [{"p50": 1000 * percentile([t for t in ts if t is not None], 50),
                         "p99": 1000 * percentile([t for t in ts if t is not None], 99)} for ts in per_turn]}


def conversation_table(run: dict) -> str:
    lines = [f"{run['clients']} clients x {run['turns']} turns: {run['seconds']:.1f} s, "
             f"{run['tokens_per_s']:.1f} generated tok/s, prefix cache hit rate of turns 2-{run['turns']} "
             f"{run['later_hit_rate']:.1%}", f"{'turn':>4} {'TTFT p50':>10} {'TTFT p99':>10}"]
    lines += [f"{i + 1:>4} {t['p50']:>8.1f}ms {t['p99']:>8.1f}ms" for i, t in enumerate(run["ttft_ms"])]
    return "\n".join(lines)


def cache_ratios(on: dict, off: dict) -> str:
    """How much the prefix cache gained: throughput, and TTFT p50 over the turns after the first."""
    later = slice(1, None)
    ttft_on = sum(t["p50"] for t in on["ttft_ms"][later]) or float("nan")
    ttft_off = sum(t["p50"] for t in off["ttft_ms"][later])
    return (f"prefix cache on / off: generated tok/s {on['tokens_per_s'] / off['tokens_per_s']:.2f}x, "
            f"TTFT p50 of turns 2-{on['turns']} {ttft_off / ttft_on:.2f}x lower")


def router_ratios(prefix: dict, default: dict, single: dict) -> str:
    """What prefix-aware routing gained: TTFT p50 of the later turns against Serve's default router, and its hit
    rate against one replica's (which holds every history)."""
    later = slice(1, None)
    ttft_prefix = sum(t["p50"] for t in prefix["ttft_ms"][later]) or float("nan")
    ttft_default = sum(t["p50"] for t in default["ttft_ms"][later])
    return (f"prefix router: TTFT p50 of turns 2-{prefix['turns']} {ttft_default / ttft_prefix:.2f}x lower than "
            f"Serve's default router; hit rate {prefix['later_hit_rate']:.1%} (default router "
            f"{default['later_hit_rate']:.1%}), {prefix['later_hit_rate'] / single['later_hit_rate']:.2f}x one "
            f"replica's ({single['later_hit_rate']:.1%})")


def table(rows: list[dict]) -> str:
    head = f"{'clients':>7} {'requests':>8} {'req/s':>7} {'gen tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} " \
           f"{'ITL p50':>8} {'ITL p99':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['concurrency']:>7} {r['requests']:>8} {r['requests_per_s']:>7.2f} {r['tokens_per_s']:>9.1f} "
                     f"{r['ttft_p50_ms']:>7.1f}ms {r['ttft_p99_ms']:>7.1f}ms {r['itl_p50_ms']:>6.1f}ms "
                     f"{r['itl_p99_ms']:>6.1f}ms")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local(args, name: str, **overrides) -> str:
    """A local Serve application of the model (Ray started by the caller); returns its URL."""
    from ray import serve

    from raymoe.deploy.serve import ServeArgs, app_builder
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_builder(ServeArgs.from_flags(args, max_queued=None, grpc_port=0, **overrides)), name=name,
              route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv=None) -> int:
    from raymoe.cluster.engine_args import add_engine_flags
    from raymoe.deploy.serve import ServeArgs

    p = argparse.ArgumentParser(prog="python -m raymoe.tools.bench_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start a local one)")
    p.add_argument("--model", default="tiny-qwen35moe")
    add_engine_flags(p, ["pp", "microbatches", "threads", "prefix_cache_gb", "itl_target_ms"], ServeArgs)   # of the local server
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=16, help="requests per level at least")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--turns", type=int, default=0, help="multi-turn chats of this many turns (0: single requests)")
    p.add_argument("--history-words", type=int, default=1200, help="the chats' shared system preamble, in words")
    p.add_argument("--own-history", action="store_true", help="each chat's preamble is its own (none shared)")
    p.add_argument("--compare-cache", action="store_true",
                   help="with --turns and a local server: run again with the prefix cache off, print the ratios")
    p.add_argument("--replicas", type=int, default=1, help="pipelines of the local server")
    p.add_argument("--compare-router", action="store_true",
                   help="with --turns, --replicas N and a local server: the prefix router, Serve's default router "
                        "and one replica, each chat with its own history; print the ratios")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.compare_cache and (args.url or not args.turns):
        p.error("--compare-cache needs --turns and a local server (no --url)")
    if args.compare_router and (args.url or not args.turns or args.replicas < 2):
        p.error("--compare-router needs --turns, --replicas 2 or more and a local server (no --url)")
    args.own_history = args.own_history or args.compare_router

    def measure(url: str, model: str):
        if args.turns:
            return [asyncio.run(run_conversations(url, model, c, args.turns, args.max_tokens, args.prompt_words,
                                                  args.history_words, args.own_history)) for c in levels]
        run = secrets.token_hex(3)      # a later run against the same server repeats no prompt either
        asyncio.run(run_level(url, model, 1, 2, 4, args.prompt_words, f"{run}w"))     # warm-up
        rows = []
        for c in levels:
            n = max(args.min_requests, c * args.requests_per_client)
            rows.append(asyncio.run(run_level(url, model, c, n, args.max_tokens, args.prompt_words, f"{run}c{c}")))
            print(f"{c} clients done", file=sys.stderr)
        return rows

    results = {}
    if args.url:
        import urllib.request
        with urllib.request.urlopen(args.url.rstrip("/") + "/v1/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
        results["server"] = measure(args.url, model)
    else:
        import ray
        from ray import serve

        from raymoe.cluster.engine import connect_ray
        connect_ray(args.pp * args.replicas)
        model = args.model
        try:
            runs = [("local", {})]
            if args.compare_cache:
                runs = [("cache on", {}), ("cache off", {"prefix_cache_gb": 0})]
            elif args.compare_router:
                runs = [("prefix router", {}), ("default router", {"request_router": "default"}),
                        ("one replica", {"replicas": 1})]
            for i, (label, overrides) in enumerate(runs):
                if i:
                    serve.shutdown()        # the previous configuration's application and proxy
                results[label] = measure(start_local(args, f"raymoe-bench-{i}", **overrides), model)
        finally:
            serve.shutdown()
            ray.shutdown()
    kind = f"{args.turns}-turn chats, {args.history_words}-word shared preamble" if args.turns else \
        f"streaming /v1/completions, {args.prompt_words}-word prompts"
    where = f"the server at {args.url}" if args.url else \
        f"pp={args.pp}, microbatches={args.microbatches or args.pp}, {args.replicas} replica(s)"
    print(f"serving benchmark: {model}, {where}, {kind}, max_tokens "
          f"{args.max_tokens}, temperature 1 (lengths vary: EOS ends some early)")
    for label, rows in results.items():
        print(f"-- {label}")
        print("\n".join(conversation_table(r) for r in rows) if args.turns else table(rows))
    if args.compare_cache:
        for on, off in zip(results["cache on"], results["cache off"]):
            print(f"{on['clients']} clients: {cache_ratios(on, off)}")
    if args.compare_router:
        for prefix, default, single in zip(results["prefix router"], results["default router"],
                                           results["one replica"]):
            print(f"{prefix['clients']} clients: {router_ratios(prefix, default, single)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
