"""OpenAIEngine: the agent's turns decoded by any OpenAI-compatible server (this project's ``serve``, vLLM, SGLang,
llama.cpp's server), through the ``openai`` client.

Each turn's constraint goes in the form such servers take: ``tools`` + ``tool_choice`` (+ ``parallel_tool_calls``)
for calls, ``response_format`` ``json_schema`` (strict) for a structured answer. What comes back is parsed here
and validated by the agent against the registered schemas exactly as a local turn is (a server's "guaranteed"
JSON is still checked): a call or output that fails raises ``ToolCallError``; a cut one is never returned.

What holds remotely (see docs/scale-out.md): validity of every returned call and output (checked here);
tool_choice / response_format enforcement only as far as the server enforces them (checked after the fact).
What does not: token identity with the local decoder (another engine, kernels, batching, possibly another
tokenizer or chat template); the local speculative invariants are the server's business.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable

from decoding import DecodeStats
from schemas import Tool, ToolCallError

from .engine import DecodedTurn, EngineConfig

_STOP_REASONS = {"length": "length", "tool_calls": "eos", "stop": "eos", "function_call": "eos",
                 "content_filter": "stop"}
_MESSAGE_KEYS = {"system": ("role", "content", "name"), "user": ("role", "content", "name"),
                 "assistant": ("role", "content", "tool_calls"), "tool": ("role", "content", "tool_call_id")}


class OpenAIEngine:
    """Decodes turns on an OpenAI-compatible server.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model id.
        api_key: sent as a bearer token (local servers ignore it).
        send_engine_config: also send this project's knobs (``drafter``, ``num_draft_tokens``, ``adaptive``,
            ``max_string_length``, ``max_decimals``, ``max_items``, ``grounding``, ``close_at_model_end``, ``tool_prior``) as extra fields: only
            this project's server takes them (the server applies the grounding rules; without them a remote
            turn's calls are as sent).
        extra_body: more fields for every request (e.g. vLLM's ``structured_outputs`` options).
        timeout: seconds per request.
    """

    call_prefixes: tuple[str, ...] = ()  # calls come back as structured tool_calls, not text

    def __init__(self, base_url: str, model: str, *, api_key: str = "none", send_engine_config: bool = False,
                 extra_body: dict | None = None, timeout: float = 600.0):
        import openai

        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.send_engine_config = send_engine_config
        self.extra_body = dict(extra_body or {})
        self.timeout = timeout
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=2)

    @property
    def name(self) -> str:
        return self.model

    def spec(self) -> tuple:
        return OpenAIEngine, (self.base_url, self.model), {
            "api_key": self.api_key, "send_engine_config": self.send_engine_config, "extra_body": self.extra_body,
            "timeout": self.timeout}

    def request(self, messages: list[dict], tools: list[Tool], tool_choice: Any = "auto",
                response_format: dict | None = None, parallel_tool_calls: bool | None = None,
                config: EngineConfig = EngineConfig()) -> tuple[dict, dict]:
        """The chat-completions body for a turn, and the extra (non-OpenAI) fields."""
        body: dict[str, Any] = {"model": self.model, "messages": [_wire_message(m) for m in messages],
                                "temperature": config.temperature, "top_p": config.top_p,
                                "max_tokens": config.max_new_tokens}
        if config.seed is not None:
            body["seed"] = config.seed
        if config.stop:
            body["stop"] = list(config.stop)
        if tools:
            body["tools"] = [t.to_openai() for t in tools]
            body["tool_choice"] = _wire_tool_choice(tool_choice)
            if tool_choice != "none" and parallel_tool_calls is not None:
                body["parallel_tool_calls"] = parallel_tool_calls
        if response_format is not None:  # a JSON Schema, or a schemas.ResponseFormat (strict or not)
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "response", "schema": getattr(response_format, "schema", response_format),
                "strict": getattr(response_format, "strict", True)}}
        extra = dict(self.extra_body)
        if self.send_engine_config:
            extra.update(drafter=config.drafter, num_draft_tokens=config.num_draft_tokens, adaptive=config.adaptive,
                         grounding=config.grounding, close_at_model_end=config.close_at_model_end,
                         tool_prior=config.tool_prior)
            extra.update({k: getattr(config, k) for k in ("window", "max_string_length", "max_decimals", "max_items")
                          if getattr(config, k) is not None})
        return body, extra

    def turn(self, messages: list[dict], tools: list[Tool], tool_choice: Any = "auto",
             response_format: dict | None = None, parallel_tool_calls: bool | None = None,
             config: EngineConfig = EngineConfig(), on_text: Callable[[str], None] | None = None,
             on_discard: Callable[[], None] | None = None) -> DecodedTurn:
        """See :class:`~agent.engine.Engine`. With ``on_text`` the turn is streamed (content deltas are passed on);
        ``on_discard`` is never called: a server streams only text its final answer starts with (this project's
        server holds what it may decode again).

        Raises:
            openai.APIError: the server refused the request or failed (status and message kept).
        """
        body, extra = self.request(messages, tools, tool_choice, response_format, parallel_tool_calls, config)
        t0 = time.perf_counter()
        if on_text is None:
            resp = self.client.chat.completions.create(**body, extra_body=extra or None)
            choice = resp.choices[0]
            content = choice.message.content or ""
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in choice.message.tool_calls or []]
            finish, usage = choice.finish_reason, resp.usage
        else:
            content, calls, finish, usage = self._stream(body, extra, on_text)
        stats = _stats(usage, time.perf_counter() - t0)
        stop_reason = _STOP_REASONS.get(finish or "stop", "eos")
        # a cut call: sent partly (vLLM) or not at all (this project's server: no text either)
        is_call = bool(calls) or finish == "tool_calls" or (
            stop_reason == "length" and not content and bool(tools) and tool_choice != "none")
        if stop_reason != "length":
            _check_tool_choice(tool_choice, calls if is_call else None)
            return DecodedTurn(content, calls if is_call else None, is_call, stop_reason, stats)
        # cut by the budget: the whole calls before the cut one (this project's server sends only those; another
        # server may send the cut one too, whose arguments are then not whole JSON: never returned)
        whole = [c for c in calls if _whole_json(c["arguments"])] if is_call else []
        return DecodedTurn(content, whole or None, is_call, stop_reason, stats)

    def _stream(self, body: dict, extra: dict, on_text: Callable[[str], None]):
        stream = self.client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True},
                                                     extra_body=extra or None)
        return collect_stream(stream, on_text)


def _whole_json(arguments: Any) -> bool:
    """Whether a call's ``arguments`` (a dict, or a JSON string as a server sent it) is a whole JSON object."""
    if not isinstance(arguments, str):
        return isinstance(arguments, dict)
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def collect_stream(stream, on_text: Callable[[str], None] | None = None) -> tuple[str, list[dict], str | None, Any]:
    """Assemble an ``openai`` chat-completion chunk stream: (content, calls ``[{"id", "name", "arguments"}]`` in
    index order, finish_reason, usage or None). ``on_text`` gets each content delta as it arrives."""
    content, calls, finish, usage = [], {}, None, None
    for ch in stream:
        usage = ch.usage or usage
        for choice in ch.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
                if on_text is not None:
                    on_text(delta.content)
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, usage


def _wire_message(m: dict) -> dict:
    """An agent message as the OpenAI API takes it (only the keys that role allows)."""
    keys = _MESSAGE_KEYS.get(m["role"], ("role", "content"))
    return {k: m[k] for k in keys if m.get(k) is not None or k == "content"}


def _wire_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        return {"type": "function", "function": {"name": name}}
    return choice


def _check_tool_choice(choice: Any, calls: list[dict] | None) -> None:
    """Raise ToolCallError when a complete turn ignored ``tool_choice`` (a server may not enforce it)."""
    if choice == "none" and calls:
        raise ToolCallError(f"the server called {[c['name'] for c in calls]} although tool_choice was 'none'")
    if choice != "none" and choice != "auto" and not calls:
        raise ToolCallError(f"the server answered without a call although tool_choice was {choice!r}")
    if isinstance(choice, dict):
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        wrong = [c["name"] for c in calls if c["name"] != name]
        if wrong:
            raise ToolCallError(f"the server called {wrong} although tool_choice named {name!r}", tool=wrong[0])


def _stats(usage: Any, seconds: float) -> DecodeStats:
    """Decode statistics from a response's ``usage`` (this project's server adds ``speculative``, whose
    ``prefilled_tokens`` / ``decoded_tokens`` count every decode of the turn, as a local engine's statistics do)."""
    if usage is None:
        return DecodeStats(seconds=seconds)
    spec = (getattr(usage, "model_extra", None) or {}).get("speculative") or {}
    details = getattr(usage, "prompt_tokens_details", None)  # OpenAI's cached prompt tokens (vLLM, this server)
    return DecodeStats(prompt_tokens=spec.get("prefilled_tokens", usage.prompt_tokens or 0),
                       new_tokens=spec.get("decoded_tokens", usage.completion_tokens or 0),
                       prompt_tokens_cached=getattr(details, "cached_tokens", None) or 0,
                       target_forwards=spec.get("target_forwards", 0), drafted=spec.get("drafted_tokens", 0),
                       accepted=spec.get("accepted_tokens", 0), forced=spec.get("forced_tokens", 0),
                       seconds=seconds)
