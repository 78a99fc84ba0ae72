"""Time every ``llama_decode`` of the batching server under ``bench.serve_load``: where a batched step's time goes.

Usage: ``python scripts/trace_batch_decode.py OUT.jsonl [bench.serve_load arguments …]``. Wraps
``decoding.llamacpp.SequenceBatchContext.decode`` and writes one JSON line per decode (``t`` start, ``ms``,
``parts`` sequences, ``tokens`` fed, ``rows`` with logits, ``maxpos`` the longest sequence's KV positions, ``lens`` the tokens of each sequence in seq_id order, ``ubatches``
the micro-batches llama.cpp's ``split_equal(sequential=true)`` makes of them: :func:`micro_batches`), then prints, for the concurrent phase (from the first decode of more than one sequence), the decodes, their seconds and
milliseconds per token fed (docs/benchmarks.md, "Server under load on the Intel Xeon").
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
    first = next((i for i, r in enumerate(records) if r["parts"] > 1), None)
    if first is None:
        print("no decode of more than one sequence")
        return rc
    phase = records[first:]
    per_token = [r["ms"] / r["tokens"] for r in phase]
    print(f"concurrent phase: {len(phase)} decodes over {phase[-1]['t'] - phase[0]['t']:.1f} s, "
          f"{sum(r['ms'] for r in phase) / 1e3:.1f} s in llama_decode, {sum(r['tokens'] for r in phase)} tokens fed, "
          f"ms per token fed: median {statistics.median(per_token):.1f} (min {min(per_token):.1f}, "
          f"max {max(per_token):.1f})")
    runs = [micro_batches(r["lens"]) for r in phase]
    extra = [r for r, n in zip(phase, runs) if n > 1]
    print(f"micro-batches per decode: {sum(runs)} in {len(phase)} decodes; {len(extra)} decodes of more than one "
          f"({sum(r['ms'] for r in extra) / 1e3:.1f} s)")
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
