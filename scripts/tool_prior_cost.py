"""What the tool prior costs per turn (docs/benchmarks.md, "The tool against the model's prior"; dev split only).

Decodes the first ``--limit`` dev questions of a category with ``LocalEngine.turn`` (tool prior on) and prints, per
turn, each scoring call of ``Generator.continuation_logprobs`` (prompt tokens, continuations asked, continuations
scored, seconds), the turn's wall time and the time spent in ``LocalEngine._prior_pick``.

Usage: ``python scripts/tool_prior_cost.py --category live_multiple --limit 8``
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--category", default="live_multiple")
    p.add_argument("--split", default="dev", choices=["dev"])  # never the test split: this informs choices
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    from agent.engine import EngineConfig, LocalEngine
    from bench.bfcl import bfcl_turn, load_questions

    engine = LocalEngine(args.model, backend="llamacpp", threads=args.threads)
    pick, score = engine._prior_pick, engine.generator.continuation_logprobs
    spent = [0.0]

    def timed_pick(*a, **k):
        t0 = time.perf_counter()
        try:
            return pick(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0

    def timed_score(prompt, conts, **kwargs):
        t0 = time.perf_counter()
        out = score(prompt, conts, **kwargs)
        print(f"  scoring: {len(prompt)} prompt tokens, {len(conts)} names, "
              f"{sum(v != float('-inf') for v in out)} scored, {time.perf_counter() - t0:.2f} s", flush=True)
        return out
    engine._prior_pick, engine.generator.continuation_logprobs = timed_pick, timed_score
    for row in load_questions(args.category, split=args.split, limit=args.limit):
        turn = bfcl_turn(row, args.category)
        spent[0], t0 = 0.0, time.perf_counter()
        engine.turn(turn.messages, turn.tools, turn.tool_choice, parallel_tool_calls=turn.parallel,
                    config=EngineConfig(max_new_tokens=256))
        print(f"{row['id']}: {len(turn.tools)} tools, turn {time.perf_counter() - t0:.2f} s, "
              f"prior {spent[0]:.2f} s", flush=True)


if __name__ == "__main__":
    main()
