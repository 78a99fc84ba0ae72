"""The backend table (``decoding.BACKENDS``): one declared interface, one row per backend; a new row is picked up by
the CLI, the agent and the benchmark, and a drafter row's needs are checked against what the backend provides."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import FIXTURES
from decoding import (BACKENDS, DRAFTERS, HIDDEN_STATES, Backend, CausalLM, Generator, LoadedModel, LoadedTarget,
                      TargetModel, backend_of)


class FakeLoaded(LoadedModel):
    """A model loaded by the test backend (its own type: a loaded model finds its row by type)."""


class CountingLM(CausalLM):
    """The tiny torch model's forward, counted (proves decodes go through the row's ``new_target``)."""

    forwards = 0

    def forward(self, tokens, **kwargs):
        CountingLM.forwards += 1
        return super().forward(tokens, **kwargs)


@pytest.fixture
def fake_backend(monkeypatch, tiny_target):
    loads: list[str] = []

    def load(spec, *, device="cpu", dtype="float32", threads=None):
        loads.append(spec)
        return FakeLoaded(**{f.name: getattr(tiny_target, f.name) for f in dataclasses.fields(tiny_target)})

    row = Backend("fake", "a test backend: the tiny torch model without hidden states", FakeLoaded, load,
                  lambda loaded, kv_cache: CountingLM(loaded), bench_prefix="fake_")
    monkeypatch.setitem(BACKENDS, "fake", row)
    CountingLM.forwards = 0
    return row, loads


def test_both_backends_targets_declare_the_interface(tiny_target):
    assert isinstance(CausalLM(tiny_target), TargetModel)
    assert isinstance(tiny_target, LoadedTarget)
    assert backend_of(tiny_target) is BACKENDS["torch"]
    with pytest.raises(TypeError, match="not a loaded model"):
        backend_of(object())


def test_a_new_backend_row_is_a_cli_choice(fake_backend):
    from agent.__main__ import build_parser

    for flag in ("--backend", "--engine"):  # --engine is the older name, kept
        args = build_parser().parse_args(["run", flag, "fake", "--tools", "m:o", "hi"])
        assert (args.backend or args.engine) == "fake"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--backend", "nope", "--tools", "m:o", "hi"])


def test_bfcl_max_decimals_flag_takes_a_count_or_none(capsys):
    from agent.__main__ import build_parser

    parse = lambda *a: build_parser().parse_args(["bfcl", *a]).max_decimals  # noqa: E731
    assert parse() == "none" and parse("--max-decimals", "NONE") == "none"  # default: unbounded (exponents allowed)
    assert parse("--max-decimals", "8") == 8
    for bad in ("-1", "eight"):
        with pytest.raises(SystemExit):
            parse("--max-decimals", bad)
        assert "--max-decimals" in capsys.readouterr().err


def test_cli_refuses_disagreeing_backend_flags_and_bad_threads(capsys):
    from agent.__main__ import main

    assert main(["run", "--backend", "torch", "--engine", "llamacpp", "--tools", "m:o", "hi"]) == 2
    assert "--backend torch and --engine llamacpp disagree" in capsys.readouterr().err
    assert main(["run", "--threads", "0", "--tools", "m:o", "hi"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_serve_refuses_an_address_it_cannot_listen_on_before_loading_the_model(capsys, monkeypatch):
    import socket

    import agent.server
    from agent.__main__ import main

    monkeypatch.setattr(agent.server, "serve", lambda *a, **k: pytest.fail("the model would load"))
    assert main(["serve", "--port", "99999"]) == 2
    assert "--port must be in 0..65535, got 99999" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2
        assert f"cannot listen on --host 127.0.0.1 --port {port}" in capsys.readouterr().err


def test_a_new_backend_row_loads_and_decodes_for_the_agent(fake_backend):
    from agent import Agent

    row, loads = fake_backend

    def get_weather(city: str) -> dict:
        """Weather in a city."""
        return {"city": city}

    agent = Agent("tiny-spec", [get_weather], backend="fake", drafter="lookup", max_string_length=8)
    assert loads == ["tiny-spec"] and agent.generator.backend is row and agent.generator.engine == "fake"
    res = agent.run("Weather in Paris?", tool_choice="required", max_steps=1, max_new_tokens=48)
    assert CountingLM.forwards > 0 and res.stats.new_tokens > 0
    assert Generator(agent.generator.loaded).backend is row  # a loaded model finds its row
    assert agent.engine.spec()[2]["backend"] == "fake"  # rebuilt (Ray) on the same backend


def test_a_drafter_that_needs_what_the_backend_lacks_is_refused_naming_it(fake_backend):
    needing = [name for name, r in DRAFTERS.items() if HIDDEN_STATES in r.needs]
    assert needing  # the MTP drafters
    for name in needing:
        with pytest.raises(ValueError, match=f"the {name} drafter needs hidden_states.*backend 'fake'"):
            Generator("tiny-spec", backend="fake", drafter=name)
    gen = Generator("tiny-spec", backend="fake")
    assert gen.resolve_drafter("auto") == "lookup"  # no MTP head on a backend without hidden states
    with pytest.raises(ValueError, match="engine='torch' disagree|disagree"):
        Generator("tiny-spec", backend="fake", engine="torch")


def test_a_new_backend_row_is_benchmarked_with_the_drafters_it_supports(fake_backend, tiny_target):
    from bench.modes import baseline_of, our_modes
    from bench.run import load_rows, run_benchmark

    modes = our_modes()
    supported = {d for d, r in DRAFTERS.items() if not r.needs}
    assert {d for b, d in modes.values() if b == "fake"} == supported | {None}
    assert "fake_mtp" not in modes and baseline_of("fake_lookup") == "fake_constrained"
    rows = load_rows(["simple_python"], str(FIXTURES), 2)
    res = run_benchmark(tiny_target, rows, ["fake_lookup"], model_spec="tiny-spec", max_new_tokens=128,
                        log=lambda s: None)
    assert not res.skipped and {"constrained", "fake_constrained", "fake_lookup"} <= set(res.results)
    assert res.results["fake_lookup"]["identical_to_constrained"] == 1.0
    assert res.results["fake_lookup"]["valid"] == 1.0 and CountingLM.forwards > 0


def test_batching_is_the_rows_own_scheduler(fake_backend, tiny_target):
    """``Generator.enable_batching`` builds the backend row's ``batcher``; a row without one is refused, naming the
    rows that batch."""
    row, _ = fake_backend
    gen = Generator("tiny-spec", backend="fake")
    with pytest.raises(ValueError, match="runs on the llamacpp backend, not 'fake'"):
        gen.enable_batching(4)
    made = []
    gen.backend = dataclasses.replace(row, batcher=lambda loaded, **kw: made.append(kw) or "scheduler")
    assert gen.enable_batching(4, seq_ctx=64) == "scheduler" and gen.batcher == "scheduler"
    assert made == [{"max_batch": 4, "seq_ctx": 64, "max_rows": made[0]["max_rows"], "exact_prefill": True}]
    with pytest.raises(ValueError, match="already enabled"):
        gen.enable_batching(4)
