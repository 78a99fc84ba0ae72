"""agent/server.py: the OpenAI-compatible server, driven by the real ``openai`` client over 127.0.0.1.

The server runs in a thread (uvicorn, ephemeral port) over a LocalEngine on the tiny random model: its text is
noise, but every call and structured output is decoded under the grammar, so validity is what is checked.
"""
from __future__ import annotations

import concurrent.futures
import json
import threading
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from agent.engine import EngineConfig, LocalEngine
from agent.server import ServerThread, create_app
from decoding import Generator

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TOOLS = [LOOKUP, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CONFIG = EngineConfig(max_string_length=8, max_decimals=2, max_new_tokens=48)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def engine(tiny_target):
    return LocalEngine(Generator(tiny_target))


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, model_name="tiny", config=CONFIG)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0, timeout=120)


def assemble(stream) -> dict:
    """Rebuild a message from stream chunks, checking the chunk shape on the way."""
    content, calls, finish, usage, ids = [], {}, None, None, set()
    for ch in stream:
        assert ch.object == "chat.completion.chunk"
        ids.add(ch.id)
        usage = ch.usage or usage
        for choice in ch.choices:
            d = choice.delta
            content.append(d.content or "")
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call carries id, type and name, once
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.type is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert len(ids) == 1
    return {"content": "".join(content), "calls": [calls[i] for i in sorted(calls)], "finish": finish,
            "usage": usage}


def plain(resp) -> dict:
    choice = resp.choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return {"content": choice.message.content or "", "calls": calls, "finish": choice.finish_reason}


def test_required_tool_choice_returns_a_schema_valid_call_and_speculative_usage(client):
    resp = client.chat.completions.create(model="tiny", messages=user("look up abc"), tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    spec = resp.usage.model_extra["speculative"]
    assert resp.usage.completion_tokens > 0 and resp.usage.total_tokens == resp.usage.prompt_tokens + \
        resp.usage.completion_tokens
    assert spec["drafter"] == "lookup" and spec["tokens_per_forward"] > 1 and spec["forced_tokens"] > 0
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # OpenAI's field; the torch engine caches no prefix


def test_streamed_tool_call_assembles_into_exactly_the_non_streamed_call(client):
    kwargs = dict(model="tiny", messages=user("weather in Oslo"), tools=TOOLS, tool_choice="required", max_tokens=96)
    full = plain(client.chat.completions.create(**kwargs))
    streamed = assemble(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    strip = lambda calls: [(c["name"], c["arguments"]) for c in calls]  # noqa: E731 - ids are per response
    assert strip(streamed["calls"]) == strip(full["calls"]) and full["calls"]
    assert streamed["finish"] == full["finish"] == "tool_calls" and streamed["content"] == ""
    assert streamed["usage"].completion_tokens > 0


def test_named_tool_choice_calls_that_tool(client):
    resp = client.chat.completions.create(model="tiny", messages=user("anything"), tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_weather"]


def test_parallel_tool_calls_false_gives_one_call(client):
    resp = client.chat.completions.create(model="tiny", messages=user("look up a, b and c"), tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False)
    assert len(resp.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "f", "strict": True, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
        "required": ["ok", "n"], "additionalProperties": False}}},
    {"type": "json_object"}])
def test_response_format_gives_a_valid_object(client, fmt):
    resp = client.chat.completions.create(model="tiny", messages=user("fill it in"), response_format=fmt,
                                          max_tokens=40)
    choice = resp.choices[0]
    if fmt["type"] == "json_object" and choice.finish_reason == "length":  # an open object may run on (noise model)
        assert choice.message.content is None  # a cut structured output is never returned
        return
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    jsonschema.validate(value, fmt.get("json_schema", {}).get("schema", {"type": "object"}))


def test_a_cut_tool_call_is_never_returned(client):
    resp = client.chat.completions.create(model="tiny", messages=user("x"), tools=TOOLS, tool_choice="required",
                                          max_tokens=5)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls and choice.message.content is None


def test_text_answer_streams_live_and_stops_before_a_stop_sequence(client):
    kwargs = dict(model="tiny", messages=user("say something"), tools=TOOLS, tool_choice="none", max_tokens=24)
    text = plain(client.chat.completions.create(**kwargs))["content"]
    stop = text[6:9]
    cut = plain(client.chat.completions.create(**kwargs, stop=[stop]))
    assert cut["content"] == text[:text.find(stop)] and cut["finish"] == "stop"
    streamed = assemble(client.chat.completions.create(**kwargs, stop=stop, stream=True))
    assert streamed["content"] == cut["content"] and streamed["finish"] == "stop"


@pytest.mark.parametrize("prompt", ["hello there", "look up code 7", "what now?"])
def test_auto_tool_choice_streams_exactly_the_non_streamed_message(client, prompt):
    kwargs = dict(model="tiny", messages=user(prompt), tools=TOOLS, tool_choice="auto", max_tokens=24)
    full = plain(client.chat.completions.create(**kwargs))
    streamed = assemble(client.chat.completions.create(**kwargs, stream=True))
    strip = lambda m: (m["content"], m["finish"], [(c["name"], c["arguments"]) for c in m["calls"]])  # noqa: E731
    assert strip(streamed) == strip(full)


def test_our_knobs_are_accepted_and_greedy_output_is_the_same_for_every_drafter(client):
    kwargs = dict(model="tiny", messages=user("look up abc"), tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False)
    base = client.chat.completions.create(**kwargs)
    ref = client.chat.completions.create(**kwargs, extra_body={"drafter": "none", "num_draft_tokens": 0})
    assert ref.usage.model_extra["speculative"]["drafter"] == "none"
    # one token per forward, plus one forward whose token is the end-of-generation token (not output) where the
    # model ends the turn itself rather than the grammar; the turn is decoded twice here (its first call took
    # nothing from the conversation): the forwards count both decodes, completion_tokens the one returned
    spec = ref.usage.model_extra["speculative"]
    assert spec["target_forwards"] - spec["decoded_tokens"] in (0, 1, 2)
    assert 0 < ref.usage.completion_tokens < spec["decoded_tokens"]
    assert ref.usage.prompt_tokens < spec["prefilled_tokens"]
    assert [c.function.arguments for c in ref.choices[0].message.tool_calls] == \
        [c.function.arguments for c in base.choices[0].message.tool_calls] and base.choices[0].message.tool_calls


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("kwargs, field", [
    (dict(extra_body={"frequency_penalty_typo": 1}), "frequency_penalty_typo"),
    (dict(logprobs=True), "logprobs"),
    (dict(temperature=5.0), "temperature"),
    (dict(extra_body={"drafter": "magic"}), "drafter"),
    (dict(extra_body={"num_draft_tokens": -1}), "num_draft_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]),
     "tools[0].function.parameters at /properties/x/not"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nope"}}}),
     "response_format.json_schema.schema"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": "lookup"}]}],
          tools=TOOLS), "messages[0].tool_calls[0]"),
    (dict(messages=[{"role": "assistant", "tool_calls": 5}]), "messages[0].tool_calls"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": ["1"], "type": "function", "function": {
        "name": "lookup", "arguments": "{}"}}]}]), "messages[0].tool_calls[0].id"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": ["lookup"]}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters at /type"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "\\p{L}+"}}}}}]),
     "tools[0].function.parameters at /properties/a/pattern"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(extra_body={"adaptive": "yes"}), "adaptive"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": "yes", "parameters": {}}}]),
     "tools[0].function.strict"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": deep_schema(300)}}),
     "response_format.json_schema.schema"),
    (dict(extra_body={"stop": {}}), "stop"),
    (dict(extra_body={"stop": 0}), "stop"),
    (dict(store=True), "store"),
    (dict(metadata={"k": 5}), "metadata"),
    (dict(service_tier="flex"), "service_tier"),
])
def test_bad_requests_get_400_naming_the_field(client, kwargs, field):
    args = dict(model="tiny", messages=user("hi"), max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == 400 and err.value.body["param"].startswith(field.split(" at ")[0])
    assert field in err.value.body["message"]


def test_a_model_not_served_is_404_and_defaults_of_unsupported_parameters_are_accepted(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=user("hi"), max_tokens=4)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    # what SDKs and UIs send as "nothing": accepted (OpenAI and vLLM accept them)
    resp = client.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=4, n=None, tool_choice=None,
                                          logprobs=False, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
                                          store=False, metadata={"run": "nightly"}, service_tier="auto")
    assert resp.choices[0].finish_reason in ("stop", "length")
    # a lone surrogate (no client library sends one; raw JSON can): 400 naming the field, the slot freed
    body = b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x \\ud800"}]}'
    req = urllib.request.Request(server + "/chat/completions", data=body, headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and json.load(e.value)["error"]["param"] == "messages[0].content"
    with urllib.request.urlopen(server.removesuffix("/v1") + "/health", timeout=10) as r:
        assert json.load(r)["in_flight"] == 0
    # a body nested past the parser's recursion limit: 400, not 500
    req = urllib.request.Request(server + "/chat/completions", data=b'{"user": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and "nested too deeply" in json.load(e.value)["error"]["message"]
    # any other path or method answers in OpenAI's error shape
    for path, method in (("/v1/nothing", "GET"), ("/v1/chat/completions", "GET")):
        req = urllib.request.Request(server.removesuffix("/v1") + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code in (404, 405) and json.load(e.value)["error"]["message"]


def test_earlier_calls_are_taken_as_given_without_this_requests_tools(client):
    """The final-answer step sends the conversation's calls and results without ``tools``, or with other tools
    (OpenAI and vLLM take the history as it is); before, each earlier call was checked against this request's
    tools (400 "unknown tool")."""
    history = [*user("weather in Oslo?"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    for tools in (None, [LOOKUP]):
        resp = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                              **({"tools": tools} if tools else {}))
        assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_request_that_breaks_the_prompt_check_never_keeps_its_slot(engine, monkeypatch):
    """Whatever fails between admission and the decode, the request's slot is freed (before, an exception other
    than a ValueError kept it: 65 such requests locked the server into 429s) and the client gets a JSON 500."""
    monkeypatch.setattr(engine, "check", lambda *a, **k: (_ for _ in ()).throw(TypeError("no tokenizer today")))
    with ServerThread(create_app(engine, model_name="tiny", config=CONFIG, max_waiting=0, concurrency=1)) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        for _ in range(3):  # more than the limit of one request in flight
            with pytest.raises(openai.InternalServerError) as err:
                client.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=4)
            assert "TypeError" not in str(err.value.body) and err.value.body["type"] == "server_error"
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as r:
            assert json.load(r)["in_flight"] == 0


def test_a_stop_sequence_ends_the_decode_there(client):
    """The decode of a text answer stops at the step that writes a stop sequence (before, it ran to its budget and
    the answer was cut afterwards)."""
    kwargs = dict(model="tiny", messages=user("say something"), max_tokens=48, temperature=0)
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert full.usage.completion_tokens >= 24 and len(text) > 12, text  # the tiny model writes to its budget
    stop = text[4:7]
    cut = client.chat.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].message.content == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < full.usage.completion_tokens


def test_health_and_models_answer(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny" and client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    with urllib.request.urlopen(server.removesuffix("/v1") + "/health", timeout=10) as r:
        assert json.load(r)["status"] == "ok"


class GatedEngine:
    """A LocalEngine whose turns wait for a gate (to fill the queue) and fail on demand (a generation error)."""

    def __init__(self, engine: LocalEngine):
        self.engine, self.call_prefixes, self.name = engine, engine.call_prefixes, "gated"
        self.gate = threading.Event()
        self.fail = False

    def turn(self, *args, **kwargs):
        assert self.gate.wait(60)
        if self.fail:
            raise self.fail if isinstance(self.fail, Exception) else RuntimeError("the accelerator caught fire")
        return self.engine.turn(*args, **kwargs)


def test_a_generation_error_is_500_and_the_server_keeps_serving(engine):
    gated = GatedEngine(engine)
    gated.gate.set()
    with ServerThread(create_app(gated, config=CONFIG)) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        gated.fail = True
        with pytest.raises(openai.InternalServerError, match="the accelerator caught fire"):
            client.chat.completions.create(model="gated", messages=user("hi"), max_tokens=4)
        gated.fail = False
        resp = client.chat.completions.create(model="gated", messages=user("hi"), max_tokens=4)
        assert resp.choices[0].finish_reason in ("stop", "length")


def test_a_schema_too_complex_for_llguidance_is_400_streamed_or_not(engine):
    """llguidance's lexer gives up on ``"pattern": "^a{100000}$"`` mid-decode ("too many expressions
    constructed"): the client's schema, so 400 with llguidance's first line, never its parser state."""
    from constraints import GrammarEngineError

    gated = GatedEngine(engine)
    gated.gate.set()
    gated.fail = GrammarEngineError("consuming token 606 failed: lexer error: too many expressions constructed",
                                    "lexer error: too many expressions constructed\n<state>\nTokens: ...")
    with ServerThread(create_app(gated, config=CONFIG)) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="too complex for llguidance") as e:
            client.chat.completions.create(model="gated", messages=user("hi"), max_tokens=4)
        assert "<state>" not in str(e.value) and "GrammarEngineError" not in str(e.value)
        body = json.dumps({"model": "gated", "messages": user("hi"), "max_tokens": 4, "stream": True}).encode()
        req = urllib.request.Request(url + "/chat/completions", body, {"Content-Type": "application/json"})
        events = urllib.request.urlopen(req, timeout=60).read().decode()
        assert '"type": "invalid_request_error"' in events and "too complex for llguidance" in events
        gated.fail = False
        resp = client.chat.completions.create(model="gated", messages=user("hi"), max_tokens=4)
        assert resp.choices[0].finish_reason in ("stop", "length")


def test_requests_beyond_the_waiting_bound_get_429_and_the_rest_are_served(engine):
    gated = GatedEngine(engine)
    with ServerThread(create_app(gated, config=CONFIG, max_waiting=2)) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        send = lambda _: client.chat.completions.create(model="gated", messages=user("hi"), max_tokens=3)  # noqa
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            admitted = [pool.submit(send, i) for i in range(3)]  # 1 decoding + 2 waiting
            while json.load(urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10))[
                    "in_flight"] < 3:
                pass
            with pytest.raises(openai.RateLimitError):
                send(3)
            gated.gate.set()
            assert all(f.result().choices[0].finish_reason == "length" for f in admitted)


def test_32_concurrent_streaming_clients_each_get_their_serial_answer(client):
    """Bounded load test: 32 streams at once against one model; none lost, every one valid and equal to the
    answer the same request gets alone (greedy)."""
    prompts = [f"look up code {i}" for i in range(32)]
    kwargs = dict(model="tiny", tools=TOOLS, tool_choice="required", max_tokens=32)
    strip = lambda m: (m["finish"], m["content"], [(c["name"], c["arguments"]) for c in m["calls"]])  # noqa: E731
    serial = [strip(plain(client.chat.completions.create(messages=user(p), **kwargs))) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        streamed = list(pool.map(lambda p: strip(assemble(client.chat.completions.create(
            messages=user(p), stream=True, **kwargs))), prompts))
    assert streamed == serial
    for finish, _, calls in streamed:
        assert finish == "tool_calls" or (finish == "length" and not calls)
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.model
def test_python_m_agent_serve_answers_the_openai_client_on_the_real_model(tmp_path):
    """The command line: ``python -m agent serve --model smollm2`` on 127.0.0.1, a tool call and a JSON object."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "agent", "serve", "--model", "smollm2", "--host", "127.0.0.1",
                             "--port", str(port), "--max-string-length", "64", "--max-decimals", "6"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    model = json.load(r)["model"]
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model=model, messages=user("What's the weather in Paris, in celsius?"),
                                              tools=TOOLS, tool_choice="required", max_tokens=64)
        call = resp.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
        resp = client.chat.completions.create(
            model=model, messages=user('Reply with a JSON object whose key "city" is "Paris".'),
            response_format={"type": "json_object"}, max_tokens=32)
        assert resp.choices[0].finish_reason == "stop" and isinstance(json.loads(resp.choices[0].message.content),
                                                                      dict)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_serve_refuses_to_start_with_a_default_drafter_batching_cannot_run():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "agent", "serve", "--model", "smollm2", "--threads", "1", "--host",
                          "127.0.0.1", "--port", "9", "--max-batch", "2", "--drafter", "mtp"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "error: the mtp drafter needs the target's hidden states, which continuous batching (" in out.stderr
    assert "the server's --max-batch) does not give" in out.stderr


def test_usage_counts_the_returned_decode_as_openai_does():
    """A turn decoded twice (an answer that only restated a call, decoded again) reported the prompt twice and both
    decodes' tokens (160 / 37 for an 80-token prompt and a 17-token answer): now the prompt and the returned
    decode, as OpenAI and vLLM count them; the work of both decodes is under ``speculative``."""
    from agent.engine import DecodedTurn, EngineConfig
    from agent.openai_protocol import usage
    from decoding import DecodeStats

    stats = DecodeStats(prompt_tokens=160, prompt_tokens_cached=150, new_tokens=37, target_forwards=30)
    u = usage(DecodedTurn("The weather…", None, False, "eos", stats, "lookup", list(range(17)), list(range(80))),
              EngineConfig())
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (80, 17, 97)
    assert u["prompt_tokens_details"]["cached_tokens"] == 80
    assert (u["speculative"]["prefilled_tokens"], u["speculative"]["decoded_tokens"]) == (160, 37)
    remote = usage(DecodedTurn("hi", None, False, "eos", DecodeStats(prompt_tokens=12, new_tokens=3)), EngineConfig())
    assert (remote["prompt_tokens"], remote["completion_tokens"]) == (12, 3)  # what a remote server reported
