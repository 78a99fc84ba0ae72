"""The Engine seam: one assistant turn, decoded locally (:class:`LocalEngine`) or by a server (``agent.remote``).

The agent loop (``agent/agent.py``) owns the conversation: it validates every call against the registered schemas,
runs tools and appends messages. An engine owns one turn: given the OpenAI-style messages, the tools, the
``tool_choice``, an optional response schema and an :class:`EngineConfig`, it returns a :class:`DecodedTurn`
(the text, the parsed calls, why it stopped, the decode statistics).

:class:`LocalEngine` is the only place that renders the chat with the model's tool format, builds the turn
grammar, runs :class:`decoding.Generator` and parses the output. Its guarantees are the project's: every call
and structured output the grammar admits validates; greedy output is token-identical for every drafter.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import jinja2

from decoding import (DEFAULT_DRAFTER, DEFAULT_MODEL, DEFAULT_NUM_DRAFT_TOKENS, DecodeStats, Generator, LoadedModel,
                      SamplingParams, check_drafter, check_window)
from schemas import SpecAgentError, Tool

from .formats import ToolFormat, ToolFormatError, make_format
from .formats.chat import plain_text_encoder
from .grounding import (Grounding, asking_named, conversation_text, grounded_call, last_user_text, named_tools,
                        run_together_prefixes, runs_numbers_together, takes_from_conversation, without_empty_named,
                        zeros_appended_prefixes)
from .parallel_calls import ParallelCallsEnd, with_written_lists
from .tool_choice import filter_tools
from .tool_prior import (MIN_PROBABILITY, PriorCache, calibrated_pick, content_free_messages, name_span,
                         opening_tokens, tokens_starting_with)

STOP_REASONS = ("eos", "grammar", "length", "stop")
DEFAULT_MAX_PARALLEL_CALLS = 8  # calls one several-call turn may return (EngineConfig.max_parallel_calls)
DEFAULT_GROUNDING_RETRIES = 2  # decodes again of a turn whose calls take nothing from the conversation
CLOSINGS_TRIED = 8  # closing points of a call the model asks to end inside, tried from its last (LocalEngine._close)


@dataclass(frozen=True)
class EngineConfig:
    """How to decode a turn: the one place these settings and their defaults live.

    Attributes:
        drafter: drafting mode, a row of ``decoding.DRAFTERS`` or ``auto`` (the default: the model's MTP card's
            drafter where a head loads on the torch backend, else ``lookup``; ``Generator.resolve_drafter``).
        num_draft_tokens: γ, drafter tokens per speculative window (>= 0; 0 drafts schema-forced tokens only).
        adaptive: adapt γ online from the acceptance rate.
        window: how speculative windows are sized, ``"cost"`` (a token only where its verify row pays, on a backend
            that measures the row cost: llama.cpp) or ``"fixed"`` (γ drafts whenever the drafter has them); None:
            the Generator's (``"cost"``). The output is the same either way.
        max_string_length: grammar cap (characters) on argument strings the schema leaves unbounded (None: no cap).
        max_decimals: grammar bound on numbers: decimals, no exponent, ``|x| <= 1e15`` (None: unbounded).
        max_items: grammar cap on the items of argument arrays the schema leaves unbounded (no ``maxItems``;
            ``schemas.bound_arrays``), so a runaway list closes at the cap and the model goes on (None: no cap).
        temperature, top_p, seed: sampling (greedy when ``temperature`` is 0).
        max_new_tokens: output budget of one turn (tokens).
        max_parallel_calls: the most calls one several-call turn returns (``agent.parallel_calls``: the turn also
            ends at the first call that repeats an earlier one, and where several are asked for at the first one
            past the second that brings no new value from the conversation).
        count_masked_ends: for a turn cut by the budget, replay it once more (one teacher-forced forward) and count
            in ``stats.masked_end_argmax`` the positions where the model's argmax was an end-of-generation token the
            grammar forbade (``Generator.masked_end_argmax``); a diagnostic for benchmarks, off by default.
        grounding: judge calls by where their values come from (``agent.grounding``; :meth:`LocalEngine.turn`):
            optional arguments the conversation does not write are dropped, a rate written only as a percent goes
            into a ``number`` field that does not ask for a percent as its fraction, an array copying its whole
            ``enum`` keeps the values the conversation asks for (``agent.grounding.grounded_call``), and a turn
            whose calls take nothing from the conversation is decoded again without those tools; and a turn
            whose call runs the items of a list of numbers the conversation writes together ("5,10 and 15" →
            ``510``: ``agent.grounding.runs_numbers_together``) or writes zeros on past a written number ("$50"
            → ``500000``: ``agent.grounding.zeros_appended_prefixes``) is decoded again with integers starting so
            (``51``, ``101``, ``500``) taken out of the grammar; where several calls are asked for, a call is
            added per item of a written list of numbers the calls go over and miss, a list every call of a
            tool holds is shared out by where its items are written, and "respectively" pairs two written lists
            item by item (``agent.parallel_calls.with_written_lists``). In a turn that answers a user message, an
            optional parameter whose name the message writes ("a maximum cost of $50": ``max_cost``) is required
            in the turn's grammar (``agent.grounding.named_optional``; the tool as registered still judges the
            call, so a value the conversation does not write is dropped as above, and so is an empty one).
            On by default; False returns the calls as the grammar-constrained decode wrote them.
        grounding_retries: how many times such a turn is decoded again (>= 0; each retry is a whole decode).
        close_at_model_end: where the model asks to end its turn inside a call it is writing (its unmasked argmax
            is an end-of-generation token the grammar forbids: a runaway list, a value it cannot finish) and the
            call can be closed there into a valid one — cut at its last point where its JSON value can be closed,
            the missing quote, brackets and the layout's close added, its arguments validating against the tool's
            schema (:meth:`agent.formats.ToolFormat.closed_turns`) — the decode stops there and the turn ends with
            its whole calls, the closed one last (``stats.closed_at_end``). Where no closing validates (a required
            argument not yet written) the model's end stays masked and it goes on writing, as without the rule.
            On by default; False: the grammar keeps the model writing until the call is whole or the budget cuts
            it.
        tool_prior: where a turn holds one call and two or more tools may be called, the tool is chosen against
            the model's prior for it (``agent.tool_prior``: the name's log-probability after the conversation less
            its log-probability after a content-free one, Zhao et al. 2021 §4, among the tools whose name's first
            token the model gives at least 1% after the conversation), and the turn is decoded again with its
            calls restricted to that tool where it differs from the decode's; the first decode stands where the
            new one is cut by the budget, answers instead of calling, or takes nothing from the conversation where
            the first did. Local engines, not under continuous batching (``Generator.enable_batching``). On by
            default; False keeps the decode's choice.
        stop: stop sequences (OpenAI's ``stop``): a text answer's decode ends at the step whose text holds one
            (``stop_reason`` ``"stop"``; the text may run a few tokens past it: the caller cuts it there, as the
            server does). Calls and structured answers are not cut.
    Raises (constructor):
        ValueError: a field is out of range, naming it.
    """

    drafter: str = DEFAULT_DRAFTER
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    adaptive: bool = False
    window: str | None = None
    max_string_length: int | None = None
    max_decimals: int | None = None
    max_items: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    max_parallel_calls: int = DEFAULT_MAX_PARALLEL_CALLS
    count_masked_ends: bool = False
    grounding: bool = True
    grounding_retries: int = DEFAULT_GROUNDING_RETRIES
    close_at_model_end: bool = True
    tool_prior: bool = True
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_drafter(self.drafter)
        if self.window is not None:
            check_window(self.window)
        _check_int("num_draft_tokens", self.num_draft_tokens, 0)
        _check_int("max_new_tokens", self.max_new_tokens, 1)
        _check_int("max_parallel_calls", self.max_parallel_calls, 1)
        _check_int("grounding_retries", self.grounding_retries, 0)
        for name in ("adaptive", "grounding", "close_at_model_end", "tool_prior"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.max_string_length is not None:
            _check_int("max_string_length", self.max_string_length, 1)
        if self.max_decimals is not None:
            _check_int("max_decimals", self.max_decimals, 0)
        if self.max_items is not None:
            _check_int("max_items", self.max_items, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, None)
            if not -2 ** 63 <= self.seed < 2 ** 64:  # what a torch.Generator takes
                raise ValueError(f"seed must be an integer in [-2^63, 2^64 - 1] (64 bits), got {self.seed!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be a number in [0, 2], got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.seed)

    def override(self, **changes: Any) -> "EngineConfig":
        """A copy with the given fields changed; a value of None means "keep this config's value"."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def _check_int(name: str, value: Any, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ValueError(f"{name} must be an integer{'' if minimum is None else f' >= {minimum}'}, got {value!r}")


@dataclass
class DecodedTurn:
    """One assistant turn as an engine produced it (calls parsed, not yet validated against the schemas).

    Attributes:
        text: the turn's text exactly as decoded (local: the tool-call text too; remote: the message content); where
            the engine closed a call at the model's end (``EngineConfig.close_at_model_end``), the decoded text up
            to the closing point and then the closing the engine wrote (not streamed: ``on_text`` saw the decoded
            text only).
        calls: ``[{"name", "arguments", "id"?}]`` when the turn is a complete tool-call turn, else None.
            ``arguments`` is a dict, or a JSON string as a server sent it.
        is_call: the turn opened a tool call (also when it was cut: ``calls`` is then None).
        stop_reason: ``eos`` (the model ended; also where it asked to end inside a call the engine then closed:
            ``EngineConfig.close_at_model_end``), ``grammar`` (nothing else allowed, or the budget ran out where the
            grammar accepts a turn of calls: every call is whole), ``length`` (budget reached mid-output),
            ``stop`` (a stop sequence).
        stats: decode statistics (a remote engine fills what the server reports).
        drafter: the drafter mode the turn was decoded with (``auto`` resolved; None: not known, remote).
        tokens: the decoded token ids (local engines; empty where not known). ``text`` may end before them (a
            several-call turn cut at its end rule) or hold a closing the engine wrote after them.
        prompt: the prompt token ids ``tokens`` were decoded after (local engines; empty where not known).
    """

    text: str
    calls: list[dict] | None
    is_call: bool
    stop_reason: str
    stats: DecodeStats = field(default_factory=DecodeStats)
    drafter: str | None = None
    tokens: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        """The budget cut the turn: a cut call or structured output is never returned."""
        return self.stop_reason == "length"


@runtime_checkable
class Engine(Protocol):
    """Decodes one assistant turn. Implemented by :class:`LocalEngine` and ``agent.remote.OpenAIEngine``."""

    def turn(self, messages: list[dict], tools: list[Tool], tool_choice: Any = "auto",
             response_format: dict | None = None, parallel_tool_calls: bool | None = None,
             config: EngineConfig = EngineConfig(), on_text: Callable[[str], None] | None = None,
             on_discard: Callable[[], None] | None = None) -> DecodedTurn:
        """Decode the assistant turn that follows ``messages``.

        Args:
            messages: OpenAI-style messages (assistant ``tool_calls``, ``tool`` results).
            tools: every tool the model may see; ``tool_choice`` selects the callable ones.
            tool_choice: ``"auto"``, ``"required"``, ``"none"``, ``{"name": ...}`` or OpenAI's named form.
            response_format: JSON Schema of a structured answer, or None for free text; or a
                :class:`schemas.ResponseFormat` (what ``Agent`` passes), whose ``strict=False`` relaxes the grammar
                (validated after) or, for a remote engine, is sent as ``"strict": false``.
            parallel_tool_calls: ``False``: one call; ``None`` (default): several allowed where the format has a
                layout for them, the model ends the turn; ``True``: several asked for
                (``ToolFormat.several_calls_rule``: hermes writes marked blocks and its end is masked). A
                several-call turn ends at the first call that repeats an earlier one, at
                ``config.max_parallel_calls`` calls, where several are asked for (hermes) at the first call past the
                second that brings no new value from the conversation (``agent.parallel_calls``), where the model
                ends it (if it may), or at the budget (then its whole calls are returned).
            config: drafter, γ, caps, sampling and budget.
            on_text: called with each new piece of text as it is decoded (streaming).
            on_discard: called where the text passed to ``on_text`` so far is void (the engine decodes the turn
                again, or returns an earlier decode and passes its text again): what ``on_text`` saw after the
                last call is the returned turn's text. An engine that never decodes a turn twice never calls it.
        """
        ...

    def spec(self) -> tuple:
        """``(factory, args, kwargs)`` that rebuild an equivalent engine in another process (for Ray)."""
        ...


class _HeldCalls:
    """The text of a decode where several calls may come, as it may be streamed: all of it until its first call is
    whole, then only up to the end of the last whole call. A call past the first can be dropped when it completes
    (the several-call end rule: a repeat, or nothing new from the conversation; ``agent.parallel_calls``) or cut by
    the budget; the decoder streams no step the end rule stopped at, so a call whose closing was streamed was
    kept. Held text is released by the next whole call, or at the end of the turn (:meth:`LocalEngine.turn`
    streams the returned text past what was streamed), so a dropped call is never streamed."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.reset()

    def reset(self) -> None:
        """A new decode of the turn begins."""
        self.text, self.sent = "", 0

    def release(self, piece: str) -> str:
        """The text that may be streamed now, given the decode's next ``piece``; "" where all of it is held."""
        self.text += piece
        found = self.fmt.complete_calls(self.text)
        safe = found[-1][1] if found else len(self.text)
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out


class LocalEngine:
    """The in-process engine: the model's tool format + the turn grammar + :class:`decoding.Generator`.

    Args:
        model: a :class:`Generator`, a :class:`LoadedModel` or a spec for ``decoding.load_model``.
        draft_model, device, dtype: load-time arguments (only with a ``LoadedModel`` or a spec; ``device``/``dtype``
            only with a spec).
        backend, threads, ctx_size: a row of ``decoding.BACKENDS`` (``"llamacpp"``: llama.cpp's CPU kernels on the
            GGUF, ``threads`` CPU threads, ``ctx_size`` KV cache positions per sequence; ``"torch"``;
            None: ``decoding.choose_backend``, llama.cpp for a GGUF on the CPU where it is installed), only with a
            spec (see :class:`decoding.Generator`); ``engine`` is an alias of ``backend``.
        tool_format, chat_template: the tool-call format (``agent.formats``; None: detected from the chat template)
            and a Jinja chat template replacing the tokenizer's.
        drafter: the drafter the runs will use, when the engine loads the model: with no backend named, one that
            needs what the default backend lacks picks a backend that has it.
    Raises:
        ValueError: load-time arguments given with a model that is already loaded (they would be ignored).
        ToolFormatError: unknown ``tool_format``, or no chat template.
    """

    def __init__(self, model: Generator | LoadedModel | str = DEFAULT_MODEL, *, draft_model: Any = None,
                 device: str | None = None, dtype: str | None = None, tool_format: str | None = None,
                 chat_template: str | None = None, backend: str | None = None, engine: str | None = None,
                 threads: int | None = None, drafter: str | None = None, ctx_size: int | None = None):
        ignored = [n for n, v in (("draft_model", draft_model), ("device", device), ("dtype", dtype),
                                  ("backend", backend), ("engine", engine), ("threads", threads),
                                  ("ctx_size", ctx_size)) if v is not None
                   and (isinstance(model, Generator) or (not isinstance(model, str) and n != "draft_model"))]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} would be ignored: the model is already loaded "
                             f"({type(model).__name__}); pass them where it is loaded")
        if isinstance(model, Generator):
            self.generator = model
        else:
            self.generator = Generator(model, draft_model=draft_model, device=device or "cpu",
                                       dtype=dtype or "float32", backend=backend, engine=engine, threads=threads,
                                       drafter=drafter or DEFAULT_DRAFTER, ctx_size=ctx_size)
        self.format: ToolFormat = make_format(self.tokenizer, tool_format, chat_template)
        self._prior_cache = PriorCache()  # content-free scores of agent.tool_prior, by tool list and opening
        self._closings: dict = {}  # character -> the tokens starting with it (agent.tool_prior.tokens_starting_with)
        if isinstance(model, str):
            where, load = model, {"backend": backend or engine, "threads": threads, "ctx_size": ctx_size}
        else:  # rebuilt from the loaded model where it pickles, else from its file (llama.cpp: ctypes handles)
            where, load = self.generator.backend.portable(self.generator.loaded)
        self._spec = (where, draft_model, device, dtype, tool_format, chat_template, load.get("backend"),
                      load.get("threads"), load.get("ctx_size"))

    @property
    def call_prefixes(self) -> tuple[str, ...]:
        """What opens a tool call in this format's text (a text answer starts with none of them)."""
        return self.format.call_prefixes()

    @property
    def tokenizer(self):
        return self.generator.tokenizer

    @property
    def name(self) -> str:
        return self.generator.loaded.name

    def spec(self) -> tuple:
        """``(LocalEngine, (model,), kwargs)``: a spec string is reloaded where the engine is rebuilt, a loaded model
        travels pickled. An engine built from a ready :class:`Generator` is rebuilt from its loaded model with
        default Generator settings (its draft model does not travel)."""
        model, draft_model, device, dtype, tool_format, chat_template, backend, threads, ctx_size = self._spec
        return LocalEngine, (model,), {"draft_model": draft_model, "device": device, "dtype": dtype,
                                       "tool_format": tool_format, "chat_template": chat_template,
                                       "backend": backend, "threads": threads, "ctx_size": ctx_size}

    def turn(self, messages: list[dict], tools: list[Tool], tool_choice: Any = "auto",
             response_format: dict | None = None, parallel_tool_calls: bool | None = None,
             config: EngineConfig = EngineConfig(), on_text: Callable[[str], None] | None = None,
             on_discard: Callable[[], None] | None = None) -> DecodedTurn:
        """See :meth:`Engine.turn`. Raises ``ToolCallError`` for a ``tool_choice`` naming an unknown tool.

        With ``config.grounding`` (the default) the calls are judged by where their values come from
        (``agent.grounding``): a turn none of whose calls takes a value from the conversation is decoded again
        with those tools masked out (at most ``config.grounding_retries`` times; under ``"auto"`` it becomes a
        text answer once no tool is left or the retries are spent, decoded again where it only restates a call as
        JSON; under ``"required"`` the first turn stands if no retry takes from the conversation), optional
        arguments holding values the conversation does not write are dropped (copied enum lists, names written in
        another order and percents read too: ``agent.grounding.grounded_call``), and a turn that runs the items of
        a written list of numbers together (``510`` for "5,10 and 15") or writes zeros on past a written number
        (``500000`` for "$50") is decoded again with such integers taken out of the grammar; where several calls
        are asked for (``parallel_tool_calls=True``), the calls are completed over the lists the user's last
        message writes (``agent.parallel_calls.with_written_lists``: the items of a list of numbers; a list every
        call of a tool holds, shared out; two lists paired item by item where the message says "respectively").
        Before those, with ``config.tool_prior`` (the
        default), a turn of one call out of two or more callable tools is decoded again restricted to the tool
        the model's prior points to where that differs (``agent.tool_prior``). ``text`` is the decoded text of
        the turn returned; ``stats`` count every decode. ``on_text`` sees every decode's text; with
        ``on_discard``, where several calls may come, a call past the first only once it is whole and kept
        (:class:`_HeldCalls`: a call the several-call end rule drops is never streamed). ``on_discard`` (with
        ``on_text``) is called before each decode past the first, and where the turn returned is an earlier decode
        than the last one streamed, or its text was cut after it streamed, it is called again and the returned
        text goes to ``on_text`` once more (a closing the engine wrote after the decoded text, or text held back,
        goes to it too): the text ``on_text`` saw after the last ``on_discard`` is the returned turn's ``text``.
        """
        shown: list[DecodedTurn] = []  # the decodes whose text on_text saw, in order
        streamed: list[str] = []  # the pieces on_text saw of the last decode
        discard, stream = (on_discard, on_text) if on_text is not None else (None, None)
        # several calls possible: a call past the first streams once it is whole and kept (_HeldCalls)
        held = _HeldCalls(self.format) if (discard is not None and tools and self.format.parallel
                                           and parallel_tool_calls is not False) else None
        if discard is not None:
            def on_text(piece: str) -> None:
                piece = held.release(piece) if held is not None else piece
                if piece:
                    streamed.append(piece)
                    stream(piece)

        def decode(**kwargs) -> DecodedTurn:  # one decode of this turn (``_decode``'s keyword options)
            if held is not None:
                held.reset()
            if shown and discard is not None:
                discard()  # the text streamed so far is void: the turn is decoded again
                streamed.clear()
            shown.append(self._decode(messages, tools, tool_choice, response_format, parallel_tool_calls, config,
                                      on_text, **kwargs))
            return shown[-1]

        out = self._turn(decode, messages, tools, tool_choice, response_format, parallel_tool_calls, config)
        if discard is not None and shown:
            seen = "".join(streamed)
            if out is shown[-1] and out.text.startswith(seen):
                if out.text != seen:
                    stream(out.text[len(seen):])  # a closing the engine wrote after the decoded text
            else:  # an earlier decode is returned, or the last one's text was cut (a several-call turn's end rule)
                discard()
                stream(out.text)
        return out

    def _turn(self, decode, messages, tools, tool_choice, response_format, parallel_tool_calls,
              config) -> DecodedTurn:
        """The body of :meth:`turn`; ``decode(**options)``: one decode of the turn (``_decode``'s keyword
        options)."""
        allowed, mode = filter_tools(tools, tool_choice)
        out = decode()
        text = conversation_text(messages)
        grounding = Grounding(text) if out.calls and (config.grounding or config.tool_prior) else None
        only: set | None = None  # tools masked out of every later decode: all but the prior's pick
        if config.tool_prior and len(allowed) >= 2 and out.calls and len(out.calls) == 1 \
                and self.generator.batcher is None:
            pick = self._prior_pick(messages, tools, parallel_tool_calls, out, allowed)
            if pick is not None:
                masked = {t.name for t in allowed if t.name != pick}
                again = decode(exclude=masked)
                again.stats = out.stats + again.stats
                took = any(takes_from_conversation(c, grounding) for c in out.calls)
                if (again.calls and not (again.truncated and not out.truncated)
                        and (any(takes_from_conversation(c, grounding) for c in again.calls) or not took)):
                    out, only = again, masked
                else:
                    out.stats = again.stats
        prefixes: frozenset[str] = frozenset()  # integer prefixes taken out of every later decode's grammar
        if config.grounding and out.calls:
            # a call copied a list's digits on past the item it meant ("5,10" → 510), or wrote zeros on past a
            # number ("$50" → 500000): decoded again with integers that would do so taken out of the grammar; the
            # first decode stands if that one is cut by the budget where the first was not
            prefixes = zeros_appended_prefixes(out.calls, text, grounding)
            if runs_numbers_together(out.calls, text, grounding):
                prefixes |= run_together_prefixes(text, grounding)
            if prefixes:
                again = decode(exclude=only, integer_prefixes=prefixes)
                again.stats = out.stats + again.stats
                if again.truncated and not out.truncated:
                    out.stats, prefixes = again.stats, frozenset()
                else:
                    out = again
        def as_prose(out: DecodedTurn, excludes: tuple[str, ...], **kwargs) -> DecodedTurn:
            """``out``, or where it is an answer that only restates a call as JSON (a ```json fence) or echoes a
            tool result, decoded again as an answer that cannot open with ``excludes``; one that opens with a sign
            and writes a call among other text ('>{"name": "get_weather", …}'), or what that retry writes, decoded
            again with no brace or backtick anywhere (at most twice in all; every decode's stats counted)."""
            for attempt in range(2):
                if out.stop_reason == "length":
                    break
                restated = restates(out.text, tools, messages)
                if not (restated or writes_call(out.text, tools)):
                    break
                again = decode(answer_only=True, answer_excludes=excludes,
                               answer_forbids="" if restated and attempt == 0 else "{`", **kwargs)
                again.stats = out.stats + again.stats
                out = again
            return out

        if not out.is_call and response_format is None and answer_wanted(messages, mode):
            # an answer is wanted (after tool results, or under "none"): the retry cannot open with a backtick (a
            # code block, or "``json" around the fence)
            out = as_prose(out, ("`",))
        if not config.grounding or not out.calls:
            return out
        first, stats, excluded = out, out.stats, set()
        retries = config.grounding_retries
        while out.calls and not any(takes_from_conversation(c, grounding) for c in out.calls):
            excluded |= {c.get("name") for c in out.calls}
            left = [t for t in allowed if t.name not in excluded]
            if isinstance(tool_choice, dict) or (mode == "required" and (not left or retries == 0)):
                out = first  # no other tool takes from the conversation either: the model's first choice
                break
            final = mode == "auto" and (not left or retries == 0)
            out = decode(exclude=None if final else excluded, answer_only=final, integer_prefixes=prefixes)
            stats = stats + out.stats
            retries -= 1
            if out.truncated and out.is_call:
                out = first  # a retry cut by the budget: the first turn stands
                break
            if final and response_format is None:
                # the answer the grounding fell back to ("What is the capital of France?" → ```json {"name":
                # "get_weather", …}) is checked as every answer (as_prose), its retry opening with neither a
                # backtick nor a brace (a bare {"name": …} is how the format writes a call)
                out.stats = stats
                out = as_prose(out, ("`", "{"), integer_prefixes=prefixes)
                stats = out.stats
        out.stats = stats
        if out.calls:
            out.calls = returned_calls(out.calls, allowed, messages, grounding,
                                       several=parallel_tool_calls is True and mode != "none",
                                       max_calls=config.max_parallel_calls)
            request = _named_request(messages, config)
            if request is not None:  # the grammar asked for the parameters the request names
                out.calls = without_empty_named(out.calls, allowed, request)
        return out

    def _prior_pick(self, messages: list[dict], tools: list[Tool], parallel_tool_calls: bool | None,
                    out: DecodedTurn, allowed: list[Tool]) -> str | None:
        """The tool of the highest calibrated score for the call of ``out`` (``agent.tool_prior``) among the
        tools whose name's first token the model gives at least :data:`agent.tool_prior.MIN_PROBABILITY` after
        the conversation, where it is not the tool the decode chose; None where it is, where fewer than two tools
        are candidates, where the turn's text does not write the name as ``"name": "…"`` after tokens of its own
        (or its tokens and prompt are not known), or where the scoring prompt does not fit the context."""
        name = out.calls[0].get("name")
        span = name_span(out.text, name)
        if span is None or not out.prompt:
            return None
        start, closing = span
        opening = opening_tokens(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False), out.tokens,
                                 out.text, start)
        if opening is None:
            return None
        ids, rest = opening
        encode = plain_text_encoder(self.format.tokenizer)
        names = [t.name for t in allowed]
        conts = [encode(rest + n) for n in names]
        then = self._closings.get(closing)
        if then is None:
            then = self._closings[closing] = tokens_starting_with(self.tokenizer, closing)
        free = self.format.render(content_free_messages(messages), list(tools), several=parallel_tool_calls is True)
        try:
            scores = self.generator.continuation_logprobs(out.prompt, conts, prefix=ids, then=then,
                                                          floor=math.log(MIN_PROBABILITY))
            kept = [k for k, v in enumerate(scores) if v != float("-inf")]
            if len(kept) < 2:
                return None
            prior = dict(zip(kept, self._prior_cache.get(
                (*free, *ids, closing), [tuple(conts[k]) for k in kept],
                lambda missing: self.generator.continuation_logprobs(free, [list(c) for c in missing],
                                                                     prefix=ids, then=then))))
        except ValueError:  # ContextLengthError: the scoring prompt is past the context
            return None
        pick = calibrated_pick(scores, [prior.get(k, 0.0) for k in range(len(names))], names)
        return None if pick == name else pick

    def _decode(self, messages, tools, tool_choice, response_format, parallel_tool_calls, config, on_text, *,
                exclude: set | None = None, answer_only: bool = False, answer_excludes: tuple[str, ...] = (),
                answer_forbids: str = "", integer_prefixes: frozenset[str] = frozenset()) -> DecodedTurn:
        """One decode of the turn (:meth:`turn` without the grounding rules); ``exclude``: tool names masked out of
        the grammar (the prompt still lists every tool); ``answer_only``: a text answer (``tool_choice="none"``'s
        grammar under the same prompt); ``answer_excludes``: openings the answer may not start with;
        ``answer_forbids``: characters it may not hold;
        ``integer_prefixes``: digit prefixes no non-negative integer argument may start with."""
        ids, grammar, allowed, mode = self._prepare(messages, tools, tool_choice, response_format,
                                                    parallel_tool_calls, config, exclude=exclude,
                                                    answer_only=answer_only, answer_excludes=answer_excludes,
                                                    answer_forbids=answer_forbids, integer_prefixes=integer_prefixes)
        parallel = bool(allowed) and mode != "none" and self.format.check_parallel(parallel_tool_calls)
        # several asked for where the format counts calls: the model's end is masked (_prepare) and the calls end
        # the turn (ParallelCallsEnd)
        masked = parallel_tool_calls is True and self.format.counts_calls
        request = _named_request(messages, config) if masked else None
        end_rule = ParallelCallsEnd(self.format, config.max_parallel_calls,
                                    context=conversation_text(messages) if masked else None,
                                    named=frozenset(named_tools(allowed, request)) if request is not None
                                    else frozenset()) if parallel else None
        # the model asks to end inside a call it is writing: stop there where the call closes into a valid one
        closings: list[str] = []  # the closing found where end_when stopped the decode (its last answer)

        def end_when(text: str) -> bool:
            closed = self._close(text, allowed)
            if closed is not None:
                closings.append(closed)
            return closed is not None
        stop_when = end_rule
        if config.stop and mode != "required" and response_format is None:  # a text answer ends at a stop sequence
            def stop_when(text: str) -> bool:
                if end_rule is not None and end_rule(text):
                    return True
                return not (allowed and self._opens_call(text)) and any(s in text for s in config.stop)
        out = self.generator.generate(ids, grammar, max_new_tokens=config.max_new_tokens, sampling=config.sampling,
                                      drafter=config.drafter, num_draft_tokens=config.num_draft_tokens,
                                      adaptive=config.adaptive, window=config.window, on_text=on_text,
                                      stop_when=stop_when,
                                      end_when=end_when if config.close_at_model_end and allowed and mode != "none"
                                      else None)
        if end_rule is not None and end_rule.text is None:
            end_rule(out.text)  # the last step's text may not have been checked (it ended inside a character)
        text = end_rule.text if end_rule is not None and end_rule.text is not None else out.text
        # "required": a call however short; "auto": an answer cannot start with what opens a call in this format
        # (the grammar's text rule), so a cut "<" or "{" is the start of a call, never an answer; but a structured
        # answer (response_format) is JSON too: whole, it is a call only where it reads as this format's calls
        opens_call = self._opens_call(text)
        if opens_call and response_format is not None and out.stop_reason != "length":
            opens_call = self._reads_as_calls(text)
        is_call = bool(allowed) and (mode == "required" or (mode == "auto" and opens_call))
        stop = "stop" if end_rule is not None and end_rule.text is not None else out.stop_reason  # the rule fired
        if stop == "masked_end":  # end_when stopped the decode where the open call closes into a valid one
            text, stop = closings[-1], "eos"
            out.stats.closed_at_end += 1
            if end_rule is not None and end_rule(text):  # the several-call rules judge the closed call too
                text, stop = end_rule.text, "stop"
        if stop == "length" and is_call and self._accepts(grammar, out.tokens):
            stop = "grammar"  # every call is whole (another could have followed): nothing was cut
        if stop == "length" and config.count_masked_ends:
            out.stats.masked_end_argmax = len(self.generator.masked_end_argmax(ids, out.tokens, grammar))
        if stop != "length":
            calls = self.format.parse(text)[0] if is_call else None
        else:  # cut by the budget: the whole calls before the cut one (several-call turns), never the cut one
            whole = [c for c, _ in self.format.complete_calls(text)] if is_call and parallel else []
            calls = whole or None
        return DecodedTurn(text, calls, is_call, stop, out.stats, self.generator.resolve_drafter(config.drafter),
                           list(out.tokens), list(ids))

    def check(self, messages: list[dict], tools: list[Tool], tool_choice: Any = "auto",
              response_format: Any = None, parallel_tool_calls: bool | None = None,
              config: EngineConfig = EngineConfig()) -> int:
        """Everything :meth:`turn` would refuse before decoding, without decoding: the prompt's length in tokens.

        Raises:
            ValueError (incl. ``ToolFormatError``, ``SchemaError``, ``MTPError``): a request this engine cannot
                serve: a format refusal, a drafter the backend cannot run or whose model or head is not loaded.
            FileNotFoundError: the MTP drafter has no head for this model.
        """
        ids, *_ = self._prepare(messages, tools, tool_choice, response_format, parallel_tool_calls, config)
        drafter = self.generator.resolve_drafter(config.drafter)
        self.generator.check_supported(drafter)
        if drafter == "draft_model":
            self.generator.draft_model()
        elif "mtp" in drafter:
            self.generator.mtp_head()
        return len(ids)

    @property
    def context_length(self) -> int | None:
        """Prompt + new tokens one turn may hold (None: not known): the model's context, or one sequence's KV cache
        when the generator batches (``Generator.enable_batching``)."""
        return self.generator.context_length

    def _prepare(self, messages, tools, tool_choice, response_format, parallel_tool_calls, config, *,
                 exclude: set | None = None, answer_only: bool = False, answer_excludes: tuple[str, ...] = (),
                 answer_forbids: str = "", integer_prefixes: frozenset[str] = frozenset()):
        """``(prompt ids, turn grammar, callable tools, tool_choice mode)``; ``exclude`` / ``answer_only``: see
        :meth:`_decode`."""
        allowed, mode = filter_tools(tools, tool_choice)
        if exclude:
            allowed = [t for t in allowed if t.name not in exclude]
        if answer_only:
            allowed, mode = [], "none"
        request = _named_request(messages, config)
        if request is not None:  # optional parameters the user's message names are written (named_optional)
            allowed = [asking_named(t, request) for t in allowed]
        strict = getattr(response_format, "strict", True)
        schema = getattr(response_format, "schema", response_format)
        grammar = self.format.turn_grammar(allowed, mode, parallel=parallel_tool_calls, response_format=schema,
                                           lenient_answer=not strict, max_string_length=config.max_string_length,
                                           max_decimals=config.max_decimals, max_items=config.max_items,
                                           excluded_integer_prefixes=integer_prefixes,
                                           after_results=messages[-1]["role"] == "tool",
                                           # several asked for, where the format counts calls: the end masked
                                           min_calls=config.max_parallel_calls + 1 if self.format.counts_calls
                                           else 2, answer_opens_no_call=True if answer_only else None,
                                           answer_excludes=answer_excludes, answer_forbids=answer_forbids)
        several = parallel_tool_calls is True and mode != "none" and bool(allowed)
        try:
            prompt = self.format.render(messages, list(tools), several=several, call_asked=mode == "required")
        except Exception as e:  # noqa: BLE001 - a chat template that fails on this conversation
            if not (isinstance(e, jinja2.TemplateError) or (self.format.user_template
                                                           and not isinstance(e, SpecAgentError))):
                raise
            ours = " (after tool results the format adds a system message of its own, the answer prompt)" \
                if messages[-1]["role"] == "tool" and "system" in str(e).lower() else ""
            raise ToolFormatError(f"the chat template failed to render this conversation{ours}: "
                                  f"{type(e).__name__}: {e}") from None
        return prompt, grammar, allowed, mode

    def _opens_call(self, text: str) -> bool:
        """Whether a turn's ``text`` (perhaps cut) opens a call: it starts with what opens one in this format."""
        return self.format.is_call(text) or text.startswith(self.call_prefixes)

    def _reads_as_calls(self, text: str) -> bool:
        """Whether a whole turn's ``text`` parses as one or more calls of this format."""
        try:
            return bool(self.format.parse(text)[0])
        except (ValueError, KeyError, TypeError):  # a JSON answer whose keys are not a call's
            return False

    def _close(self, text: str, allowed: list[Tool]) -> str | None:
        """The longest of the first :data:`CLOSINGS_TRIED` :meth:`ToolFormat.closed_turns` of ``text`` whose closed
        call names a callable tool and whose arguments validate against its schema (None: none does; the model then
        goes on writing, so a long call cannot make every masked end cost a validation per element)."""
        tools = {t.name: t for t in allowed}
        for turn, calls in itertools.islice(self.format.closed_turns(text), CLOSINGS_TRIED):
            tool = tools.get(calls[-1].get("name"))
            if tool is None:
                continue
            try:
                tool.validate(calls[-1].get("arguments"))
            except ValueError:
                continue
            return turn
        return None

    def _accepts(self, grammar, tokens: list[int]) -> bool:
        """Whether ``grammar`` accepts ``tokens`` as a whole output (replayed on a fresh state)."""
        state = self.generator.new_state(grammar)
        if state.valid_prefix_len(tokens) != len(tokens):
            return False
        state.consume_many(tokens)
        return state.is_accepting()


FENCE = "```"  # opens a Markdown code block


def _named_request(messages: list[dict], config: EngineConfig) -> Grounding | None:
    """The user's message whose named optional parameters a turn's grammar requires
    (``agent.grounding.asking_named``), read by ``_prepare`` and again by ``_turn`` for the empty values it drops;
    None unless grounding is on and the turn answers a user message."""
    if config.grounding and messages and messages[-1].get("role") == "user":
        return Grounding(last_user_text(messages))
    return None


def returned_calls(calls: list[dict], tools: list[Tool], messages: list[dict], grounding: Grounding, *,
                   several: bool, max_calls: int) -> list[dict]:
    """A grounded turn's decoded ``calls`` as :meth:`LocalEngine.turn` returns them: each read against the
    conversation (``agent.grounding.grounded_call``), each once (:func:`distinct_calls`), and where ``several``
    calls were asked for, completed over the lists the user's last message writes
    (``agent.parallel_calls.with_written_lists``, at most ``max_calls``). The replay scripts call it too, so a
    replay applies what the engine applies."""
    out = distinct_calls([grounded_call(c, tools, grounding) for c in calls])
    return with_written_lists(out, tools, last_user_text(messages), max_calls) if several else out


def distinct_calls(calls: list[dict]) -> list[dict]:
    """``calls`` less each call whose name and arguments equal an earlier one's (Python ``==``, as the repeat rule
    of ``agent.parallel_calls`` compares: keys in any order, ``3 == 3.0``), first kept: two calls that differed only
    in optional arguments grounding dropped are one call (a turn never returns the same call twice)."""
    out: list[dict] = []
    for call in calls:
        if not any(call.get("name") == kept.get("name") and call.get("arguments") == kept.get("arguments")
                   for kept in out):
            out.append(call)
    return out


def answer_json(text: str) -> tuple[bool, Any]:
    """``(True, value)`` when a text answer is only JSON: ``text`` (whitespace stripped) is one Markdown code block
    (```` ```json ```` or a bare fence) holding a JSON value, or a JSON value; else ``(False, None)`` (text around
    the block, several blocks, JSON that does not parse)."""
    body = text.strip()
    if body.startswith(FENCE):
        _, _, rest = body.partition("\n")  # past the fence line (```json)
        rest = rest.rstrip()
        if not rest.endswith(FENCE) or FENCE in rest[:-len(FENCE)]:
            return False, None
        body = rest[:-len(FENCE)].strip()
    try:
        return True, json.loads(body)
    except ValueError:
        return False, None


def answer_wanted(messages: list[dict], mode: str) -> bool:
    """Whether the turn after ``messages`` under ``tool_choice`` mode ``mode`` wants an answer, not a call: it
    follows tool results, or calls are off (``"none"``). There :meth:`LocalEngine.turn` decodes again an answer that
    only :func:`restates` (and the server holds such an answer back while streaming)."""
    return mode == "none" or (bool(messages) and messages[-1].get("role") == "tool")


def writes_call(text: str, tools: list[Tool]) -> bool:
    """Whether a text answer opens with neither a letter nor a digit and writes a call of one of ``tools`` as JSON
    somewhere: an object whose ``"name"`` names one of them (``>{"name": "get_weather", "arguments": …}``: what
    Qwen2.5-Coder-0.5B answered after two tool results, scripts/chain_steps.py). An answer opening with a word is
    prose, whatever it quotes (and streams live: ``agent.openai_protocol.TextStream``)."""
    s = text.lstrip()
    names = {t.name for t in tools}
    return bool(s) and not s[0].isalnum() and any(m.group(1) in names for m in _NAME_VALUE.finditer(s))


_NAME_VALUE = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def restates(text: str, tools: list[Tool], messages: list[dict]) -> bool:
    """Whether a text answer only restates: it is only JSON (:func:`answer_json`) and that JSON is a tool call — an
    object, or a list whose first item is one, with a ``"name"`` naming one of ``tools`` (how Qwen2.5-Coder writes
    a call outside its ``<tool_call>`` layout) — or an object or list that is the content of one of the ``tool``
    messages (a result echoed; a number or string that a tool returned is an answer)."""
    is_json, value = answer_json(text)
    if not is_json:
        return False
    first = value[0] if isinstance(value, list) and value else value
    if isinstance(first, dict) and first.get("name") in {t.name for t in tools}:
        return True
    if not isinstance(value, (dict, list)):
        return False  # "42" after a tool returned 42 is an answer
    for m in messages:
        if m.get("role") == "tool" and isinstance(m.get("content"), str):
            ok, result = answer_json(m["content"])
            if ok and result == value:
                return True
    return False


def build_engine(spec: tuple) -> Engine:
    """The engine an :meth:`Engine.spec` describes."""
    factory, args, kwargs = spec
    return factory(*args, **kwargs)
