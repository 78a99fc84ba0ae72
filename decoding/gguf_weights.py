"""The target's shared weights for the MTP head, read from a GGUF: token embedding, final norm and LM head.

The MTP head (``decoding/mtp.py``) shares three modules with its target and trains none of them. On the torch
backend they are the loaded model's own modules; on the llama.cpp backend no torch model exists, so
:func:`shared_target` builds a small module holding just those three, de-quantised from the same GGUF with the
``gguf`` package (the same de-quantisation transformers applies when the torch backend loads the GGUF, so the head
sees the weights it was trained with), plus the target's config and its decoder-layer and rotary-embedding classes
(the head's one block is a layer of the target's own architecture).

Built once per GGUF (cached de-quantised on disk, memoised per process by sha256): Qwen2.5-Coder-0.5B's embedding
and LM head are ``[151936, 896]`` float32 each (545 MB; its GGUF stores them apart, Q5_0 and Q8_0).
"""
from __future__ import annotations

import importlib
import threading
from pathlib import Path

import numpy as np
import torch
from torch import nn

from schemas.errors import SpecAgentError


class SharedWeightsError(SpecAgentError, ValueError):
    """The GGUF lacks a tensor the MTP head shares, or its architecture has no transformers classes."""


class SharedTarget(nn.Module):
    """What an :class:`decoding.mtp.MTPHead` reads of its target, without the target's layers.

    Attributes:
        config: the target's transformers config (from the GGUF's metadata).
        model.embed_tokens: ``nn.Embedding [V, d]`` float32, frozen.
        model.norm: the final RMSNorm (``weight float32 [d]``, the config's ``rms_norm_eps``), frozen.
        lm_head: ``nn.Linear(d, V)`` float32 without bias, frozen (the embedding's weight when the GGUF ties them).
        layer_class, rotary_class: the target's decoder-layer and rotary-embedding classes (transformers).
    """

    def __init__(self, config, embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor | None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.model.norm = LlamaRMSNorm(embed.shape[1], eps=config.rms_norm_eps)
        with torch.no_grad():
            self.model.norm.weight.copy_(norm)
        self.lm_head = nn.Linear(embed.shape[1], embed.shape[0], bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight if lm_head is None else nn.Parameter(lm_head)
        self.layer_class, self.rotary_class = layer_classes(config)
        self.requires_grad_(False)
        self.eval()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def layer_classes(config) -> tuple[type, type]:
    """``(DecoderLayer class, RotaryEmbedding class)`` of the transformers architecture of ``config``
    (``Qwen2DecoderLayer``, ``Qwen2RotaryEmbedding`` for ``model_type == "qwen2"``).

    Raises:
        SharedWeightsError: transformers has no causal LM of that ``model_type``.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = config.model_type
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
    if not arch:
        raise SharedWeightsError(f"transformers has no causal LM for model_type {kind!r}: the MTP head cannot be built")
    prefix = arch.removesuffix("ForCausalLM")
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    try:
        return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding")
    except AttributeError:
        raise SharedWeightsError(f"transformers' {module.__name__} has no {prefix}DecoderLayer / "
                                 f"{prefix}RotaryEmbedding: the MTP head cannot be built") from None


def _dequantized(reader, name: str) -> torch.Tensor | None:
    """``float32 [rows, cols]`` (or ``[n]``) of GGUF tensor ``name``, de-quantised; None when the file lacks it."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name == name:
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dimensions innermost first
            data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            return torch.from_numpy(np.array(data, copy=True))  # writable, contiguous
    return None


_CACHE: dict[str, SharedTarget] = {}
_LOCK = threading.Lock()


def shared_target(gguf: Path, sha256: str) -> SharedTarget:
    """The :class:`SharedTarget` of GGUF file ``gguf`` (``token_embd``, ``output_norm``, and ``output`` or the tied
    embedding), memoised per process by ``sha256`` and cached on disk de-quantised
    (``<cache>/mtp-shared/<sha256[:16]>/``: the config and a float32 safetensors file), since reading a GGUF's
    metadata with the ``gguf`` package takes ~10–15 s for Qwen's (its vocabulary and merges) and de-quantising ~3 s.

    Raises:
        SharedWeightsError: a tensor is missing or the architecture is unknown to transformers.
    """
    with _LOCK:
        if sha256 in _CACHE:
            return _CACHE[sha256]
        from safetensors.torch import load_file, save_file
        from transformers import AutoConfig

        from .loader import built_dir, cache_root

        out = cache_root() / "mtp-shared" / sha256[:16]
        if not (out / "shared.safetensors").exists():
            from gguf import GGUFReader

            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            reader = GGUFReader(str(gguf))
            tensors = {name: t for name in ("token_embd.weight", "output_norm.weight", "output.weight")
                       if (t := _dequantized(reader, name)) is not None}  # output.weight absent: tied
            if "token_embd.weight" not in tensors or "output_norm.weight" not in tensors:
                raise SharedWeightsError(f"{gguf.name} has no token_embd.weight / output_norm.weight: the MTP head "
                                         f"shares them")
            with built_dir(out) as tmp:
                config.save_pretrained(tmp)
                save_file(tensors, tmp / "shared.safetensors")
        config = AutoConfig.from_pretrained(out, local_files_only=True)
        tensors = load_file(out / "shared.safetensors")
        target = SharedTarget(config, tensors["token_embd.weight"], tensors["output_norm.weight"],
                              tensors.get("output.weight"))
        _CACHE[sha256] = target
        return target
