"""The drafter table: one name → factory row per drafting mode, used by the CLI, the agent and the benchmark.

Adding a drafter is one class (a :class:`decoding.drafters.Drafter` subclass) and one row here; see
docs/architecture.md, "Add a drafter".

A factory takes the :class:`decoding.Generator` (for what the drafter needs from the target: its draft model, its
MTP head) and returns a fresh drafter for one sequence, or None: ``none`` is the non-speculative reference decode
(``decoding/decoder.py``), ``forced`` is speculative with schema-forced tokens only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .drafters import ChainDrafter, Drafter, DraftModelDrafter, PromptLookupDrafter, SchemaDrafter
from .model import CausalLM
from .mtp import MTPDrafter

if TYPE_CHECKING:
    from .generator import Generator

DrafterFactory = Callable[["Generator"], "Drafter | None"]

DRAFTERS: dict[str, DrafterFactory] = {
    "none": lambda gen: None,
    "forced": lambda gen: None,
    "schema": lambda gen: SchemaDrafter(),
    "lookup": lambda gen: ChainDrafter([SchemaDrafter(), PromptLookupDrafter()]),
    "draft_model": lambda gen: ChainDrafter([SchemaDrafter(),
                                             DraftModelDrafter(CausalLM(gen.draft_model(), cache=gen.kv_cache))]),
    # forced tokens are free; the head drafts the rest
    "mtp": lambda gen: MTPDrafter(gen.mtp_head()),
    "lookup_mtp": lambda gen: ChainDrafter([SchemaDrafter(), PromptLookupDrafter(), MTPDrafter(gen.mtp_head())]),
}
# ``auto``: the drafter the model's MTP head card names (``"drafter"``, the fastest on the benchmark's test split),
# where a head loads on the torch engine; else ``lookup`` (resolved by ``Generator.resolve_drafter``)
AUTO = "auto"
FALLBACK_DRAFTER = "lookup"
DEFAULT_DRAFTER = AUTO
DRAFTER_CHOICES = (AUTO, *DRAFTERS)
# what an MTP card's "drafter" may name (``draft_model`` needs a second model, which a card cannot supply)
CARD_DRAFTERS = tuple(d for d in DRAFTERS if d != "draft_model")
DEFAULT_NUM_DRAFT_TOKENS = 4  # γ, drafter tokens per speculative window


def check_drafter(name: str) -> None:
    """Raise ``ValueError`` naming the choices unless ``name`` is ``auto`` or a row of :data:`DRAFTERS`."""
    if name not in DRAFTER_CHOICES:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTER_CHOICES)}")


def make_drafter(name: str, generator: "Generator") -> Drafter | None:
    """A fresh drafter for mode ``name`` (``auto`` resolved for the generator's model; None for ``none`` /
    ``forced``). Raises ``ValueError`` for an unknown name, and whatever the factory raises (no draft model, no MTP
    checkpoint)."""
    check_drafter(name)
    return DRAFTERS[generator.resolve_drafter(name)](generator)
