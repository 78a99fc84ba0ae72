"""Count the recorded irrelevance answers that only restate a call as JSON, and how many of those calls take a value
from the conversation (docs/benchmarks.md "Fenced calls under auto, counted again").

Each row of a ``python -m agent bfcl`` TSV holds the turn's decoded text. For each irrelevance question (right = no
call) whose answer only restates a call of one of its tools (``agent.engine.restates``: a ```` ```json ```` fence,
how Qwen2.5-Coder writes a call outside its layout), this asks whether that call holds arguments and takes a value
from the conversation (``agent.grounding.takes_from_conversation``) — the turns a rule "a fenced call that takes
from the conversation is a call" would make wrong.

Usage: ``python scripts/count_fenced_calls.py OUT.tsv [OUT.tsv …]`` (a question in several files: the first row).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.engine import answer_json, restates  # noqa: E402
from agent.grounding import Grounding, conversation_text, takes_from_conversation  # noqa: E402
from bench.bfcl import bfcl_turn, is_irrelevance, load_questions  # noqa: E402
from compare_bfcl_runs import category as category_of  # noqa: E402 (this folder)


def main(paths: list[str]) -> int:
    seen: set[str] = set()
    rows: dict[str, dict] = {}
    counts: dict[str, list[int]] = {}  # category -> [answers, restating a call, of which taking from the conversation]
    for path in paths:
        for line in open(path):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4 or parts[2] not in ("0", "1") or parts[0] in seen:
                continue
            category = category_of(parts[0])
            if not is_irrelevance(category):
                continue
            seen.add(parts[0])
            if category not in rows:
                rows[category] = {r["id"]: r for r in load_questions(category)}
            turn = bfcl_turn(rows[category][parts[0]], category)
            count = counts.setdefault(category, [0, 0, 0])
            count[0] += 1
            text = json.loads(parts[3])
            if not isinstance(text, str) or not restates(text, turn.tools, turn.messages):
                continue
            count[1] += 1
            _, value = answer_json(text)
            first = value[0] if isinstance(value, list) else value
            args = first.get("arguments") if isinstance(first.get("arguments"), dict) else {}
            call = {"name": first.get("name"), "arguments": args}
            if args and takes_from_conversation(call, Grounding(conversation_text(turn.messages))):
                count[2] += 1
    for category, (n, restating, taking) in counts.items():
        print(f"{category}: answers {n}, restating a call {restating}, of which taking from the conversation {taking}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
