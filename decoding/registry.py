"""The drafter table: one name → factory row per drafting mode, used by the CLI, the agent and the benchmark.

Adding a drafter is one class (a :class:`decoding.drafters.Drafter` subclass) and one row here; see
docs/architecture.md, "Add a drafter".

A factory takes the :class:`decoding.Generator` (for what the drafter needs from the target: its draft model, its
MTP head) and returns a fresh drafter for one sequence, or None: ``none`` is the non-speculative reference decode
(``decoding/decoder.py``), ``forced`` is speculative with schema-forced tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .backends import HIDDEN_STATES, TORCH_WEIGHTS
from .drafters import ChainDrafter, Drafter, DraftModelDrafter, PromptLookupDrafter, SchemaDrafter
from .mtp import MTPDrafter



class DrafterHost(Protocol):
    """What a factory reads from the target (a :class:`decoding.Generator` provides it; typed here without importing
    it, so the table does not import the generator that imports the table)."""

    def new_draft_target(self) -> Any: ...

    def mtp_head(self) -> Any: ...

    def resolve_drafter(self, name: str) -> str: ...


DrafterFactory = Callable[[DrafterHost], "Drafter | None"]


@dataclass(frozen=True)
class DrafterRow:
    """One row of :data:`DRAFTERS`.

    Attributes:
        make: the factory: ``make(generator) -> Drafter | None``, a fresh drafter for one sequence.
        needs: what the drafter needs from the backend (``decoding.backends.HIDDEN_STATES``, ``TORCH_WEIGHTS``);
            a backend that does not provide it all refuses the drafter (``Backend.supports``).
        summary: one line for docs and help.
    """

    make: DrafterFactory
    needs: frozenset[str] = frozenset()
    summary: str = ""

    def __call__(self, generator: DrafterHost) -> Drafter | None:
        return self.make(generator)


_MTP_NEEDS = frozenset({HIDDEN_STATES, TORCH_WEIGHTS})  # the head reads the target's states and its torch weights

DRAFTERS: dict[str, DrafterRow] = {
    "none": DrafterRow(lambda gen: None, summary="non-speculative reference: one token per target forward"),
    "forced": DrafterRow(lambda gen: None, summary="schema-forced tokens only (the mask allows one token)"),
    "schema": DrafterRow(lambda gen: SchemaDrafter(), summary="forced + llguidance fast-forward tokens"),
    "lookup": DrafterRow(lambda gen: ChainDrafter([SchemaDrafter(), PromptLookupDrafter()]),
                         summary="forced + fast-forward + prompt lookup"),
    "draft_model": DrafterRow(
        lambda gen: ChainDrafter([SchemaDrafter(), DraftModelDrafter(gen.new_draft_target())]),
        summary="forced + fast-forward + a smaller draft model (same tokenizer, on the target's backend)"),
    # forced tokens are free; the head drafts the rest
    "mtp": DrafterRow(lambda gen: MTPDrafter(gen.mtp_head()), needs=_MTP_NEEDS,
                      summary="forced + the model's MTP head"),
    "lookup_mtp": DrafterRow(
        lambda gen: ChainDrafter([SchemaDrafter(), PromptLookupDrafter(), MTPDrafter(gen.mtp_head())]),
        needs=_MTP_NEEDS, summary="forced + fast-forward + prompt lookup, the MTP head where lookup finds nothing"),
}
# ``auto``: the drafter the model's MTP head card names (``"drafter"``, the fastest on the benchmark's test split),
# where a head loads on a backend that runs it; else ``lookup`` (resolved by ``Generator.resolve_drafter``)
AUTO = "auto"
FALLBACK_DRAFTER = "lookup"
DEFAULT_DRAFTER = AUTO
DEFAULT_NUM_DRAFT_TOKENS = 4  # γ, drafter tokens per speculative window


def drafter_choices() -> tuple[str, ...]:
    """``auto`` and every row of :data:`DRAFTERS`, read now (a row added later is a choice too)."""
    return (AUTO, *DRAFTERS)


def card_drafters() -> tuple[str, ...]:
    """What an MTP card's ``"drafter"`` may name (``draft_model`` needs a second model, which a card cannot
    supply)."""
    return tuple(d for d in DRAFTERS if d != "draft_model")


def check_drafter(name: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``name`` is ``auto`` or a row of :data:`DRAFTERS`."""
    if name not in drafter_choices():
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(drafter_choices())}")


def make_drafter(name: str, generator: DrafterHost) -> Drafter | None:
    """A fresh drafter for mode ``name`` (``auto`` resolved for the generator's model; None for ``none`` /
    ``forced``). Raises ``ValueError`` for an unknown name, and whatever the factory raises (no draft model, no MTP
    checkpoint)."""
    check_drafter(name)
    return DRAFTERS[generator.resolve_drafter(name)].make(generator)
