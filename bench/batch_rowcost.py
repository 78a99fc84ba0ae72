"""What a row costs when many sequences share one ``llama_decode``: ``python -m bench.batch_rowcost``.

The minimal experiment behind continuous batching's ceiling (docs/benchmarks.md, "Server under load"): one
``decoding.llamacpp.SequenceBatchContext`` of ``--sequences`` sequences (each its own KV stream, as the server's
batch scheduler makes it), every sequence prefilled with the same ``--prompt-tokens`` tokens; then, median of
``--repeat`` decodes each (cropped back after each):

* ``k`` rows of every sequence in one decode (k = 1, 2, 4: what a batched step of one-token or short speculative
  windows sends), and
* ``k`` rows of one sequence alone (k = 8, 32, 128: a one-sequence verify window, and as many rows as the batched
  decodes), and one row alone,

printing milliseconds per decode and per row, and each per-row cost as a share of one row alone. Batching can at
most turn the per-row cost of a one-sequence decode into the per-row cost of a full batch; where those are close,
batching the windows of many sequences cannot multiply throughput.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def prefilled(spec: str, *, threads: int, sequences: int, prompt_tokens: int):
    """``timed(parts, repeat)`` over a ``SequenceBatchContext`` of ``sequences`` sequences, each prefilled with the
    same ``prompt_tokens`` tokens: the median milliseconds of ``repeat`` decodes of ``parts`` (``(seq_id, tokens,
    rows)``; every sequence cropped back to the prompt after each decode)."""
    from decoding.llamacpp import SequenceBatchContext, load_llamacpp

    model = load_llamacpp(spec, n_threads=threads)
    ctx = SequenceBatchContext(model, sequences, prompt_tokens + 256, 512)
    prompt = [1000 + i % 5000 for i in range(prompt_tokens)]
    for s in range(sequences):
        for a in range(0, prompt_tokens, 256):
            ctx.decode([(s, prompt[a:a + 256], [])])

    def timed(parts, repeat: int) -> float:
        times = []
        for r in range(repeat):
            parts_r = [(s, [2000 + r] * len(t), rows) for s, t, rows in parts]
            t0 = time.perf_counter()
            ctx.decode(parts_r)
            times.append(time.perf_counter() - t0)
            for s, _, _ in parts:
                ctx.crop(s, prompt_tokens)
        return statistics.median(times) * 1000

    return timed


def measure(spec: str, *, threads: int, sequences: int = 32, prompt_tokens: int = 600, repeat: int = 3) -> dict:
    timed_r = prefilled(spec, threads=threads, sequences=sequences, prompt_tokens=prompt_tokens)

    def timed(parts) -> float:
        return timed_r(parts, repeat)

    alone = timed([(0, [0], [0])])
    out = {"model": spec, "threads": threads, "sequences": sequences, "prompt_tokens": prompt_tokens,
           "ms_one_row_alone": round(alone, 1), "batched": [], "one_sequence": []}
    for k in (1, 2, 4):
        ms = timed([(s, [0] * k, list(range(k))) for s in range(sequences)])
        out["batched"].append({"rows_per_sequence": k, "rows": k * sequences, "ms": round(ms, 1),
                               "ms_per_row": round(ms / (k * sequences), 2),
                               "share_of_one_row": round(ms / (k * sequences) / alone, 3)})
    for k in (8, 32, 128):
        ms = timed([(0, [0] * k, list(range(k)))])
        out["one_sequence"].append({"rows": k, "ms": round(ms, 1), "ms_per_row": round(ms / k, 2),
                                    "share_of_one_row": round(ms / k / alone, 3)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batch_rowcost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=None,
                    help="llama.cpp threads (default: the cores this process may use)")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    from decoding.llamacpp import default_threads

    r = measure(args.model, threads=args.threads or default_threads(), sequences=args.sequences,
                prompt_tokens=args.prompt_tokens, repeat=args.repeat)
    print(f"{r['model']}, {r['threads']} thread(s), {r['sequences']} sequences of {r['prompt_tokens']} cached "
          f"positions; one row alone {r['ms_one_row_alone']} ms")
    print("| decode | rows | ms | ms per row | per row / one row alone |\n|---|---:|---:|---:|---:|")
    for b in r["batched"]:
        print(f"| {b['rows_per_sequence']} row(s) of each of {r['sequences']} sequences | {b['rows']} | {b['ms']} | "
              f"{b['ms_per_row']} | {b['share_of_one_row']} |")
    for b in r["one_sequence"]:
        print(f"| one sequence | {b['rows']} | {b['ms']} | {b['ms_per_row']} | {b['share_of_one_row']} |")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
