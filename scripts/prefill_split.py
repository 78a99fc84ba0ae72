"""Does a token's result depend on how its prompt was split into llama.cpp decodes? The minimal experiment behind
the prefix cache's two classes (``decoding.llamacpp.prefill_classes``; docs/benchmarks.md, "A reused prefix decodes
as a fresh prefill").

For one prompt it feeds ``prompt[:-1]`` in several splits (each number a ``llama_decode`` of that many tokens) and
prints how far the next-token logits of the last token land from a one-decode prefill (max |Δ logit|, float32), and
the same for the rows of an 8-row verify against each row decoded alone (the speculative decoder's invariance). With
``--no-flash-attn`` the context is made with flash attention off (llama.cpp's default is ``auto``: on, on CPU).

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/prefill_split.py --model smollm2 --threads 1
    OMP_NUM_THREADS=1 taskset -c 0 python scripts/prefill_split.py --model smollm2 --threads 1 --no-flash-attn
"""
from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--length", type=int, default=200, help="prompt tokens (default 200)")
    ap.add_argument("--no-flash-attn", action="store_true", help="create the context with flash attention off")
    args = ap.parse_args()

    import llama_cpp

    from decoding.llamacpp import load_llamacpp

    if args.no_flash_attn:
        default = llama_cpp.llama_context_default_params

        def params():
            p = default()
            p.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
            return p

        llama_cpp.llama_context_default_params = params
    model = load_llamacpp(args.model, n_threads=args.threads, n_ctx=2048)
    text = open("README.md", encoding="utf-8").read()
    prompt = model.tokenizer.encode(text, add_special_tokens=False)[:args.length]
    n = len(prompt) - 1
    lm = model.new_lm()
    ctx = lm.ctx

    def next_logits(split: list[int]) -> np.ndarray:
        lm.reset()
        ctx.decode(prompt[:-1], [], chunks=split)
        return lm.forward(prompt[-1:])[0][0].numpy()

    ref = next_logits([n])
    print(f"{args.model}, {args.threads} thread(s), flash attention {'off' if args.no_flash_attn else 'auto'}, "
          f"prompt {len(prompt)} tokens: max |Δ logit| of the next token against one decode of {n}")
    splits = [[n // 2, n - n // 2], [64, n - 64], [n - 64, 64], [7, n - 7], [63, n - 63], [n - 10, 10],
              [63, 63, 63, n - 189], [32] * (n // 32) + [n % 32]]
    for split in splits:
        split = [s for s in split if s]
        small = sum(s for s in split if s < 64)
        d = float(np.abs(next_logits(split) - ref).max())
        print(f"  split {split[:4]}{'…' if len(split) > 4 else ''}: tokens in decodes of < 64: {small:4d}  "
              f"max |Δ| {d:.4f}")

    lm.reset()
    lm.forward(prompt[:-8], num_logits=1)
    base = ctx.length
    rows = lm.forward(prompt[-8:], num_logits=8)[0].numpy()
    worst = 0.0
    for i in range(8):
        lm.crop(base + i)
        alone = lm.forward(prompt[-8 + i:-7 + i] if i < 7 else prompt[-1:])[0][0].numpy()
        worst = max(worst, float(np.abs(alone - rows[i]).max()))
    print(f"  verify: 8 rows in one decode against each alone: max |Δ| {worst:.4f}")


if __name__ == "__main__":
    main()
