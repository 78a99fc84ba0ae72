"""The BFCL questions where the named-optional rule applies, as a data folder the bfcl command reads.

``agent.grounding.named_optional`` makes an optional parameter whose name the user's last message writes required
in the turn's grammar. It reads only the question (the user's message and the tools), so the questions where it
can change an output are known before decoding; this writes them, per category, into ``OUT`` as
``BFCL_v4_<category>.first_half.jsonl`` holding those rows twice (so that ``--split dev`` of the bfcl command
reads exactly them), and prints how many there are (docs/benchmarks.md "Parameters the user names").

Usage::

    python scripts/named_optional_questions.py --split dev OUT
    python scripts/named_optional_questions.py --split test --limits reported OUT   # the reported test questions
    python -m agent bfcl --model qwen2.5-coder-0.5b --backend llamacpp --threads 1 --split dev --data-dir OUT \\
        --category <the categories printed>
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.grounding import Grounding, last_user_text, named_optional  # noqa: E402
from bench.bfcl import CATEGORIES, bfcl_turn, load_questions  # noqa: E402

# the first n of each category's test half that docs/benchmarks.md reports (issue "Tool-call quality")
REPORTED = dict(simple_python=100, simple_java=25, simple_javascript=13, multiple=50, parallel=50,
                parallel_multiple=50, irrelevance=30, live_simple=30, live_multiple=30, live_parallel=4,
                live_parallel_multiple=6, live_irrelevance=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--split", choices=("dev", "test"), required=True)
    ap.add_argument("--limits", choices=("all", "reported"), default="all",
                    help="every question of the split, or the first n the docs report per category")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    found = []
    for category in CATEGORIES:
        limit = REPORTED[category] if args.limits == "reported" else None
        rows = load_questions(category, None, limit, args.split)
        hit = []
        for row in rows:
            turn = bfcl_turn(row, category)
            request = Grounding(last_user_text(turn.messages))
            if any(named_optional(t.parameters, request) for t in turn.tools):
                hit.append(row)
        print(f"{category}\t{len(rows)} questions\t{len(hit)} where a parameter is named")
        if hit:
            found.append(category)
            with open(args.out / f"BFCL_v4_{category}.first_half.jsonl", "w") as f:
                for row in hit + hit:
                    f.write(json.dumps(row) + "\n")
    print("categories: " + ",".join(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
