"""Compare two sets of ``python -m agent bfcl`` outputs question by question.

Usage: ``python scripts/compare_bfcl_runs.py --before OLD.tsv [OLD.tsv …] --after NEW.tsv [NEW.tsv …]``.
Each TSV row is ``id, valid, correct, output`` (the bfcl command's stdout); a later file of ``--before`` overrides
an earlier one for the same question. Prints, per category of the ``--after`` questions: correct after / before,
how many outputs are the same string, and each question whose verdict changed (docs/benchmarks.md,
"Qwen2.5-Coder-0.5B runs as Q8_0 on llama.cpp").
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

ROW_ID = re.compile(r"^[a-z_]+_\d")


def read(paths: list[str]) -> dict[str, tuple[str, str]]:
    """``{question id: (correct "0"/"1", output)}`` from the bfcl command's TSV rows (summary lines skipped)."""
    out: dict[str, tuple[str, str]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4 and ROW_ID.match(parts[0]):
                    out[parts[0]] = (parts[2], parts[3])
    return out


def category(qid: str) -> str:
    return re.sub(r"_\d[\d-]*$", "", qid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", nargs="+", required=True)
    ap.add_argument("--after", nargs="+", required=True)
    args = ap.parse_args(argv)
    before, after = read(args.before), read(args.after)
    rows: dict[str, dict] = defaultdict(lambda: {"n": 0, "after": 0, "both": 0, "before": 0, "same": 0, "changed": []})
    for qid, (correct, output) in after.items():
        r = rows[category(qid)]
        r["n"] += 1
        r["after"] += correct == "1"
        if qid not in before:
            r["changed"].append(f"{qid}: not in --before")
            continue
        r["both"] += 1
        r["before"] += before[qid][0] == "1"
        r["same"] += before[qid][1] == output
        if before[qid][0] != correct:
            r["changed"].append(f"{qid}: {before[qid][0]} -> {correct}")
    for cat, r in rows.items():
        print(f"{cat}: correct {r['after']}/{r['n']} after, {r['before']}/{r['both']} before; same output "
              f"{r['same']}/{r['both']}; verdicts changed: {', '.join(r['changed']) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
