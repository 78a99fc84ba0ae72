"""Hugging Face tokenizer -> llguidance tokenizer (cached: building one takes ~0.3–1 s)."""
from __future__ import annotations

import threading
import weakref

import llguidance
import llguidance.hf

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def llg_tokenizer(hf_tokenizer, n_vocab: int, eos_token_id: int | None = None) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for ``hf_tokenizer`` with ``n_vocab`` = the model's logits width.

    The logits width can exceed the tokenizer's vocabulary (Qwen2.5 pads to 151936); masks then have that width
    and the padding ids are never allowed.
    """
    key = (n_vocab, eos_token_id)
    with _LOCK:
        per_tok = _CACHE.setdefault(hf_tokenizer, {})
        if key not in per_tok:
            per_tok[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token_id)
        return per_tok[key]
