"""Load test of the OpenAI-compatible server: N concurrent streaming clients against one model, on 127.0.0.1.

    python -m bench.serve_load --clients 32 --max-tokens 48 [--model smollm2] [--concurrency 1] [--out FILE]
    python -m bench.serve_load --sweep 1,8,32 --batching off,on --max-batch 32 --threads 1 [--out FILE]
    python -m bench.serve_load --url http://127.0.0.1:8000/v1 --model M --clients 32   # clients in their own process

Every prompt is first sent alone (non-streamed, greedy): its serial answer. Then all N are streamed at once. Checked:
none lost, every call validates against its tool's schema, every streamed answer (content, calls, finish_reason)
equals its serial answer. Reported: wall time of the concurrent phase, requests/s, completion tokens/s, latency
p50/p95 (s), time to the first chunk carrying content or a call p50 (s), and the serial phase's tokens/s.

``--sweep`` runs each client count against each server in ``--batching``: ``off`` decodes ``--concurrency`` requests
at a time (default 1: one at a time), ``on`` is continuous batching (``--max-batch`` sequences, llama.cpp backend);
both load the model once, with the same ``--threads``. Each server's serial answers (the largest count's prompts, sent
alone) are the reference of its concurrent runs. The summary ends with ``speedup``: batching-on requests/s over
batching-off requests/s per client count.

``--rounds R`` (with ``--batching off,on``) starts both servers at once and interleaves them: each server's serial
answers first, then R rounds, each running every client count against each server in turn (the order reversed
every other round), so the two modes of a pair run minutes apart at most; ``speedup`` is then the median over rounds
of each round's on / off ratio (``speedup_rounds``: every round's), and every run carries its ``round``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import statistics
import time

from agent.demo_tools import TOOLS
from agent.engine import EngineConfig, LocalEngine
from agent.remote import collect_stream
from agent.server import ServerThread, create_app
from decoding import DEFAULT_NUM_DRAFT_TOKENS
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
    ap.add_argument("--sweep", default=None, help="client counts, comma-separated (e.g. 1,8,32); overrides --clients")
    ap.add_argument("--batching", default="off", help="off | on | off,on (with --sweep: each server in turn)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=1, help="batching off: decodes at once on the server")
    ap.add_argument("--max-batch", type=int, default=32, help="batching on: sequences decoded together")
    ap.add_argument("--seq-ctx", type=int, default=None, help="batching on: KV positions per sequence")
    ap.add_argument("--max-rows", type=int, default=None, help="batching on: tokens per step's llama_decode")
    ap.add_argument("--fast-prefill", action="store_true",
                    help="batching on: reuse cached prefixes as they are (fewer rows; see BatchScheduler exact_prefill)")
    ap.add_argument("--batch-num-draft-tokens", type=int, default=None,
                    help="batching on: γ of that server's requests (default: the engine's); off keeps the default")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (1: the identity configuration)")
    ap.add_argument("--backend", default=None, help="decoding backend (default: llama.cpp for a GGUF)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --batching off,on: both servers up at once, R interleaved rounds, median speedup")
    ap.add_argument("--out", default=None, help="write the JSON summary here too")
    ap.add_argument("--url", default=None,
                    help="clients only, against a server already running (its own process), e.g. "
                         "http://127.0.0.1:8000/v1 from `python -m agent serve --max-string-length 64 "
                         "--max-decimals 6`; its flags decide batching and threads, --model names the served model")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.sweep.split(",")] if args.sweep else [args.clients]
    modes = args.batching.split(",")
    if any(m not in ("off", "on") for m in modes) or any(c < 1 for c in counts):
        ap.error("--batching takes off, on or off,on; client counts are >= 1")
    if args.rounds < 1 or (args.rounds > 1 and (args.url or sorted(modes) != ["off", "on"])):
        ap.error("--rounds takes R >= 1; R > 1 needs --batching off,on and no --url")
    if args.url:
        runs = load_clients(args.url, args.model, counts, args.max_tokens)
        for summary in runs:
            summary["server"] = args.url
            print(json.dumps(summary), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(runs[0] if len(runs) == 1 else {"runs": runs}, f, indent=1)
        return 0 if all(r["valid"] == r["equal_to_serial"] == r["clients"] == r["answered"] for r in runs) else 1

    from decoding import Generator

    loaded = Generator(args.model, backend=args.backend, threads=args.threads).loaded  # one load, shared
    runs, ok = [], True

    def server(mode: str):
        engine = LocalEngine(Generator(loaded))
        batch = dict(max_batch=args.max_batch, seq_ctx=args.seq_ctx, max_rows=args.max_rows) if mode == "on" else {}
        if batch and args.fast_prefill:
            engine.generator.enable_batching(**batch, exact_prefill=False)
        gamma = args.batch_num_draft_tokens if mode == "on" else None
        return engine, batch, gamma

    def report(summary: dict, mode: str, gamma: int | None) -> None:
        nonlocal ok
        summary["batching"] = mode
        summary["num_draft_tokens"] = gamma if gamma is not None else DEFAULT_NUM_DRAFT_TOKENS
        ok &= summary["valid"] == summary["equal_to_serial"] == summary["clients"] == summary["answered"]
        print(json.dumps(summary), flush=True)
        runs.append(summary)

    if args.rounds == 1:
        for mode in modes:
            engine, batch, gamma = server(mode)
            for summary in run_server(engine, args.model, counts, args.max_tokens, args.concurrency, batch, gamma):
                report(summary, mode, gamma)
    else:
        todo = prompts(max(counts))
        with contextlib.ExitStack() as stack:
            up = {}
            for mode in modes:
                engine, batch, gamma = server(mode)
                url = stack.enter_context(ServerThread(make_app(engine, args.model, counts, args.max_tokens,
                                                                args.concurrency, batch, gamma)))
                clients = LoadClients(url, args.model, args.max_tokens)
                up[mode] = (clients, clients.serial(todo), batch, gamma)
            for r in range(args.rounds):
                for n in counts:
                    for mode in (modes if r % 2 == 0 else modes[::-1]):
                        clients, alone, batch, gamma = up[mode]
                        summary = clients.concurrent(todo[:n], alone[:n], args.concurrency, batch)
                        summary["round"] = r + 1
                        report(summary, mode, gamma)
    result: dict = {"runs": runs}
    if len(runs) == 1:
        result = runs[0]
    elif set(modes) == {"off", "on"}:
        rate = {(r["batching"], r["clients"], r.get("round", 1)): r["requests_per_s"] for r in runs}
        ratios = {c: [rate["on", c, k] / rate["off", c, k] for k in range(1, args.rounds + 1)] for c in counts}
        result["speedup"] = {str(c): round(statistics.median(v), 2) for c, v in ratios.items()}
        if args.rounds > 1:
            result["speedup_rounds"] = {str(c): [round(x, 2) for x in v] for c, v in ratios.items()}
        print(json.dumps({k: result[k] for k in ("speedup", "speedup_rounds") if k in result}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


def run_server(engine: LocalEngine, model: str, counts: list[int], max_tokens: int, concurrency: int,
               batch: dict, num_draft_tokens: int | None = None) -> list[dict]:
    """One server over ``engine`` (``batch``: ``create_app``'s continuous-batching arguments, or none;
    ``num_draft_tokens``: γ of its requests, None: the engine's default): the serial answers of ``max(counts)``
    prompts, then each count of concurrent streamed clients. One summary per count."""
    with ServerThread(make_app(engine, model, counts, max_tokens, concurrency, batch, num_draft_tokens)) as url:
        return load_clients(url, model, counts, max_tokens, concurrency, batch)


def make_app(engine: LocalEngine, model: str, counts: list[int], max_tokens: int, concurrency: int, batch: dict,
             num_draft_tokens: int | None = None):
    """The server application :func:`run_server` runs (arguments as there)."""
    config = EngineConfig(max_string_length=64, max_decimals=6, max_new_tokens=max_tokens).override(
        num_draft_tokens=num_draft_tokens)
    return create_app(engine, model_name=model, config=config, max_waiting=max(64, max(counts)),
                      concurrency=concurrency, **batch)


def load_clients(url: str, model: str, counts: list[int], max_tokens: int, concurrency: int = 1,
                 batch: dict | None = None) -> list[dict]:
    """The clients' side against the server at ``url`` (``…/v1``; in this process or another): the serial answers
    of ``max(counts)`` prompts, then each count of concurrent streamed clients. One summary per count
    (``concurrency`` / ``batch`` only label it)."""
    clients, todo = LoadClients(url, model, max_tokens), prompts(max(counts))
    alone = clients.serial(todo)
    return [clients.concurrent(todo[:n], alone[:n], concurrency, batch) for n in counts]


class LoadClients:
    """OpenAI clients of the server at ``url`` (``…/v1``), the demo tools, ``tool_choice="required"``, greedy."""

    def __init__(self, url: str, model: str, max_tokens: int):
        import openai

        self.model, self.max_tokens = model, max_tokens
        self.registry = ToolRegistry(TOOLS)
        self.client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600)
        self.request = dict(model=model, tools=[t.to_openai() for t in self.registry], tool_choice="required",
                            max_tokens=max_tokens)

    def serial(self, todo: list[str]) -> list[tuple]:
        """Each prompt sent alone, non-streamed, one after another: ``(answer, completion tokens, seconds)`` each,
        ``answer`` = ``(content, [(name, arguments)], finish_reason)``."""
        out = []
        for prompt in todo:
            t0 = time.perf_counter()
            r = self.client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **self.request)
            m = r.choices[0].message
            calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
            out.append(((m.content or "", calls, r.choices[0].finish_reason), r.usage.completion_tokens,
                        time.perf_counter() - t0))
        return out

    def concurrent(self, todo: list[str], alone: list[tuple], concurrency: int = 1, batch: dict | None = None) -> dict:
        """The prompts streamed at once; their summary against ``alone`` (:meth:`serial`'s answers to them)."""

        def streamed(prompt: str):
            t0, first = time.perf_counter(), []

            def chunks():
                for ch in self.client.chat.completions.create(
                        messages=[{"role": "user", "content": prompt}], stream=True,
                        stream_options={"include_usage": True}, **self.request):
                    if not first and any(c.delta.content or c.delta.tool_calls for c in ch.choices):
                        first.append(time.perf_counter() - t0)
                    yield ch
            content, calls, finish, usage = collect_stream(chunks())
            answer = (content, [(c["name"], c["arguments"]) for c in calls], finish)
            return answer, usage.completion_tokens, time.perf_counter() - t0, first[0] if first else None

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(todo)) as pool:
            together = list(pool.map(streamed, todo))
        wall = time.perf_counter() - t0
        return summarize(self.registry, self.model, self.max_tokens, concurrency, batch or {}, together, alone, wall)


def summarize(registry, model, max_tokens, concurrency, batch, together, alone, wall) -> dict:
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
    return {"clients": len(together), "model": model, "max_tokens": max_tokens,
            "concurrency": batch.get("max_batch", concurrency), "answered": len(together), "valid": valid,
            "equal_to_serial": sum(t[0] == a[0] for t, a in zip(together, alone)),
            "calls": sum(len(t[0][1]) for t in together), "wall_s": round(wall, 2),
            "requests_per_s": round(len(together) / wall, 3), "completion_tokens_per_s": round(tokens / wall, 1),
            "latency_p50_s": round(statistics.median(latencies), 2),
            "latency_p95_s": round(latencies[math.ceil(0.95 * len(latencies)) - 1], 2),  # nearest rank
            "first_chunk_p50_s": round(statistics.median(firsts), 2) if firsts else None,
            "serial_tokens_per_s": round(sum(a[1] for a in alone) / sum(a[2] for a in alone), 1)}


if __name__ == "__main__":
    raise SystemExit(main())
