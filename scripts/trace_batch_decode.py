"""Time every ``llama_decode`` of the batching server under ``bench.serve_load``: where a batched step's time goes.

Usage: ``python scripts/trace_batch_decode.py OUT.jsonl [bench.serve_load arguments …]``. Wraps
``decoding.llamacpp.SequenceBatchContext.decode`` and writes one JSON line per decode (``t`` start, ``ms``,
``parts`` sequences, ``tokens`` fed, ``rows`` with logits, ``maxpos`` the longest sequence's KV positions, ``lens``
each sequence's ``(seq_id, tokens)`` in seq_id order), then prints the concurrent phase's summary (:func:`summary`:
from the first decode of more than one sequence; its decodes by the micro-batches llama.cpp makes of them,
:func:`micro_batches`, and by sequence count; docs/benchmarks.md, "Server under load").
``python scripts/trace_batch_decode.py --summary OUT.jsonl`` prints that summary of a trace already written.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import serve_load  # noqa: E402
from decoding import llamacpp  # noqa: E402


def micro_batches(lens: list[tuple[int, int]], n_ubatch: int = 512) -> int:
    """How many graph runs ``llama_batch_allocr::split_equal(n_ubatch, sequential=true)`` makes of a batch whose
    sequences ``(seq_id, tokens)`` come in this order: each micro-batch starts at the first sequence with tokens
    left, takes the sequences after it while their seq_ids follow one another (and tokens are left), and as many
    tokens from each as the one with the fewest left (bounded by ``n_ubatch``)."""
    left = [[s, n] for s, n in lens]
    runs = 0
    while any(n for _, n in left):
        i = next(k for k, (_, n) in enumerate(left) if n)
        group = [i]
        while group[-1] + 1 < len(left) and left[group[-1] + 1][1] and \
                left[group[-1] + 1][0] == left[group[-1]][0] + 1 and len(group) < n_ubatch:
            group.append(group[-1] + 1)
        take = max(1, min(min(left[k][1] for k in group), n_ubatch // len(group)))
        for k in group:
            left[k][1] -= take
        runs += 1
    return runs


def main(argv: list[str]) -> int:
    if argv[:1] == ["--summary"]:
        print(summary([json.loads(line) for line in Path(argv[1]).read_text().splitlines()]))
        return 0
    out = Path(argv[0])
    records: list[dict] = []
    decode = llamacpp.SequenceBatchContext.decode

    def traced(self, parts, *args, **kwargs):
        t = time.perf_counter()
        result = decode(self, parts, *args, **kwargs)
        records.append({"t": t, "ms": (time.perf_counter() - t) * 1e3, "parts": len(parts),
                        "tokens": sum(len(p[1]) for p in parts), "rows": sum(len(p[2]) for p in parts),
                        "maxpos": max(len(self.tokens[p[0]]) for p in parts),
                        "lens": sorted((p[0], len(p[1])) for p in parts)})
        return result

    llamacpp.SequenceBatchContext.decode = traced
    rc = serve_load.main(argv[1:])
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(summary(records))
    return rc


def summary(records: list[dict]) -> str:
    """The concurrent phase of a trace (from its first decode of more than one sequence): decodes, seconds in
    ``llama_decode``, tokens fed, milliseconds per token fed and micro-batches, for all its decodes and by kind."""
    first = next((i for i, r in enumerate(records) if r["parts"] > 1), None)
    if first is None:
        return "no decode of more than one sequence"
    phase = records[first:]
    per_token = [r["ms"] / r["tokens"] for r in phase]
    lines = [f"concurrent phase: {len(phase)} decodes over {phase[-1]['t'] - phase[0]['t']:.1f} s, "
             f"ms per token fed: median {statistics.median(per_token):.1f} (min {min(per_token):.1f}, "
             f"max {max(per_token):.1f})",
             "| decodes | decodes | seconds | tokens fed | ms per token fed | micro-batches |",
             "|---|---:|---:|---:|---:|---:|"]
    runs = [micro_batches(r["lens"]) for r in phase]
    kinds = {"all": lambda r, n: True, "of one micro-batch": lambda r, n: n == 1,
             "of several": lambda r, n: n > 1, "of 16 sequences or more": lambda r, n: r["parts"] >= 16,
             "of fewer": lambda r, n: r["parts"] < 16}
    for name, keep in kinds.items():
        chosen = [(r, n) for r, n in zip(phase, runs) if keep(r, n)]
        ms, tokens = sum(r["ms"] for r, _ in chosen), sum(r["tokens"] for r, _ in chosen)
        lines.append(f"| {name} | {len(chosen)} | {ms / 1e3:.1f} | {tokens} | "
                     f"{ms / tokens if tokens else float('nan'):.1f} | {sum(n for _, n in chosen)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
