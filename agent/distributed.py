"""Batch runs across a Ray cluster: ``agent.run_batch(prompts, backend="ray", max_workers=N)``.

Each of N Ray actors rebuilds the agent from :meth:`Agent.spec` once (its own engine: the model loaded in the
actor's process, or a client of the same remote server; its tools registered again), then runs prompts with
``Agent.run``. The builder comes in as an argument (``Agent.run_batch`` passes :func:`agent.agent.agent_from_spec`,
which Ray pickles by reference), so this module imports nothing from ``agent.agent``. Results come back in input
order. Ray must be initialised by the caller: ``ray.init()`` for this machine, ``ray.init(address="ray://head:10001")``
for a cluster. Every returned call and output was validated in the actor exactly as in a local run; greedy local
engines give the same results as a serial run.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable


class _AgentActor:
    """Holds one agent (built once per actor by ``build(spec)``) and runs prompts on it."""

    def __init__(self, build: Callable[[tuple], Any], spec: tuple):
        self.agent = build(spec)

    def run(self, prompt: Any, run_kwargs: dict):
        """The run's result, or the exception it raised (as itself where it survives pickling, else a
        :class:`RemoteRunError` naming it), so one failed prompt does not discard the others' results."""
        try:
            return self.agent.run(prompt, **run_kwargs)
        except Exception as e:  # noqa: BLE001 - returned to the caller, which reports it for this prompt
            try:
                pickle.loads(pickle.dumps(e))
                return e
            except Exception:  # noqa: BLE001 - an exception class Ray could not carry back
                return RemoteRunError(type(e).__name__, str(e))


class RemoteRunError(RuntimeError):
    """An exception a Ray actor's run raised that does not survive pickling (e.g. ``openai.BadRequestError``):
    its message, and ``type_name``, the name of its class."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name

    def __reduce__(self):
        return (RemoteRunError, (self.type_name, str(self)))


def ray_run_batch(build: Callable[[tuple], Any], spec: tuple, prompts: list, *, num_actors: int = 1,
                  run_kwargs: dict | None = None, num_cpus_per_actor: float = 1) -> list:
    """Run ``prompts`` on ``num_actors`` Ray actors, each holding the agent ``build(spec)`` returns (``build``: a
    module-level function, e.g. ``agent_from_spec``, so Ray pickles it by reference); the :class:`RunResult` list
    in input order (the exception a prompt's run raised in its place).

    Raises:
        RuntimeError: Ray is not initialised (call ``ray.init(...)`` first).
        ImportError: Ray is not installed (``pip install 'specagent[ray]'``).
    """
    import ray
    from ray.util import ActorPool

    if not ray.is_initialized():
        raise RuntimeError("run_batch(backend='ray') needs a Ray cluster: call ray.init() (this machine) or "
                           "ray.init(address=...) first")
    if not prompts:
        return []
    actor_cls = ray.remote(num_cpus=num_cpus_per_actor)(_AgentActor)
    actors = [actor_cls.remote(build, spec) for _ in range(max(1, min(num_actors, len(prompts))))]
    try:
        pool = ActorPool(actors)
        return list(pool.map(lambda actor, p: actor.run.remote(p, run_kwargs or {}), prompts))
    finally:
        for actor in actors:
            ray.kill(actor)
