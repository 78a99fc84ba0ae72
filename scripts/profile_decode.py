"""Where a llama.cpp decode's time goes outside ``llama_decode``: cProfile over ``Generator.generate`` on BFCL
questions (docs/benchmarks.md, "Python's share of a decode on llama.cpp").

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/profile_decode.py --threads 1 --split dev --limit 4

Prints, per drafter, tokens, seconds (prefill included), target forwards, and the functions with the most time of
their own (``llama_decode`` is ``decoding/llamacpp.py``'s ``decode``).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.modes import Bench, build_prompts  # noqa: E402
from bench.run import load_rows  # noqa: E402
from decoding import Generator  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--split", choices=("dev", "test"), default="dev")
    ap.add_argument("--categories", default="simple_python,multiple")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--drafters", default="none,lookup")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    gen = Generator(args.model, backend="llamacpp", threads=args.threads)
    bench = Bench(gen.loaded, max_new_tokens=128)
    bench.gen = gen
    prompts = build_prompts(gen.loaded.tokenizer, load_rows(args.categories.split(","), None, args.limit, args.split))
    for drafter in args.drafters.split(","):
        bench.run_ours(drafter, prompts[0], None)  # warm: the row-cost calibration, the prefix cache
        prof, seconds, tokens, forwards = cProfile.Profile(), 0.0, 0, 0
        prof.enable()
        for p in prompts:
            r = bench.run_ours(drafter, p, None)
            seconds, tokens, forwards = seconds + r.seconds, tokens + len(r.tokens), forwards + r.forwards
        prof.disable()
        stats = pstats.Stats(prof)
        own = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in stats.stats.items()), reverse=True)
        print(f"{drafter}: {tokens} tokens, {seconds:.2f} s (prefill included), {forwards} target forwards; "
              f"time of its own: " + ", ".join(f"{name} {t:.2f} s" for t, name in own[:args.top]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
