"""A thin KV-cached forward wrapper over a transformers causal LM (target or draft model)."""
from __future__ import annotations

import torch

from .loader import LoadedModel


class CausalLM:
    """KV-cached forwards of a transformers causal LM.

    The cache holds keys/values for ``self.length`` tokens; :meth:`forward` appends, :meth:`crop` removes from
    the end (rollback after a rejected draft).
    """

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = loaded.vocab_size
        self.cache = None

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    @property
    def length(self) -> int:
        """Tokens whose keys/values are in the cache."""
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    @torch.inference_mode()
    def forward(self, tokens: list[int], *, num_logits: int | None = None,
                hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` after the cached ones.

        Args:
            tokens: ``k >= 1`` token ids.
            num_logits: logits for the last ``num_logits`` positions (default all ``k``).
        Returns:
            ``(logits float32 [num_logits, V], last-layer hidden states [k, d] or None)``.
        """
        if self.cache is None:
            self.reset()
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        n = len(tokens) if num_logits is None else num_logits
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=n,
                         output_hidden_states=hidden)
        logits = out.logits[0].float()
        h = out.hidden_states[-1][0] if hidden else None
        return logits, h

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens."""
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot crop the KV cache to {length}: it holds {self.length}")
        if extra:
            self.cache.crop(-extra)
