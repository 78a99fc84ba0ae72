"""Load test of the OpenAI-compatible server: N concurrent streaming clients against one model, on 127.0.0.1.

    python -m bench.serve_load --clients 32 --max-tokens 48 [--model smollm2] [--concurrency 1] [--out FILE]

Every prompt is first sent alone (non-streamed, greedy): its serial answer. Then all N are streamed at once. Checked:
none lost, every call validates against its tool's schema, every streamed answer (content, calls, finish_reason)
equals its serial answer. Reported: wall time of the concurrent phase, requests/s, completion tokens/s, latency
p50/p95 (s), time to the first chunk carrying content or a call p50 (s), and the serial phase's tokens/s.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

from agent.demo_tools import TOOLS
from agent.engine import EngineConfig, LocalEngine
from agent.remote import collect_stream
from agent.server import ServerThread, create_app
from schemas import ToolRegistry

CITIES = ["Paris", "Tokyo", "Oslo", "Lima", "Cairo", "Delhi", "Quito", "Rome"]


def prompts(n: int) -> list[str]:
    kinds = [lambda i: f"What's the weather in {CITIES[i % len(CITIES)]}?",
             lambda i: f"What is {i} plus {2 * i + 1}?",
             lambda i: f"Convert {i + 1} km to m."]
    return [kinds[i % len(kinds)](i) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=1, help="decodes at once on the server")
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    args = ap.parse_args(argv)

    import openai

    registry = ToolRegistry(TOOLS)
    tools = [t.to_openai() for t in registry]
    config = EngineConfig(max_string_length=64, max_decimals=6, max_new_tokens=args.max_tokens)
    app = create_app(LocalEngine(args.model), model_name=args.model, config=config,
                     max_waiting=max(64, args.clients), concurrency=args.concurrency)
    todo = prompts(args.clients)
    with ServerThread(app) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
        request = dict(model=args.model, tools=tools, tool_choice="required")

        def serial(prompt: str):
            r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **request)
            m = r.choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
            return (m.content or "", calls, r.choices[0].finish_reason), r.usage.completion_tokens

        def streamed(prompt: str):
            t0, first = time.perf_counter(), []

            def chunks():
                for ch in client.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=True,
                                                         stream_options={"include_usage": True}, **request):
                    if not first and any(c.delta.content or c.delta.tool_calls for c in ch.choices):
                        first.append(time.perf_counter() - t0)
                    yield ch
            content, calls, finish, usage = collect_stream(chunks())
            answer = (content, [(c["name"], c["arguments"]) for c in calls], finish)
            return answer, usage.completion_tokens, time.perf_counter() - t0, first[0] if first else None

        t0 = time.perf_counter()
        alone = [serial(p) for p in todo]
        serial_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            together = list(pool.map(streamed, todo))
        wall = time.perf_counter() - t0

    valid = 0
    for answer, *_ in together:
        try:
            for name, arguments in answer[1]:
                registry.parse_call({"name": name, "arguments": arguments})
            valid += answer[2] == "tool_calls" or (answer[2] == "length" and not answer[1])
        except ValueError:
            pass
    latencies = sorted(t[2] for t in together)
    firsts = sorted(t[3] for t in together if t[3] is not None)
    tokens = sum(t[1] for t in together)
    summary = {"clients": args.clients, "model": args.model, "max_tokens": args.max_tokens,
               "concurrency": args.concurrency, "answered": len(together), "valid": valid,
               "equal_to_serial": sum(t[0] == a[0] for t, a in zip(together, alone)),
               "calls": sum(len(t[0][1]) for t in together), "wall_s": round(wall, 2),
               "requests_per_s": round(len(together) / wall, 3), "completion_tokens_per_s": round(tokens / wall, 1),
               "latency_p50_s": round(statistics.median(latencies), 2),
               "latency_p95_s": round(latencies[max(0, int(0.95 * len(latencies)) - 1)], 2),
               "first_chunk_p50_s": round(statistics.median(firsts), 2) if firsts else None,
               "serial_tokens_per_s": round(sum(a[1] for a in alone) / serial_s, 1)}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["valid"] == summary["equal_to_serial"] == args.clients else 1


if __name__ == "__main__":
    raise SystemExit(main())
