"""Of several calls in one turn, drop those that invent every value: a rule tried and not adopted (2026-12-04).

The rule (:func:`invents_every_value`): from a turn of several calls, drop each call that takes nothing from the
conversation (``agent.grounding.takes_from_conversation`` is False) and holds a string or number the conversation
does not write at all and its tool does not offer as an ``enum`` / ``const`` (:func:`schema_choices`), where
another call of the turn takes from the conversation. It acts on decoded calls only (the decode is the same with
it or without it), so the verdicts of a recording, re-scored with it, are what the bfcl command would give with
it. Reads the output lines of ``python -m agent bfcl`` (``ID<TAB>VALID<TAB>CORRECT<TAB>OUTPUT``) for the
several-call categories, scores each turn's calls with and without the rule (the optional-argument rule applied
to both, as the engine does; BFCL's official checker where installed) and prints the turns it changes and a
table. Not in the engine: it drops calls asked for whose values the model derives (docs/benchmarks.md, "Of
several calls, the invented one dropped").

Usage::

    python scripts/invented_calls.py bench/results/bfcl/qwen2.5-coder-0.5b-dev-close-at-end-first.tsv --split dev
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CATEGORIES = ("parallel", "parallel_multiple", "live_parallel", "live_parallel_multiple")


def schema_choices(schema: Any) -> list:
    """The strings and numbers a JSON Schema offers as choices: every ``enum`` member and ``const`` of every
    subschema (``schemas.check.walk``)."""
    from agent.grounding import is_text_or_number
    from schemas.check import walk

    found: list = []
    for _, node in walk(schema):
        enum = node.get("enum")
        members = (enum if isinstance(enum, list) else []) + ([node["const"]] if "const" in node else [])
        found += [v for v in members if is_text_or_number(v)]
    return found


def invents_every_value(call: dict, grounding, choices: Iterable = ()) -> bool:
    """Whether ``call`` takes nothing from the conversation and holds a string or number the conversation does not
    write at all (``value not in grounding``) and that is not one of ``choices``."""
    from agent.grounding import is_text_or_number, leaf_values, takes_from_conversation

    offered = list(choices)
    values = [v for v in leaf_values(call.get("arguments")) if is_text_or_number(v)]
    return not takes_from_conversation(call, grounding) and any(
        v not in grounding and not any(isinstance(v, str) == isinstance(c, str) and v == c for c in offered)
        for v in values)


def main() -> None:
    from agent.formats.hermes import HermesFormat
    from agent.grounding import Grounding, conversation_text, without_unwritten_optional
    from bench.bfcl import bfcl_turn, load_questions

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outputs", nargs="+", help="bfcl command output files")
    ap.add_argument("--split", choices=("dev", "test"), required=True)
    args = ap.parse_args()
    rows = {r["id"]: (r, c) for c in CATEGORIES for r in load_questions(c, None, None, args.split)}
    fmt = HermesFormat(None)
    totals: dict[str, list[int]] = {}
    seen: set[str] = set()
    for path in args.outputs:
        for line in open(path):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 4 or parts[0] not in rows or parts[0] in seen:
                continue
            seen.add(parts[0])
            row, category = rows[parts[0]]
            turn = bfcl_turn(row, category)
            grounding = Grounding(conversation_text(turn.messages))
            calls = [c for c, _ in fmt.complete_calls(json.loads(parts[3]))]
            offered = {t.name: schema_choices(t.parameters) for t in turn.tools}
            taking = [c for c in calls if not invents_every_value(c, grounding, offered.get(c.get("name"), ()))] \
                if len(calls) > 1 else calls
            kept = taking or calls
            valid = parts[1] == "1"  # a turn cut by the budget or invalid stays wrong

            def verdict(cs):
                return valid and turn.check([without_unwritten_optional(c, turn.tools, grounding) for c in cs])
            before, after = verdict(calls), verdict(kept)
            t = totals.setdefault(category, [0, 0, 0])
            t[0] += 1
            t[1] += before
            t[2] += after
            if kept != calls:
                dropped = [c for c in calls if c not in kept]
                print(f"{parts[0]}: {int(before)} -> {int(after)}, dropped {json.dumps(dropped, ensure_ascii=False)}")
    print(f"\n| category ({args.split}) | n | calls as decoded | invented calls dropped |\n|---|---:|---:|---:|")
    for category, (n, before, after) in totals.items():
        print(f"| {category} | {n} | {before} | {after} |")


if __name__ == "__main__":
    main()
