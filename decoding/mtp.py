"""Multi-token-prediction (MTP) head and drafter: a light head on the frozen target drafts the next tokens.

The head is DeepSeek-V3's depth-1 MTP module (arXiv 2412.19437, §2.2): for position i it takes the target's
last-layer hidden state h_i and the embedding of the next token x_{i+1},

    g_i = Block( W_proj [ RMSNorm(h_i) ‖ RMSNorm(Emb(x_{i+1})) ] ),   logits_i = LMHead(FinalNorm(g_i)) ≈ p(x_{i+2})

where Block is one transformer layer of the target's own architecture (its decoder-layer class with the target's
config) and Emb, FinalNorm and LMHead are the target's own modules, shared and frozen (not copied). Drafting γ > 1
tokens reuses the head recurrently, as Google LiteRT-LM's MTP drafter feeds back its projected activations: where
the target's h_j is not known yet (a drafted position) the head's own output stands in for it — ``FinalNorm(g_{j-1})``
(:meth:`MTPHead.stand_in`), in the same space as h_j, which ``CausalLM.forward(hidden=True)`` returns after the
target's final norm (heads trained before this used the raw g_{j-1}; their card has no ``"stand_in"``).

Drafting stops early, EAGLE-2 style (Li et al. 2024, arXiv 2406.16858, §4: draft where the draft model is confident),
when the head's probability of its own token under the grammar mask falls below ``min_confidence``, or when the
token would be drafted more than ``max_depth`` stand-ins past the target's last verified state (both chosen on the
validation split by ``scripts/train_mtp.py``, stored in the card): a draft that is likely rejected costs head
forwards and a verify row and ends the window anyway. The confidence is calibrated per sequence
(:meth:`MTPDrafter.calibration`): where the head is confidently wrong — a 135M target looping on ``"C:C:C:…"``,
where nearly every confident draft is rejected — its confidence is scaled down by the sequence's own record of
accepted against expected drafts, so drafting pauses instead of spending a verify row per rejected token.

The head keeps a small KV cache for its one block, position-aligned with the sequence; after every verification
the target's hidden states of the accepted positions (taken from the verify forward: no extra target forward)
replace the head's drafted stand-ins.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from constraints import allowed_among, allowed_tokens, apply_bitmask
from schemas.errors import SpecAgentError

from .loader import LoadedModel
from .drafters import Drafter
from .sampling import probs_from_logits, sample

DEFAULT_CHECKPOINT_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


class MTPError(SpecAgentError, ValueError):
    """An MTP checkpoint does not fit the target model (wrong sha256 or shapes)."""


class MTPHead(nn.Module):
    """The MTP module. Trainable: ``hidden_norm``, ``embed_norm``, ``proj`` and ``block``; shared (frozen, not
    registered as parameters): the target's token embedding, final norm and LM head.

    Args:
        target: the target ``LlamaForCausalLM``-style model (``model.embed_tokens``, ``model.norm``, ``lm_head``), or
            on the llama.cpp backend a :class:`decoding.gguf_weights.SharedTarget` (those three de-quantised from the
            GGUF, and the layer classes).
        stand_in: what stands in for the target's hidden state at a drafted position: ``"final_norm"``
            (``FinalNorm(g)``, the target's h space) or ``"raw"`` (g itself, heads trained before the change).
        min_confidence: the drafter's confidence stop (masked probability of its own token; 0: never stop).
        max_depth: the drafter's depth stop: at most this many drafted positions (stand-ins) between the target's
            last known hidden state and the drafted token (None: no limit; -1: never draft).
    """

    def __init__(self, target: nn.Module, *, stand_in: str = "final_norm", min_confidence: float = 0.0,
                 max_depth: int | None = None):
        super().__init__()
        self.max_depth = max_depth
        self.draft_vocab: torch.Tensor | None = None  # int64 [n] (see candidates()); saved beside the weights
        if stand_in not in ("final_norm", "raw"):
            raise ValueError(f"stand_in must be 'final_norm' or 'raw', got {stand_in!r}")
        self.stand_in_kind = stand_in
        self.min_confidence = min_confidence
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        cfg = target.config
        d = cfg.hidden_size
        self.hidden_norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.embed_norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        block_cfg = cfg.__class__.from_dict(cfg.to_dict(), attn_implementation="sdpa")
        # the target's own layer and rotary classes (Llama; Qwen2's carries q/k/v biases); a target without layers
        # (decoding.gguf_weights.SharedTarget, the llama.cpp backend's) names them
        layer_class = getattr(target, "layer_class", None) or type(target.model.layers[0])
        rotary_class = getattr(target, "rotary_class", None) or type(target.model.rotary_emb)
        self.block = layer_class(block_cfg, layer_idx=0)
        self.rotary = rotary_class(block_cfg)
        self.__dict__["_target"] = target  # shared, not a submodule: never saved, never trained, never copied
        with torch.no_grad():
            nn.init.normal_(self.proj.weight, std=0.02)

    @property
    def target(self) -> nn.Module:
        return self.__dict__["_target"]

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor,
                cache: Any = None) -> torch.Tensor:
        """Head states for ``T`` positions.

        Args:
            hidden: ``float [B, T, d]`` target (or recurrent head) hidden states h_i.
            next_tokens: ``int64 [B, T]`` tokens x_{i+1}.
            position_ids: ``int64 [B, T]`` positions i.
            cache: a one-layer ``DynamicCache`` holding earlier positions (None: no cache).
        Returns:
            ``float [B, T, d]`` head outputs g_i (before the final norm).
        """
        emb = self.target.get_input_embeddings()(next_tokens)
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(emb)], dim=-1))
        past = 0 if cache is None else cache.get_seq_length()
        t = x.shape[1]
        # causal over [cached positions | new positions] (explicit: SDPA's is_causal aligns top-left)
        mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)[None, None]
        pos_emb = self.rotary(x, position_ids)
        return self.block(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                          use_cache=cache is not None, position_embeddings=pos_emb)

    def stand_in(self, g: torch.Tensor) -> torch.Tensor:
        """``float [..., d]``: the input that replaces the target's hidden state at the position after ``g``'s."""
        return self.target.model.norm(g) if self.stand_in_kind == "final_norm" else g

    def logits(self, g: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``float [..., V]`` logits of head states, or ``[..., n]`` for ``token_ids`` only (mask-sparse)."""
        h = self.target.model.norm(g)
        w = self.target.get_output_embeddings().weight
        if token_ids is not None:
            w = w[token_ids]
        return h @ w.T

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}

    def candidates(self, prompt_tokens) -> torch.Tensor | None:
        """``int64 [n]`` the token ids the drafter scores for a sequence: the head's draft vocabulary (frequent
        answer tokens, FR-Spec style: Zhao et al. 2025, arXiv 2502.14856, §3) and the prompt's own tokens (argument
        values are often copied; :class:`MTPDrafter` adds the output's tokens as they are accepted). None when the
        head has no draft vocabulary (every allowed token is scored)."""
        if self.draft_vocab is None:
            return None
        prompt = torch.as_tensor(list(prompt_tokens), dtype=torch.long, device=self.draft_vocab.device)
        return torch.unique(torch.cat([self.draft_vocab, prompt]))


def target_sha256(loaded: LoadedModel) -> str:
    """The identity an MTP checkpoint is tied to: the source weights' sha256 (the GGUF as shipped, also for weights
    the llama.cpp backend re-quantised from it: ``source_sha256``), else a hash of the config."""
    if getattr(loaded, "source_sha256", None):
        return loaded.source_sha256
    if loaded.sha256:
        return loaded.sha256
    return hashlib.sha256(json.dumps(loaded.model.config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()


def save_head(head: MTPHead, directory: Path, card: dict, dtype: torch.dtype | None = None) -> None:
    """Write ``mtp_head.safetensors`` and ``mtp_head.json`` (the card) into ``directory``; ``dtype`` (e.g.
    ``torch.float16``) stores the floating-point weights in that type (loading casts them to the target's)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, v in head.trainable_state_dict().items()}
    if head.draft_vocab is not None:
        tensors["draft_vocab"] = head.draft_vocab.to(torch.int32).contiguous()
    save_file(tensors, directory / "mtp_head.safetensors")
    (directory / "mtp_head.json").write_text(json.dumps(card, indent=2) + "\n")


def read_card(loaded: LoadedModel, directory: Path | str | None = None) -> tuple[Path, dict]:
    """``(directory, card)``: the MTP head card (``mtp_head.json``) for ``loaded`` in ``directory`` (default:
    ``checkpoints/<model sha256[:16]>``), without loading the weights.

    Raises:
        FileNotFoundError: no checkpoint there.
        MTPError: the checkpoint was trained for another target (sha256 mismatch).
    """
    sha = target_sha256(loaded)
    directory = Path(directory) if directory else DEFAULT_CHECKPOINT_DIR / f"mtp-{sha[:16]}"
    card_path = directory / "mtp_head.json"
    if not card_path.exists():
        raise FileNotFoundError(f"no MTP head checkpoint at {directory} for {loaded.name}; train one with "
                                f"scripts/train_mtp.py")
    card = json.loads(card_path.read_text())
    if card.get("target_sha256") != sha:
        raise MTPError(f"MTP head at {directory} was trained for target sha256 {card.get('target_sha256')}, "
                       f"but {loaded.name} has {sha}: refusing a mismatched head")
    return directory, card


def card_drafter(card: dict, backend: str) -> str | None:
    """The drafter an MTP card names for ``backend``: ``card["drafters"][backend]`` where given, else for the
    torch backend ``card["drafter"]`` (chosen on the torch benchmark before the head ran on llama.cpp); None when
    the card names none for that backend."""
    named = card.get("drafters", {})
    if backend in named:
        return named[backend]
    return card.get("drafter") if backend == "torch" else None


def load_head(loaded: LoadedModel, directory: Path | str | None = None,
              target: nn.Module | None = None) -> tuple[MTPHead, dict]:
    """Load the MTP head for ``loaded`` from ``directory`` (default: ``checkpoints/<model sha256[:16]>``).

    ``target``: the module whose embedding, final norm and LM head the head shares (default ``loaded.model``, the
    torch backend's model; the llama.cpp backend passes its :class:`decoding.gguf_weights.SharedTarget`). The head
    runs on that module's device, in its dtype.

    Raises:
        FileNotFoundError: no checkpoint there.
        MTPError: the checkpoint was trained for another target (sha256 mismatch) or its shapes differ.
    """
    directory, card = read_card(loaded, directory)
    from safetensors.torch import load_file

    target = loaded.model if target is None else target
    weight = target.get_input_embeddings().weight
    head = MTPHead(target, stand_in=card.get("stand_in", "raw"),
                   min_confidence=float(card.get("min_confidence", 0.0)),
                   max_depth=card.get("max_depth")).to(weight.device, weight.dtype)
    state = load_file(directory / "mtp_head.safetensors", device=str(weight.device))
    vocab = state.pop("draft_vocab", None)
    if vocab is not None:
        if vocab.numel() and int(vocab.max()) >= target.config.vocab_size:
            raise MTPError(f"MTP head at {directory}: draft vocabulary holds ids past {loaded.name}'s vocabulary")
        head.draft_vocab = vocab.long()
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise MTPError(f"MTP head at {directory} does not fit {loaded.name}: {e}") from None
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise MTPError(f"MTP head at {directory}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    head.eval()
    return head, card


class MTPDrafter(Drafter):
    """Drafts with an :class:`MTPHead` (see module docstring), masked by the grammar row before each token.

    Mask-sparse drafting: when the row allows at most ``sparse_limit`` tokens, only those LM-head rows are
    multiplied (``[n, d]`` instead of ``[V, d]``); when it allows more and the head has a draft vocabulary, only
    the allowed candidates (:meth:`MTPHead.candidates`) are scored, and the draft distribution q is theirs,
    renormalised (verification stays exact for any q).

    Args:
        min_confidence: stop the window (``propose`` returns None) when the masked, renormalised head probability
            (times :meth:`calibration`) is below this — greedy: of the drafted token; sampled: q's largest, decided
            before the draw so the draft stays a draw from q (None: the head's own ``min_confidence``, from its card).
        max_depth: stop the window instead of drafting a token more than this many drafted positions (forced
            ones included) past the target's last verified hidden state (None: the head's ``max_depth``). A free
            token after a long forced run (``", "arguments": {"``…) is then drafted at depth 0 in the next window,
            once the verify forward has given the target's states of the forced tokens.
        calibration_prior: pseudo-count of the per-sequence calibration (:meth:`calibration`); ``inf`` turns it
            off (the head's confidence is used as it is).
        calibration_decay: factor applied to the calibration's counts after every verified window (older windows
            weigh less, so drafting resumes after a pause).
    """

    name = "mtp"
    needs_hidden_states = True

    def __init__(self, head: MTPHead, sparse_limit: int = 512, min_confidence: float | None = None,
                 max_depth: int | None = None, calibration_prior: float = 1.0, calibration_decay: float = 0.8):
        if not calibration_prior > 0 or not 0 < calibration_decay <= 1:
            raise ValueError(f"need calibration_prior > 0 and 0 < calibration_decay <= 1, got {calibration_prior}, "
                             f"{calibration_decay}")
        self.head = head
        self.sparse_limit = sparse_limit
        self.calibration_prior = calibration_prior
        self.calibration_decay = calibration_decay
        self.min_confidence = head.min_confidence if min_confidence is None else min_confidence
        self.max_depth = head.max_depth if max_depth is None else max_depth
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.known = 0  # head-cache positions [0, known) were fed the target's own hidden states
        self.inputs: list[int] = []  # token x_{j+1} fed at head position j
        self.outputs: list[torch.Tensor] = []  # head output g_j at position j ([d])
        self.forwards = 0
        self.sparse_calls = 0
        self.stops = 0  # windows ended by the confidence or depth stop
        self.cand: torch.Tensor | None = None  # the sequence's candidate ids (head.candidates), set by the prefill
        self.pending: dict[int, tuple[int, float]] = {}  # this window's proposals: position -> (token, confidence)
        self.hits = 0.0  # the sequence's judged proposals: accepted (decayed count) ...
        self.expected = 0.0  # ... and the sum of their confidences (decayed)

    def _crop(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)
        del self.inputs[length:]
        del self.outputs[length:]

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, next_tokens: list[int], start: int) -> None:
        """Feed the target's hidden states ``float [m, d]`` of positions ``start … start+m-1`` with the tokens that
        followed them (one head forward); drafted stand-ins from ``start`` on are dropped."""
        if hidden.shape[0] == 0:
            return
        self._crop(min(start, len(self.inputs)))
        if len(self.inputs) != start:
            raise RuntimeError(f"MTP head cache has {len(self.inputs)} positions, observe() starts at {start}")
        pos = torch.arange(start, start + hidden.shape[0], device=hidden.device)[None]
        tok = torch.tensor([next_tokens], device=hidden.device)
        g = self.head(hidden[None].to(self.head.proj.weight.dtype), tok, pos, self.cache)[0]
        if start == 0:
            self.cand = self.head.candidates(next_tokens)
        else:
            self._judge(next_tokens, start)
            if self.cand is not None:  # the output's own tokens become candidates (a value repeated, a loop)
                self.cand = torch.unique(torch.cat([self.cand, tok[0].to(self.cand.device)]))
        self.forwards += 1
        self.inputs.extend(next_tokens)
        self.outputs.extend(g)
        self.known = len(self.inputs)

    def _judge(self, next_tokens: list[int], start: int) -> None:
        """Score this window's proposals against the tokens the target kept (accepted drafts and the bonus token
        at positions ``start + 1 …``); proposals past them were never judged. Then decay the counts."""
        for pos, (tok, confidence) in self.pending.items():
            i = pos - start - 1
            if 0 <= i < len(next_tokens):
                self.hits += float(next_tokens[i] == tok)
                self.expected += confidence
        self.pending.clear()
        self.hits *= self.calibration_decay
        self.expected *= self.calibration_decay

    def calibration(self) -> float:
        """The factor in ``(0, 1]`` that scales the head's confidence before the confidence stop:
        ``min(1, (accepted + prior) / (expected + prior))`` over this sequence's judged proposals, where
        ``expected`` sums their confidences (a calibrated head keeps 1; an overconfident one on this sequence goes
        towards its real acceptance ratio). Counts decay by ``calibration_decay`` per window."""
        prior = self.calibration_prior
        if prior == float("inf"):
            return 1.0
        return min(1.0, (self.hits + prior) / (self.expected + prior))

    def _stop(self, confidence: float) -> bool:
        """Whether the confidence stop ends the window: ``confidence`` (a masked head probability) times
        :meth:`calibration` is below ``min_confidence``. A stop is counted."""
        if self.min_confidence > 0 and confidence * self.calibration() < self.min_confidence:
            self.stops += 1
            return True
        return False

    def _greedy(self, position: int, logits: torch.Tensor, ids: torch.Tensor | None):
        """The greedy proposal from ``logits`` (``float [n]``, ``-inf`` = masked) over ``ids`` (None: the vocabulary
        ids themselves), or None when the confidence stop ends the window."""
        best = int(torch.argmax(logits))
        token = best if ids is None else int(ids[best])
        confidence = float(torch.softmax(logits, -1)[best]) if self.min_confidence > 0 else 1.0
        if self._stop(confidence):
            return None
        self.pending[position] = (token, confidence)  # judged once the target has verified it (_judge)
        return token, None

    @torch.inference_mode()
    def propose(self, tokens, state, bitmask_row, sampling, generator):
        need = len(tokens) - 2  # head position whose output predicts tokens[len(tokens)]
        if self.known == 0 or need < self.known - 1:
            return None
        if self.max_depth is not None and need - (self.known - 1) > self.max_depth:
            self.stops += 1
            return None
        # drop drafted positions whose input token changed (rollback), then run the missing ones recurrently
        for j in range(self.known, len(self.inputs)):
            if j + 1 >= len(tokens) or self.inputs[j] != tokens[j + 1]:
                self._crop(j)
                break
        device = self.head.proj.weight.device
        while len(self.inputs) <= need:
            j = len(self.inputs)
            g = self.head(self.head.stand_in(self.outputs[j - 1])[None, None],
                          torch.tensor([[tokens[j + 1]]], device=device),
                          torch.tensor([[j]], device=device), self.cache)[0, 0]
            self.forwards += 1
            self.inputs.append(tokens[j + 1])
            self.outputs.append(g)
        g = self.outputs[need]
        allowed = allowed_tokens(bitmask_row, self.head.target.config.vocab_size)
        if allowed.numel() > self.sparse_limit and self.cand is not None:  # score the candidates the mask allows
            allowed = allowed_among(bitmask_row, self.cand)
            if allowed.numel() == 0:
                self.stops += 1
                return None
        if 0 < allowed.numel() <= max(self.sparse_limit, 0 if self.cand is None else self.cand.numel()):
            self.sparse_calls += 1
            allowed = allowed.to(device)
            logits = self.head.logits(g, allowed).float()
            if sampling.greedy:
                return self._greedy(len(tokens), logits, allowed)
            masked = torch.full((1, self.head.target.config.vocab_size), float("-inf"), device=device)
            masked[0, allowed] = logits
        else:
            masked = apply_bitmask(self.head.logits(g)[None].float(), bitmask_row[None])
        if sampling.greedy:
            return self._greedy(len(tokens), masked[0], None)
        # sampled: the stop is decided before the draw, from q alone (its largest probability), so a drafted token
        # is a draw from the whole q that verification divides by; a stop that looked at the drawn token would
        # draft from q cut to its confident tokens and bias the output (Leviathan et al. need the q drawn from)
        q = probs_from_logits(masked, sampling)[0]
        if self._stop(float(q.max())):
            return None
        tok = sample(q, generator)
        self.pending[len(tokens)] = (tok, float(q[tok]))
        return tok, q
