"""Speculative windows sized by the row cost against fixed γ windows, side by side: ``python -m bench.windows``.

For each prompt (BFCL questions as the benchmark builds them), every drafter runs with ``window="fixed"`` (γ drafter
tokens whenever the drafter has them) and ``window="cost"`` (a token only where its verify row pays:
``decoding.window``), interleaved, ``--repeat`` times; then ``none`` (one token per forward) once, the reference of
token identity. Prints per drafter: tokens/s (median over prompts), the per-prompt median ratio cost / fixed and
each against ``none``, tokens per forward and whether every output equals ``none``'s. Every figure comes from the
product's own ``Generator.generate`` and ``DecodeStats`` (``bench.modes.Bench.run_ours``).

Example: ``python -m bench.windows --model qwen2.5-coder-0.5b --threads 2 --split test --limit 12
--drafters lookup,lookup_mtp``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .aggregate import aggregate, median_speed_ratio, peak_rss_mb
from .modes import Bench, build_prompts
from .run import categories, load_rows

WINDOWS = ("fixed", "cost")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.windows", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: every physical core)")
    ap.add_argument("--split", choices=("dev", "test"), default="test")
    ap.add_argument("--category", nargs="+", default=["simple_python"])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafters", default="lookup", help="comma list of drafters (each runs fixed and cost)")
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="γ (default: the Generator's)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    from decoding import Generator

    gen = Generator(args.model, backend="llamacpp", threads=args.threads,
                    **({} if args.num_draft_tokens is None else {"num_draft_tokens": args.num_draft_tokens}))
    bench = Bench(gen.loaded, max_new_tokens=args.max_new_tokens)
    bench.gen = gen
    prompts = build_prompts(gen.loaded.tokenizer, load_rows(categories(args), args.data_dir, args.limit, args.split))
    drafters = args.drafters.split(",")
    cost = gen.row_cost("cost")
    print(f"row cost ({gen.loaded.n_threads} threads, 1 row {cost.ms_1_row:.1f} ms): "
          + ", ".join(f"{n}: {c:.2f}" for n, c in zip(cost.rows, cost.cost)), flush=True)
    modes = [(d, w) for d in drafters for w in WINDOWS]
    for d, w in modes:  # warm-up: loads the MTP head, fills the prefix cache, not counted
        bench.run_ours(d, prompts[0], None, window=w)
    runs = {m: {p.id: [] for p in prompts} for m in modes + [("none", "fixed")]}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        for _ in range(args.repeat):
            for m in modes:
                runs[m][p.id].append(bench.run_ours(m[0], p, None, window=m[1]))
        runs[("none", "fixed")][p.id].append(bench.run_ours("none", p, None))
        print(f"[{i + 1}/{len(prompts)}] {p.id}: " + "  ".join(
            f"{d}/{w} {runs[(d, w)][p.id][-1].tokens_per_s:.1f}" for d, w in modes)
            + f"  none {runs[('none', 'fixed')][p.id][-1].tokens_per_s:.1f}", flush=True)
    none = runs[("none", "fixed")]
    report = {"model": args.model, "threads": gen.loaded.n_threads, "split": args.split, "prompts": len(prompts),
              "repeat": args.repeat, "row_cost": cost.to_dict(), "seconds": round(time.perf_counter() - t0, 1),
              "drafters": {}}
    print(f"\n| drafter | window | tokens/s | ×none | cost/fixed | tokens/forward | identical to none |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for d, w in modes + [("none", "fixed")]:
        r = runs[(d, w)]
        agg = aggregate(r, prompts, none, peak_rss_mb())  # the benchmark's own fields, none as the baseline
        vs_fixed = median_speed_ratio(r, runs[(d, "fixed")], prompts) if w == "cost" else None
        report["drafters"][f"{d}/{w}"] = {"tokens_per_s": agg["tokens_per_s"], "vs_none": agg["speedup_vs_constrained"],
                                          "cost_vs_fixed": vs_fixed, "tokens_per_forward": agg["tokens_per_forward"],
                                          "identical_to_none": agg["identical_to_constrained"]}
        print(f"| {d} | {w} | {agg['tokens_per_s']:.1f} | {agg['speedup_vs_constrained']:.2f} | "
              f"{'' if vs_fixed is None else f'{vs_fixed:.2f}'} | {agg['tokens_per_forward']:.2f} | "
              f"{agg['identical_to_constrained']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
