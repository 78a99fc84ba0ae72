"""How the default model answers BFCL questions under ``tool_choice="auto"`` (a diagnostic; dev split only).

``probe``: runs the first ``--limit`` dev questions of each category through :class:`agent.Agent` with
``tool_choice="auto"`` (one turn) and counts the turns that returned a call, a Markdown-fenced text (```` ``` ````,
the model's own call layout, which the hermes format and vLLM's parser read as text) or other text.

``fence-as-call``: on the output lines of a ``python -m agent bfcl`` run of the irrelevance categories (which run
under ``"auto"``), what taking a fenced call as a call would do: each fenced text is parsed as a call object and
judged by the tool-choice rule of ``agent.grounding`` (a call that takes nothing from the conversation is decoded
again, so it would not stay a call); a fence cut by the budget is counted apart.

    python scripts/auto_tool_choice.py probe --category simple_python,multiple,live_simple,live_multiple --limit 20
    python scripts/auto_tool_choice.py fence-as-call bench/results/bfcl/qwen2.5-coder-0.5b-dev-string-numbers-b.tsv

Used in docs/benchmarks.md, "The default model under tool_choice auto".
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent import Agent  # noqa: E402
from agent.grounding import Grounding, conversation_text, takes_from_conversation  # noqa: E402
from bench.bfcl import bfcl_turn, load_questions  # noqa: E402


def probe(categories: list[str], limit: int, model: str, threads: int | None) -> None:
    counts = collections.Counter()
    first = None
    for category in categories:
        for row in load_questions(category, None, limit, "dev"):
            turn = bfcl_turn(row, category)
            agent = Agent(model, turn.tools, threads=threads) if first is None else Agent(first.engine, tools=turn.tools)
            first = first or agent
            res = agent.run(turn.messages, tool_choice="auto", max_steps=1, max_new_tokens=128)
            text = res.raw_turns[-1] if res.raw_turns else ""
            kind = "call" if res.pending_calls else "fenced text" if text.lstrip().startswith("```") else "text"
            counts[category, kind] += 1
    for category in categories:
        print(json.dumps({"category": category, "split": "dev",
                          **{k: counts[category, k] for k in ("call", "fenced text", "text")}}))


def fence_as_call(tsv: Path) -> None:
    outputs = {}
    for line in tsv.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 4 and "irrelevance" in parts[0] and parts[1] in "01":
            outputs[parts[0]] = json.loads(parts[3])
    counts = collections.Counter()
    for category in ("irrelevance", "live_irrelevance"):
        for row in load_questions(category, None, None, "dev"):
            if row["id"] not in outputs:
                continue
            text = outputs[row["id"]].lstrip()
            kind = "text (no call either way)"
            if text.startswith("```"):
                m = re.match(r"```[^\n]*\n(\{.*\})\s*(```)?\s*$", text, re.S)
                try:
                    obj = json.loads(m.group(1)) if m else None
                except json.JSONDecodeError:
                    obj = None
                if not isinstance(obj, dict) or "name" not in obj:
                    kind = "fence cut or not a call object"
                else:
                    turn = bfcl_turn(row, category)
                    grounding = Grounding(conversation_text(turn.messages))
                    call = {"name": obj["name"], "arguments": obj.get("arguments")}
                    kind = ("a call (takes from the conversation: wrong)" if takes_from_conversation(call, grounding)
                            else "decoded again (takes nothing from the conversation)")
            counts[category, kind] += 1
    for (category, kind), n in sorted(counts.items()):
        print(f"{category}\t{kind}\t{n}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("probe")
    a.add_argument("--category", default="simple_python,multiple,live_simple,live_multiple")
    a.add_argument("--limit", type=int, default=20)
    a.add_argument("--model", default="qwen2.5-coder-0.5b")
    a.add_argument("--threads", type=int, default=None)
    b = sub.add_parser("fence-as-call")
    b.add_argument("tsv", type=Path)
    args = p.parse_args()
    if args.cmd == "probe":
        probe(args.category.split(","), args.limit, args.model, args.threads)
    else:
        fence_as_call(args.tsv)
