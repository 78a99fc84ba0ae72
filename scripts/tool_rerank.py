"""Would scoring a whole call per tool pick the right tool more often than greedy decoding? (docs/benchmarks.md,
"Tools ranked by the likelihood of their call"; dev split only.)

For each question with two or more tools: the call decoded with the tool forced (``tool_choice`` naming it), for
every tool, and its log-likelihood under the model without a grammar (the prompt as ``Agent.run`` renders it, then
the turn's raw text). Writes one JSON line per question: the greedy call (``tool_choice="required"``), each tool's
forced call, its token count, summed and mean log-probability, and each call's verdict by the official checker.

Usage: ``python scripts/tool_rerank.py --category multiple --split dev --limit 50 > rerank.jsonl``, then
``python scripts/tool_rerank.py --summarize rerank.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def summarize(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    rules = {
        "greedy (as built)": lambda r: r["greedy"],
        "sum log p": lambda r: max(r["forced"], key=lambda f: f["sum"]),
        "mean log p": lambda r: max(r["forced"], key=lambda f: f["mean"]),
        "name log p": lambda r: max(r["forced"], key=lambda f: f["name"]),
    }
    print(f"{len(rows)} questions with two or more tools")
    for label, rule in rules.items():
        right = sum(bool(rule(r)["correct"]) for r in rows)
        print(f"{label:20s} {right:3d} right")
    oracle = sum(any(f["correct"] for f in r["forced"]) or r["greedy"]["correct"] for r in rows)
    print(f"{'any tool (oracle)':20s} {oracle:3d} right")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--category", default="multiple")
    p.add_argument("--split", default="dev", choices=["dev"])  # tuning data only
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--summarize")
    a = p.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return

    import llama_cpp
    import numpy as np

    from agent import Agent
    from agent.engine import EngineConfig, LocalEngine
    from bench.bfcl import MAX_ITEMS, MAX_STRING_LENGTH, bfcl_turn, load_questions

    engine = LocalEngine("qwen2.5-coder-0.5b", backend="llamacpp", threads=1)
    config = EngineConfig(max_string_length=MAX_STRING_LENGTH, max_items=MAX_ITEMS)
    path = engine.generator.loaded.path
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=4096, n_threads=1, n_batch=512, logits_all=True,
                          verbose=False)
    tok = engine.tokenizer

    def logprobs(prompt: list[int], cont: list[int]) -> np.ndarray:
        n = len(prompt)
        if llm.n_tokens < n or list(llm._input_ids[:n]) != prompt:
            llm.reset()
            llm._ctx.kv_cache_seq_rm(-1, 0, -1)
            llm.eval(prompt)
        else:
            llm.n_tokens = n
            llm._ctx.kv_cache_seq_rm(-1, n, -1)
        llm.eval(cont)
        scores = np.asarray(llm.scores[n - 1:n - 1 + len(cont)], dtype=np.float64)
        lse = np.log(np.exp(scores - scores.max(1, keepdims=True)).sum(1)) + scores.max(1)
        return scores[np.arange(len(cont)), cont] - lse

    for row in load_questions(a.category, limit=a.limit, split=a.split):
        if len(row["function"]) < 2:
            continue
        turn = bfcl_turn(row, a.category)
        agent = Agent(engine, turn.tools, config=config, strict=False)
        prompt = agent.format.render(turn.messages, turn.tools)

        def decode(choice):
            res = agent.run(turn.messages, tool_choice=choice, max_steps=1, parallel_tool_calls=False)
            text = res.raw_turns[-1] if res.raw_turns else ""
            calls = [{"name": c.name, "arguments": c.arguments} for c in res.pending_calls or []]
            _, correct = turn.judge(text, res.truncated, agent.registry, agent.format, calls or None)
            return text, calls, correct

        text, calls, correct = decode("required")
        out = {"id": row["id"], "greedy": {"text": text, "correct": correct,
                                           "name": calls[0]["name"] if calls else None}, "forced": []}
        for fn in row["function"]:
            text, calls, correct = decode({"type": "function", "function": {"name": fn["name"]}})
            cont = tok.encode(text, add_special_tokens=False)
            lp = logprobs(prompt, cont)
            # the name's tokens: up to and including the first token whose decoded prefix holds the whole name
            k = next((i + 1 for i in range(len(cont)) if fn["name"] in tok.decode(cont[:i + 1])), len(cont))
            out["forced"].append({"tool": fn["name"], "text": text, "correct": correct, "tokens": len(cont),
                                  "sum": float(lp.sum()), "mean": float(lp.mean()), "name": float(lp[:k].sum())})
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
