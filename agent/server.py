"""OpenAI-compatible HTTP server over a local engine: ``python -m agent serve --model M --host H --port P``.

Endpoints: ``POST /v1/chat/completions`` (also ``stream: true``, server-sent events), ``GET /v1/models`` (and
``GET /v1/models/{id}``: the served model or ``"default"``, else 404),
``GET /metrics`` (Prometheus text format), ``GET /health`` (never needs the key). One model in memory; requests
are decoded ``concurrency`` at a time (default 1) and up to ``max_waiting`` more wait in line; beyond that the server
answers 429 with ``Retry-After``. A request is counted from its admission, streamed or not, until its decode ends.
A bad request gets 400 naming the field (``agent/openai_protocol.py``; 404 for a model not served, for an unknown
route too, in OpenAI's error shape); a failed decode gets 500 with its message (never an exception class name), and
the server keeps serving: whatever fails after admission, the request's slot is freed. Every returned call and
structured output was decoded under its grammar and validated, as in :class:`Agent`; where a relaxed schema's
(``"strict": false``) output fails validation, the choice holds the decoded text and ``validation_error``
(``openai_protocol.make_choice``).

Limits (flags of ``python -m agent serve``; :func:`create_app` arguments):
    ``--api-key`` / ``SPECAGENT_API_KEY``: ``Authorization: Bearer KEY`` on every route but ``/health`` (401).
    ``--max-waiting`` (64), ``--concurrency`` (1): the queue (429 beyond it, ``Retry-After: 1``).
    ``--max-batch N`` (llama.cpp backend): continuous batching (``decoding.batch``): up to N requests decoded
        together, their verify rows in one ``llama_decode`` per step; it takes ``--concurrency``'s place in the
        queue limit. ``--seq-ctx`` KV positions per request (default 2048; longer prompts get 400),
        ``--max-rows`` tokens per step (128).
    ``--request-timeout`` seconds (none): from admission; the decode stops, the client gets 504 (a stream: an
        error event).
    ``--max-body-bytes`` (4 MiB): 413 beyond it.
    ``num_draft_tokens`` at most 32 (``MAX_NUM_DRAFT_TOKENS``); ``seed`` 64 bits; a prompt must leave room in
    the model's context, and an explicit ``max_tokens`` must fit after it (400, vLLM's wording).
    A client that disconnects stops its decode at the next step and frees its slot.
    SIGTERM (or Ctrl-C): drain: new requests get 503, in-flight ones finish (at most ``--drain-timeout`` seconds,
    30, then they are cancelled), then the process exits; a second signal exits at once.

Metrics (``GET /metrics``): ``specagent_requests_total{status}``, ``specagent_generated_tokens_total``,
``specagent_drafted_tokens_total``, ``specagent_accepted_tokens_total``, ``specagent_acceptance_rate``,
``specagent_in_flight`` (admitted: decoding + waiting), ``specagent_queue_length`` (waiting for a decode slot, with
``--max-batch``: for a place in the batch), ``specagent_request_latency_seconds`` (histogram). With ``--max-batch``
also the scheduler's (as vLLM's running / waiting / KV cache usage / tokens per iteration):
``specagent_batch_slots`` (``max_batch``), ``specagent_batch_running`` (sequences in the batch, each holding a KV
slot), ``specagent_batch_waiting`` (sequences waiting in the scheduler for a slot), ``specagent_kv_cache_usage_ratio``
(KV positions held by running sequences / ``max_batch × seq_ctx``), ``specagent_batch_steps_total`` (batched
``llama_decode`` steps), ``specagent_batch_step_tokens`` and ``specagent_batch_step_sequences`` (summaries: ``_sum /
_count`` = tokens, sequences per step), ``specagent_batch_aborted_sequences_total`` (left unfinished: client gone,
timeout, failure; KV removed), ``specagent_batch_prefix_copies_total`` (prompt prefixes copied from another slot).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import logging
import sys
import threading
import time
from typing import Any

from fastapi import FastAPI, Request  # the optional "serve" extra: pip install 'specagent[serve]'
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from constraints import GrammarEngineError

from .engine import DecodedTurn, EngineConfig, LocalEngine
from .openai_protocol import (ChatRequest, RequestError, TextStream, chunk, completion, make_choice, model_not_found,
                              model_object, new_id, parse_chat_request, tool_call_deltas, usage)

logger = logging.getLogger(__name__)
DEFAULT_MAX_WAITING = 64
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a request body beyond this gets 413
DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds a SIGTERM waits for in-flight requests before cancelling them
RETRY_AFTER_S = 1  # the Retry-After (seconds) of 429 and 503 answers
LOOPBACK = ("localhost",)  # names; any address of 127.0.0.0/8 or ::1 is loopback too (is_loopback)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, 127.0.0.0/8 or ``::1``."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Cancelled(Exception):
    """Raised inside a decode (from its per-step callback) whose client left or whose time ran out."""


class _Slot:
    """One admitted request: counted in ``in_flight`` from admission (before any response byte) until its decode
    ends or it fails before decoding; ``cancel`` stops its decode at the next step."""

    def __init__(self, state, timeout: float | None):
        self.state = state
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.cancel = threading.Event()
        self.reason = ""
        self.released = False
        self.future: concurrent.futures.Future | None = None
        self.timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout, self.stop, "timeout")
        state.in_flight += 1
        state.slots.add(self)

    def stop(self, reason: str) -> None:
        """Stop the decode: a waiting one at once (its slot freed now), a running one at its next step."""
        if not self.cancel.is_set():
            self.reason = reason
            self.cancel.set()
        if self.future is not None:
            self.future.cancel()  # succeeds only while it waits in line

    def release(self) -> None:  # on the event loop only
        if not self.released:
            self.released = True
            self.state.in_flight -= 1
            self.state.slots.discard(self)
            if self.timer is not None:
                self.timer.cancel()

    def outcome(self, future: asyncio.Future) -> DecodedTurn:
        """The decoded turn, or :class:`Cancelled` (a decode stopped before it started included)."""
        if future.cancelled():
            raise Cancelled(self.reason)
        return future.result()

    def check(self) -> None:
        """Raise :class:`Cancelled` when the client left or the deadline passed (called in the decode thread)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.stop("timeout")
        if self.cancel.is_set():
            raise Cancelled(self.reason)


def _decode_error(e: Exception) -> RequestError:
    """The client's error for a decode that raised ``e``: 400 where llguidance failed on the request's grammar (a
    schema too complex for it: the client can simplify it), else 500 (logged with its traceback)."""
    if isinstance(e, GrammarEngineError):
        logger.warning("grammar engine failed: %s", e.detail or e)
        return RequestError(None, f"the grammar of this request's tools or response_format is too complex for "
                            f"llguidance ({e}); simplify the schema (e.g. a long counted repetition such as "
                            f"a{{100000}} in a pattern)", status=400)
    logger.error("decode failed", exc_info=e)
    return RequestError(None, f"generation failed: {e}", status=500)


def _timeout_error(seconds: float | None) -> RequestError:
    return RequestError(None, f"the request took longer than the server's request timeout ({seconds} s); the "
                              f"decode was stopped", status=504, code="timeout")


def create_app(engine: LocalEngine, *, model_name: str | None = None, config: EngineConfig = EngineConfig(),
               max_waiting: int = DEFAULT_MAX_WAITING, concurrency: int = 1, api_key: str | None = None,
               request_timeout: float | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_batch: int | None = None, seq_ctx: int | None = None, max_rows: int | None = None):
    """A FastAPI app serving ``engine``.

    Args:
        engine: the engine every request decodes with (any :class:`~agent.engine.Engine` with ``call_prefixes``;
            with ``check``/``context_length`` as :class:`LocalEngine` has, bad requests are refused before decoding).
        model_name: the id clients pass as ``model`` (default: the engine's model name); ``"default"`` also works.
        config: the defaults a request's fields override (drafter, γ, caps, sampling, ``max_new_tokens``).
        max_waiting: requests that may wait beyond the ``concurrency`` being decoded; more get HTTP 429 (with
            ``Retry-After``). A request counts from its admission, streamed or not, until its decode ends.
        concurrency: decodes at once (threads over one set of weights).
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (else 401).
        request_timeout: seconds from admission (queueing included) after which the decode stops and the client
            gets 504 (a stream: an error event); None: no limit.
        max_body_bytes: the largest request body (bytes); a larger one gets 413.
        max_batch: continuous batching (a :class:`LocalEngine` on the llama.cpp backend): its generator decodes up to
            ``max_batch`` requests together (``Generator.enable_batching``, with ``seq_ctx`` KV positions per request
            and ``max_rows`` tokens per step), and ``max_batch`` replaces ``concurrency`` (decodes at once; the
            queue limit is ``max_batch + max_waiting``). None: no batching.

    Limits and statuses: 401 bad or missing key; 413 body too large; 400 a bad field, a prompt beyond the model's
    context (or a ``max_tokens`` that does not fit after it), a drafter the server cannot run, ``num_draft_tokens``
    above :data:`~agent.openai_protocol.MAX_NUM_DRAFT_TOKENS`; 429 queue full; 503 draining (after SIGTERM);
    504 request timeout; 500 a failed decode (its message, never an exception class name). All are decided before
    the status line, for streams too; a client that disconnects stops its decode at the next step.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    for what, value, low in (("max_waiting", max_waiting, 0), ("concurrency", concurrency, 1),
                             ("max_body_bytes", max_body_bytes, 1), ("max_batch", max_batch, 1)):
        if value is not None and value < low:
            raise ValueError(f"{what} must be >= {low}, got {value}")
    if request_timeout is not None and not request_timeout > 0:  # NaN too
        raise ValueError(f"request_timeout must be > 0 seconds (None: no limit), got {request_timeout}")
    name = model_name or engine.name
    names = (name, "default")
    if max_batch is not None:
        generator = getattr(engine, "generator", None)
        if generator is None:
            raise ValueError("max_batch needs a LocalEngine (continuous batching runs in-process on llama.cpp)")
        if generator.batcher is None:
            generator.enable_batching(max_batch, seq_ctx=seq_ctx, max_rows=max_rows)
        elif generator.batcher.max_batch != max_batch:
            raise ValueError(f"the engine already batches {generator.batcher.max_batch} sequences, not {max_batch}")
        concurrency = max_batch  # one waiting thread per sequence in the scheduler
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="decode")
    app = FastAPI(title="specagent", docs_url=None, redoc_url=None)
    state = app.state
    state.in_flight = 0  # admitted: decoding + waiting; touched only on the event loop
    state.slots = set()
    state.draining = False
    check = getattr(engine, "check", None)
    context_length = getattr(engine, "context_length", None)

    registry = CollectorRegistry()
    m_requests = Counter("specagent_requests", "Chat completions answered and error responses of any route, by "
                         "HTTP status", ["status"],
                         registry=registry)
    m_tokens = Counter("specagent_generated_tokens", "Tokens generated", registry=registry)
    m_drafted = Counter("specagent_drafted_tokens", "Drafter tokens proposed", registry=registry)
    m_accepted = Counter("specagent_accepted_tokens", "Drafter tokens accepted", registry=registry)
    m_latency = Histogram("specagent_request_latency_seconds", "Admission to last byte of a completion (s)",
                          registry=registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
    Gauge("specagent_in_flight", "Requests admitted (decoding + waiting)", registry=registry).set_function(
        lambda: state.in_flight)
    Gauge("specagent_queue_length", "Requests waiting for a decode slot", registry=registry).set_function(
        lambda: max(0, state.in_flight - concurrency))
    Gauge("specagent_acceptance_rate", "Accepted / drafted tokens since start", registry=registry).set_function(
        lambda: m_accepted._value.get() / max(1.0, m_drafted._value.get()))
    batcher = getattr(getattr(engine, "generator", None), "batcher", None)
    if batcher is not None:
        registry.register(_BatchMetrics(batcher))

    def error(e: RequestError, headers: dict | None = None) -> JSONResponse:
        m_requests.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 404 / 405 and the like in OpenAI's error shape
        return error(RequestError(None, str(exc.detail), status=exc.status_code), getattr(exc, "headers", None))

    def denied(request: Request) -> JSONResponse | None:
        if api_key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, key = given.strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode()):  # RFC 7235
            return None
        body = RequestError(None, "Incorrect or missing API key: send 'Authorization: Bearer <key>'", 401,
                            code="invalid_api_key")
        return error(body, {"WWW-Authenticate": "Bearer"})

    def record(turn: DecodedTurn | None, status: int, t0: float) -> None:
        """Count one answered request (``turn`` None: a stream that failed or whose client left)."""
        m_requests.labels(str(status)).inc()
        if turn is not None:
            m_tokens.inc(turn.stats.new_tokens)
            m_drafted.inc(turn.stats.drafted)
            m_accepted.inc(turn.stats.accepted)
        m_latency.observe(time.monotonic() - t0)

    def submit(req: ChatRequest, slot: _Slot, on_text=None) -> asyncio.Future:
        """Queue the decode of ``req``; ``slot`` is released when the decode ends (a cancelled one at its next
        step, one cancelled while waiting at once)."""
        loop = asyncio.get_running_loop()

        def step(text: str) -> None:  # the decode's per-step callback: where a cancellation stops it
            slot.check()
            if on_text is not None:
                on_text(text)

        def run():
            slot.check()  # left or timed out while waiting
            return engine.turn(req.messages, list(req.registry), req.tool_choice, req.response,
                               req.parallel_tool_calls, req.config, step)
        def done(_) -> None:
            if not loop.is_closed():  # a decode that outlived the server has nothing to release
                loop.call_soon_threadsafe(slot.release)
        slot.future = pool.submit(run)
        slot.future.add_done_callback(done)
        wrapped = asyncio.wrap_future(slot.future, loop=loop)
        # a stream whose client left never awaits its future: retrieve the Cancelled here, or asyncio logs it as
        # "Future exception was never retrieved" with a traceback that looks like a crash
        wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())
        return wrapped

    async def admit(request: Request) -> tuple[ChatRequest, _Slot] | JSONResponse:
        """Everything decided before the status line: auth, draining, body size, the request's fields, the queue,
        the prompt's length and the drafter. Returns the request and its slot, or the error response."""
        if (no := denied(request)) is not None:
            return no
        if state.draining:
            return error(RequestError(None, "the server is shutting down; retry on another replica", 503),
                         {"Retry-After": str(RETRY_AFTER_S)})
        too_large = RequestError(None, f"the request body exceeds {max_body_bytes} bytes", 413)
        if int(request.headers.get("content-length") or 0) > max_body_bytes:
            return error(too_large)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > max_body_bytes:
                return error(too_large)
        try:
            body = json.loads(bytes(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(RequestError(None, f"the request body is not JSON: {e}"))
        except RecursionError:
            return error(RequestError(None, "the request body is nested too deeply to read"))
        try:
            req = parse_chat_request(body, config, names)
        except RequestError as e:
            return error(e)
        except (TypeError, AttributeError, KeyError, IndexError, RecursionError) as e:  # a shape no check foresaw
            logger.warning("request not readable: %r", e)
            return error(RequestError(None, f"the request could not be read: {e}"[:300]))
        if state.in_flight >= concurrency + max_waiting:
            return error(RequestError(None, f"{state.in_flight} requests in flight (limit "
                                            f"{concurrency + max_waiting}); retry later", status=429,
                                      code="rate_limit_exceeded"), {"Retry-After": str(RETRY_AFTER_S)})
        slot = _Slot(state, request_timeout)
        try:
            if check is not None:
                prompt = await asyncio.to_thread(check, req.messages, list(req.registry), req.tool_choice,
                                                 req.response, req.parallel_tool_calls, req.config)
                limit = context_length
                asked = prompt + (req.config.max_new_tokens if req.budget_given else 1)
                if limit is not None and (prompt >= limit or asked > limit):
                    raise RequestError("messages", f"This model's maximum context length is {limit} tokens. "
                                       f"However, you requested {asked} tokens ({prompt} in the messages, "
                                       f"{asked - prompt} in the completion). Please reduce the length of the "
                                       f"messages or completion.", code="context_length_exceeded")
        except RequestError as e:
            slot.release()
            return error(e)
        except (ValueError, FileNotFoundError) as e:  # a format refusal, a drafter the server cannot run
            slot.release()
            param = "drafter" if "drafter" in str(e) or "head" in str(e) else None
            return error(RequestError(param, str(e)))
        except Exception:  # noqa: BLE001 - whatever failed, the slot is freed and the client gets a JSON 500
            slot.release()
            logger.exception("preparing the request failed")
            return error(RequestError(None, "internal server error while preparing the request (see the server's "
                                            "log)", status=500))
        return req, slot

    @app.get("/health")
    async def health():  # 503 while draining: a load balancer stops routing here (new requests get 503 anyway)
        body = {"status": "draining" if state.draining else "ok", "model": name, "in_flight": state.in_flight}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics(request: Request):
        if (no := denied(request)) is not None:
            return no
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        if (no := denied(request)) is not None:
            return no
        return {"object": "list", "data": [model_object(name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):  # the OpenAI client's models.retrieve
        if (no := denied(request)) is not None:
            return no
        return error(model_not_found(model_id, names)) if model_id not in names else model_object(model_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.monotonic()
        admitted = await admit(request)
        if isinstance(admitted, JSONResponse):
            return admitted
        req, slot = admitted
        if req.stream:  # submitted now: the stream's body may never start (the client gone)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            future = submit(req, slot, lambda text: loop.call_soon_threadsafe(queue.put_nowait, text))
            future.add_done_callback(lambda _: queue.put_nowait(None))
            return _CancellingStream(_sse(req, slot, future, queue, engine.call_prefixes, record, t0,
                                          request_timeout), slot, media_type="text/event-stream")
        future = submit(req, slot)
        try:
            while not future.done():  # a client that leaves stops its decode
                await asyncio.wait({future}, timeout=0.1)
                if not future.done() and await request.is_disconnected():
                    slot.stop("disconnected")
            turn = slot.outcome(future)
            choice = make_choice(req, turn)
        except Cancelled as e:
            if e.args and e.args[0] == "timeout":
                return error(_timeout_error(request_timeout))
            m_requests.labels("499").inc()  # nobody is listening
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - a failed decode answers 500 (400: the schema); the server goes on
            return error(_decode_error(e))
        record(turn, 200, t0)
        return completion(req, choice, turn)

    return app


class _BatchMetrics:
    """The continuous-batching scheduler's metrics (a ``decoding.batch.BatchScheduler``), read at each scrape: see
    the module docstring."""

    def __init__(self, batcher):
        self.batcher = batcher

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        b = self.batcher
        yield GaugeMetricFamily("specagent_batch_slots", "Sequences decoded together at most (--max-batch)",
                                value=b.max_batch)
        yield GaugeMetricFamily("specagent_batch_running", "Sequences in the batch, each holding a KV cache slot "
                                "(decoding or prefilling)", value=b.active)
        yield GaugeMetricFamily("specagent_batch_waiting", "Sequences waiting in the scheduler for a free slot",
                                value=b.waiting)
        yield GaugeMetricFamily("specagent_kv_cache_usage_ratio", "KV cache positions held by the running "
                                "sequences / (max_batch x seq_ctx)", value=b.kv_positions / (b.max_batch * b.seq_ctx))
        yield CounterMetricFamily("specagent_batch_steps", "Batched llama_decode steps", value=b.steps)
        yield SummaryMetricFamily("specagent_batch_step_tokens", "Tokens per step (all sequences' verify rows and "
                                  "prefill chunks)", count_value=b.steps, sum_value=b.step_tokens)
        yield SummaryMetricFamily("specagent_batch_step_sequences", "Sequences per step", count_value=b.steps,
                                  sum_value=b.step_sequences)
        yield CounterMetricFamily("specagent_batch_aborted_sequences", "Sequences that left the batch unfinished "
                                  "(client gone, timeout, failed decode); their KV cache removed", value=b.aborted)
        yield CounterMetricFamily("specagent_batch_prefix_copies", "Prompt prefixes copied from another slot's KV "
                                  "cache instead of prefilled", value=b.copies)


class _CancellingStream(StreamingResponse):
    """A streamed completion that stops its decode however the response ends (the client gone included)."""

    def __init__(self, content, slot: _Slot, **kwargs):
        super().__init__(content, **kwargs)
        self.slot = slot

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.stop("disconnected")  # no-op when the decode has ended


async def _sse(req: ChatRequest, slot: _Slot, future: asyncio.Future, queue: asyncio.Queue,
               call_prefixes: tuple[str, ...], record, t0: float, request_timeout: float | None):
    """Server-sent events of one streamed completion (its decode ``future`` feeding ``queue`` with text, then
    None), ending with ``data: [DONE]``."""
    cid = new_id()
    stream = TextStream(req, call_prefixes)
    counted = False  # the request is in specagent_requests_total: 200, its error's status, or 499 (client left)

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        yield event(chunk(cid, req, {"role": "assistant", "content": ""}))
        while (text := await queue.get()) is not None:
            if piece := stream.feed(text):
                yield event(chunk(cid, req, {"content": piece}))
        try:
            turn: DecodedTurn = slot.outcome(future)
            choice = make_choice(req, turn)
        except Exception as e:  # noqa: BLE001 - reported in the stream: the status line is already sent
            if isinstance(e, Cancelled) and e.args and e.args[0] == "timeout":
                err = _timeout_error(request_timeout)
            else:
                err = _decode_error(e)
            if not (isinstance(e, Cancelled) and e.args and e.args[0] != "timeout"):
                record(None, err.status, t0)
                counted = True
            yield event(err.body())
            yield "data: [DONE]\n\n"
            return
        if rest := stream.finish(choice.content):
            yield event(chunk(cid, req, {"content": rest}))
        for delta in tool_call_deltas(choice.tool_calls):
            yield event(chunk(cid, req, delta))
        last = chunk(cid, req, {}, choice.finish_reason)
        if choice.validation_error is not None:
            last["choices"][0]["validation_error"] = choice.validation_error
        yield event(last)
        if req.include_usage:
            yield event(chunk(cid, req, None, usage_=usage(turn, req.config)))
        record(turn, 200, t0)
        counted = True
        yield "data: [DONE]\n\n"
    finally:
        slot.stop("disconnected")  # no-op when the decode has ended
        if not counted:
            record(None, 499, t0)  # the client left (nobody is listening)


def draining_server(app: Any, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT, **config: Any):
    """A ``uvicorn.Server`` for ``app`` (a :func:`create_app` app) whose first SIGTERM/SIGINT drains: the app answers
    new requests 503 while the in-flight ones finish, then the server exits; after ``drain_timeout`` seconds the
    remaining decodes are cancelled. A second signal exits at once (uvicorn's own handling)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drain_deadline: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.drain_deadline is not None or not hasattr(app.state, "draining"):
                return super().handle_exit(sig, frame)
            app.state.draining = True
            self.drain_deadline = time.monotonic() + drain_timeout
            logger.warning("draining: %d requests in flight; new requests get 503", app.state.in_flight)

        async def on_tick(self, counter: int) -> bool:
            should_exit = await super().on_tick(counter)
            if self.drain_deadline is None:
                return should_exit
            if time.monotonic() > self.drain_deadline:
                for slot in list(app.state.slots):
                    slot.stop("shutdown")
            return should_exit or app.state.in_flight == 0

    config.setdefault("timeout_graceful_shutdown", 5)
    return DrainingServer(uvicorn.Config(app, **config))


class ServerThread:
    """Runs an app with uvicorn in a background thread (tests, notebooks): ``with ServerThread(app) as url: ...``.

    Args:
        host: interface to bind (default 127.0.0.1: loopback only).
        port: 0 picks a free port. ``url`` is then ``http://host:port/v1``.
        drain_timeout: see :func:`draining_server`; :meth:`drain` starts a drain as SIGTERM does.
    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT):
        self.server = draining_server(app, drain_timeout, host=host, port=port, log_level="warning", lifespan="off")
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.02)
        sock_host, sock_port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{sock_host}:{sock_port}/v1"

    def drain(self) -> None:
        """What SIGTERM does: stop accepting (503), finish in-flight requests, exit."""
        import signal

        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, config: EngineConfig = EngineConfig(),
          max_waiting: int = DEFAULT_MAX_WAITING, concurrency: int = 1, draft_model: str | None = None,
          device: str = "cpu", dtype: str = "float32", backend: str | None = None, engine: str | None = None,
          threads: int | None = None, api_key: str | None = None, request_timeout: float | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
          max_batch: int | None = None, seq_ctx: int | None = None, max_rows: int | None = None,
          ctx_size: int | None = None) -> None:
    """Load ``model`` once and serve it, under the id ``model``, until interrupted (blocks; SIGTERM drains, see
    :func:`draining_server`). ``backend`` (alias ``engine``) / ``threads`` / ``ctx_size``: see
    :class:`agent.engine.LocalEngine`;
    ``api_key`` (default: env ``SPECAGENT_API_KEY``), ``request_timeout``, ``max_body_bytes``: see
    :func:`create_app`; ``max_batch``/``seq_ctx``/``max_rows``: continuous batching, see :func:`create_app`. Binding
    anything but loopback without a key prints a warning."""
    import os

    api_key = api_key or os.environ.get("SPECAGENT_API_KEY") or None
    if not is_loopback(host) and api_key is None:
        print(f"warning: serving on {host} without an API key: anyone who can reach it can use the model; pass "
              f"--api-key or set SPECAGENT_API_KEY", file=sys.stderr, flush=True)
    engine = LocalEngine(model, draft_model=draft_model, device=device, dtype=dtype, backend=backend, engine=engine,
                         threads=threads, ctx_size=ctx_size)
    app = create_app(engine, model_name=model, config=config, max_waiting=max_waiting, concurrency=concurrency,
                     api_key=api_key, request_timeout=request_timeout, max_body_bytes=max_body_bytes,
                     max_batch=max_batch, seq_ctx=seq_ctx, max_rows=max_rows)
    drafter = engine.generator.resolve_drafter(config.drafter)
    engine.generator.check_supported(drafter)  # a default drafter the server cannot run refuses to start (ValueError)
    engine.generator.row_cost()  # measured (or read from the cache) now, not under the first requests' load
    batching = "" if max_batch is None else (f", continuous batching of {max_batch} × {engine.context_length} "
                                             f"positions")
    print(f"serving {engine.name} as model {model!r} on http://{host}:{port}/v1 (drafter {drafter}, "
          f"γ {config.num_draft_tokens}{batching})", flush=True)
    draining_server(app, drain_timeout, host=host, port=port, log_level="info").run()
