"""The agent loop: prompt -> constrained turn (tool calls or an answer) -> run tools -> feed results -> answer."""
from __future__ import annotations

import concurrent.futures
import inspect
import json
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import pydantic

from decoding import DEFAULT_MODEL, ContextLengthError, DecodeStats, Generator, LoadedModel
from schemas import ResponseFormat, Tool, ToolCall, ToolCallError, ToolRegistry

from .engine import Engine, EngineConfig, LocalEngine, build_engine
from .openai_protocol import ROLES
from .tool_choice import filter_tools

logger = logging.getLogger(__name__)

STREAM_WORKERS = 8  # streams of one Agent decoding at once (a further one waits for a free thread)
_STREAM_WORKERS_LOCK = threading.Lock()


@dataclass
class ToolCallRecord:
    """A validated call, and what running it gave (``error`` set when the tool raised or timed out)."""

    call: ToolCall
    result: Any = None
    error: str | None = None


@dataclass
class RunResult:
    """Everything one :meth:`Agent.run` produced.

    Attributes:
        messages: the whole transcript as OpenAI-style message dicts (feed it to another run).
        tool_calls: every validated call in order, with its result.
        final_answer: the model's text answer (None if the run ended on calls; cut short when ``truncated``).
        output: the validated ``response_format`` value (pydantic instance or dict), when one was asked for.
        pending_calls: calls of tools with no Python callable, returned for the caller to run.
        truncated: a turn hit its token budget: a partial tool call or structured output is never returned; a
            partial text answer is returned in ``final_answer``.
        error: why the run stopped early without raising (a decoded call of a lenient tool that still failed
            validation after the retries, tool results that no longer fit the context, an answer that fails its
            ``response_format`` (a keyword relaxed in the grammar, or a pydantic validator the grammar cannot see):
            ``final_answer`` holds its text, ``output`` None; in ``run_batch``, what
            that prompt's run raised); the transcript and earlier results are kept. None when it did not.
        stop_reason: why the run ended: ``"answer"`` (a final answer), ``"calls"`` (calls returned for the
            caller to run: ``pending_calls``), ``"length"`` (a token budget cut a turn, or ``max_total_tokens`` left
            none), ``"max_steps"`` (the steps ran out after tool results, before an answer: e.g. a model calling
            again and again), ``"error"`` (``error`` is set).
        stats: decode statistics summed over turns.
        steps: assistant turns decoded.
        raw_turns: each turn's decoded text, exactly.
    """

    messages: list[dict]
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    final_answer: str | None = None
    output: Any = None
    pending_calls: list[ToolCall] = field(default_factory=list)
    truncated: bool = False
    stats: DecodeStats = field(default_factory=DecodeStats)
    steps: int = 0
    raw_turns: list[str] = field(default_factory=list)
    error: str | None = None
    stop_reason: str = "max_steps"


@dataclass
class Event:
    """A streaming event from :meth:`Agent.stream`.

    ``type`` is one of ``"token"`` (``text``: the new text), ``"discard"`` (the ``token`` events of the turn so far
    are void: the engine decodes the turn again, e.g. with a tool the conversation fits better
    (``agent.grounding``, ``agent.tool_prior``), and the returned turn's text follows in new ``token`` events),
    ``"tool_call_started"`` (``call``: ToolCall),
    ``"tool_call_finished"`` (``record``: ToolCallRecord), ``"final_answer"`` (``text``, ``output``),
    ``"stats"`` (``stats``: DecodeStats of the turn), ``"done"`` (``result``: RunResult).
    """

    type: str
    text: str = ""
    call: ToolCall | None = None
    record: ToolCallRecord | None = None
    output: Any = None
    stats: DecodeStats | None = None
    result: RunResult | None = None


def _takes_on_discard(engine: Any) -> bool:
    """Whether ``engine.turn`` takes ``on_discard`` (engines written before it was added to the protocol do not)."""
    try:
        params = inspect.signature(engine.turn).parameters
    except (TypeError, ValueError):
        return False
    return "on_discard" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Agent:
    """A tool-calling agent whose every tool call and structured output validates against its schema.

    Args:
        model: an :class:`~agent.engine.Engine` (``LocalEngine``, ``agent.remote.OpenAIEngine``), a
            :class:`Generator`, a :class:`LoadedModel`, or a spec for ``decoding.load_model`` (default
            ``"qwen2.5-coder-0.5b"``: Qwen2.5-Coder-0.5B-Instruct from its PyPI part packages, ``make models``).
        tools: functions, pydantic models, OpenAI tool dicts or :class:`Tool` objects.
        config: an :class:`EngineConfig` (drafter, γ, caps, sampling, per-turn budget); the keyword arguments
            ``drafter``, ``num_draft_tokens``, ``adaptive``, ``window``, ``max_string_length``, ``max_decimals``,
            ``max_items``, ``grounding``, ``tool_prior`` override its fields (None: keep). ``grounding`` (default
            True): calls judged by where their values come from (``agent.grounding``): optional arguments the
            conversation does not write are dropped, and a turn whose calls take nothing from it is decoded again
            without those tools. ``tool_prior`` (default True): the tool of a one-call turn checked against the
            model's prior for the tools listed (``agent.tool_prior``).
        draft_model, device, dtype, backend, threads, ctx_size: load-time arguments, only when the agent loads the model
            (ValueError with a ready engine or Generator, where they would be ignored); ``backend`` is a row of
            ``decoding.BACKENDS``: ``"llamacpp"`` runs the GGUF on llama.cpp's CPU kernels (``threads`` CPU
            threads, ``ctx_size`` KV cache positions per sequence; the default where llama-cpp-python is
            installed), ``"torch"`` on transformers. ``engine`` is an alias of ``backend``.
        max_steps: assistant turns per run.
        strict: reject schemas the grammar cannot enforce exactly (default); False relaxes them in the grammar and
            validates every output (failed calls are retried ``max_retries`` times with the error fed back), for
            the tools registered and for ``run``'s ``response_format``.
        tool_timeout: seconds a tool may run before its call gets a timeout error (None: no limit).
        parallel_tool_execution: run the calls of one turn concurrently when every tool is ``thread_safe``.
        tool_format, chat_template: the local engine's tool-call format (``hermes``, ``llama3_json``, ``generic``;
            None: detected from the chat template) and a Jinja chat template replacing the tokenizer's (see
            ``agent/formats``); only when the agent builds the engine.

    The engine's settings have one owner: :attr:`config` (see :class:`EngineConfig`); ``run`` overrides it per run.

    Raises:
        ToolFormatError: unknown ``tool_format``, or the model has no chat template and none was given.
    """

    def __init__(self, model: Engine | LoadedModel | Generator | str = DEFAULT_MODEL, tools: Iterable[Any] = (), *,
                 config: EngineConfig | None = None, drafter: str | None = None, num_draft_tokens: int | None = None,
                 adaptive: bool | None = None, window: str | None = None, max_string_length: int | None = None,
                 max_decimals: int | None = None, max_items: int | None = None,
                 grounding: bool | None = None, tool_prior: bool | None = None, draft_model: Any = None,
                 device: str | None = None,
                 dtype: str | None = None, max_steps: int = 4,
                 strict: bool = True, tool_timeout: float | None = None, max_retries: int = 1,
                 parallel_tool_execution: bool = True, tool_format: str | None = None,
                 chat_template: str | None = None, backend: str | None = None, engine: str | None = None,
                 threads: int | None = None, ctx_size: int | None = None):
        if isinstance(model, Engine):
            ignored = [n for n, v in (("draft_model", draft_model), ("device", device), ("dtype", dtype),
                                      ("tool_format", tool_format), ("chat_template", chat_template),
                                      ("backend", backend), ("engine", engine), ("threads", threads),
                                      ("ctx_size", ctx_size))
                       if v is not None]
            if ignored:
                raise ValueError(f"{', '.join(ignored)} would be ignored: the engine is already built; pass them "
                                 f"to the engine")
            self.engine = model
        else:
            self.engine = LocalEngine(model, draft_model=draft_model, device=device, dtype=dtype,
                                      tool_format=tool_format, chat_template=chat_template, backend=backend,
                                      engine=engine, threads=threads, ctx_size=ctx_size,
                                      drafter=drafter or (config.drafter if config is not None else None))
        self.config = (config or EngineConfig()).override(
            drafter=drafter, num_draft_tokens=num_draft_tokens, adaptive=adaptive, window=window,
            max_string_length=max_string_length, max_decimals=max_decimals, max_items=max_items,
            grounding=grounding, tool_prior=tool_prior)
        self.registry = ToolRegistry(strict=strict)
        self._tool_sources: list[tuple[Any, bool | None]] = []
        for t in tools:
            self.register(t)
        _check_budgets(1, None, max_steps)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        if tool_timeout is not None and (isinstance(tool_timeout, bool) or not isinstance(tool_timeout, (int, float))
                                         or not tool_timeout > 0):
            raise ValueError(f"tool_timeout must be a number of seconds > 0 (or None), got {tool_timeout!r}")
        self.max_steps = max_steps
        self.tool_timeout = tool_timeout
        self.max_retries = max_retries
        self.parallel_tool_execution = parallel_tool_execution
        self._settings = dict(max_steps=max_steps, strict=strict, tool_timeout=tool_timeout, max_retries=max_retries,
                              parallel_tool_execution=parallel_tool_execution)
        self._streams: concurrent.futures.ThreadPoolExecutor | None = None  # created by the first stream

    @property
    def generator(self) -> Generator:
        """The local engine's Generator (AttributeError for a remote engine)."""
        return self.engine.generator

    @property
    def format(self):
        """The local engine's tool-call format (``agent.formats.ToolFormat``; AttributeError for a remote engine)."""
        return self.engine.format

    def register(self, tool: Any, *, strict: bool | None = None) -> Tool:
        """Register one more tool (raises ToolError on duplicates, SchemaError on bad schemas)."""
        registered = self.registry.register(tool, strict=strict)
        self._tool_sources.append((tool, strict))
        return registered

    def spec(self) -> tuple:
        """A picklable recipe of this agent (engine spec, tools as given, settings, config): :func:`agent_from_spec`
        rebuilds it in another process (``run_batch(backend="ray")``)."""
        return self.engine.spec(), list(self._tool_sources), dict(self._settings), self.config

    # -- public entry points -----------------------------------------------------------------------------------------
    def run(self, prompt: str | list[dict], *, tool_choice: Any = "auto", response_format: Any = None,
            max_new_tokens: int | None = None, max_total_tokens: int | None = None, max_steps: int | None = None,
            parallel_tool_calls: bool | None = None, temperature: float | None = None, top_p: float | None = None,
            seed: int | None = None, drafter: str | None = None, num_draft_tokens: int | None = None,
            grounding: bool | None = None, tool_prior: bool | None = None) -> RunResult:
        """Run the loop until a final answer, a call of a tool without a callable, or ``max_steps`` turns.

        Args:
            prompt: a user message, or OpenAI-style messages (user-supplied tool calls are validated).
            tool_choice: ``"auto"``, ``"required"``, ``"none"`` or ``{"name": ...}``, enforced by the grammar on
                the first turn; later turns are ``"auto"`` (so a forced call cannot loop).
            response_format: a pydantic model class, a JSON Schema (OpenAI's ``{"type": "json_schema", …}``
                wrapper too) or a :class:`schemas.ResponseFormat`: the final answer is constrained to it and
                returned validated in ``RunResult.output`` (a model instance, or the parsed JSON); relaxed in the
                grammar where the agent is ``strict=False`` or the format says so (``ResponseFormat(...,
                strict=False)``, ``"strict": false``).
            max_new_tokens: per-turn output budget (tokens, >= 1).
            max_total_tokens: budget over all turns of the run (tokens, >= 1); None: no limit.
            parallel_tool_calls: allow several calls in one turn (None: when the tool format has a layout for
                them; True raises ToolFormatError for a format that has none, e.g. ``llama3_json``).
            temperature, top_p, seed, drafter, num_draft_tokens, max_new_tokens, grounding, tool_prior: override
                :attr:`config` for this run (None: the config's value; ``num_draft_tokens=0`` is honoured; greedy
                when temperature is 0; ``grounding=False`` returns calls exactly as decoded; ``tool_prior=False``
                keeps the tool the decode chose).
        Returns:
            :class:`RunResult`. A decoded call of a lenient tool that still fails validation after ``max_retries``
            retries ends the run with ``RunResult.error`` set (the transcript and earlier results are kept).
        Raises:
            ValueError: the prompt is None, empty or not a string / message list, a budget is below 1, or an
                override is out of range (naming it).
            ToolCallError: a supplied message calls an unknown tool or has invalid arguments.
            SchemaError: ``response_format`` is not a valid, enforceable schema.
        """
        return self._run(prompt, None, tool_choice=tool_choice, response_format=response_format,
                         max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens, max_steps=max_steps,
                         parallel_tool_calls=parallel_tool_calls, temperature=temperature, top_p=top_p, seed=seed,
                         drafter=drafter, num_draft_tokens=num_draft_tokens, grounding=grounding,
                         tool_prior=tool_prior)

    def stream(self, prompt: str | list[dict], **kwargs) -> Iterator[Event]:
        """Like :meth:`run`, but yields :class:`Event` objects as they happen (tokens, tool calls, answer, stats);
        the last event is ``"done"`` with the :class:`RunResult`. Exceptions are re-raised in the caller. A stream
        left early (``close()``, a ``break``) stops its decode at the next step, as the server does for a client
        that disconnects.

        Raises:
            TypeError: a keyword argument :meth:`run` does not take (at the call, before anything runs)."""
        inspect.signature(self.run).bind(prompt, **kwargs)
        return self._stream(prompt, **kwargs)

    def _stream(self, prompt: str | list[dict], **kwargs) -> Iterator[Event]:
        q: queue.Queue = queue.Queue()
        sentinel = object()
        closed = threading.Event()  # the consumer stopped iterating (close(), break, garbage collection)

        def emit(event: Event) -> None:  # called from the decode at every step: where a closed stream stops it
            if closed.is_set():
                raise _StreamClosed()
            q.put(event)

        def work():
            try:
                result = self._run(prompt, emit, **kwargs)
                q.put(Event("done", result=result))
            except _StreamClosed:
                pass  # nobody is listening
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put(e)
            finally:
                q.put(sentinel)

        done = self._stream_workers().submit(work)
        try:
            while True:
                item = q.get()
                if item is sentinel:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            closed.set()  # a stream left early stops its decode at the next step (a tool already running finishes)
        done.result()

    def _stream_workers(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads :meth:`stream` decodes on, kept for the agent's life: an idle one takes the next stream, so
        consecutive streams decode on the same thread and reuse its KV cache's prefix (llama.cpp keeps a context
        per thread: a thread of its own per stream prefilled every prompt whole). Up to
        :data:`STREAM_WORKERS` streams decode at once."""
        with _STREAM_WORKERS_LOCK:
            if self._streams is None:
                self._streams = concurrent.futures.ThreadPoolExecutor(max_workers=STREAM_WORKERS,
                                                                      thread_name_prefix="specagent-stream")
        return self._streams

    def run_batch(self, prompts: list[str | list[dict]], *, max_workers: int = 1, backend: str = "thread",
                  return_errors: bool = True, **kwargs) -> list[RunResult]:
        """Run many prompts; results in input order.

        ``backend="thread"``: ``max_workers > 1`` runs them on threads (each run has its own KV cache and grammar
        state; weights are shared read-only); on llama.cpp, after ``agent.engine.generator.enable_batching(n)``, the
        threads' decodes are continuously batched (``decoding.batch``: one ``llama_decode`` per step for all).
        ``backend="ray"``: ``max_workers`` Ray actors, each rebuilding this agent from :meth:`spec` (its own engine:
        the model loaded in the actor, or the same remote server), on the cluster ``ray.init`` connected to (see
        ``agent.distributed``). ``kwargs``: :meth:`run`'s options, the same for every prompt.

        Every prompt and option is checked before any prompt runs (the errors :meth:`run` raises for them, the
        prompt's index named). A prompt whose run then raises (its messages too long for the context, a remote
        server's error) does not cost the others their results: with ``return_errors`` (default) its
        :class:`RunResult` has ``stop_reason == "error"`` and ``error`` naming the exception (``messages``: its
        prompt's); with ``return_errors=False`` the first such error, in input order, is raised once every run has
        ended.
        """
        if isinstance(prompts, (str, dict)) or not isinstance(prompts, Iterable):
            raise ValueError(f"run_batch takes a list of prompts (each a string or a message list), got "
                             f"{type(prompts).__name__}; for one prompt use run()")
        prompts = list(prompts)
        if backend not in ("thread", "ray"):
            raise ValueError(f"backend must be 'thread' or 'ray', got {backend!r}")
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        try:
            inspect.signature(self.run).bind("", **kwargs)
        except TypeError as e:
            raise TypeError(f"run_batch passes its keywords to Agent.run(): {e}") from None
        run_options = {k: kwargs.get(k, d) for k, d in (("tool_choice", "auto"), ("response_format", None),
                                                         ("max_total_tokens", None), ("max_steps", None),
                                                         ("parallel_tool_calls", None))}
        config, response = self._options(**run_options,
                                          overrides={k: v for k, v in kwargs.items() if k not in run_options})
        initial = []  # each prompt's messages: checked before any runs, an error's result holds them
        for i, p in enumerate(prompts):
            try:
                initial.append(self._initial_messages(p))
            except ValueError as e:  # the same exception, its message naming the prompt
                if len(e.args) != 1:
                    raise ValueError(f"prompts[{i}]: {e}") from None
                e.args = (f"prompts[{i}]: {e.args[0]}",)
                raise
        check = getattr(self.engine, "check", None)  # what turn() refuses before decoding: format, drafter
        if check is not None and initial:
            check(initial[0], list(self.registry), run_options["tool_choice"], response,
                  run_options["parallel_tool_calls"], config)
        if backend == "ray":
            from .distributed import ray_run_batch

            outcomes = ray_run_batch(agent_from_spec, self.spec(), prompts, num_actors=max_workers,
                                     run_kwargs=kwargs)
        elif max_workers <= 1:
            outcomes = [_outcome(self.run, p, kwargs) for p in prompts]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
                outcomes = list(pool.map(lambda p: _outcome(self.run, p, kwargs), prompts))
        results = []
        for i, (messages, out) in enumerate(zip(initial, outcomes)):
            if isinstance(out, RunResult):
                results.append(out)
                continue
            if not return_errors:
                raise out
            kind = getattr(out, "type_name", type(out).__name__)  # a Ray actor's error it could not carry back
            logger.warning("run_batch: prompts[%d] failed: %s: %s", i, kind, out)
            results.append(RunResult(messages=messages, error=f"{kind}: {out}", stop_reason="error"))
        return results

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _run(self, prompt, emit: Callable[[Event], None] | None, *, tool_choice: Any = "auto",
             response_format: Any = None, max_total_tokens: int | None = None, max_steps: int | None = None,
             parallel_tool_calls: bool | None = None, **overrides: Any) -> RunResult:
        config, response = self._options(tool_choice, response_format, max_total_tokens, max_steps,
                                         parallel_tool_calls, overrides)
        on_text = None if emit is None else (lambda text: emit(Event("token", text=text)))
        # a turn decoded again: the token events since the turn began are void ("discard"); an engine of the
        # protocol before on_discard is called without it
        streaming = {"on_discard": lambda: emit(Event("discard"))} if emit is not None and _takes_on_discard(
            self.engine) else {}
        emit = emit or (lambda event: None)
        messages = self._initial_messages(prompt)
        result = RunResult(messages=messages)
        choice = tool_choice
        retries = 0
        invalid: str | None = None  # the last turn's call failed validation and is being retried
        for _ in range(self.max_steps if max_steps is None else max_steps):
            budget = config.max_new_tokens
            if max_total_tokens is not None:
                budget = min(budget, max_total_tokens - result.stats.new_tokens)
                if budget <= 0:
                    result.truncated, result.stop_reason = True, "length"
                    break
            try:
                out = self.engine.turn(messages, list(self.registry), choice,
                                       response, parallel_tool_calls,
                                       config.override(max_new_tokens=budget), on_text, **streaming)
            except ContextLengthError as e:
                if not result.tool_calls:
                    raise  # the caller's own messages do not fit
                # tool results made the conversation too long: keep what the run has, say which result is largest
                size = {id(rec): len(_to_json_text({"error": rec.error} if rec.error else rec.result))
                        for rec in result.tool_calls}  # as the tool message holds it
                big = max(result.tool_calls, key=lambda rec: size[id(rec)])
                result.error = (f"the tool results no longer fit the context (the largest: tool {big.call.name!r}, "
                                f"{size[id(big)]} characters); return less from the tool or raise ctx_size: {e}")
                result.stop_reason = "error"
                logger.warning("%s", result.error)
                break
            result.stats = result.stats + out.stats
            result.steps += 1
            result.raw_turns.append(out.text)
            emit(Event("stats", stats=out.stats))
            logger.info("turn %d: %d tokens, %.2f tokens/forward, acceptance %.2f, %d forced, stop=%s",
                        result.steps, out.stats.new_tokens, out.stats.tokens_per_forward,
                        out.stats.acceptance_rate, out.stats.forced, out.stop_reason)
            is_call = out.is_call
            if out.truncated:
                result.truncated, result.stop_reason = True, "length"
                if not is_call and response is None:  # a cut text answer is still an answer
                    result.final_answer = out.text
                    messages.append({"role": "assistant", "content": out.text})
                    emit(Event("final_answer", text=out.text))
                if not (is_call and out.calls):
                    break  # a cut tool call or structured output is never returned
                # a several-call turn cut by the budget: its whole calls are run (then the run ends), the cut never
            if not is_call:
                messages.append({"role": "assistant", "content": out.text})
                result.final_answer = out.text
                result.stop_reason = "answer"
                if response is not None:
                    try:
                        result.output = response.validate(json.loads(out.text))
                    except ToolCallError as e:  # a relaxed keyword, or a pydantic validator the grammar cannot see
                        result.error, result.stop_reason = f"the answer fails its response_format: {e}", "error"
                        logger.warning("%s", result.error)
                emit(Event("final_answer", text=out.text, output=result.output))
                break
            try:
                validated = [self.registry.parse_call(c) for c in out.calls]
            except ToolCallError as e:  # possible only for lenient tools: the grammar relaxed some keyword
                if retries >= self.max_retries:  # keep what the run has, mark why it stopped
                    messages.append({"role": "assistant", "content": out.text})
                    result.error = f"decoded call still invalid after {retries} retries: {e}"
                    result.stop_reason = "error"
                    logger.warning("%s", result.error)
                    break
                retries += 1
                invalid = str(e)
                messages.append({"role": "assistant", "content": out.text})
                messages.append({"role": "user", "content": f"That tool call is invalid: {e}. Call it again with "
                                                            f"valid arguments."})
                continue
            invalid = None
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": [c.to_openai() for c in validated]})
            for c in validated:
                emit(Event("tool_call_started", call=c))
            runnable = [c for c in validated if self.registry.get(c.name).fn is not None]
            result.pending_calls = [c for c in validated if self.registry.get(c.name).fn is None]
            for rec in self._run_tools(runnable):
                result.tool_calls.append(rec)
                emit(Event("tool_call_finished", record=rec))
                content = {"error": rec.error} if rec.error else rec.result
                messages.append({"role": "tool", "tool_call_id": rec.call.id, "name": rec.call.name,
                                 "content": _to_json_text(content)})
            if result.pending_calls or out.truncated:
                if not out.truncated:
                    result.stop_reason = "calls"
                break
            choice = "auto"
        else:
            if invalid is not None:  # the steps ran out while an invalid call waited for its retry
                result.error = f"decoded call invalid, and no step was left to retry it: {invalid}"
                result.stop_reason = "error"
                logger.warning("%s", result.error)
        return result

    def _options(self, tool_choice: Any, response_format: Any, max_total_tokens: Any, max_steps: Any,
                 parallel_tool_calls: Any, overrides: dict) -> tuple[EngineConfig, ResponseFormat | None]:
        """A run's options checked before it decodes: (its config, its response format).

        Raises:
            ValueError: a bad override, budget, ``parallel_tool_calls`` or ``tool_choice`` (naming it).
            ToolCallError: ``tool_choice`` names a tool that is not registered.
            SchemaError: ``response_format`` is not a valid, enforceable schema.
        """
        config = self.config.override(**overrides)  # raises ValueError naming a bad override (max_new_tokens < 1)
        _check_budgets(config.max_new_tokens, max_total_tokens, max_steps)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError(f"parallel_tool_calls must be True, False or None, got {parallel_tool_calls!r}")
        filter_tools(self.registry, tool_choice)
        return config, _response_format(response_format, self.registry.strict)

    def _run_one(self, call: ToolCall) -> ToolCallRecord:
        tool = self.registry.get(call.name)
        rec = ToolCallRecord(call)
        try:
            if self.tool_timeout is None:
                rec.result = tool.invoke(call)
            else:
                pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
                try:
                    rec.result = pool.submit(tool.invoke, call).result(timeout=self.tool_timeout)
                finally:
                    pool.shutdown(wait=False, cancel_futures=True)
        except concurrent.futures.TimeoutError:
            rec.error = f"tool {call.name!r} timed out after {self.tool_timeout} s"
        except Exception as e:  # the error goes back to the model as the tool result
            rec.error = f"{type(e).__name__}: {e}"
        return rec

    def _run_tools(self, calls: list[ToolCall]) -> list[ToolCallRecord]:
        """Run calls; concurrently when allowed and every tool is thread-safe. Results keep the calls' order."""
        concurrent_ok = (self.parallel_tool_execution and len(calls) > 1
                         and all(self.registry.get(c.name).thread_safe for c in calls))
        if not concurrent_ok:
            return [self._run_one(c) for c in calls]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(self._run_one, calls))

    def _initial_messages(self, prompt: str | list[dict]) -> list[dict]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty: give a question or instruction")
            return [{"role": "user", "content": prompt}]
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"the prompt must be a string or a list of message dicts, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is an empty message list")
        messages = []
        for i, m in enumerate(prompt):
            if not isinstance(m, dict):
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
            messages.append(dict(m))
        for i, m in enumerate(messages):
            if "role" not in m:
                raise ValueError(f"message {i} has no 'role'")
            if m["role"] not in ROLES:
                raise ValueError(f"message {i}: role {m['role']!r} is not one of {', '.join(ROLES)}")
            if m["role"] == "developer":  # OpenAI's newer name for system instructions (as the server reads it)
                m["role"] = "system"
            content = m.get("content")
            calls = m.get("tool_calls")
            if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(tc, dict) and isinstance(tc.get("function", tc), dict) for tc in calls)):
                raise ValueError(f"message {i}: 'tool_calls' must be a list of calls {{'id', 'type': 'function', "
                                 f"'function': {{'name', 'arguments'}}}} on an assistant message")
            if content is None and not (m["role"] == "assistant" and calls):
                raise ValueError(f"message {i} ({m['role']}) has no 'content'")
            text = _text_parts(content)  # a list of text parts: their text, as the server reads them
            if m["role"] == "tool":  # a tool's result: text, or any JSON value (rendered as JSON)
                _check_answers_a_call(messages, i)
                if text is not None and content:
                    m["content"] = text
            elif isinstance(content, list):
                if text is None:
                    raise ValueError(f"message {i}: only text content parts ({{'type': 'text', 'text': ...}}) are "
                                     f"supported")
                m["content"] = text
            elif content is not None and not isinstance(content, str):
                raise ValueError(f"message {i}: 'content' must be a string or a list of text parts, got "
                                 f"{type(content).__name__}")
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function", tc)
                try:
                    self.registry.parse_call({"name": fn.get("name"), "arguments": fn.get("arguments", {})})
                except ToolCallError as e:
                    raise ToolCallError(f"message {i}: {e}", tool=e.tool, pointer=e.pointer) from None
        return messages


class _StreamClosed(Exception):
    """Raised in a stream's decode thread at its next step once the consumer stopped iterating."""


def _text_parts(content: Any) -> str | None:
    """The text of ``content`` where it is a list of OpenAI text parts (``{"type": "text", "text": ...}``), joined;
    None where it is anything else."""
    if not isinstance(content, list) or not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return None
    return "".join(p["text"] for p in content)


def _check_answers_a_call(messages: list[dict], i: int) -> None:
    """Raise ValueError unless the ``tool`` message ``messages[i]`` answers a call: it follows (after other tool
    messages) an assistant message with ``tool_calls``, and its ``tool_call_id``, where given, names one of them
    (as the server and OpenAI require)."""
    j = i - 1
    while j >= 0 and messages[j].get("role") == "tool":
        j -= 1
    calls = messages[j].get("tool_calls") if j >= 0 and messages[j].get("role") == "assistant" else None
    if not calls:
        raise ValueError(f"message {i} (tool) answers no call: a tool message follows the assistant message whose "
                         f"tool_calls it answers")
    call_id = messages[i].get("tool_call_id")
    ids = {tc.get("id") for tc in calls if isinstance(tc, dict) and tc.get("id")}
    if call_id is not None and ids and call_id not in ids:
        raise ValueError(f"message {i} (tool): tool_call_id {call_id!r} names no call of message {j} "
                         f"({', '.join(sorted(map(repr, ids)))})")


def _outcome(run: Callable[..., RunResult], prompt: Any, kwargs: dict) -> RunResult | Exception:
    """``run(prompt, **kwargs)``, or the exception it raised."""
    try:
        return run(prompt, **kwargs)
    except Exception as e:  # noqa: BLE001 - returned to run_batch, which reports it for this prompt
        return e


def _response_format(spec: Any, strict: bool) -> ResponseFormat | None:
    """``run``'s ``response_format``: None, a :class:`ResponseFormat` as given, or one built from a pydantic model
    class or JSON Schema (OpenAI's wrappers included) with the agent's ``strict`` (an OpenAI wrapper's own
    ``"strict": false`` relaxes it too)."""
    if spec is None or isinstance(spec, ResponseFormat):
        return spec
    return ResponseFormat(spec, strict=strict)


def _check_budgets(max_new_tokens: Any, max_total_tokens: Any, max_steps: Any) -> None:
    """Raise ValueError naming the budget argument that is not an integer >= 1."""
    for name, value, optional in (("max_new_tokens", max_new_tokens, False),
                                  ("max_total_tokens", max_total_tokens, True), ("max_steps", max_steps, True)):
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _to_json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def agent_from_spec(spec: tuple) -> Agent:
    """The agent an :meth:`Agent.spec` describes (its engine rebuilt, its tools registered again)."""
    engine_spec, tool_sources, settings, config = spec
    agent = Agent(build_engine(engine_spec), config=config, **settings)
    for tool, strict in tool_sources:
        agent.register(tool, strict=strict)
    return agent
