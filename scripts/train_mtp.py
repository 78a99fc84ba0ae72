"""Train the MTP head (decoding/mtp.py) for the default target by self-distillation, on CPU.

    .venv/bin/python scripts/train_mtp.py            # ~20-30 min on 2 cores; writes checkpoints/mtp-<sha16>/

Data: the target's own constrained greedy outputs (tool calls, and some text answers) for prompts built from
../shared/data/bfcl: simple_python questions 50…199 and multiple 0…99. simple_python 0…49 are never used (they are
the evaluation set); 10% of the training prompts are held out as the validation split. The prompts' own tokens are
part of each sequence.

Loss (teacher forcing with cached target hidden states): cross-entropy of the head's prediction at position i
(inputs h_i, x_{i+1}) against the target's own greedy token for position i+2, plus the same loss for a recurrent
pass where the head's own previous output stands in for h_i (how drafts of depth > 1 are made). Positions: every
output token and a sample of prompt tokens.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from decoding.mtp import MTPHead, save_head, target_sha256  # noqa: E402


def build_sequences(loaded, rows, *, text_every: int = 3, max_new_tokens: int = 160) -> list[dict]:
    """Generate the target's own outputs for BFCL rows: ``[{"tokens", "prompt_len"}]``."""
    from agent.bfcl import bfcl_turn
    from decoding import Generator

    gen = Generator(loaded, drafter="lookup")
    out = []
    for i, row in enumerate(rows):
        turn = bfcl_turn(row, "simple_python")  # Python typing for every row (the multiple category is Python too)
        ids = turn.prompt_ids(loaded.tokenizer)
        modes = ["required"] + (["none"] if (i + 1) % text_every == 0 else [])
        for mode in modes:
            grammar = turn.grammar(mode)
            res = gen.generate(ids, grammar, max_new_tokens=max_new_tokens if mode == "required" else 48)
            out.append({"tokens": ids + res.tokens, "prompt_len": len(ids), "id": row["id"], "mode": mode})
        if (i + 1) % 10 == 0:
            print(f"  generated for {i + 1}/{len(rows)} prompts", flush=True)
    return out


@torch.no_grad()
def featurize(loaded, sequences: list[dict], *, prompt_positions: int = 64, seed: int = 0) -> list[dict]:
    """Add target hidden states ``float [N, d]``, the target's greedy tokens ``int64 [N]`` and loss positions."""
    from decoding import CausalLM

    rng = random.Random(seed)
    target = CausalLM(loaded)
    feats = []
    for s in sequences:
        toks = s["tokens"]
        target.reset()
        logits, h = target.forward(toks, hidden=True)
        greedy = logits.argmax(-1).clone()  # clone: plain tensors (the forward ran in inference mode)
        n = len(toks)
        # position i predicts the target's token for i+2, so i <= n-3
        out_pos = list(range(max(s["prompt_len"] - 2, 0), n - 2))
        prompt_pos = rng.sample(range(0, max(s["prompt_len"] - 2, 0)), min(prompt_positions, max(s["prompt_len"] - 2, 0)))
        feats.append({"hidden": h.float().clone(), "tokens": torch.tensor(toks), "greedy": greedy,
                      "positions": torch.tensor(sorted(prompt_pos + out_pos)), "out_positions": torch.tensor(out_pos)})
    return feats


def head_loss(head: MTPHead, f: dict, *, recurrent_weight: float = 0.5) -> tuple[torch.Tensor, dict]:
    """Cross-entropy at the sampled positions (teacher-forced pass + recurrent pass)."""
    h = f["hidden"][:-1][None]
    nxt = f["tokens"][1:][None]
    pos = torch.arange(h.shape[1])[None]
    g1 = head(h, nxt, pos)
    p = f["positions"]
    labels = f["greedy"][p + 1]
    loss1 = torch.nn.functional.cross_entropy(head.logits(g1[0, p]).float(), labels)
    loss = loss1
    if recurrent_weight:
        h2 = torch.cat([h[:, :1], g1[:, :-1].detach()], dim=1)  # g_{i-1} stands in for h_i
        g2 = head(h2, nxt, pos)
        loss2 = torch.nn.functional.cross_entropy(head.logits(g2[0, p]).float(), labels)
        loss = loss1 + recurrent_weight * loss2
    return loss, {"loss1": float(loss1.detach())}


@torch.inference_mode()
def agreement(head: MTPHead, feats: list[dict]) -> dict:
    """Top-1 agreement of the head (teacher-forced) with the target's own token two ahead, on output positions."""
    hit = tot = 0
    for f in feats:
        p = f["out_positions"]
        if p.numel() == 0:
            continue
        g = head(f["hidden"][:-1][None], f["tokens"][1:][None], torch.arange(f["hidden"].shape[0] - 1)[None])
        pred = head.logits(g[0, p]).argmax(-1)
        hit += int((pred == f["greedy"][p + 1]).sum())
        tot += p.numel()
    return {"top1_agreement": hit / tot if tot else 0.0, "positions": tot}


def train_head(head: MTPHead, feats: list[dict], *, epochs: int = 4, max_steps: int | None = None, lr: float = 1e-3,
               seed: int = 0, log=print) -> list[float]:
    """AdamW with cosine decay over ``epochs`` passes (or ``max_steps`` sequences). Returns the per-step losses."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    total = max_steps or epochs * len(feats)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    losses = []
    step = 0
    while step < total:
        order = list(range(len(feats)))
        rng.shuffle(order)
        for i in order:
            if step >= total:
                break
            loss, _ = head_loss(head, feats[i])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss))
            step += 1
            if step % 100 == 0:
                log(f"step {step}/{total} loss {sum(losses[-100:]) / 100:.3f}")
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "bfcl"))
    ap.add_argument("--out", default=None, help="checkpoint directory (default checkpoints/mtp-<sha16>)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="use only this many training prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text-every", type=int, default=3, help="also a text answer for every Nth prompt (0: none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    t_start = time.time()
    from agent.bfcl import load_questions
    from decoding import load_model
    from decoding.mtp import DEFAULT_CHECKPOINT_DIR

    loaded = load_model(args.model)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    rows = load_questions("simple_python", args.data_dir)[50:200] + load_questions("multiple", args.data_dir)
    random.Random(args.seed).shuffle(rows)
    if args.limit:
        rows = rows[: args.limit]
    n_val = max(1, len(rows) // 10)
    val_rows, train_rows = rows[:n_val], rows[n_val:]
    print(f"{len(train_rows)} training prompts, {len(val_rows)} validation prompts", flush=True)
    t0 = time.time()
    every = args.text_every or 10 ** 9
    train_seqs = build_sequences(loaded, train_rows, text_every=every)
    val_seqs = build_sequences(loaded, val_rows, text_every=every)
    print(f"generated {len(train_seqs)} + {len(val_seqs)} sequences in {time.time() - t0:.0f} s", flush=True)
    t0 = time.time()
    train_f = featurize(loaded, train_seqs, seed=args.seed)
    val_f = featurize(loaded, val_seqs, seed=args.seed)
    print(f"target hidden states in {time.time() - t0:.0f} s", flush=True)
    head = MTPHead(loaded.model)
    history = []
    for epoch in range(args.epochs):
        t0 = time.time()
        losses = train_head(head, train_f, epochs=1, lr=1e-3 * (0.5 ** epoch), seed=args.seed + epoch,
                            log=lambda s: print(s, flush=True))
        head.eval()
        val = agreement(head, val_f)
        head.train()
        history.append({"epoch": epoch + 1, "train_loss": sum(losses) / len(losses), **val,
                        "seconds": round(time.time() - t0, 1)})
        print(json.dumps(history[-1]), flush=True)
    sha = target_sha256(loaded)
    out = Path(args.out) if args.out else DEFAULT_CHECKPOINT_DIR / f"mtp-{sha[:16]}"
    card = {"target": loaded.name, "target_sha256": sha, "architecture": "DeepSeek-V3 depth-1 MTP module: "
            "RMSNorm(h) || RMSNorm(Emb(x)) -> Linear(2d->d) -> 1 LlamaDecoderLayer -> shared final norm + LM head",
            "data": {"train": "BFCL simple_python 50-199 + multiple 0-99 (minus validation), target's own "
                              "constrained greedy tool calls (+ text answers for every --text-every'th prompt)",
                     "train_prompts": len(train_rows), "validation_prompts": len(val_rows),
                     "train_sequences": len(train_seqs), "held_out": "BFCL simple_python 0-49 never used"},
            "steps": args.epochs * len(train_f), "epochs": args.epochs, "seed": args.seed,
            "validation": history[-1] if history else None, "history": history,
            "train_seconds": round(time.time() - t_start), "command": "python scripts/train_mtp.py "
            + " ".join(argv if argv is not None else sys.argv[1:])}
    save_head(head, out, card)
    print(f"saved {out} ({card['train_seconds']} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
