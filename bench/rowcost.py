"""What a verify of n rows costs on llama.cpp's CPU kernels: ``python -m bench.rowcost``.

For a model alias of ``decoding.loader.KNOWN_MODELS``, by weight type (``shipped``; ``q4_0`` / ``q8_0`` re-quantised
by llama.cpp's own quantizer: the model spec ``alias:q8_0``, ``decoding.llamacpp.requantized``), threads and weight repacking
(llama.cpp's ``use_extra_bufts``), one ``llama_decode`` of n = 1 … 32 rows after a ``--prompt-tokens`` prompt, logits
for every row, median of ``--repeat`` runs (the KV cache is cropped back to the prompt after each). Prints, per
configuration, the 1-row time (ms), the cost of n rows as a multiple of it, and batch invariance: the largest
absolute difference between row 0's logits in the n-row batch and the same row alone (0 = bit-identical: the greedy
identity of speculative and one-token-per-forward decoding holds up to that n).

Example (the issue's table): ``python -m bench.rowcost --model qwen2.5-coder-0.5b --threads 1,2 --weights
shipped,q4_0,q8_0 --repack off,on``. Writes ``--out`` (JSON) when given.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32)


def measure(spec: str, *, threads: int, repack: bool, rows=DEFAULT_ROWS, prompt_tokens: int = 300,
            repeat: int = 7) -> dict:
    """One configuration: ``{"ms_1_row", "cost": {n: multiple of 1 row}, "max_abs_diff": {n: float}}``."""
    import numpy as np

    from decoding.llamacpp import load_llamacpp, time_verify_rows

    loaded = load_llamacpp(spec, n_threads=threads, repack=repack, n_ctx=prompt_tokens + max(rows) + 8)
    text = "def add(a, b):\n    return a + b\n" * (prompt_tokens // 8 + 1)
    prompt = loaded.tokenizer.encode(text, add_special_tokens=False)[:prompt_tokens]
    rng = np.random.default_rng(0)
    window = [int(t) for t in rng.integers(100, min(loaded.vocab_size, 30000), size=max(rows))]
    lm = loaded.new_lm()
    lm.reset()
    lm.forward(prompt, num_logits=1)
    ms, row0 = time_verify_rows(lm, window, rows, repeat)  # the product's own timing (its row-cost calibration)
    diff = {n: float((row0[n] - row0[rows[0]]).abs().max()) for n in rows}
    return {"ms_1_row": round(ms[rows[0]], 2), "cost": {n: round(ms[n] / ms[rows[0]], 2) for n in rows},
            "max_abs_diff": diff}


def _positive_list(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers >= 1")
    return values


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= 1")
    return value


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = text.split(",")
        if bad := [v for v in values if v not in allowed]:
            raise argparse.ArgumentTypeError(f"{bad[0]!r}: choose from {', '.join(allowed)} (several joined by "
                                             f"commas)")
        return values
    return parse


def main(argv: list[str] | None = None) -> int:
    from decoding.llamacpp import REQUANT_TYPES

    ap = argparse.ArgumentParser(prog="python -m bench.rowcost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="alias or .gguf path")
    ap.add_argument("--threads", type=_positive_list, default=(1,), help="comma-separated thread counts, e.g. 1,2")
    ap.add_argument("--weights", type=_choices(("shipped", *REQUANT_TYPES)), default=["shipped"],
                    help="comma-separated: shipped, " + ", ".join(REQUANT_TYPES))
    ap.add_argument("--repack", type=_choices(("off", "on")), default=["off"], help="comma-separated: off, on")
    ap.add_argument("--rows", type=_positive_list, default=DEFAULT_ROWS, help="comma-separated, starting with 1")
    ap.add_argument("--prompt-tokens", type=_positive, default=300)
    ap.add_argument("--repeat", type=_positive, default=7)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.rows[0] != 1:
        ap.error("--rows must start with 1 (the unit of the cost)")
    out = Path(args.out).expanduser() if args.out else None
    if out is not None and (out.is_dir() or not out.resolve().parent.is_dir()):  # before the measuring, not after
        ap.error(f"--out {args.out}: " + ("a directory; give a file name" if out.is_dir() else "no such directory"))
    from decoding.loader import KNOWN_MODELS, SHIPPED_TAG, naming_a_bad_gguf
    from schemas import SpecAgentError

    rows = tuple(args.rows)
    header = "| weights | threads | repack | 1 row ms | " + " | ".join(f"{n} rows" for n in rows[1:]) + \
             " | row 0 in the batch vs alone |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    try:
        with naming_a_bad_gguf(args.model):
            results = _measure_all(args, rows, KNOWN_MODELS, SHIPPED_TAG)
    except (SpecAgentError, ValueError) as e:  # a model that is not there, a prompt past the context: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def _measure_all(args, rows: tuple[int, ...], known: dict, shipped_tag: str) -> list[dict]:
    """Every table row of :func:`main` measured and printed as it comes; their dicts."""
    results = []
    for weight in args.weights:
        # an alias's "shipped" is alias:shipped (a bare alias loads its chosen weights, e.g. the 0.5B as Q8_0)
        shipped = args.model + shipped_tag if args.model in known else args.model
        spec = shipped if weight == "shipped" else f"{args.model}:{weight}"
        for threads in args.threads:
            for repack in (r == "on" for r in args.repack):
                r = measure(spec, threads=threads, repack=repack, rows=rows, prompt_tokens=args.prompt_tokens,
                            repeat=args.repeat)
                flips = [n for n in rows if r["max_abs_diff"][n] > 0]
                same = "bit-identical at every n" if not flips else \
                    f"differs ({max(r['max_abs_diff'].values()):.2g}) from {flips[0]} rows on"
                print(f"| {weight} | {threads} | {'on' if repack else 'off'} | {r['ms_1_row']:.1f} | "
                      + " | ".join(f"{r['cost'][n]:.2f}×" for n in rows[1:]) + f" | {same} |", flush=True)
                results.append({"model": args.model, "weights": weight, "threads": threads, "repack": repack, **r})
    return results


if __name__ == "__main__":
    raise SystemExit(main())
