"""agent/distributed.py: ``run_batch(backend="ray")`` on a local Ray (2 CPUs, 127.0.0.1, no dashboard, no usage
stats) gives the serial results, in input order, for a local engine and for a remote one."""
from __future__ import annotations

import os

import pytest

from agent import Agent
from agent.demo_tools import TOOLS
from agent.engine import EngineConfig, LocalEngine
from agent.remote import OpenAIEngine
from agent.server import ServerThread, create_app
from decoding import Generator

# before Ray starts: no usage stats; the node on 127.0.0.1 (Ray otherwise takes the host's address for a node);
# generous start-up timeouts for a busy 2-core machine
for key, value in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                   "RAY_agent_register_timeout_ms": "120000", "RAY_raylet_start_wait_time_s": "120"}.items():
    os.environ.setdefault(key, value)
import ray  # noqa: E402 - the env above must be set first (the "ray" extra; `make setup` installs it)

CONFIG = EngineConfig(max_string_length=8, max_decimals=2, max_new_tokens=48)
PROMPTS = ["Weather in Oslo?", "What is 2 + 40?", "Convert 3 km to m."]
RUN = dict(tool_choice="required", max_steps=2, parallel_tool_calls=False)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    yield
    ray.shutdown()


def summary(res):
    return ([(r.call.name, r.call.arguments, r.result, r.error) for r in res.tool_calls], res.final_answer,
            res.truncated, res.raw_turns if res.steps else None)


def test_ray_batch_needs_an_initialised_ray(tiny_target, monkeypatch):
    # whatever an earlier test left running: the check sees no Ray (deterministic, never skipped)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs a Ray cluster: call ray\.init\(\)"):  # our check, no other error
        Agent(LocalEngine(Generator(tiny_target)), TOOLS, config=CONFIG).run_batch(["x"], backend="ray")


def test_ray_batch_equals_the_serial_results_local_and_remote_engines(tiny_target, local_ray):
    engine = LocalEngine(Generator(tiny_target))
    agent = Agent(engine, TOOLS, config=CONFIG)
    serial = [summary(agent.run(p, **RUN)) for p in PROMPTS]
    assert any(s[0] for s in serial)  # some prompt ran a tool
    batched = agent.run_batch(PROMPTS, backend="ray", max_workers=2, **RUN)
    assert [summary(r) for r in batched] == serial
    with ServerThread(create_app(engine, model_name="tiny")) as url:  # actors reach it over 127.0.0.1
        remote = Agent(OpenAIEngine(url, "tiny", send_engine_config=True), TOOLS, config=CONFIG)
        results = remote.run_batch(PROMPTS, backend="ray", max_workers=2, **RUN)
    assert [summary(r)[:3] for r in results] == [s[:3] for s in serial]


def test_ray_batch_checks_before_running_and_keeps_the_results_of_a_batch_with_a_failing_prompt(tiny_target,
                                                                                               local_ray):
    """With Ray, an empty prompt was found only after the others had run (and their results discarded), and one
    prompt that raised (too long for the context) discarded every result: now checked first, as on threads, and
    that prompt's result names its error."""
    agent = Agent(LocalEngine(Generator(tiny_target)), TOOLS, config=CONFIG)
    with pytest.raises(ValueError, match=r"prompts\[1\]: the prompt is empty"):
        agent.run_batch([PROMPTS[0], ""], backend="ray", max_workers=2, **RUN)
    with pytest.raises(ValueError, match="max_workers must be an integer >= 1"):
        agent.run_batch(PROMPTS, backend="ray", max_workers=0, **RUN)
    results = agent.run_batch([PROMPTS[0], "word " * 5000, PROMPTS[2]], backend="ray", max_workers=2, **RUN)
    assert results[1].stop_reason == "error" and results[1].error.startswith("ContextLengthError: ")
    assert [summary(r) for r in results[::2]] == [summary(agent.run(p, **RUN)) for p in PROMPTS[::2]]


def test_an_actor_returns_an_error_it_cannot_pickle_by_its_name():
    """``openai.BadRequestError`` does not survive pickling: the actor returns a RemoteRunError naming its class, so
    run_batch reports 'BadRequestError: …' as on threads (it said 'RuntimeError: BadRequestError: …')."""
    import pickle

    from agent.distributed import RemoteRunError, _AgentActor

    class Unpicklable(Exception):
        def __init__(self, message, response):
            super().__init__(message)
            self.response = response

    class Failing:
        def run(self, prompt, **kwargs):
            raise Unpicklable("400: too long", object())

    out = _AgentActor(lambda spec: Failing(), ()).run("x", {})
    assert isinstance(out, RemoteRunError) and out.type_name == "Unpicklable" and str(out) == "400: too long"
    again = pickle.loads(pickle.dumps(out))
    assert again.type_name == "Unpicklable" and str(again) == "400: too long"
