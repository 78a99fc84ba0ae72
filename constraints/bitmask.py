"""Token bitmasks: ``int32 [rows, ceil(V/32)]``, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed.

The layout is llguidance's (``llguidance.torch.allocate_token_bitmask``); applying it here avoids the
``torch.compile`` kernel that llguidance's helper uses, which needs a compiler and warm-up on CPU.
"""
from __future__ import annotations

import threading

import torch

_SHIFTS = {torch.device("cpu"): torch.arange(32, dtype=torch.int32)}  # bit positions, one constant per device
_STAGING = threading.local()  # per thread and CUDA device: (pinned int32 buffer, event of its last copy)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU ``int32 [rows, ceil(vocab_size/32)]`` bitmask, all tokens allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bool [rows, vocab_size]`` from an ``int32 [rows, W]`` bitmask (True = allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _shifts(device: torch.device) -> torch.Tensor:
    """``int32 [32]`` bit positions on ``device`` (uploaded once per device)."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS.setdefault(device, _SHIFTS[torch.device("cpu")].to(device))
    return shifts


def to_device(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``bitmask`` on ``device``; a CPU mask bound for CUDA is copied through a pinned (page-locked) buffer, so
    the upload is one asynchronous DMA instead of a pageable copy. The buffer is reused: before it is
    overwritten, the previous upload from it is waited for (a CUDA event)."""
    if bitmask.device == device or device.type != "cuda" or bitmask.device.type != "cpu":
        return bitmask.to(device)
    key = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    staging = getattr(_STAGING, "buffers", None)
    if staging is None:
        staging = _STAGING.buffers = {}
    buffer, done = staging.get(key, (None, None))
    if buffer is None or buffer.numel() < bitmask.numel():
        buffer = torch.empty(max(bitmask.numel(), 4096), dtype=torch.int32).pin_memory()
        done = None
    if done is not None:
        done.synchronize()
    staged = buffer[: bitmask.numel()].view(bitmask.shape)
    staged.copy_(bitmask)
    out = staged.to(device, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(key))
    staging[key] = (buffer, done)
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to ``-inf`` in place and return them.

    Args:
        logits: ``float [rows, V]`` (any device). Columns past ``32 * W`` are disallowed.
        bitmask: ``int32 [rows, W]`` on CPU or the logits' device (a CPU mask goes to CUDA through a pinned
            buffer, :func:`to_device`).
    """
    rows, vocab = logits.shape
    allowed = unpack_bitmask(to_device(bitmask, logits.device), min(vocab, bitmask.shape[1] * 32))
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


def allow_tokens(bitmask_row: torch.Tensor, token_ids: list[int]) -> None:
    """Set the bits of ``token_ids`` in the ``int32 [W]`` row (in place)."""
    for token in token_ids:
        word = int(bitmask_row[token // 32]) | (1 << (token % 32))
        bitmask_row[token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as a signed int32


def allowed_among(bitmask_row: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``int64 [m]``: the ids of ``token_ids`` (``int64 [n]``) that the ``int32 [W]`` row allows, in their order
    (:func:`is_allowed` for many ids at once, without unpacking the whole row)."""
    row = bitmask_row.to(token_ids.device)
    return token_ids[((row[token_ids >> 5] >> (token_ids & 31)) & 1).bool()]


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``int64 [n]`` ids allowed by one ``int32 [W]`` row."""
    return unpack_bitmask(bitmask_row.unsqueeze(0), vocab_size)[0].nonzero().flatten()
