"""Does the order in which tools are listed decide the tool the model calls? (docs/benchmarks.md, "The order of the
tools"; dev split only.)

For each question: the prompt as ``Agent.run`` renders it (``BfclTurn.prompt_ids``) with the tools as listed and
again with their order reversed; after each, the probability of every tool's name at the name position (the
model's preferred bare layout ``{"name": "``, then the name and its closing quote, teacher-forced, no grammar;
normalised over the question's tools). Prints one JSON line per question: the ground truth's index ``gt`` (in the
listed order), ``p`` / ``p_rev`` (indices of the listed order), and the tool each order picks and the one that
the mean of the two orders' log-probabilities picks.

With ``--prior``: also the names' probabilities after a content-free question ("N/A": Zhao et al. 2021,
"Calibrate Before Use", §4) and the tool that the listed order's log-probabilities less those pick
(``p_prior``, ``pick_cal``; what ``agent.tool_prior`` builds on); ``--no-reverse`` skips the reversed order.

Usage: ``python scripts/tool_order_bias.py --split dev --category multiple --limit 50 > order.jsonl``, then
``python scripts/tool_order_bias.py --summarize order.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PREFIX = '{"name": "'


def summarize(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    print(f"{len(rows)} questions")
    for key, label in (("pick", "tools as listed"), ("pick_rev", "tools reversed"),
                       ("pick_avg", "mean of both orders"), ("pick_cal", "listed, content-free prior")):
        if key not in rows[0]:
            continue
        print(f"{label:22s} {sum(r[key] == r['gt'] for r in rows):3d} pick the ground truth's tool")
    if "pick_rev" not in rows[0]:
        return
    flips = [r for r in rows if r["pick"] != r["pick_rev"]]
    first = sum(r["pick"] == 0 and r["pick_rev"] == r["n"] - 1 for r in flips)
    print(f"the pick changes with the order in {len(flips)}; in {first} of them each order picks its first-listed "
          f"tool: {', '.join(r['id'] for r in flips)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--category", default="multiple")
    p.add_argument("--split", default="dev", choices=["dev"])  # never the test split: this informs choices
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--summarize", metavar="JSONL")
    p.add_argument("--prior", action="store_true",
                   help="also the names' probabilities under a content-free question ('N/A', Zhao et al. 2021, "
                        "'Calibrate before use', §4) and the pick of the listed order divided by them")
    p.add_argument("--no-reverse", action="store_true", help="skip the reversed order")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return

    import torch

    from agent.engine import LocalEngine
    from agent.formats.chat import plain_text_encoder
    from bench.bfcl import bfcl_turn, load_questions
    from decoding.decoder import prefill
    from decoding.stats import DecodeStats

    engine = LocalEngine(args.model, backend="llamacpp", threads=args.threads)
    fmt, gen = engine.format, engine.generator
    encode = plain_text_encoder(fmt.tokenizer)
    n_prefix = len(encode(PREFIX))

    def name_probs(row: dict) -> dict[str, float]:
        turn = bfcl_turn(row, args.category)
        target = gen.new_target()
        last = prefill(target, list(turn.prompt_ids(fmt.tokenizer, fmt)), DecodeStats())
        base, logp = target.length, {}
        for fn in row["function"]:
            cont = encode(PREFIX + fn["name"] + '"')
            target.crop(base)
            lp = torch.log_softmax(target.forward([last] + cont[:-1])[0].float(), dim=-1)
            logp[fn["name"]] = sum(lp[j, cont[j]].item() for j in range(n_prefix, len(cont)))
        top = max(logp.values())
        z = sum(math.exp(v - top) for v in logp.values())
        return {k: math.exp(v - top) / z for k, v in logp.items()}

    for row in load_questions(args.category, split=args.split, limit=args.limit):
        names = [fn["name"] for fn in row["function"]]
        a = name_probs(row)
        out = {"id": row["id"], "gt": names.index(next(iter(row["ground_truth"][0]))), "n": len(names),
               "p": [round(a[k], 4) for k in names], "pick": names.index(max(a, key=a.get))}
        if not args.no_reverse:
            b = name_probs(dict(row, function=list(reversed(row["function"]))))
            mean = {k: (math.log(a[k]) + math.log(b[k])) / 2 for k in names}
            out.update(p_rev=[round(b[k], 4) for k in names], pick_rev=names.index(max(b, key=b.get)),
                       pick_avg=names.index(max(mean, key=mean.get)))
        if args.prior:
            question = [[{"role": "user", "content": "N/A"}]]
            c = name_probs(dict(row, question=question))
            cal = {k: math.log(a[k]) - math.log(c[k]) for k in names}
            out.update(p_prior=[round(c[k], 4) for k in names], pick_cal=names.index(max(cal, key=cal.get)))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
