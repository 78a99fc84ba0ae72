"""The tools each BFCL question's request names (``agent.grounding.named_tools``), per question, where several
calls are asked for and two or more tools are offered: the only turns the rule of "Tools the user names"
(docs/benchmarks.md) can change. The rule reads only the question, so two versions of it decode the same text
wherever they name the same tools; ``--compare-without-negations`` prints the questions whose named tools the
negation guard (``agent.grounding.affirmed_text``) changes.

Usage::

    python scripts/named_tools_questions.py --split dev
    python scripts/named_tools_questions.py --split test --compare-without-negations
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.grounding import Grounding, last_user_text, named_tools  # noqa: E402
from bench.bfcl import CATEGORIES, bfcl_turn, load_questions  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("dev", "test"), required=True)
    ap.add_argument("--compare-without-negations", action="store_true",
                    help="print only the questions whose named tools the negation guard changes")
    args = ap.parse_args()
    for category in CATEGORIES:
        rows = load_questions(category, None, None, args.split)
        n = changed = 0
        for row in rows:
            turn = bfcl_turn(row, category)
            if turn.parallel is not True or len(turn.tools) < 2:
                continue
            n += 1
            request = Grounding(last_user_text(turn.messages))
            named = named_tools(turn.tools, request)
            if args.compare_without_negations:
                plain = named_tools(turn.tools, request, declined=True)
                if plain != named:
                    changed += 1
                    print(f"{row['id']}\t{plain} -> {named}")
            else:
                print(f"{row['id']}\t{', '.join(named)}")
        if n:
            print(f"# {category}: {n} questions" + (f", {changed} changed by the negation guard"
                                                   if args.compare_without_negations else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
