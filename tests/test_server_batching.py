"""agent/server.py under load with continuous batching (``create_app(max_batch=2)``, decoding/batch.py) on the real
SmolLM2-135M GGUF on llama.cpp (marked ``model``): the guarantees tests/test_server_limits.py checks for the default
server hold when requests are decoded together, and /metrics shows the batch scheduler.

Checked: a burst of streams past ``max_batch + max_waiting`` admits exactly that many (the rest 429 with
Retry-After); a stream closed after its first chunks, a non-streamed client that times out and the server's request
timeout (504 / an error event) each end their sequence at its next step: it leaves the batch, its KV cache is removed
(``seq_rm``), its slot serves the next request, and the sequence decoded beside it is untouched.

The per-step text callback runs in the scheduler's thread, so a hook there holds (or slows) the whole batch: that is
how these tests keep requests in flight. Servers bind 127.0.0.1; every load is a few requests of at most 48 tokens.
"""
from __future__ import annotations

import json
import re
import threading
import time

import pytest

pytest.importorskip("llama_cpp")

from agent.engine import EngineConfig, LocalEngine  # noqa: E402
from agent.server import Cancelled, ServerThread, create_app  # noqa: E402
from decoding import Generator, load_llamacpp  # noqa: E402

from test_server_limits import in_flight, open_stream, post, request, wait_until  # noqa: E402

pytestmark = pytest.mark.model

MAX_BATCH = 2
CONFIG = EngineConfig(max_string_length=8, max_decimals=2, max_new_tokens=48)
STORY = "Write a long story about a dragon who learns to fly."
OTHER = "Describe the city of Paris in detail."


@pytest.fixture(scope="module")
def engine():
    """One batching engine for the module (2 slots of 1024 positions, one thread: the identity configuration)."""
    gen = Generator(load_llamacpp("smollm2", n_threads=1, n_ctx=2048))
    gen.enable_batching(MAX_BATCH, seq_ctx=1024)
    yield LocalEngine(gen)
    gen.batcher.close()


class Hooked:
    """The batching engine, whose per-step text callback (in the scheduler's thread: it holds the whole batch) waits
    while ``hold()`` is true and sleeps ``delay`` seconds; records how each turn ended."""

    def __init__(self, engine: LocalEngine, delay: float = 0.0):
        self.engine, self.delay = engine, delay
        self.hold = lambda: False
        self.holding = threading.Event()  # set once a step is held
        self.ended: list[str] = []

    def __getattr__(self, name):  # generator, check, context_length, call_prefixes, name
        return getattr(self.engine, name)

    def turn(self, messages, tools, tool_choice="auto", response_format=None, parallel=None, config=EngineConfig(),
             on_text=None):
        def hooked(text):
            deadline = time.monotonic() + 60
            while self.hold() and time.monotonic() < deadline:
                self.holding.set()
                time.sleep(0.01)
            time.sleep(self.delay)
            if on_text:
                on_text(text)
        try:
            out = self.engine.turn(messages, tools, tool_choice, response_format, parallel, config, hooked)
        except Cancelled as e:
            self.ended.append(f"cancelled:{e}")
            raise
        self.ended.append("done")
        return out


def body(text: str = STORY, **kw) -> dict:
    out = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 48}
    out.update(kw)
    return out


def content(sse: str) -> str:
    """The text of a streamed completion (asserting it ended with [DONE] and no error)."""
    lines = [line[6:] for line in sse.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", sse[-300:]
    events = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in e for e in events), events
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def metrics(url: str) -> dict[str, float]:
    text = request("GET", url.removesuffix("/v1") + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def empty_slots(batcher) -> None:
    """Drop what the idle slots cache (earlier requests' prefixes), so a sequence's KV cache is all they hold."""
    assert batcher.active == 0
    for s in range(batcher.max_batch):
        batcher.ctx.crop(s, 0)


def assert_kv_removed(batcher) -> None:
    """No slot holds a token or a KV cell (after :func:`empty_slots` and one sequence that left unfinished)."""
    assert [(len(batcher.ctx.tokens[s]), batcher.ctx.used(s)) for s in range(batcher.max_batch)] == [(0, 0)] * 2


def assert_no_kv_leak(batcher) -> None:
    """Every slot's KV cells are exactly the tokens it records (a removed sequence left none behind)."""
    assert batcher.active == 0
    for s in range(batcher.max_batch):
        assert batcher.ctx.used(s) == len(batcher.ctx.tokens[s]), s


# -- the queue ----------------------------------------------------------------------------------------------------
def test_a_burst_of_streams_admits_max_batch_plus_max_waiting_and_the_rest_get_429(engine):
    hooked = Hooked(engine)
    gate = threading.Event()
    hooked.hold = lambda: not gate.is_set()  # the first sequence's first step holds the batch
    batcher = engine.generator.batcher
    steps, sequences = batcher.steps, batcher.step_sequences
    with ServerThread(create_app(hooked, config=CONFIG, max_batch=MAX_BATCH, max_waiting=2)) as url:
        results, lock = [], threading.Lock()

        def stream():
            r = post(url + "/chat/completions", body(OTHER, stream=True, max_tokens=8))
            with lock:
                results.append(r)
        threads = [threading.Thread(target=stream) for _ in range(8)]
        for t in threads:
            t.start()
        wait_until(lambda: len(results) == 4, 30)  # the refused ones answer at once; the admitted ones are held
        assert in_flight(url) == MAX_BATCH + 2
        for r in results:
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert "limit 4" in r.json()["error"]["message"]
        gate.set()
        for t in threads:
            t.join(60)
        served = [r for r in results if r.status_code != 429]
        assert [r.status_code for r in served] == [200] * 4
        texts = [content(r.text) for r in served]
        assert texts[0] and texts == [texts[0]] * 4  # greedy: the same answer, whoever decoded beside it
        assert batcher.step_sequences - sequences > batcher.steps - steps  # decoded together
        assert in_flight(url) == 0
        m = metrics(url)
        assert m['specagent_requests_total{status="429"}'] == 4 and m['specagent_requests_total{status="200"}'] == 4
    assert_no_kv_leak(batcher)


# -- cancellation -------------------------------------------------------------------------------------------------
def test_a_stream_closed_after_its_first_chunks_leaves_the_batch_and_frees_its_slot(engine):
    hooked = Hooked(engine, delay=0.05)
    batcher = engine.generator.batcher
    aborted = batcher.aborted
    with ServerThread(create_app(hooked, config=CONFIG, max_batch=MAX_BATCH)) as url:
        alone = post(url + "/chat/completions", body(OTHER, stream=True, max_tokens=16))
        reference = content(alone.text)
        hooked.ended.clear()

        conn, r = open_stream(url, body(stream=True), 3)
        beside = []
        other = threading.Thread(target=lambda: beside.append(
            post(url + "/chat/completions", body(OTHER, stream=True, max_tokens=16))))
        other.start()
        wait_until(lambda: batcher.active == 2)  # both in the batch
        r.close()
        conn.close()  # the client leaves after three chunks
        t0 = time.monotonic()
        wait_until(lambda: hooked.ended, 5)
        assert time.monotonic() - t0 < 2  # at the next step, not after 48 tokens × 50 ms
        assert hooked.ended == ["cancelled:disconnected"]  # before the one beside it (16 tokens) ended
        assert batcher.aborted == aborted + 1
        wait_until(lambda: in_flight(url) <= 1, 5)
        assert min(len(t) for t in batcher.ctx.tokens) == 0  # its KV cache removed (seq_rm), the slot free
        after = post(url + "/chat/completions", body(OTHER, max_tokens=8), timeout=60)  # the free slot serves
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"]
        other.join(60)
        assert beside[0].status_code == 200 and content(beside[0].text) == reference  # untouched beside it
        wait_until(lambda: in_flight(url) == 0, 5)
        assert sorted(hooked.ended) == ["cancelled:disconnected", "done", "done"]
        assert metrics(url)["specagent_batch_aborted_sequences_total"] == batcher.aborted == aborted + 1
    assert_no_kv_leak(batcher)


def test_a_non_streamed_client_that_times_out_stops_its_decode_in_the_batch(engine):
    hooked = Hooked(engine, delay=0.1)
    batcher = engine.generator.batcher
    aborted = batcher.aborted
    empty_slots(batcher)
    with ServerThread(create_app(hooked, config=CONFIG, max_batch=MAX_BATCH)) as url:
        with pytest.raises(TimeoutError):
            post(url + "/chat/completions", body(), timeout=0.5)
        wait_until(lambda: in_flight(url) == 0, 5)  # not after 48 tokens × 100 ms
        wait_until(lambda: hooked.ended)
        assert hooked.ended == ["cancelled:disconnected"]
        assert batcher.aborted == aborted + 1 and batcher.active == 0
        assert_kv_removed(batcher)
        hooked.delay = 0
        assert post(url + "/chat/completions", body(max_tokens=4)).status_code == 200
    assert_no_kv_leak(batcher)


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_stops_the_batched_decode_and_answers_504(engine, stream):
    hooked = Hooked(engine, delay=0.1)
    batcher = engine.generator.batcher
    aborted = batcher.aborted
    empty_slots(batcher)
    with ServerThread(create_app(hooked, config=CONFIG, max_batch=MAX_BATCH, request_timeout=0.5)) as url:
        t0 = time.monotonic()
        r = post(url + "/chat/completions", body(stream=stream), timeout=30)
        assert time.monotonic() - t0 < 3
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert r.status_code == 200 and events[-1]["error"]["code"] == "timeout"
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        wait_until(lambda: in_flight(url) == 0, 5)
        assert hooked.ended == ["cancelled:timeout"]
        assert batcher.aborted == aborted + 1
        assert_kv_removed(batcher)
        if not stream:
            assert metrics(url)['specagent_requests_total{status="504"}'] == 1
    assert_no_kv_leak(batcher)


# -- metrics ------------------------------------------------------------------------------------------------------
def test_metrics_show_the_batch_scheduler(engine):
    hooked = Hooked(engine, delay=0.03)  # the first sequence is still decoding when the second joins
    gate = threading.Event()
    batcher = engine.generator.batcher
    hooked.hold = lambda: not gate.is_set() and batcher.active == MAX_BATCH  # hold once the batch is full
    steps, sequences = batcher.steps, batcher.step_sequences
    with ServerThread(create_app(hooked, config=CONFIG, max_batch=MAX_BATCH)) as url:
        m = metrics(url)
        assert m["specagent_batch_slots"] == MAX_BATCH and m["specagent_batch_running"] == 0
        assert m["specagent_kv_cache_usage_ratio"] == 0
        threads = [threading.Thread(target=post, args=(url + "/chat/completions",
                                                       body(text, stream=True, max_tokens=24)))
                   for text in (STORY, OTHER, STORY)]
        for t in threads:
            t.start()
        wait_until(lambda: hooked.holding.is_set() and in_flight(url) == 3, 30)
        m = metrics(url)  # held mid-step with the batch full
        assert m["specagent_batch_running"] == 2 and m["specagent_batch_waiting"] == 0
        assert m["specagent_in_flight"] == 3 and m["specagent_queue_length"] == 1  # the third waits for a place
        positions = sum(len(held) for held in batcher.ctx.tokens)
        assert 0 < m["specagent_kv_cache_usage_ratio"] == positions / (MAX_BATCH * batcher.seq_ctx)
        assert m["specagent_batch_steps_total"] == batcher.steps > steps
        assert m["specagent_batch_step_tokens_count"] == batcher.steps
        assert m["specagent_batch_step_tokens_sum"] == batcher.step_tokens >= batcher.steps
        gate.set()
        hooked.delay = 0
        for t in threads:
            t.join(60)
        wait_until(lambda: in_flight(url) == 0, 5)
        m = metrics(url)
        assert m["specagent_batch_running"] == 0 and m["specagent_kv_cache_usage_ratio"] == 0
        assert m["specagent_batch_steps_total"] == batcher.steps and m['specagent_requests_total{status="200"}'] == 3
        assert m["specagent_batch_step_sequences_count"] == batcher.steps
        assert m["specagent_batch_step_sequences_sum"] == batcher.step_sequences
        assert batcher.step_sequences - sequences > batcher.steps - steps  # steps of 2 sequences
        assert m["specagent_batch_prefix_copies_total"] == batcher.copies
        assert m["specagent_batch_aborted_sequences_total"] == batcher.aborted
    assert_no_kv_leak(batcher)


def test_serve_load_runs_its_clients_in_process_or_against_a_running_server(tmp_path, capsys):
    """``bench.serve_load``: the same prompts give the same checked summary whether it starts the server itself or
    its clients load a server already running (``--url``, as from ``python -m agent serve`` in another process)."""
    from bench import serve_load

    assert serve_load.main(["--model", "smollm2", "--clients", "2", "--max-tokens", "48", "--threads", "1"]) == 0
    inside = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    engine = LocalEngine(Generator("smollm2", backend="llamacpp", threads=1))
    config = EngineConfig(max_string_length=64, max_decimals=6, max_new_tokens=512)  # the request's max_tokens cuts
    with ServerThread(create_app(engine, model_name="smollm2", config=config)) as url:
        out = tmp_path / "load.json"
        assert serve_load.main(["--url", url, "--model", "smollm2", "--clients", "2", "--max-tokens", "48",
                                "--out", str(out)]) == 0
    outside = json.loads(out.read_text())
    assert outside["server"] == url and outside["clients"] == outside["valid"] == outside["equal_to_serial"] == 2
    assert inside["clients"] == inside["valid"] == inside["equal_to_serial"] == 2
    assert outside["calls"] == inside["calls"] and outside["max_tokens"] == 48


def test_serve_load_interleaves_rounds_of_both_servers_and_takes_the_median_ratio(tmp_path):
    """``--rounds R``: both servers up at once, each round runs off and on in turn (the order reversed every other
    round), every run checked against its own server's serial answers; ``speedup`` is the median of the rounds'
    on / off ratios."""
    import statistics

    from bench import serve_load

    out = tmp_path / "rounds.json"
    assert serve_load.main(["--model", "smollm2", "--clients", "2", "--max-tokens", "48", "--threads", "1",
                            "--batching", "off,on", "--max-batch", "2", "--rounds", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    order = [(r["round"], r["batching"]) for r in result["runs"]]
    assert order == [(1, "off"), (1, "on"), (2, "on"), (2, "off"), (3, "off"), (3, "on")]
    assert all(r["clients"] == r["valid"] == r["equal_to_serial"] == 2 for r in result["runs"])
    assert all(r["latency_p95_s"] >= r["latency_p50_s"] for r in result["runs"])  # nearest rank, of 2 the slower
    rate = {(r["round"], r["batching"]): r["requests_per_s"] for r in result["runs"]}
    ratios = [rate[k, "on"] / rate[k, "off"] for k in (1, 2, 3)]
    assert result["speedup_rounds"]["2"] == [round(x, 2) for x in ratios]
    assert result["speedup"]["2"] == round(statistics.median(ratios), 2)
    with pytest.raises(SystemExit):
        serve_load.main(["--model", "smollm2", "--batching", "on", "--rounds", "2"])
