"""Of several calls in one turn, drop those that invent every value: the rule scored on recorded bfcl outputs.

``LocalEngine.turn`` drops, from a turn of several calls, each call that takes nothing from the conversation and
holds a value the conversation does not write nor its tool offers as an ``enum`` / ``const``
(``agent.grounding.invents_every_value``), where another call takes from it. The rule acts on decoded calls only (the decode is the same with it or without it), so the verdicts of a
recording made without it, re-scored with it, are what the bfcl command gives with it. Reads the output lines of
``python -m agent bfcl`` (``ID<TAB>VALID<TAB>CORRECT<TAB>OUTPUT``) for the several-call categories, scores each
turn's calls with and without the rule (the optional-argument rule applied to both, as the engine does; BFCL's
official checker where installed) and prints the turns it changes and a table.

Usage::

    python scripts/invented_calls.py bench/results/bfcl/qwen2.5-coder-0.5b-dev-close-at-end-first.tsv --split dev
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CATEGORIES = ("parallel", "parallel_multiple", "live_parallel", "live_parallel_multiple")


def main() -> None:
    from agent.formats.hermes import HermesFormat
    from agent.grounding import (Grounding, conversation_text, invents_every_value, schema_choices,
                                 without_unwritten_optional)
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
