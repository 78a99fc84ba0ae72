"""String values the model wrote that the conversation holds only inside a longer word ("Christian" for
"Christianity", "asc" for "ascending"), over recorded BFCL outputs: would extending such a value to the whole word
help? (docs/benchmarks.md, "A value written inside a longer word").

    python scripts/written_inside_words.py bench/results/bfcl/*dev*.tsv

Prints one line per (question, value, word) with the verdicts it had (1 right, 0 wrong) in the files given.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.grounding import leaf_values  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "bfcl"


def questions() -> dict[str, str]:
    out = {}
    for f in DATA.glob("*.jsonl"):
        for line in f.open():
            r = json.loads(line)
            q = r["question"]
            msgs = [m for turn in q for m in turn] if isinstance(q[0], list) else q
            out[r["id"]] = " ".join(m["content"] for m in msgs if m["role"] in ("user", "system"))
    return out


def main(files: list[str]) -> int:
    text_of, seen = questions(), {}
    for f in files:
        for line in open(f):
            p = line.rstrip("\n").split("\t")
            if len(p) < 4 or p[0] not in text_of:
                continue
            try:
                out = json.loads(p[3])
            except json.JSONDecodeError:
                continue
            text = text_of[p[0]]
            for m in re.finditer(r'"arguments": (\{.*?\})\}', out):
                try:
                    args = json.loads(m.group(1))
                except json.JSONDecodeError:
                    continue
                for s in (v for v in leaf_values(args) if isinstance(v, str)):
                    if len(s) < 3 or s.lower() not in text.lower():
                        continue
                    if re.search(r"(?<!\w)" + re.escape(s) + r"(?!\w)", text, re.I):
                        continue  # written as a word of its own
                    if mm := re.search(r"(?<!\w)" + re.escape(s) + r"\w+", text, re.I):
                        seen.setdefault((p[0], s, mm.group()), set()).add(p[2])
    for (qid, value, word), verdicts in sorted(seen.items()):
        print(f"{qid}\t{value!r} in {word!r}\tright: {','.join(sorted(verdicts))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
