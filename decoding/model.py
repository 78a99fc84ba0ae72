"""A thin KV-cached forward wrapper over a transformers causal LM (target or draft model).

Two KV caches:

- ``"dynamic"`` (transformers' ``DynamicCache``): every forward ``torch.cat``-copies the cache to append; ``crop``
  slices. The default on CPU, where it is the faster of the two (the static cache attends over its whole capacity).
- ``"static"`` (transformers' ``StaticCache``, preallocated keys/values written in place): ``crop`` only moves the
  length, O(1) — the stale entries past it are masked out by the causal mask (query positions start at the length)
  and overwritten by the next forward. The default on CUDA (gpt-fast's preallocated cache).
"""
from __future__ import annotations

import torch

from .loader import LoadedModel

CACHES = ("dynamic", "static")
_STATIC_MIN_CAPACITY = 256  # tokens; the static cache's capacity is a multiple of this and grows by doubling


def check_cache(cache: str | None) -> str | None:
    """``cache`` if it names a KV cache (or is None: the device's default).

    Raises:
        ValueError: an unknown name.
    """
    if cache is not None and cache not in CACHES:
        raise ValueError(f"unknown KV cache {cache!r}; use one of {list(CACHES)}")
    return cache


def default_cache(device: torch.device | str) -> str:
    """The KV cache for a device: ``"static"`` on CUDA, ``"dynamic"`` elsewhere."""
    return "static" if torch.device(device).type == "cuda" else "dynamic"


class CausalLM:
    """KV-cached forwards of a transformers causal LM.

    The cache holds keys/values for ``self.length`` tokens; :meth:`forward` appends, :meth:`crop` removes from
    the end (rollback after a rejected draft).

    Args:
        loaded: the model.
        cache: ``"dynamic"`` or ``"static"`` (see the module docstring); None: :func:`default_cache` of the
            model's device.
        max_length: static cache only: the initial capacity in tokens (default: what the first forward needs,
            rounded up to 256). A forward past the capacity reallocates it at twice the size (one copy), never
            past the model's ``context_length``.

    Raises:
        ValueError: an unknown ``cache``, or a static cache for a model whose layers are not all full attention.
    """

    def __init__(self, loaded: LoadedModel, *, cache: str | None = None, max_length: int | None = None):
        cache = default_cache(loaded.device) if check_cache(cache) is None else cache
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.vocab_size
        self.cache_kind = cache
        self.max_length = max_length
        self.cache = None
        self._length = 0  # static cache: tokens held (tracked here, so reading it never syncs with the device)

    def reset(self) -> None:
        """Empty the cache (a static cache keeps its buffers; nothing is reallocated)."""
        from transformers import DynamicCache

        self._length = 0
        if self.cache_kind == "dynamic":
            self.cache = DynamicCache(config=self.model.config)
        elif self.cache is not None:
            self._set_static_length(0)

    def reuse_prefix(self, prompt: list[int], hidden: bool = False) -> int:
        """Prefix caching hook of the backend interface (see ``LlamaCppLM.reuse_prefix``): this cache lives for one
        decode, so nothing is reused — it is emptied and 0 is returned."""
        self.reset()
        return 0

    def cached_hidden(self, n: int) -> torch.Tensor:
        """Hidden states kept from earlier decodes: none here (:meth:`reuse_prefix` reuses nothing). Raises
        ``ValueError`` for ``n > 0``."""
        if n:
            raise ValueError(f"no hidden states are kept across decodes on the torch backend ({n} asked for)")
        return torch.zeros(0, self.model.config.hidden_size, device=self.device)

    @property
    def length(self) -> int:
        """Tokens whose keys/values are in the cache."""
        if self.cache_kind == "static":
            return self._length
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    @property
    def capacity(self) -> int | None:
        """Static cache: tokens it can hold before it is reallocated (None before the first forward / dynamic)."""
        if self.cache_kind != "static" or self.cache is None:
            return None
        return self.cache.layers[0].max_cache_len

    @torch.inference_mode()
    def forward(self, tokens: list[int], *, num_logits: int | None = None, hidden: bool = False,
                logit_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` after the cached ones.

        Args:
            tokens: ``k >= 1`` token ids.
            num_logits: logits for the last ``num_logits`` positions (default all ``k``).
            logit_rows: instead, the increasing indices (into ``tokens``) of the positions whose logits are wanted
                (the LM head runs for those rows only: transformers' ``logits_to_keep`` as an index tensor).
        Returns:
            ``(logits float32 [num_logits or len(logit_rows), V], last-layer hidden states [k, d] or None)``, on
            ``self.device``.
        Raises:
            ValueError: static cache: the sequence would exceed the model's context length.
        """
        if self.cache is None and self.cache_kind == "dynamic":
            self.reset()
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        if logit_rows is not None:  # an index tensor (possibly empty: no LM head at all), not an int (0 = keep all)
            n = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        else:
            n = len(tokens) if num_logits is None else num_logits
        extra = {}
        if self.cache_kind == "static":
            end = self._length + len(tokens)
            self._reserve(end)
            extra["position_ids"] = torch.arange(self._length, end, device=self.device)[None]
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=n,
                         output_hidden_states=hidden, **extra)
        if self.cache_kind == "static":
            self._length = end
        logits = out.logits[0].float()
        h = out.hidden_states[-1][0] if hidden else None
        return logits, h

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (static cache: O(1), only the length moves).

        Raises:
            ValueError: ``length`` exceeds what the cache holds.
        """
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot crop the KV cache to {length}: it holds {self.length}")
        if not extra:
            return
        if self.cache_kind == "static":
            self._set_static_length(length)
        else:
            self.cache.crop(-extra)

    def synchronize(self) -> None:
        """Wait for the device's queued work (``torch.cuda.synchronize`` on CUDA; nothing on CPU), so that a
        ``time.perf_counter()`` read after it times the work, not its launch."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- static cache ------------------------------------------------------------------------------------------------
    @torch.inference_mode()  # the layers' tensors were made in inference mode (in forward)
    def _set_static_length(self, length: int) -> None:
        # StaticLayer keeps its write position (and the mask's query offset) in a tensor, `cumulative_length`
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)
        self._length = length

    def _reserve(self, needed: int) -> None:
        """Make the static cache hold at least ``needed`` tokens (reallocate at twice the size, copying the
        ``self.length`` cached tokens)."""
        old = self.cache
        if old is not None and needed <= self.capacity:
            return
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        limit = self.loaded.context_length
        if limit is not None and needed > limit:
            raise ValueError(f"{needed} tokens exceed {self.loaded.name}'s context length {limit}")
        size = max(needed, self.max_length or 0, 2 * self.capacity if old is not None else 0)
        size = -(-size // _STATIC_MIN_CAPACITY) * _STATIC_MIN_CAPACITY
        if limit is not None:
            size = min(size, limit)
        new = StaticCache(config=self.model.config, max_cache_len=size)
        if any(type(layer) is not StaticLayer for layer in new.layers):
            raise ValueError(f"a static KV cache needs full-attention layers only; {self.loaded.name} has "
                             f"{sorted({type(layer).__name__ for layer in new.layers})}: use cache='dynamic'")
        if old is not None and self._length:
            n = self._length
            for src, dst in zip(old.layers, new.layers):
                if src.is_initialized:
                    dst.lazy_initialization(src.keys, src.values)
                    dst.keys[:, :, :n].copy_(src.keys[:, :, :n])
                    dst.values[:, :, :n].copy_(src.values[:, :, :n])
        self.cache = new
        self._set_static_length(self._length)
