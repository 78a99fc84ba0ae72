"""OpenAI-compatible HTTP server over a local engine: ``python -m agent serve --model M --host H --port P``.

Endpoints: ``POST /v1/chat/completions`` (also ``stream: true``, server-sent events), ``GET /v1/models``,
``GET /health``. One model in memory; requests are decoded ``concurrency`` at a time (default 1) and up to
``max_waiting`` more wait in line; beyond that the server answers 429. A bad request gets 400 naming the field
(``agent/openai_protocol.py``); a failed decode gets 500 with its message, and the server keeps serving.
Every returned call and structured output was decoded under its grammar and validated, as in :class:`Agent`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, Request  # the optional "serve" extra: pip install 'specagent[serve]'
from fastapi.responses import JSONResponse, StreamingResponse

from .engine import DecodedTurn, EngineConfig, LocalEngine
from .openai_protocol import (ChatRequest, RequestError, TextStream, chunk, completion, make_choice, new_id,
                              parse_chat_request, tool_call_deltas, usage)

logger = logging.getLogger(__name__)
DEFAULT_MAX_WAITING = 64


def create_app(engine: LocalEngine, *, model_name: str | None = None, config: EngineConfig = EngineConfig(),
               max_waiting: int = DEFAULT_MAX_WAITING, concurrency: int = 1):
    """A FastAPI app serving ``engine``.

    Args:
        engine: the engine every request decodes with (any :class:`~agent.engine.Engine` with ``call_start_chars``).
        model_name: the id clients pass as ``model`` (default: the engine's model name); ``"default"`` also works.
        config: the defaults a request's fields override (drafter, γ, caps, sampling, ``max_new_tokens``).
        max_waiting: requests that may wait beyond the ``concurrency`` being decoded; more get HTTP 429.
        concurrency: decodes at once (threads over one set of weights).
    """
    name = model_name or engine.name
    names = (name, "default")
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="decode")
    app = FastAPI(title="specagent", docs_url=None, redoc_url=None)
    app.state.in_flight = 0  # decoding + waiting; touched only on the event loop

    def error(e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def submit(req: ChatRequest, on_text=None) -> asyncio.Future:
        """Queue the decode of ``req``; the slot is freed when the decode ends, whatever the client does."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(pool, lambda: engine.turn(
            req.messages, list(req.registry), req.tool_choice, req.response.schema if req.response else None,
            req.parallel_tool_calls, req.config, on_text))
        app.state.in_flight += 1

        def done(_):
            app.state.in_flight -= 1
        future.add_done_callback(done)
        return future

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "in_flight": app.state.in_flight}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "specagent"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(RequestError(None, f"the request body is not JSON: {e}"))
        try:
            req = parse_chat_request(body, config, names)
        except RequestError as e:
            return error(e)
        if app.state.in_flight >= concurrency + max_waiting:
            return error(RequestError(None, f"{app.state.in_flight} requests in flight (limit "
                                            f"{concurrency + max_waiting}); retry later", status=429))
        if req.stream:
            return StreamingResponse(_sse(req, submit, engine.call_start_chars), media_type="text/event-stream")
        try:
            turn = await submit(req)
            return completion(req, make_choice(req, turn), turn)
        except Exception as e:  # noqa: BLE001 - a failed decode answers 500; the server goes on
            logger.exception("decode failed")
            return error(RequestError(None, f"generation failed: {type(e).__name__}: {e}", status=500))

    return app


async def _sse(req: ChatRequest, submit, call_start_chars: str):
    """Server-sent events of one streamed completion, ending with ``data: [DONE]``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    future = submit(req, lambda text: loop.call_soon_threadsafe(queue.put_nowait, text))
    future.add_done_callback(lambda _: queue.put_nowait(None))
    cid = new_id()
    stream = TextStream(req, call_start_chars)

    def event(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    yield event(chunk(cid, req, {"role": "assistant", "content": ""}))
    while (text := await queue.get()) is not None:
        if piece := stream.feed(text):
            yield event(chunk(cid, req, {"content": piece}))
    try:
        turn: DecodedTurn = future.result()
        choice = make_choice(req, turn)
    except Exception as e:  # noqa: BLE001 - reported in the stream: the status line is already sent
        logger.exception("decode failed")
        yield event(RequestError(None, f"generation failed: {type(e).__name__}: {e}", status=500).body())
        yield "data: [DONE]\n\n"
        return
    if rest := stream.finish(choice.content):
        yield event(chunk(cid, req, {"content": rest}))
    for delta in tool_call_deltas(choice.tool_calls):
        yield event(chunk(cid, req, delta))
    yield event(chunk(cid, req, {}, choice.finish_reason))
    if req.include_usage:
        yield event(chunk(cid, req, None, usage_=usage(turn, req.config)))
    yield "data: [DONE]\n\n"


class ServerThread:
    """Runs an app with uvicorn in a background thread (tests, notebooks): ``with ServerThread(app) as url: ...``.

    Args:
        host: interface to bind (default 127.0.0.1: loopback only).
        port: 0 picks a free port. ``url`` is then ``http://host:port/v1``.
    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                   lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.02)
        sock_host, sock_port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{sock_host}:{sock_port}/v1"

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
          threads: int | None = None) -> None:
    """Load ``model`` once and serve it, under the id ``model``, until interrupted (blocks). ``backend`` (alias
    ``engine``) / ``threads``: see :class:`agent.engine.LocalEngine`."""
    import uvicorn

    engine = LocalEngine(model, draft_model=draft_model, device=device, dtype=dtype, backend=backend, engine=engine,
                         threads=threads)
    app = create_app(engine, model_name=model, config=config, max_waiting=max_waiting, concurrency=concurrency)
    drafter = engine.generator.resolve_drafter(config.drafter)
    print(f"serving {engine.name} as model {model!r} on http://{host}:{port}/v1 (drafter {drafter}, "
          f"γ {config.num_draft_tokens})", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info")
