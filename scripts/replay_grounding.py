"""Replay the grounding rules that act on parsed calls over recorded BFCL outputs (docs/benchmarks.md, "Percents
and copied enum lists").

Each row of a ``python -m agent bfcl`` TSV holds the turn's decoded text. This parses its calls and applies both
the rule of before (optional arguments only: ``agent.grounding.without_unwritten_optional``) and the rules of now
(``agent.grounding.grounded_call``, as ``LocalEngine.turn`` applies them after its decodes), scores both with the
bfcl command's checker (BFCL's own where installed) and prints every question whose calls differ, with both
verdicts, then the counts. Rules that decide a decode (a retry, the end of a
several-call turn) are not replayed: a figure from here holds where those decide alike; the turns the rules
that decode again for numbers run on (``runs_numbers_together``, ``zeros_appended_prefixes``) would decode again
are listed (``again``, with the recorded verdict and the integer prefixes the grammar would take out).

Usage: ``python scripts/replay_grounding.py OUT.tsv [OUT.tsv …]`` (a question in several files: the first row).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.grounding import (Grounding, conversation_text, grounded_call,  # noqa: E402
                             run_together_prefixes, runs_numbers_together, without_unwritten_optional,
                             zeros_appended_prefixes)
from bench.bfcl import bfcl_turn, is_irrelevance, load_questions  # noqa: E402
from compare_bfcl_runs import category as category_of  # noqa: E402 (this folder: the same id → category rule)

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def calls_of(output: str) -> list[dict] | None:
    """The calls of a recorded output (a JSON string: the decoded text, bare call objects or ``<tool_call>``
    blocks), or None where it holds none."""
    value = json.loads(output)
    if isinstance(value, str):
        blocks = _BLOCK.findall(value)
        try:
            value = [json.loads(b) for b in blocks] if blocks else json.loads(value)
        except ValueError:
            return None
    if isinstance(value, dict):
        return [value]
    return [c for c in value if isinstance(c, dict)] if isinstance(value, list) else None


def recorded_turns(paths: list[str]):
    """``(qid, recorded verdict, BfclTurn, calls)`` for each question of the TSVs ``paths`` (a question in several
    files: its first row) whose recorded output holds calls, irrelevance questions left out."""
    rows: dict[str, dict] = {}
    seen: set[str] = set()
    for path in paths:
        for line in open(path):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4 or parts[2] not in ("0", "1") or parts[0] in seen:
                continue
            qid = parts[0]
            seen.add(qid)
            category = category_of(qid)
            if is_irrelevance(category):
                continue
            if category not in rows:
                rows[category] = {r["id"]: r for r in load_questions(category)}
            calls = calls_of(parts[3])
            if calls:
                yield qid, parts[2], bfcl_turn(rows[category][qid], category), calls


class Tally:
    """Counts the questions whose calls a rule changes, and prints each: its verdict before and after."""

    def __init__(self):
        self.won = self.lost = self.same = 0

    def add(self, qid: str, turn, before: list[dict], after: list[dict]) -> None:
        if after == before:
            return
        was, right = bool(turn.check(before)), bool(turn.check(after))
        self.won += right and not was
        self.lost += was and not right
        self.same += right == was
        print(f"{qid}\t{int(was)} -> {int(right)}\t{json.dumps([c.get('arguments') for c in after])[:300]}")

    @property
    def changed(self) -> int:
        return self.won + self.lost + self.same


def main(paths: list[str]) -> int:
    turns = again = 0
    tally = Tally()
    for qid, verdict, turn, calls in recorded_turns(paths):
        turns += 1
        text = conversation_text(turn.messages)
        grounding = Grounding(text)
        prefixes = zeros_appended_prefixes(calls, text) | (
            run_together_prefixes(text) if runs_numbers_together(calls, text) else frozenset())
        if prefixes:
            again += 1
            print(f"{qid}\t{verdict}\tagain\t{sorted(prefixes)}")
        before = [without_unwritten_optional(c, turn.tools, grounding) for c in calls]
        tally.add(qid, turn, before, [grounded_call(c, turn.tools, grounding) for c in calls])
    print(f"turns {turns}; the rules of now change the calls of {tally.changed}: won {tally.won}, lost "
          f"{tally.lost}; decoded again for numbers run on: {again}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
