"""What a batched decode costs by the seq_ids of its sequences: ``python scripts/seq_id_layout.py [--threads N]``.

The minimal experiment behind the batch scheduler's ``_compact`` (docs/benchmarks.md, "Server under load":
"Scattered seq_ids"). One ``decoding.llamacpp.SequenceBatchContext`` of 32 sequences, each prefilled with the same
560 tokens; then the median of 5 decodes (cropped back after each) of: one row alone; one row of each of 8 sequences
on seq_ids 0-7, on 0, 4, …, 28, and on 0-7 handed over in decreasing order (the batch is laid out by seq_id since
2026-12-05, so this equals 0-7); one row of each of 32 sequences; and 32 sequences where 8 feed 3 tokens, scattered
or on consecutive seq_ids. llama.cpp's ``split_equal`` (non-unified KV cache) puts only consecutive seq_ids in one
micro-batch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.batch_rowcost import prefilled  # noqa: E402

PROMPT = 560


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    timed_parts = prefilled(args.model, threads=args.threads, sequences=32, prompt_tokens=PROMPT)

    def timed(parts) -> float:  # (seq_id, rows) pairs
        return timed_parts([(s, [0] * n, list(range(n))) for s, n in parts], 5)

    cases = {
        "one row alone": [(0, 1)],
        "8 sequences x 1 row, seq_ids 0-7": [(s, 1) for s in range(8)],
        "8 sequences x 1 row, seq_ids 0, 4, ..., 28": [(s, 1) for s in range(0, 32, 4)],
        "8 sequences x 1 row, seq_ids 7, 6, ..., 0 (in that order)": [(s, 1) for s in reversed(range(8))],
        "32 sequences x 1 row": [(s, 1) for s in range(32)],
        "32 sequences, 8 of them x 3 rows on seq_ids 0, 4, ..., 28": [(s, 3 if s % 4 == 0 else 1) for s in range(32)],
        "32 sequences, 8 of them x 3 rows on seq_ids 24-31": [(s, 3 if s >= 24 else 1) for s in range(32)],
    }
    print(f"{args.model}, {args.threads} thread(s), 32 sequences of {PROMPT} cached positions")
    print("| decode | ms (median of 5) |\n|---|---:|")
    for name, parts in cases.items():
        print(f"| {name} | {timed(parts):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
