"""Which recorded BFCL outputs hold a long list: the check behind the bfcl command's item cap (``--max-items``).

A grammar-only cap of N items changes a greedy decode only where one of its lists reaches N items (below that the
grammar allows exactly what it allowed before), so the recorded outputs whose lists stay shorter are the outputs the
cap leaves as they were. For each ``bench/results/bfcl`` TSV (``ID<TAB>VALID<TAB>CORRECT<TAB>OUTPUT``), prints the
questions whose output holds a list of at least ``--min-items`` items: of a whole call, the longest list in its
arguments; of a call the budget cut, the commas after its last opening ``[`` (an upper bound on its items).

    python scripts/long_lists.py bench/results/bfcl/*.tsv [--min-items 16]

Used in docs/benchmarks.md, "Lists capped at 32 items in the bfcl command".
"""
from __future__ import annotations

import argparse
import json
import re


def longest_list(value) -> int:
    """Items of the longest list anywhere in a JSON value (0: none)."""
    if isinstance(value, list):
        return max([len(value)] + [longest_list(v) for v in value])
    if isinstance(value, dict):
        return max([0] + [longest_list(v) for v in value.values()])
    return 0


def output_lists(text: str) -> tuple[int, bool]:
    """(longest list, whether a call was cut) of one turn's text: each call object parsed where whole."""
    best, cut = 0, False
    for m in re.finditer(r'\{"name".*?(?=\n</tool_call>|$)', text, re.S):
        try:
            best = max(best, longest_list(json.loads(m.group(0))))
        except json.JSONDecodeError:
            cut = True
            open_list = m.group(0).rfind("[")
            best = max(best, m.group(0)[open_list:].count(",") + 1 if open_list >= 0 else 0)
    return best, cut


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--min-items", type=int, default=16)
    args = ap.parse_args(argv)
    for path in args.files:
        found = []
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 4:
                    continue
                text = json.loads(parts[3])
                if not isinstance(text, str):
                    continue
                n, cut = output_lists(text)
                if n >= args.min_items:
                    found.append(f"{parts[0]} ({n} items{', cut' if cut else ''})")
        print(f"{path}: {', '.join(found) if found else 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
