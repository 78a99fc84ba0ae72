"""Shared fixtures: the real SmolLM2 tokenizer, tiny random Llama models over its vocabulary, a tiny-vocabulary
tokenizer for exact distribution tests, and (marked ``model``) the real SmolLM2-135M-Instruct."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def smol_dir():
    from decoding.loader import resolve_model

    directory, _, _ = resolve_model("smollm2")
    return directory


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir, local_files_only=True)


def tiny_llama(vocab_size: int, seed: int, *, hidden: int = 32, layers: int = 2, init: float = 0.5):
    """A randomly initialised Llama (float32, CPU) with spread-out logits (no near-ties in argmax)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=init,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    return model


@pytest.fixture(scope="session")
def tiny_target(smol_tokenizer):
    from decoding import LoadedModel

    return LoadedModel(tiny_llama(smol_tokenizer.vocab_size, 0), smol_tokenizer, "tiny-target", None,
                       torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def tiny_draft(smol_tokenizer):
    from decoding import LoadedModel

    return LoadedModel(tiny_llama(smol_tokenizer.vocab_size, 1, hidden=16, layers=1), smol_tokenizer, "tiny-draft",
                       None, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def smol():
    from decoding import load_model

    return load_model("smollm2")


class CharTokenizer:
    """A tiny byte-level tokenizer for llguidance: single characters, a few merges and EOS (id 0)."""

    def __init__(self, alphabet: str = 'ab{}":,[]0123456789', merges: tuple[str, ...] = ("ab", "ba", "aa", '{"', '":')):
        self.tokens = [b"<eos>"] + [c.encode() for c in alphabet] + [m.encode() for m in merges]
        self.eos_token_id = 0
        self.bos_token_id = None
        self.special_token_ids = [0]
        self._ids = {t: i for i, t in enumerate(self.tokens)}

    def __call__(self, s):
        data = s if isinstance(s, bytes) else s.encode()
        out, i = [], 0
        while i < len(data):
            for n in (2, 1):
                piece = data[i:i + n]
                if len(piece) == n and piece in self._ids:
                    out.append(self._ids[piece])
                    i += n
                    break
            else:
                raise ValueError(f"cannot tokenize {data[i:i+1]!r}")
        return out


@pytest.fixture(scope="session")
def char_tokenizer():
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    tok = CharTokenizer()
    return tok, llguidance.LLTokenizer(TokenizerWrapper(tok))
