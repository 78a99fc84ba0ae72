"""Sampling settings and the masked, renormalised distributions used by both decoders.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1) needs the target distribution p and the
draft distribution q to be the *same transform* of their logits: grammar mask -> temperature -> top-p ->
renormalise. :func:`probs_from_logits` is that transform, used for p and q alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy (argmax of the masked logits).

    Attributes:
        temperature: > 0 for sampling.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        seed: seed of the run's ``torch.Generator`` (None: nondeterministic).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The run's generator on ``device`` (the target's: every draw of the run is made there)."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def probs_from_logits(masked_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``float32 [rows, V]`` probabilities from already-masked logits (``-inf`` = forbidden).

    Temperature scaling, then top-p (keep the smallest set of most likely tokens whose mass reaches ``top_p``),
    then renormalisation. Rows must allow at least one token.
    """
    logits = masked_logits.float() / max(params.temperature, 1e-6)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= params.top_p  # mass before this token already reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from ``float32 [V]`` probabilities, on the generator's device (a CUDA generator cannot
    draw for CPU tensors, nor a CPU generator for CUDA ones)."""
    return int(torch.multinomial(probs.to(generator.device), 1, generator=generator))


def pick(masked_logits: torch.Tensor, params: SamplingParams,
         generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """The next token from masked logits ``[1, V]`` (``-inf`` = forbidden): ``(argmax, None)`` when greedy (a
    deterministic choice is a one-hot q), else ``(a draw from q, q)`` with ``q`` = :func:`probs_from_logits`
    ``float32 [V]``, the distribution the Leviathan et al. 2023 (Alg. 1) acceptance test needs."""
    if params.greedy:
        return int(torch.argmax(masked_logits[0])), None
    q = probs_from_logits(masked_logits, params)[0]
    return sample(q, generator), q
