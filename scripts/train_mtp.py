"""Train the MTP head (decoding/mtp.py) by self-distillation on CPU, from ``scripts/mtp_data.py``'s shards.

    .venv/bin/python scripts/mtp_data.py --out /tmp/mtp/smollm2 --seconds 3300        # data: one target forward
    .venv/bin/python scripts/train_mtp.py --data /tmp/mtp/smollm2 --seconds 2400      # writes checkpoints/mtp-<sha16>/

Data (see ``scripts/mtp_data.py``): BFCL **dev split** questions of every category (the target's own constrained
greedy turn and the ground-truth call, both in the model's tool format), MaskBench valid instances (never
MaskBench's ``bfcl`` file) as calls of tools built from their schemas. The BFCL test split is never read. About 1
sequence group (question / schema) in 12 is held out for validation (``mtp_data.is_validation``).

Labels are the target's own predictions from one forward over each sequence: head position i (inputs h_i, x_{i+1})
learns the target's distribution for token i+2 — soft (KL to the target's top-k logits, renormalised) plus hard
(cross-entropy to the token the target picks: on a greedy turn's answer, the grammar-masked choice itself). The
frozen LM head's cost is controlled by scoring only a candidate set per sequence: the target's top-k of every loss
position, the labels and uniformly sampled negatives (whose logits get the sampled-softmax correction
log((V − |positives|) / |negatives|), Jean et al. 2015).

Recurrent drafting (depth k: the head's own output ``FinalNorm(g)`` stands in for the target's h at the k drafted
positions before) is trained as it is used: the prompt runs once at depth 0 (the verified context, with a KV cache),
then the answer positions at depths 0 … ``--depths``-1, each depth fed the previous depth's stand-ins.

Loss positions: every answer position (weight 1 when the predicted token is free, ``--forced-weight`` when the
grammar forces it: the drafter is never asked for forced tokens) and ``--prompt-positions`` sampled prompt
positions (weight ``--prompt-weight``). Validation reports top-1 agreement with the target (full vocabulary, no
mask) on free answer positions by depth, picks the depth stop (``max_depth``: the deepest depth whose agreement
pays ``--draft-cost`` + ``--step-cost`` × depth) and the confidence stop (``min_confidence``, EAGLE-2 style) that
maximises accepted − ``--draft-cost`` × drafted tokens on the validation free positions within that depth.
The draft vocabulary (``--draft-vocab`` most frequent free answer tokens of the training data, FR-Spec style) joins
the prompt's tokens as the candidates the drafter scores where the mask allows many tokens; validation scores the
same candidates and reports how many free labels they cover.
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from decoding.mtp import MTPHead, save_head, target_sha256  # noqa: E402
from decoding.registry import card_drafters  # noqa: E402


# -- data --------------------------------------------------------------------------------------------------------------
def load_records(directory: Path) -> list[dict]:
    """All sequences of ``mtp_data.py``'s shards in ``directory``."""
    records = []
    for p in sorted(Path(directory).glob("shard*.pt")):
        records += torch.load(p, weights_only=False)
    return records


@torch.no_grad()
def featurize(loaded, sequences: list[dict], *, topk: int = 32) -> list[dict]:
    """Records (as ``mtp_data.py`` stores them) for ``[{"tokens", "prompt_len"}]`` from one target forward each;
    every position after the prompt counts as a free answer position (tests and small runs)."""
    from mtp_data import PrefixForward

    pf = PrefixForward(loaded, topk)
    out = []
    for s in sequences:
        pf.lm.reset()
        pf.tokens, pf.hidden, pf.ids, pf.vals = [], [], [], []
        pf.extend(list(s["tokens"]))
        n = len(s["tokens"])
        out.append(pf.record(s["prompt_len"], [True] * (n - s["prompt_len"]), None, kind="plain",
                             group=str(s.get("id", len(out)))))
    return out


# -- loss --------------------------------------------------------------------------------------------------------------
def _crop(cache, length: int) -> None:
    """Keep the first ``length`` positions of a one-layer ``DynamicCache`` (it takes the count to drop)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _candidates(rec: dict, rows: torch.Tensor, vocab: int, negatives: int, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(candidate ids [C], logit correction [C])``: the target's top-k of ``rows``, their labels, and uniform
    negatives (corrected by log((V − |positives|) / |negatives|))."""
    pos = torch.unique(torch.cat([rec["topk_ids"][rows].reshape(-1).long(), rec["label"][rows]]))
    if negatives <= 0:
        return pos, torch.zeros(len(pos))
    neg = torch.randint(0, vocab, (negatives,), generator=gen)
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[pos] = False
    neg = torch.unique(neg[keep[neg]])
    corr = math.log(max(vocab - len(pos), 1) / max(len(neg), 1))
    return torch.cat([pos, neg]), torch.cat([torch.zeros(len(pos)), torch.full((len(neg),), corr)])


def _distill(head: MTPHead, g: torch.Tensor, rec: dict, rows: torch.Tensor, cand: torch.Tensor, corr: torch.Tensor,
             hard_weight: float) -> torch.Tensor:
    """Per-position loss ``[len(rows)]``: KL(target top-k ‖ head over the candidates) + ``hard_weight`` × CE(label).

    ``rows``: target logit rows (row j = the target's distribution of token j+1); ``g``: head outputs whose
    prediction is that token, one per row."""
    logp = F.log_softmax(head.logits(g, cand).float() + corr, dim=-1)  # [L, C]
    index = torch.full((int(cand.max()) + 1,), -1, dtype=torch.long)
    index[cand] = torch.arange(len(cand))
    t_ids = index[rec["topk_ids"][rows].long()]  # [L, K] positions in the candidate set
    t_p = F.softmax(rec["topk_logits"][rows].float(), dim=-1)
    kl = (t_p * (t_p.clamp_min(1e-9).log() - logp.gather(1, t_ids))).sum(-1)
    ce = -logp.gather(1, index[rec["label"][rows]][:, None])[:, 0]
    return kl + hard_weight * ce


def head_loss(head: MTPHead, rec: dict, *, depths: int = 3, depth_weights=(1.0, 0.8, 0.6, 0.5, 0.4),
              prompt_positions: int = 32, prompt_weight: float = 0.2, forced_weight: float = 0.2,
              negatives: int = 2048, hard_weight: float = 0.5, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """The loss of one sequence (see the module docstring). Returns ``(loss, {"depth0": float, ...})``."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    h = rec["hidden"].float()
    tokens = rec["tokens"].long()
    n = len(tokens)
    p0 = max(min(rec["prompt_len"] - 2, n - 2), 1)  # first head position predicting an answer token
    a_pos = torch.arange(p0, n - 2)  # head positions i predicting answer token i+2
    k = min(prompt_positions, p0)
    p_pos = torch.sort(torch.randperm(p0, generator=gen)[:k]).values
    vocab = head.target.config.vocab_size
    rows = torch.cat([p_pos, a_pos]) + 1
    cand, corr = _candidates(rec, rows, vocab, negatives, gen)
    free = rec["free"][a_pos + 2]
    a_w = torch.where(free, 1.0, forced_weight)
    cache = DynamicCache()
    g_pre = head(h[None, :p0], tokens[None, 1:p0 + 1], torch.arange(p0)[None], cache)[0]  # depth 0, verified
    total = torch.zeros(())
    parts = {}
    norm = float(a_w.sum()) + prompt_weight * k
    if k:
        lp = _distill(head, g_pre[p_pos], rec, p_pos + 1, cand, corr, hard_weight)
        total = total + prompt_weight * lp.sum()
    if len(a_pos):
        inp = h[a_pos]
        for depth in range(depths):
            g = head(inp[None], tokens[None, a_pos + 1], a_pos[None], cache)[0]
            _crop(cache, p0)
            la = _distill(head, g, rec, a_pos + 1, cand, corr, hard_weight)
            w = depth_weights[min(depth, len(depth_weights) - 1)]
            total = total + w * (la * a_w).sum()
            parts[f"depth{depth}"] = float((la * a_w).sum().detach() / a_w.sum())
            # depth+1: position i takes the stand-in of position i-1's output at this depth (detached)
            inp = head.stand_in(torch.cat([g_pre[-1:], g[:-1]]).detach())
    return total / max(norm, 1e-6), parts


# -- validation --------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def evaluate(head: MTPHead, records: list[dict], *, depths: int = 4) -> dict:
    """Top-1 agreement (full vocabulary, unmasked) with the target's label and the head's confidence, on answer
    positions, by depth (depth d: d drafted positions before, as in :func:`head_loss`).

    Returns ``{"free": [agreement by depth], "all": [...], "positions_free": int, "samples": [(depth, p, hit)]}``
    (samples on free positions, for the confidence stop)."""
    from transformers import DynamicCache

    covered = [0, 0]  # free labels inside the draft candidates (draft vocabulary ∪ prompt tokens)
    hit = [[0, 0] for _ in range(depths)]
    hit_free = [[0, 0] for _ in range(depths)]
    samples = []
    for rec in records:
        h = rec["hidden"].float()
        tokens = rec["tokens"].long()
        n = len(tokens)
        p0 = max(min(rec["prompt_len"] - 2, n - 2), 1)
        a_pos = torch.arange(p0, n - 2)
        if not len(a_pos):
            continue
        cache = DynamicCache()
        g_pre = head(h[None, :p0], tokens[None, 1:p0 + 1], torch.arange(p0)[None], cache)[0]
        free = rec["free"][a_pos + 2]
        label = rec["label"][a_pos + 1]
        cand = head.candidates(rec["tokens"][1:rec["prompt_len"]].tolist())
        if cand is not None:
            covered[0] += int(torch.isin(label[free], cand).sum())
            covered[1] += int(free.sum())
        inp = h[a_pos]
        for depth in range(depths):
            g = head(inp[None], tokens[None, a_pos + 1], a_pos[None], cache)[0]
            _crop(cache, p0)
            if cand is None:
                conf, pred = torch.softmax(head.logits(g).float(), -1).max(-1)
            else:
                conf, best = torch.softmax(head.logits(g, cand).float(), -1).max(-1)
                pred = cand[best]
            ok = pred == label
            hit[depth][0] += int(ok.sum())
            hit[depth][1] += len(ok)
            hit_free[depth][0] += int(ok[free].sum())
            hit_free[depth][1] += int(free.sum())
            samples += [(depth, float(c), bool(o)) for c, o in zip(conf[free], ok[free])]
            inp = head.stand_in(torch.cat([g_pre[-1:], g[:-1]]))
    rate = lambda hs: [round(a / b, 4) if b else 0.0 for a, b in hs]  # noqa: E731
    return {"free": rate(hit_free), "all": rate(hit), "positions_free": hit_free[0][1],
            "positions_all": hit[0][1], "candidate_coverage": rate([covered])[0] if covered[1] else None,
            "samples": samples}


def draft_vocabulary(records: list[dict], size: int) -> torch.Tensor:
    """``int64 [size]``: the target's most frequent tokens at free answer positions of ``records`` (the labels the
    drafter has to hit), most frequent first."""
    counts: dict[int, int] = {}
    for rec in records:
        n = len(rec["tokens"])
        rows = torch.arange(rec["prompt_len"] - 1, n - 1)  # row j predicts token j+1 (an answer token)
        rows = rows[rec["free"][rows + 1]]
        for t in rec["label"][rows].tolist():
            counts[t] = counts.get(t, 0) + 1
    top = sorted(counts, key=lambda t: -counts[t])[:size]
    return torch.tensor(sorted(top), dtype=torch.long)


def choose_max_depth(free_agreement: list[float], draft_cost: float, step_cost: float) -> int | None:
    """The deepest depth d (contiguous from 0) whose validation agreement pays for the draft:
    ``a_d − draft_cost − step_cost·d > 0`` (each depth is one more recurrent head forward). None: depth 0 does not
    pay either (the drafter would only cost)."""
    depth = None
    for d, a in enumerate(free_agreement):
        if a - draft_cost - step_cost * d <= 0:
            break
        depth = d
    return depth


def choose_min_confidence(samples: list[tuple[int, float, bool]], draft_cost: float) -> tuple[float, dict]:
    """The confidence stop maximising Σ (hit − draft_cost) over the validation free positions the head would still
    draft (confidence ≥ threshold); ``(threshold, {"kept", "kept_agreement"})``."""
    best, best_t = 0.0, 0.0
    for t in [0.0] + [i / 40 for i in range(1, 40)]:
        kept = [hit for _, c, hit in samples if c >= t]
        gain = sum(1.0 - draft_cost if hit else -draft_cost for hit in kept)
        if gain > best:
            best, best_t = gain, t
    kept = [hit for _, c, hit in samples if c >= best_t]
    return best_t, {"kept": round(len(kept) / max(len(samples), 1), 3),
                    "kept_agreement": round(sum(kept) / max(len(kept), 1), 3)}


# -- training ----------------------------------------------------------------------------------------------------------
def train_head(head: MTPHead, records: list[dict], *, epochs: float = 1, max_steps: int | None = None,
               lr: float = 1e-3, seed: int = 0, seconds: float | None = None, log=print, **loss_kw) -> list[float]:
    """AdamW with linear warm-up and cosine decay over ``epochs`` passes (or ``max_steps`` sequences), stopping
    early when ``seconds`` run out. Returns the per-step losses."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    total = max_steps or max(1, int(epochs * len(records)))
    warm = min(50, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(warm, 1)) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    losses: list[float] = []
    t0 = time.time()
    step = 0
    while step < total:
        order = list(range(len(records)))
        rng.shuffle(order)
        for i in order:
            if step >= total or (seconds is not None and time.time() - t0 > seconds):
                return losses
            loss, _ = head_loss(head, records[i], seed=seed * 100003 + step, **loss_kw)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step += 1
            if step % 100 == 0:
                log(f"step {step}/{total} loss {sum(losses[-100:]) / 100:.3f} ({time.time() - t0:.0f} s)")
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", required=True, nargs="+", help="directories of scripts/mtp_data.py's shards")
    ap.add_argument("--out", default=None, help="checkpoint directory (default checkpoints/mtp-<sha16>)")
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--seconds", type=float, default=None, help="stop training after this many seconds")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--depths", type=int, default=4, help="recurrent depths trained (0 … depths-1)")
    ap.add_argument("--eval-depths", type=int, default=8, help="depths validated (the depth stop is chosen there)")
    ap.add_argument("--step-cost", type=float, default=0.02,
                    help="cost of one recurrent head forward relative to a target forward (depth stop)")
    ap.add_argument("--draft-cost", type=float, default=0.15,
                    help="cost of a drafted token relative to the target forward it may save (confidence stop)")
    ap.add_argument("--draft-vocab", type=int, default=4096,
                    help="draft vocabulary size: most frequent free answer tokens in training (0: score every "
                         "allowed token)")
    ap.add_argument("--save-dtype", choices=("float32", "float16"), default="float32",
                    help="dtype the weights are stored in (float16 halves the checkpoint)")
    ap.add_argument("--drafter", choices=card_drafters(), default=None,
                    help="the card's 'drafter': what the default drafter 'auto' uses with this head (default: the one "
                         "in the card already at --out, else lookup; set it from the benchmark)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    from decoding import load_model
    from decoding.mtp import DEFAULT_CHECKPOINT_DIR
    from mtp_data import is_validation

    loaded = load_model(args.model)
    for p in loaded.model.parameters():
        p.requires_grad_(False)
    records = [r for d in args.data for r in load_records(Path(d))]
    data_summary = [json.loads((Path(d) / "summary.json").read_text()) for d in args.data
                    if (Path(d) / "summary.json").exists()]
    val = [r for r in records if is_validation(r["group"])]
    train = [r for r in records if not is_validation(r["group"])]
    count = lambda rs, key: int(sum(int(r[key].sum()) for r in rs))  # noqa: E731
    print(f"{len(train)} training sequences ({sum(len(r['tokens']) for r in train)} tokens, "
          f"{count(train, 'answer')} answer, {count(train, 'free')} free), {len(val)} validation", flush=True)
    head = MTPHead(loaded.model)
    t0 = time.time()
    losses = train_head(head, train, epochs=args.epochs, lr=args.lr, seed=args.seed, seconds=args.seconds,
                        depths=args.depths, log=lambda s: print(s, flush=True))
    train_seconds = time.time() - t0
    head.eval()
    if args.draft_vocab:
        head.draft_vocab = draft_vocabulary(train, args.draft_vocab)
    t0 = time.time()
    result = evaluate(head, val, depths=args.eval_depths)
    samples = result.pop("samples")
    max_depth = choose_max_depth(result["free"], args.draft_cost, args.step_cost)
    max_depth = -1 if max_depth is None else max_depth  # -1: not even depth 0 pays, the drafter never drafts
    threshold, kept = choose_min_confidence([x for x in samples if x[0] <= max_depth],
                                            args.draft_cost)
    print(json.dumps({"validation": result, "max_depth": max_depth, "min_confidence": threshold, **kept,
                      "eval_seconds": round(time.time() - t0)}), flush=True)
    head.min_confidence = threshold
    head.max_depth = max_depth
    sha = target_sha256(loaded)
    out = Path(args.out) if args.out else DEFAULT_CHECKPOINT_DIR / f"mtp-{sha[:16]}"
    kinds: dict = {}
    categories: dict = {}
    for r in train:
        c = categories.setdefault(r.get("category", "?"), {"sequences": 0, "tokens": 0, "answer_tokens": 0})
        c["sequences"] += 1
        c["tokens"] += len(r["tokens"])
        c["answer_tokens"] += int(r["answer"].sum())
        k = kinds.setdefault(r["kind"], {"sequences": 0, "answer_tokens": 0})
        k["sequences"] += 1
        k["answer_tokens"] += int(r["answer"].sum())
    card = {"target": loaded.name, "target_sha256": sha, "architecture": "DeepSeek-V3 depth-1 MTP module: "
            "RMSNorm(h) || RMSNorm(Emb(x)) -> Linear(2d->d) -> 1 decoder layer of the target's architecture -> "
            "shared final norm + LM head", "stand_in": head.stand_in_kind, "min_confidence": threshold, "max_depth": max_depth,
            "draft_vocab": 0 if head.draft_vocab is None else len(head.draft_vocab),
            "data": {"sources": "BFCL dev split (first half of each shared file) of every category: the target's "
                                "constrained greedy turn + the ground-truth call in the model's tool format; "
                                "MaskBench github/glaive/other valid instances as tool calls (never MaskBench bfcl); "
                                "JSONSchemaBench first-half schemas as tools with the target's constrained greedy "
                                "instance",
                     "held_out": "BFCL test split (second half of each file) never read; validation = 1 in 12 "
                                 "question/schema groups (mtp_data.is_validation)",
                     "train_sequences": len(train), "train_tokens": sum(len(r["tokens"]) for r in train),
                     "train_answer_tokens": count(train, "answer"), "train_free_answer_tokens": count(train, "free"),
                     "by_kind": kinds, "validation_sequences": len(val),
                     "by_category": categories, "generation": data_summary},
            "training": {"steps": len(losses), "epochs": round(len(losses) / max(len(train), 1), 2),
                         "depths": args.depths, "lr": args.lr, "seconds": round(train_seconds),
                         "final_loss": round(sum(losses[-100:]) / max(len(losses[-100:]), 1), 4),
                         "threads": args.threads},
            "validation": {**result, "max_depth": max_depth, "min_confidence": threshold, **kept,
                           "draft_cost": args.draft_cost, "step_cost": args.step_cost,
                           "metric": "top-1 agreement with the target's token two ahead (no grammar mask; over the draft "
                                     "candidates: draft vocabulary + prompt tokens), by recurrent depth (0 = the "
                                     "target's own hidden state), free = answer tokens the grammar does not force"},
            "seconds_total": round(time.time() - t_start), "seed": args.seed,
            "command": "python scripts/train_mtp.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    card["weights_dtype"] = args.save_dtype
    old_card = out / "mtp_head.json"
    card["drafter"] = args.drafter or (json.loads(old_card.read_text()).get("drafter", "lookup")
                                       if old_card.exists() else "lookup")
    save_head(head, out, card, dtype=getattr(torch, args.save_dtype))
    print(f"saved {out} ({card['seconds_total']} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
