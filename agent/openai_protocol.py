"""OpenAI Chat Completions wire format: request checking, responses, stream chunks (used by ``agent/server.py``).

A request is checked field by field before anything is decoded; every problem raises :class:`RequestError` naming
the field (``tools[0].function.parameters``, ``messages[2].tool_calls[0]``, ``response_format.json_schema.schema``)
so the server answers HTTP 400 with a message a client can act on. Our own knobs are extra fields under their own
names: ``drafter``, ``num_draft_tokens`` (at most :data:`MAX_NUM_DRAFT_TOKENS`), ``adaptive``, ``window``
(``"cost"`` or ``"fixed"``), ``max_string_length``, ``max_decimals``, ``max_items``, ``grounding`` (a boolean:
``agent.grounding``), ``close_at_model_end`` and ``tool_prior`` (booleans: ``agent.engine.EngineConfig``).
``seed`` is a 64-bit integer. A ``tool`` message needs a ``tool_call_id`` naming a call of the assistant message before it (as OpenAI);
earlier assistant ``tool_calls`` are taken as given (well-formed, not checked against this request's tools).
``logprobs``, ``top_logprobs``, ``logit_bias`` and the penalties are served at their defaults only
(:data:`DEFAULT_ONLY_FIELDS`); a lone surrogate in any string is refused (no tokenizer reads it); a model not
served is 404 ``model_not_found``; ``stop`` also ends the decode of a text answer (``EngineConfig.stop``).
``response_format``'s ``json_schema.strict: false`` relaxes in the grammar what it cannot enforce; the answer is
validated after.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from schemas.errors import RELAX_RESPONSE_FORMAT, RELAX_TOOL
from schemas import ResponseFormat, SchemaError, ToolCall, ToolCallError, ToolError, ToolRegistry, as_tool

from .engine import DecodedTurn, EngineConfig, answer_wanted

STANDARD_FIELDS = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
                   "temperature", "top_p", "seed", "max_tokens", "max_completion_tokens", "stop", "stream",
                   "stream_options", "n", "user", "metadata", "service_tier")
EXTRA_FIELDS = ("drafter", "num_draft_tokens", "adaptive", "window", "max_string_length", "max_decimals",
                "max_items", "grounding", "close_at_model_end", "tool_prior")
# standard parameters served only at their default (no effect): any other value is refused, naming the parameter
DEFAULT_ONLY_FIELDS = {"logprobs": False, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0,
                       "logit_bias": {}, "store": False}
SERVICE_TIERS = ("auto", "default")  # one tier here: the others OpenAI names are refused
ROLES = ("system", "developer", "user", "assistant", "tool")
ARGUMENT_FRAGMENT_CHARS = 16  # streamed tool-call arguments come in pieces of at most this many characters
MAX_NUM_DRAFT_TOKENS = 32  # γ per request: the speculative window's own cap (decoding.speculative max_window)


class RequestError(ValueError):
    """A request the server cannot serve as asked: HTTP ``status`` with ``message`` naming ``param``."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        self.param = param
        self.status = status
        self.code = code
        super().__init__(f"{param}: {message}" if param and not message.startswith(param) else message)

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked ``POST /v1/chat/completions`` body.

    Attributes:
        messages: normalised messages (``role``, ``content`` text, ``tool_calls``, ``tool_call_id``).
        registry: the request's tools (strict unless a function says ``"strict": false``).
        tool_choice: ``auto`` / ``required`` / ``none`` / ``{"name": ...}``.
        response: the structured-answer schema, or None.
        config: the server's :class:`EngineConfig` with this request's sampling, budget and knobs.
        stop: stop sequences (text answers only; the answer is cut before the first one).
        budget_given: the client set ``max_tokens`` / ``max_completion_tokens`` (then it must fit the context).
    """

    model: str
    messages: list[dict]
    registry: ToolRegistry
    tool_choice: Any
    parallel_tool_calls: bool | None
    response: ResponseFormat | None
    config: EngineConfig
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    budget_given: bool = False


def parse_chat_request(body: Any, base: EngineConfig, model_names: tuple[str, ...]) -> ChatRequest:
    """Check an OpenAI chat-completions request body. Raises :class:`RequestError` naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    for key, value in body.items():
        if key in DEFAULT_ONLY_FIELDS:
            default = DEFAULT_ONLY_FIELDS[key]
            # equal and of the default's JSON type (0 or 0.0 for a number, never False; false for a boolean)
            same = value == default and type(value) in ((int, float) if type(default) is int else (type(default),))
            if value is not None and not same:
                raise RequestError(key, f"is not supported here other than at its default ({json.dumps(default)}), "
                                        f"got {json.dumps(value)[:80]}")
        elif key not in STANDARD_FIELDS and key not in EXTRA_FIELDS:
            raise RequestError(key, f"unsupported parameter {key!r}")
    _check_unicode(body, "")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError("user", "must be a string")
    metadata = body.get("metadata")  # OpenAI's tags for stored completions: checked as OpenAI does, then unused
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items())):
        raise RequestError("metadata", "must be an object of at most 16 string keys (64 characters at most) "
                                       "with string values (512 characters at most)")
    if body.get("service_tier") is not None and body["service_tier"] not in SERVICE_TIERS:
        raise RequestError("service_tier", f"must be one of {', '.join(SERVICE_TIERS)} here, got "
                                           f"{json.dumps(body['service_tier'])[:80]}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model", "is required: the name of a served model, one of " + ", ".join(model_names))
    if model not in model_names:
        raise model_not_found(model, model_names)
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise RequestError("n", "only n=1 is supported")
    registry = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    tool_choice = _tool_choice(("auto" if len(registry) else "none") if choice is None else choice, registry)
    response = _response_format(body.get("response_format"))
    config = _config(body, base)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop  # {} or 0 is no list: refused
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop", "must be a non-empty string or a list of at most 4 non-empty strings")
    stream = body.get("stream", False) or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise RequestError("stream" if not isinstance(stream, bool) else "stream_options", "has the wrong type")
    if options and not stream:
        raise RequestError("stream_options", "is allowed only with stream: true")
    if not isinstance(options.get("include_usage", False), bool):
        raise RequestError("stream_options.include_usage", "must be a boolean")
    parallel = body.get("parallel_tool_calls")  # None: the tool format's default
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls", "must be a boolean")
    config = config.override(stop=tuple(stop) or None)  # the decode of a text answer ends at a stop sequence
    budget_given = any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
    return ChatRequest(model, _messages(body.get("messages")), registry, tool_choice, parallel, response,
                       config, stop, stream, bool(options.get("include_usage")), budget_given)


def _tools(tools: Any) -> ToolRegistry:
    registry = ToolRegistry()
    if tools is None:
        return registry
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list of {'type': 'function', 'function': {...}}")
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError(f"tools[{i}]", "must be {'type': 'function', 'function': {'name', 'parameters'}}")
        for key, kind, what in (("strict", bool, "a boolean"), ("description", str, "a string")):
            if t["function"].get(key) is not None and not isinstance(t["function"][key], kind):
                raise RequestError(f"tools[{i}].function.{key}", f"must be {what}")
        try:
            registry.register(as_tool(t, strict=t["function"].get("strict") is not False))
        except SchemaError as e:
            where = f"tools[{i}].function.parameters" + (f" at {e.pointer}" if e.pointer else "")
            raise RequestError(where, _http_advice(str(e), f"tools[{i}].function")) from None
        except (ToolError, ValueError) as e:
            raise RequestError(f"tools[{i}].function", str(e)) from None
        except RecursionError:
            raise RequestError(f"tools[{i}].function.parameters", "is nested too deeply to compile") from None
    return registry


def _http_advice(message: str, where: str) -> str:
    """A schema error's advice in the request's terms: the Python API's ``strict=False`` is the field
    ``"strict": false`` of ``where`` over HTTP."""
    for advice in (RELAX_TOOL, RELAX_RESPONSE_FORMAT):
        message = message.replace(advice, f'set "strict": false in {where}')
    return message


def _tool_choice(choice: Any, registry: ToolRegistry) -> Any:
    if choice in ("auto", "none"):
        return choice
    if not len(registry):
        raise RequestError("tool_choice", f"{json.dumps(choice)[:80]} needs tools: the request has none")
    if choice == "required":
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise RequestError("tool_choice", "must be 'auto', 'required', 'none' or "
                                          "{'type': 'function', 'function': {'name': ...}}")
    if name not in registry:
        raise RequestError("tool_choice", f"names unknown tool {name!r}; tools: {registry.names}")
    return {"name": name}


def _response_format(spec: Any) -> ResponseFormat | None:
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat({"type": "object"})
    if kind != "json_schema":
        raise RequestError("response_format.type", "must be 'text', 'json_object' or 'json_schema'")
    js = spec.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise RequestError("response_format.json_schema.schema", "a JSON Schema object is required")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("response_format.json_schema.strict", "must be a boolean")
    try:
        return ResponseFormat(js["schema"], strict=strict is not False)
    except SchemaError as e:
        raise RequestError("response_format.json_schema.schema" + (f" at {e.pointer}" if e.pointer else ""),
                           _http_advice(str(e), "response_format.json_schema")) from None
    except RecursionError:
        raise RequestError("response_format.json_schema.schema", "is nested too deeply to compile") from None


def _config(body: dict, base: EngineConfig) -> EngineConfig:
    budgets = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    if len(set(map(repr, budgets.values()))) > 1:
        raise RequestError("max_completion_tokens", "differs from max_tokens: give one")
    changes = {k: (k, body.get(k)) for k in ("temperature", "top_p", "seed") + EXTRA_FIELDS}
    for k, v in budgets.items():
        changes["max_new_tokens"] = (k, v)
    config = base
    for name, (param, value) in changes.items():
        try:
            config = config.override(**{name: value})
        except (ValueError, TypeError) as e:
            raise RequestError(param, str(e).replace(name, param, 1)) from None
    if config.num_draft_tokens > MAX_NUM_DRAFT_TOKENS:
        raise RequestError("num_draft_tokens", f"must be at most {MAX_NUM_DRAFT_TOKENS}, got {config.num_draft_tokens}")
    return config


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"{where}[{j}]", "only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(where, "must be a string or a list of text parts")


def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list")
    out = []
    answerable: set = set()  # ids of the calls of the last assistant message, not yet answered
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
        if answerable and m["role"] != "tool":
            _unanswered(answerable, f"messages[{i}]")
        msg = {"role": "system" if m["role"] == "developer" else m["role"],
               "content": _text(m.get("content"), f"messages[{i}].content")}
        if m["role"] == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RequestError(f"messages[{i}].tool_calls", "must be a list of calls")
            msg["tool_calls"] = [_history_call(tc, f"messages[{i}].tool_calls[{j}]")
                                 for j, tc in enumerate(m["tool_calls"])]
            seen_ids: set = set()
            for j, tc in enumerate(msg["tool_calls"]):
                if tc["id"] in seen_ids:
                    raise RequestError(f"messages[{i}].tool_calls[{j}].id", f"{tc['id']!r} is the id of an earlier "
                                       f"call of this message: each call needs its own id")
                seen_ids.add(tc["id"])
        elif msg["content"] is None:
            raise RequestError(f"messages[{i}].content", "is required")
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise RequestError(f"messages[{i}].tool_call_id", "is required: the id of the call this message "
                                                                  "answers")
            if call_id not in answerable:
                raise RequestError(f"messages[{i}].role", f"messages with role 'tool' must be a response to a "
                                   f"preceding message with 'tool_calls'; no call {call_id!r} awaits an answer")
            answerable.discard(call_id)
            msg["tool_call_id"] = call_id
        elif m["role"] == "assistant":
            answerable = {c["id"] for c in msg.get("tool_calls", []) if c.get("id")}
        else:
            answerable = set()
        out.append(msg)
    if answerable:
        _unanswered(answerable, "messages")
    return out


def model_not_found(model: str, served: tuple[str, ...] | list[str]) -> RequestError:
    """The 404 ``model_not_found`` for a ``model`` this server does not serve (``served``: the names it answers)."""
    return RequestError("model", f"the model {model!r} does not exist here; served: {', '.join(served)}",
                        status=404, code="model_not_found")


def model_object(model: str) -> dict:
    """OpenAI's ``model`` object for a served model id (``GET /v1/models`` and ``/v1/models/{id}``)."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "specagent"}


def _unanswered(ids: set, where: str) -> None:
    """Raise the 400 OpenAI gives where an assistant message's calls are not all answered before the message
    ``where`` names (or the end of the list: ``"messages"``)."""
    raise RequestError(where, "an assistant message with 'tool_calls' must be followed by tool messages responding "
                       "to each 'tool_call_id'; not answered: " + ", ".join(sorted(map(repr, ids))))


def _history_call(tc: Any, where: str) -> dict:
    """An earlier assistant call, normalised (``arguments`` as a JSON string; an id made where none is given).
    Taken as given, as OpenAI and vLLM take the history: not checked against this request's tools (the final-answer
    step often sends none)."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        raise RequestError(where, "must be {'id': ..., 'type': 'function', 'function': {'name', 'arguments'}}")
    name, args, call_id = tc["function"].get("name"), tc["function"].get("arguments"), tc.get("id")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.function.name", "must be a non-empty string")
    if call_id is not None and (not isinstance(call_id, str) or not call_id):
        raise RequestError(f"{where}.id", "must be a non-empty string")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}.function.arguments", f"is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments", "must be a JSON object (as a string)")
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _check_unicode(value: Any, where: str) -> None:
    """Raise :class:`RequestError` naming the first string (key or value) holding a lone surrogate (``"\\ud800"``
    in JSON): not Unicode text, so no tokenizer can read it."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(at or None, "holds a lone surrogate (e.g. \\ud800), which is not Unicode text; "
                                               "send the character's whole surrogate pair") from None
        elif isinstance(v, dict):
            stack += [(k, at) for k in v] + [(x, f"{at}.{k}" if at else str(k)) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(x, f"{at}[{i}]") for i, x in enumerate(v)]


# -- responses ----------------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """The assistant message of one decoded turn, validated: ``content`` and/or ``tool_calls``."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    validation_error: str | None = None  # a relaxed schema's output that failed validation (then content is text)


def make_choice(req: ChatRequest, turn: DecodedTurn) -> Choice:
    """The validated answer for ``turn``: a cut call or structured output is never returned (``content`` None);
    a several-call turn cut by the budget returns the whole calls before the cut one, with ``"length"``.

    Where a schema was relaxed (a ``"strict": false`` tool or ``response_format``) and the decoded call or
    structured output fails validation, no call is returned: ``content`` is the decoded text, ``finish_reason``
    ``"stop"`` and ``validation_error`` says what failed (the choice's ``validation_error`` field), so a client
    gets a 200 it can act on rather than a 5xx its library retries.

    Raises:
        ToolCallError: a call of a strict tool or a strict structured output fails validation (the grammar should
            have made that impossible: the server answers 500).
    """
    if turn.is_call:  # cut by the budget: the whole calls before the cut one (several-call turns), "length"
        try:
            calls = [req.registry.parse_call(c) for c in turn.calls or []]
        except ToolCallError as e:
            if all(t.strict for t in req.registry):
                raise
            return Choice(turn.text, [], "stop", str(e))
        return Choice(None, calls, "length" if turn.truncated else "tool_calls")
    if req.response is not None:
        if turn.truncated:
            return Choice(None, [], "length")
        try:
            req.response.validate(json.loads(turn.text))
        except (ToolCallError, ValueError) as e:
            if req.response.strict:
                raise
            return Choice(turn.text, [], "stop", str(e))
        return Choice(turn.text, [], "stop")
    text, hit = cut_at_stop(turn.text, req.stop)
    return Choice(text, [], "stop" if hit or not turn.truncated else "length")


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop sequence (excluded), and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)


def usage(turn: DecodedTurn, config: EngineConfig) -> dict:
    """OpenAI ``usage`` as OpenAI and vLLM count it: ``prompt_tokens`` the prompt's length, ``completion_tokens`` the
    tokens of the decode whose output is returned (``prompt_tokens_details.cached_tokens``: prompt tokens found in
    the KV cache, at most the prompt), plus ``speculative``: the drafter used (``auto`` resolved), target forwards,
    tokens per forward, drafted/accepted/forced tokens, and the work behind the turn where the engine decoded it
    more than once (a call that took nothing from the conversation, an answer that only restated a call:
    ``LocalEngine.turn``): ``prefilled_tokens`` and ``decoded_tokens`` over every decode (the forwards and drafts
    count every decode too)."""
    s = turn.stats
    prompt = len(turn.prompt) if turn.prompt else s.prompt_tokens  # a remote engine's turn: what its server said
    completion = len(turn.tokens) if turn.tokens else s.new_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(s.prompt_tokens_cached, prompt)},
            "speculative": {"drafter": turn.drafter or config.drafter, "num_draft_tokens": config.num_draft_tokens,
                            "prefilled_tokens": s.prompt_tokens, "decoded_tokens": s.new_tokens,
                            "target_forwards": s.target_forwards, "tokens_per_forward": s.tokens_per_forward,
                            "drafted_tokens": s.drafted, "accepted_tokens": s.accepted,
                            "acceptance_rate": s.acceptance_rate, "forced_tokens": s.forced}}


def completion(req: ChatRequest, choice: Choice, turn: DecodedTurn) -> dict:
    """The ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.content, "refusal": None}
    if choice.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in choice.tool_calls]
    out = {"index": 0, "message": message, "logprobs": None, "finish_reason": choice.finish_reason}
    if choice.validation_error is not None:
        out["validation_error"] = choice.validation_error
    return {"id": new_id(), "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": [out], "usage": usage(turn, req.config)}


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def chunk(completion_id: str, req: ChatRequest, delta: dict | None, finish_reason: str | None = None,
          usage_: dict | None = None) -> dict:
    """One ``chat.completion.chunk``; ``delta=None`` gives the usage-only chunk (``choices: []``)."""
    out = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model,
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish_reason}]}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def tool_call_deltas(calls: list[ToolCall]) -> list[dict]:
    """Stream deltas of validated calls: per call, ``index``, ``id``, ``type`` and ``name`` once, then argument
    fragments whose concatenation is exactly the non-streamed ``arguments`` string."""
    deltas = []
    for i, c in enumerate(calls):
        wire = c.to_openai()
        deltas.append({"tool_calls": [{"index": i, "id": wire["id"], "type": "function",
                                       "function": {"name": c.name, "arguments": ""}}]})
        args = wire["function"]["arguments"]
        for k in range(0, len(args), ARGUMENT_FRAGMENT_CHARS):
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": args[k:k + ARGUMENT_FRAGMENT_CHARS]}}]})
    return deltas


class TextStream:
    """Decides what decoded text may be streamed as ``content`` before the turn ends.

    Only a free-text answer streams live: a tool call or a structured output is sent once validated (a cut one is
    never returned, so no fragment of it may go out first). With ``tool_choice`` auto the text is held until its
    start shows whether it opens a call (``call_prefixes``: the format's call openers, e.g. ``"<"``, ``"{"``,
    ``"```json"``); after tool results or under ``"none"`` an answer opening with neither a letter nor a digit is
    held whole (the engine may decode it again: ``agent.engine.restates``, ``writes_call``); the last
    ``len(longest stop) - 1`` characters are held back so a stop sequence is never sent. What was sent is always a
    prefix of the final ``content``.
    """

    def __init__(self, req: ChatRequest, call_prefixes: tuple[str, ...]):
        mode = req.tool_choice if isinstance(req.tool_choice, str) else "required"
        self.live = req.response is None and mode != "required"
        # where the engine decodes again an answer that restates a call or a result as JSON or writes a call
        # (agent.engine.restates, writes_call: after tool results, or under "none"), an answer opening with
        # neither a letter nor a digit is held too
        self.restating = bool(list(req.registry)) and answer_wanted(req.messages, mode)
        self.may_call = mode == "auto" or self.restating
        self.call_prefixes = tuple(call_prefixes)
        self.hold = max((len(s) for s in req.stop), default=1) - 1
        self.stop = req.stop
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        """The part of the text so far that can go out now ("" if none)."""
        self.text += delta
        if not self.live:
            return ""
        if self.may_call:
            s = self.text.lstrip()
            if not s:
                return ""
            if s.startswith(self.call_prefixes) or (self.restating and not s[0].isalnum()):
                self.live = False  # a call, or an answer the engine may decode again: sent once final
                return ""
            if any(p.startswith(s) for p in self.call_prefixes):
                return ""  # may still open a call (e.g. "``" of "```json")
            self.may_call = False
        text, hit = cut_at_stop(self.text, self.stop)
        end = len(text) if hit else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        if hit:
            self.live = False
        return piece

    def finish(self, content: str | None) -> str:
        """The rest of the final ``content`` after what was sent."""
        content = content or ""
        assert content[:self.sent] == self.text[:self.sent], "streamed text is not a prefix of the content"
        return content[self.sent:]
