"""agent/server.py under load and misuse: every limit holds for streams too, a client that leaves stops its decode,
client errors are 4xx decided before the status line, a key guards the routes, SIGTERM drains, /metrics.

Servers bind 127.0.0.1 (ephemeral port) over the tiny random model; every load here is bounded in count and time.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest

from agent.engine import EngineConfig, LocalEngine
from agent.server import Cancelled, ServerThread, create_app
from decoding import Generator

from test_server import CONFIG, TOOLS, GatedEngine, user


@pytest.fixture(scope="module")
def engine(tiny_target):
    return LocalEngine(Generator(tiny_target))


class SlowEngine(GatedEngine):
    """Each decoded piece of text takes ``delay`` seconds; records how each turn ended."""

    def __init__(self, engine: LocalEngine, delay: float = 0.05):
        super().__init__(engine)
        self.gate.set()
        self.delay = delay
        self.ended: list[str] = []

    def turn(self, messages, tools, tool_choice="auto", response_format=None, parallel=None,
             config=EngineConfig(), on_text=None):
        def slow(text):
            time.sleep(self.delay)
            if on_text:
                on_text(text)
        try:
            out = super().turn(messages, tools, tool_choice, response_format, parallel, config, slow)
        except Cancelled as e:
            self.ended.append(f"cancelled:{e}")
            raise
        self.ended.append("done")
        return out


@dataclass
class Reply:
    status_code: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


def request(method: str, url: str, json_body=None, headers=None, timeout: float = 60) -> Reply:
    """One HTTP request with the standard library (raises TimeoutError when no answer comes in ``timeout`` s)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = None if json_body is None else json.dumps(json_body).encode()
        conn.request(method, u.path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode())
    finally:
        conn.close()


def post(url, json_body, **kw) -> Reply:
    return request("POST", url, json_body, **kw)


def body(**kw) -> dict:
    out = {"model": "gated", "messages": user("hi"), "max_tokens": 4}
    out.update(kw)
    return out


def open_stream(url: str, payload: dict, chunks: int):
    """Start a streamed completion on a raw connection and read its first ``chunks`` events: ``(conn, response)``,
    still open (close both to leave as a client does)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path + "/chat/completions", json.dumps(payload), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    read = 0
    while read < chunks:
        read += r.fp.readline().startswith(b"data: ")
    return conn, r


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as r:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                if line and not line.startswith("#")}


def in_flight(url: str) -> int:
    return request("GET", url.removesuffix("/v1") + "/health", timeout=10).json()["in_flight"]


def wait_until(pred, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# -- the queue counts streams -------------------------------------------------------------------------------------
def test_streams_are_counted_before_their_response_starts_and_the_excess_gets_429(engine):
    gated = GatedEngine(engine)
    with ServerThread(create_app(gated, config=CONFIG, max_waiting=2)) as url:
        results = []

        def stream(_):
            r = post(url + "/chat/completions", body(stream=True))
            results.append((r.status_code, r.text.encode()))
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: in_flight(url) == 3)
        for extra in (body(stream=True), body()):
            r = post(url + "/chat/completions", extra, timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "invalid_request_error"
        gated.gate.set()
        for t in threads:
            t.join(60)
        assert [s for s, _ in results] == [200] * 3 and all(b"[DONE]" in b for _, b in results)
        assert in_flight(url) == 0


# -- cancellation -------------------------------------------------------------------------------------------------
def test_a_stream_closed_after_two_chunks_stops_its_decode_and_frees_its_slot(engine, caplog):
    slow = SlowEngine(engine)
    with caplog.at_level("ERROR", logger="asyncio"), ServerThread(create_app(slow, config=CONFIG)) as url:
        conn, r = open_stream(url, body(stream=True, tool_choice="none", max_tokens=400), 2)
        r.close()
        conn.close()  # the client leaves after two chunks
        t0 = time.monotonic()
        wait_until(lambda: in_flight(url) == 0, 5)
        assert time.monotonic() - t0 < 2  # at the next step, not after 400 tokens × 50 ms
        wait_until(lambda: slow.ended)
        assert slow.ended == ["cancelled:disconnected"]
        # counted in /metrics as 499 (nobody listening), as a non-streamed client that leaves is
        wait_until(lambda: metrics(url).get('specagent_requests_total{status="499"}') == 1, 5)
        import gc

        gc.collect()  # an unretrieved future's exception is logged when it is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_non_streamed_client_that_times_out_stops_its_decode(engine):
    slow = SlowEngine(engine)
    with ServerThread(create_app(slow, config=CONFIG)) as url:
        with pytest.raises(TimeoutError):
            post(url + "/chat/completions", body(tool_choice="none", max_tokens=400), timeout=0.5)
        wait_until(lambda: in_flight(url) == 0, 5)
        wait_until(lambda: slow.ended)
        assert slow.ended == ["cancelled:disconnected"]


def test_a_waiting_request_whose_client_left_never_decodes(engine):
    gated = GatedEngine(engine)
    with ServerThread(create_app(gated, config=CONFIG)) as url:
        first = threading.Thread(target=lambda: post(url + "/chat/completions", body()))
        first.start()
        wait_until(lambda: in_flight(url) == 1)
        with pytest.raises(TimeoutError):
            post(url + "/chat/completions", body(), timeout=0.5)
        wait_until(lambda: in_flight(url) == 1, 5)  # the waiting one is gone at once, the running one stays
        gated.gate.set()
        first.join(60)
        assert in_flight(url) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_stops_the_decode_and_answers_504(engine, stream):
    slow = SlowEngine(engine)
    with ServerThread(create_app(slow, config=CONFIG, request_timeout=0.5)) as url:
        t0 = time.monotonic()
        r = post(url + "/chat/completions", body(stream=stream, tool_choice="none", max_tokens=400), timeout=30)
        assert time.monotonic() - t0 < 5
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert r.status_code == 200 and events[-1]["error"]["code"] == "timeout"
        else:
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        wait_until(lambda: in_flight(url) == 0, 5)
        assert slow.ended == ["cancelled:timeout"]
        assert metrics(url)['specagent_requests_total{status="504"}'] == 1  # a stream's too


# -- client errors: 4xx before the status line, streamed or not ---------------------------------------------------
@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(create_app(engine, model_name="gated", config=CONFIG, max_body_bytes=200_000)) as u:
        yield u


CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"code": "a"}'}}


@pytest.mark.parametrize("kw, status, param, text", [
    (dict(messages=user("word " * 5000)), 400, "messages", "maximum context length is 4096 tokens"),
    (dict(messages=user("word " * 3000), max_tokens=2000), 400, "messages", "in the completion"),
    (dict(seed=2 ** 64), 400, "seed", "64 bits"),
    (dict(seed=-2 ** 63 - 1), 400, "seed", "64 bits"),
    (dict(drafter="draft_model"), 400, "drafter", "draft_model"),
    (dict(num_draft_tokens=33), 400, "num_draft_tokens", "at most 32"),
    (dict(window="auto"), 400, "window", "unknown window 'auto'; choose one of cost, fixed"),
    (dict(max_items=0), 400, "max_items", ">= 1"),
    (dict(tools=TOOLS, messages=user("x") + [{"role": "tool", "content": "1"}]), 400, "messages[1].tool_call_id",
     "required"),
    (dict(tools=TOOLS, messages=user("x") + [{"role": "tool", "tool_call_id": "call_1", "content": "1"}]), 400,
     "messages[1].role", "preceding message with 'tool_calls'"),
    (dict(tools=TOOLS, messages=user("x") + [{"role": "assistant", "tool_calls": [CALL]},
                                              {"role": "tool", "tool_call_id": "call_2", "content": "1"}]), 400,
     "messages[2].role", "'call_2'"),
    (dict(tools=TOOLS, messages=user("x") + [{"role": "assistant", "tool_calls": [CALL]}] + user("y")), 400,
     "messages[2]", "not answered: 'call_1'"),  # as OpenAI: every call answered before the conversation goes on
    (dict(tools=TOOLS, messages=user("x") + [{"role": "assistant", "tool_calls": [CALL]}]), 400, "messages",
     "must be followed by tool messages"),
    (dict(tools=TOOLS, messages=user("x") + [{"role": "assistant", "tool_calls": [CALL, CALL]}]), 400,
     "messages[1].tool_calls[1].id", "each call needs its own id"),
    (dict(messages=user("x" * 300_000)), 413, None, "exceeds 200000 bytes"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_client_errors_are_4xx_before_the_status_line_for_streams_too(url, kw, status, param, text, stream):
    r = post(url + "/chat/completions", body(stream=stream, **kw))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"]
    assert "Error" not in err["message"]  # no exception class names
    assert in_flight(url) == 0


def test_a_tool_result_answering_the_assistants_call_is_served(url):
    msgs = user("x") + [{"role": "assistant", "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    assert post(url + "/chat/completions", body(tools=TOOLS, messages=msgs)).status_code == 200


def test_response_format_strict_false_relaxes_the_grammar_and_validates_after(url):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}, "required": ["n"],
              "additionalProperties": False}
    fmt = lambda strict: {"type": "json_schema", "json_schema": {"name": "r", "strict": strict, "schema": schema}}  # noqa
    r = post(url + "/chat/completions", body(response_format=fmt(True)))
    assert r.status_code == 400 and "not" in r.json()["error"]["message"]
    # the advice names the request's field, not the Python API's keyword
    assert 'set "strict": false in response_format.json_schema' in r.json()["error"]["message"]
    assert "strict=False" not in r.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    r = post(url + "/chat/completions", body(tools=[tool]))
    assert r.status_code == 400 and 'set "strict": false in tools[0].function' in r.json()["error"]["message"]
    r = post(url + "/chat/completions", body(response_format=fmt(False), max_tokens=16))
    assert r.status_code == 200, r.text  # a relaxed output that fails validation is named, not a 500
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop" and "validation_error" not in choice:
        assert json.loads(choice["message"]["content"])["n"] != 3


class FixedTurnEngine(LocalEngine):
    """Every turn decodes to ``text`` (a relaxed schema's output that fails validation, for the tests below)."""

    def __init__(self, engine: LocalEngine, text: str, calls: list | None):
        super().__init__(engine.generator)
        self.text, self.calls = text, calls

    def turn(self, messages, tools, tool_choice="auto", response_format=None, parallel=None,
             config=EngineConfig(), on_text=None):
        from agent.engine import DecodedTurn

        if on_text:
            on_text(self.text)
        return DecodedTurn(self.text, self.calls, self.calls is not None, "eos")


UNIQUE = {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
                                                  "minItems": 3}}, "required": ["v"]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["tool", "response_format"])
def test_a_relaxed_schemas_output_that_fails_validation_is_a_200_naming_why(engine, kind, stream):
    args = {"v": [1, 1, 1]}
    if kind == "tool":
        fixed = FixedTurnEngine(engine, '<tool_call>\n{"name": "f", "arguments": {"v": [1, 1, 1]}}\n</tool_call>',
                                [{"name": "f", "arguments": args}])
        kw = dict(tools=[{"type": "function", "function": {"name": "f", "strict": False, "parameters": UNIQUE}}],
                  tool_choice="required")
    else:
        fixed = FixedTurnEngine(engine, json.dumps(args), None)
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "strict": False,
                                                                          "schema": UNIQUE}})
    with ServerThread(create_app(fixed, model_name="gated", config=CONFIG)) as url:
        r = post(url + "/chat/completions", body(stream=stream, **kw))
        assert r.status_code == 200, r.text  # was 500 "generation failed" (and OpenAI clients retry 5xx)
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            last = chunks[-1]["choices"][0]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks if c["choices"])
        else:
            last = r.json()["choices"][0]
            content = last["message"]["content"]
            assert "tool_calls" not in last["message"]
        assert last["finish_reason"] == "stop" and "uniqueItems" in last["validation_error"]
        assert content == fixed.text


# -- authentication, metrics, drain -------------------------------------------------------------------------------
def test_api_key_guards_every_route_but_health(engine):
    with ServerThread(create_app(engine, model_name="gated", config=CONFIG, api_key="s3cret")) as url:
        root = url.removesuffix("/v1")
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions")):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = request(method, root + path, body() if method == "POST" else None, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert request("GET", root + "/health").status_code == 200
        ok = {"Authorization": "Bearer s3cret"}
        assert request("GET", root + "/v1/models", headers=ok).status_code == 200
        for scheme in ("bearer s3cret", "BEARER  s3cret"):  # the scheme is case-insensitive (RFC 7235 §2.1)
            assert request("GET", root + "/v1/models", headers={"Authorization": scheme}).status_code == 200
        assert request("GET", root + "/v1/models", headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert post(url + "/chat/completions", body(stream=True), headers=ok).status_code == 200


def test_every_loopback_address_is_loopback():
    """No key warning for 127.0.0.0/8 or ::1 (a helper saw one for 127.0.0.2); one for anything else."""
    from agent.server import is_loopback

    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "192.168.1.2", "::", "example.com", "128.0.0.1", ""))


def test_metrics_are_prometheus_text(url):
    post(url + "/chat/completions", body())
    post(url + "/chat/completions", body(seed=2 ** 64))
    text = request("GET", url.removesuffix("/v1") + "/metrics").text
    for line in ('specagent_requests_total{status="200"}', 'specagent_requests_total{status="400"}',
                 "specagent_generated_tokens_total", "specagent_queue_length 0.0", "specagent_in_flight 0.0",
                 "specagent_request_latency_seconds_count", "specagent_acceptance_rate"):
        assert line in text, line
    assert "specagent_batch_" not in text  # no batch scheduler: its metrics are tests/test_server_batching.py's


def test_sigterm_drains_new_requests_get_503_and_in_flight_ones_finish(engine):
    gated = GatedEngine(engine)
    server = ServerThread(create_app(gated, config=CONFIG))
    url, results = server.url, []
    t = threading.Thread(target=lambda: results.append(post(url + "/chat/completions", body())))
    t.start()
    wait_until(lambda: in_flight(url) == 1)
    server.drain()
    r = post(url + "/chat/completions", body(), timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    health = request("GET", url.removesuffix("/v1") + "/health")  # 503: a load balancer stops routing here
    assert health.status_code == 503 and health.json()["status"] == "draining"
    gated.gate.set()
    t.join(60)
    assert results[0].status_code == 200
    server.thread.join(30)
    assert not server.thread.is_alive()


@pytest.mark.parametrize("first", ['```json\n{"name": "lookup", "arguments": {"q": "x"}}\n```',
                                   '{"name": "lookup", "arguments": {"q": "x"}}'])
def test_a_streamed_answer_the_engine_decodes_again_streams_only_the_final_answer(tiny_target, first):
    from test_agent_loop import CountingScript, ScriptedGenerator

    script = CountingScript(first, "It is x.", first="")
    engine = LocalEngine(ScriptedGenerator(tiny_target, script))
    after_result = user("x") + [{"role": "assistant", "tool_calls": [CALL]},
                                {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    kw = dict(messages=after_result) if first.startswith("`") else dict(tool_choice="none")
    with ServerThread(create_app(engine, model_name="gated", config=CONFIG)) as url:
        r = post(url + "/chat/completions", body(stream=True, tools=TOOLS, **kw))
        assert r.status_code == 200, r.text
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert not any("error" in c for c in chunks), r.text
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert content == "It is x." and chunks[-1]["choices"][0]["finish_reason"] == "stop"
