"""The tool a turn calls, chosen against the model's prior for it: contextual calibration (Zhao et al. 2021,
"Calibrate Before Use: Improving Few-Shot Performance of Language Models", arXiv 2102.09690, §4), applied to the
name of the call of a one-call turn.

A small model leans towards the tool listed first: Qwen2.5-Coder-0.5B, asked nothing ("N/A") with the tools of a
question listing two to four tools, gives the first-listed tool's name the most probability in 49 of 50 dev questions
(median 0.96; docs/benchmarks.md, "The tool against the model's prior"). The score of tool ``k`` is
``log p(name_k | conversation) − log p(name_k | content-free conversation)``, both teacher-forced after the same
call opening (``<tool_call>\\n{"name": "`` as the decode wrote it) with no grammar; the content-free conversation
keeps the system and developer messages and the tools and replaces the rest by one user message,
:data:`CONTENT_FREE`. Only the tools whose name's first token the model gives at least :data:`MIN_PROBABILITY`
after the conversation are candidates (a name the model all but rules out is not made likely by a small prior).
:meth:`agent.engine.LocalEngine.turn` decodes the turn again with the calls restricted to the tool of the highest
score where that is not the tool the decode chose (``EngineConfig.tool_prior``).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict

import torch

CONTENT_FREE = "N/A"  # the content-free input of Zhao et al. (2021), §4
PRIOR_CACHE_SIZE = 64  # content-free prompts whose scores an engine keeps (one per tool list, system prompt, opening)
MIN_PROBABILITY = 0.01  # a tool whose name's first token the model gives less after the conversation is no candidate
_NAME_KEY = re.compile(r'"name"\s*:\s*"')


def content_free_messages(messages: list[dict]) -> list[dict]:
    """The conversation with its content taken out: its system and developer messages, then one user message
    :data:`CONTENT_FREE`."""
    return [m for m in messages if m.get("role") in ("system", "developer")] + \
        [{"role": "user", "content": CONTENT_FREE}]


def name_span(text: str, name: str) -> tuple[int, str] | None:
    """``(start, closing)`` of the first call's name in a call turn's ``text``: where the name starts (after the
    first ``"name": "``) and the character written after it (``"``); None where the text does not write the name
    there (a format that writes names otherwise). A name is scored followed by any token starting with the
    closing (:func:`tokens_starting_with`): the model writes ``",`` as one token, seldom a bare ``"``."""
    m = _NAME_KEY.search(text)
    if m is None or not text.startswith(name, m.end()) or len(text) <= m.end() + len(name):
        return None
    return m.end(), text[m.end() + len(name)]


def opening_tokens(decode, tokens: list[int], text: str, start: int) -> tuple[list[int], str] | None:
    """``(ids, rest)``: the longest prefix ``ids`` of the decoded ``tokens`` whose text (``decode(ids)``) is a
    prefix of ``text[:start]``, and the characters of ``text[:start]`` after it (a token that runs into the name
    is left out: its text is scored with the name). None where no such prefix reads as the text."""
    best, seen = 0, ""
    for k in range(1, len(tokens) + 1):
        piece = decode(tokens[:k])
        if len(piece) > start:
            break
        if text.startswith(piece):
            best, seen = k, piece
    if not best:
        return None
    return tokens[:best], text[len(seen):start]


def tokens_starting_with(tokenizer, text: str) -> torch.Tensor:
    """``bool [len(tokenizer)]``: the tokens whose text (decoded alone, special tokens as written) starts with
    ``text``: what may follow a name however the model goes on (``"``, ``",``, ``"}``)."""
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
    return torch.tensor([p.startswith(text) for p in pieces], dtype=torch.bool)


class PriorCache:
    """Content-free log-probabilities of continuations, by (prompt ids, continuation), least recently used prompt
    dropped past :data:`PRIOR_CACHE_SIZE` prompts: an agent that keeps its tools pays for each name once."""

    def __init__(self, size: int = PRIOR_CACHE_SIZE):
        self.size = size
        self._entries: OrderedDict[tuple, dict[tuple, float]] = OrderedDict()
        self._lock = threading.Lock()  # a server's request threads share the engine

    def get(self, prompt: tuple, continuations: list[tuple], compute) -> list[float]:
        """The scores of ``continuations`` after ``prompt``; those not cached are computed by
        ``compute(missing) -> scores`` (outside the lock)."""
        with self._lock:
            known = dict(self._entries.get(prompt, {}))
        missing = [c for c in dict.fromkeys(continuations) if c not in known]
        if missing:
            known.update(zip(missing, compute(missing)))
        with self._lock:
            self._entries.setdefault(prompt, {}).update(known)
            self._entries.move_to_end(prompt)
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return [known[c] for c in continuations]


def calibrated_pick(scores: list[float], prior: list[float], names: list[str]) -> str | None:
    """The name of the highest ``score − prior`` among the names scored (``score`` finite; first listed on a tie);
    None where none was."""
    scored = [k for k in range(len(names)) if scores[k] != float("-inf")]
    if not scored:
        return None
    return names[max(scored, key=lambda k: (scores[k] - prior[k], -k))]
