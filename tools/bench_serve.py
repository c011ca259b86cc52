"""Serving benchmark: streaming completions against the OpenAI-compatible endpoint at 1, 8 and 32
concurrent clients; prints requests/s, generated tokens/s, and TTFT and inter-token latency p50/p99.

    python -m tools.bench_serve [--model tiny-qwen35moe] [--pp 1] [--max-tokens 32]   # starts a local server
    python -m tools.bench_serve --url http://127.0.0.1:8000                           # or measures a running one

TTFT is from sending the request to the first chunk that carries a token; inter-token latency is the
gap between consecutive token-carrying chunks of a request (per token). Every client sends its next
request as soon as the previous one finished (closed loop).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def one_request(session, url: str, body: dict) -> dict:
    start = time.perf_counter()
    ttft, gaps, tokens, last = None, [], 0, None
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
            if not n:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                gaps.extend([(now - last) / n] * n)
            last = now
            tokens += n
    return {"ttft": ttft, "itl": gaps, "tokens": tokens}


async def run_level(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int, prompt_words: int):
    import aiohttp

    queue = list(range(n_requests))
    results = []

    async def client(session):
        while queue:
            i = queue.pop()
            body = {"model": model, "prompt": " ".join(f"word{(i * 7 + j) % 50}" for j in range(prompt_words)),
                    "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stream": True,
                    "return_token_ids": True}
            results.append(await one_request(session, url, body))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
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


def main(argv=None) -> int:
    from cluster.engine_args import add_engine_flags
    from deploy.serve import ServeArgs

    p = argparse.ArgumentParser(prog="python -m tools.bench_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start a local one)")
    p.add_argument("--model", default="tiny-qwen35moe")
    add_engine_flags(p, ["pp", "microbatches"], ServeArgs)      # of the local server
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=16, help="requests per level at least")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    url, model, started = args.url, args.model, False
    if url is None:
        from ray import serve

        from cluster.engine import connect_ray
        from deploy.serve import app_builder
        connect_ray(args.pp)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder(ServeArgs.from_flags(args, max_queued=None, grpc_port=0)), name="raymoe-bench", route_prefix="/")
        url, started = f"http://127.0.0.1:{port}", True
    else:
        import urllib.request
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
    try:
        asyncio.run(run_level(url, model, 1, 2, 4, args.prompt_words))          # warm-up
        rows = []
        for c in levels:
            n = max(args.min_requests, c * args.requests_per_client)
            rows.append(asyncio.run(run_level(url, model, c, n, args.max_tokens, args.prompt_words)))
            print(f"{c} clients done", file=sys.stderr)
    finally:
        if started:
            import ray
            from ray import serve
            serve.shutdown()
            ray.shutdown()
    print(f"serving benchmark: {model}, pp={args.pp}, microbatches={args.microbatches or args.pp}, streaming /v1/completions, max_tokens {args.max_tokens}, "
          f"{args.prompt_words}-word prompts, temperature 1 (lengths vary: EOS ends some early)")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
