"""Token bitmasks: ``int32 [rows, ceil(V/32)]``, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed.

The layout is llguidance's (``llguidance.torch.allocate_token_bitmask``); applying it here avoids the
``torch.compile`` kernel that llguidance's helper uses, which needs a compiler and warm-up on CPU.
"""
from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU ``int32 [rows, ceil(vocab_size/32)]`` bitmask, all tokens allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bool [rows, vocab_size]`` from an ``int32 [rows, W]`` bitmask (True = allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to ``-inf`` in place and return them.

    Args:
        logits: ``float [rows, V]`` (any device). Columns past ``32 * W`` are disallowed.
        bitmask: ``int32 [rows, W]`` on CPU or the logits' device.
    """
    rows, vocab = logits.shape
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), min(vocab, bitmask.shape[1] * 32))
    if allowed.shape[1] < vocab:
        logits[:, allowed.shape[1]:] = float("-inf")
        logits = logits[:, : allowed.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))
    return logits


def single_allowed(bitmask_row: torch.Tensor) -> int | None:
    """The one allowed token id if the ``int32 [W]`` row allows exactly one token, else None."""
    nz = torch.nonzero(bitmask_row).flatten()
    if nz.numel() != 1:
        return None
    word = int(nz[0])
    value = int(bitmask_row[word]) & 0xFFFFFFFF
    if value & (value - 1):
        return None
    return word * 32 + value.bit_length() - 1


def is_allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    """Whether ``token`` is allowed by the ``int32 [W]`` row."""
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int64 [n]`` ids allowed by one ``int32 [W]`` row."""
    return unpack_bitmask(bitmask_row.unsqueeze(0), vocab_size)[0].nonzero().flatten()
