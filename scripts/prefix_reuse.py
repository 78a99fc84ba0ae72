"""Warm prefix cache against a cold one, end to end: the demo's tools, a few questions run as whole agent runs
(a required call turn, tool results, an answer turn) one after another on one agent ("warm"), then each again from
an empty cache ("cold": its answer turn still reuses its call turn's prompt), then with every turn from an empty cache.
Prints, per question, the prompt tokens decoded and reused over its turns and whether its transcript (less call ids)
and token counts equal the ones with no cache (docs/benchmarks.md, "A reused prefix decodes as a fresh prefill").

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/prefix_reuse.py --model smollm2 --threads 1
"""
from __future__ import annotations

import argparse
import json
import time

QUESTIONS = ["What's the weather in Paris?", "What is 12 times 7?", "Convert 3 miles to kilometers.",
             "Is it colder in London or in Tokyo right now?", "What is (1234 + 4321) / 5?",
             "How many feet are in 250 meters?"]


def transcript(result) -> str:
    """The run's messages less the call ids (fresh per run), and the tokens decoded: a turn decoded again
    (``agent.grounding``) leaves its first decode out of the messages, not out of the counts."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("id", "tool_call_id")}
        return [strip(v) for v in x] if isinstance(x, list) else x
    return json.dumps([strip(result.messages), result.stats.prompt_tokens, result.stats.new_tokens], default=str)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafter", default="auto")
    args = ap.parse_args()

    from agent import Agent
    from agent.demo_tools import TOOLS

    agent = Agent(args.model, TOOLS, backend="llamacpp", threads=args.threads, drafter=args.drafter, max_steps=3,
                  max_string_length=48, max_decimals=6)
    lm = agent.engine.generator.loaded.new_lm()  # this thread's context: its two prefix-cache slots

    def run(q):
        t = time.perf_counter()
        r = agent.run(q, tool_choice="required", max_new_tokens=64)  # a call turn, then an answer turn
        return r, time.perf_counter() - t

    warm = [run(q) for q in QUESTIONS]
    cold = []
    for q in QUESTIONS:
        lm.reset()
        cold.append(run(q))
    from decoding.llamacpp import LlamaCppLM

    reuse = LlamaCppLM.reuse_prefix

    def no_cache(self, prompt, hidden=False):  # every turn prefilled from an empty cache
        self.reset()
        return reuse(self, prompt, hidden)

    LlamaCppLM.reuse_prefix = no_cache
    none = [run(q) for q in QUESTIONS]
    print(f"{args.model}, {args.threads} thread(s), drafter {args.drafter}; transcripts (less call ids) and token "
          f"counts against every turn from an empty cache")
    print("question | prompt tokens | reused warm | warm s | cold s | no-cache s | warm equal | cold equal")
    same = [0, 0]
    for q, (w, ws), (c, cs), (n, ns) in zip(QUESTIONS, warm, cold, none):
        eq = transcript(w) == transcript(n), transcript(c) == transcript(n)
        same = [a + b for a, b in zip(same, eq)]
        print(f"{q[:40]:40s} | {w.stats.prompt_tokens:5d} | {w.stats.prompt_tokens_cached:5d} | {ws:6.2f} | "
              f"{cs:6.2f} | {ns:6.2f} | {eq[0]} | {eq[1]}")
    print(f"equal to no cache: warm {same[0]}/{len(QUESTIONS)}, cold {same[1]}/{len(QUESTIONS)}")


if __name__ == "__main__":
    main()
