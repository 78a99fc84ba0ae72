"""Where the grammar masked the model's end in one BFCL question's turn (a diagnostic for cut turns).

Runs the bfcl command on one question (a BFCL file holding only that row, twice, so that the test half is it) with
``count_masked_ends``, and prints, for the turn's output, the positions where the model's unmasked argmax is an
end-of-generation token the grammar forbids — replayed once in chunks of 64 rows (as the bfcl summary counts them)
and once one row per forward (the one-token-per-forward decode's own logits) — and whether the grammar forces each
of those positions (allows one token only: the decoder's ``end_when`` is never asked there).

    python scripts/masked_end_probe.py parallel_multiple_52 [--data-dir ../shared/data/bfcl]

Used in docs/benchmarks.md, "The model's end inside a call closes the call there".
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.__main__ import main as agent_main  # noqa: E402
from constraints import single_allowed  # noqa: E402
from decoding import Generator  # noqa: E402


def probe(question: str, data_dir: Path, model: str) -> None:
    category = question.rsplit("_", 1)[0]
    source = next(f for f in sorted(data_dir.glob("BFCL_v*.jsonl"))
                  if re.fullmatch(rf"BFCL_v\d+_{re.escape(category)}\..*jsonl", f.name))
    row = next(line for line in source.read_text().splitlines() if json.loads(line)["id"] == question)
    replay = Generator.masked_end_argmax

    def both(self, prompt, tokens, grammar, chunk=64):
        found = replay(self, prompt, tokens, grammar, chunk=chunk)
        one_row = replay(self, prompt, tokens, grammar, chunk=1)
        state = self.new_state(grammar)
        forced = []
        for j, tok in enumerate(tokens):
            forced.append(single_allowed(state.next_mask()) is not None)
            if tok in self.eog_token_ids:
                break
            state.consume(tok)
        print(json.dumps({"question": question, "output_tokens": len(tokens), "masked_end_chunk64": found,
                          "masked_end_one_row": one_row,
                          "forced": {j: forced[j] for j in sorted(set(found) | set(one_row)) if j < len(forced)},
                          "text_at": {j: self.tokenizer.decode(tokens[max(0, j - 3):j + 1])
                                      for j in sorted(set(found) | set(one_row))}}, ensure_ascii=False),
              file=sys.stderr)
        return found

    Generator.masked_end_argmax = both
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / source.name).write_text(row + "\n" + row + "\n")
        agent_main(["bfcl", "--model", model, "--backend", "llamacpp", "--threads", "1", "--split", "test",
                    "--category", category, "--data-dir", tmp])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("question", help="a BFCL question id, e.g. parallel_multiple_52")
    p.add_argument("--data-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "bfcl")
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    args = p.parse_args()
    probe(args.question, args.data_dir, args.model)
