"""BFCL's official AST checker (``bfcl-eval``'s ``bfcl_eval/eval_checker/ast_eval/ast_checker.py``), when installed.

``bfcl-eval`` is installed with ``--no-deps`` (``make setup``; its own dependencies are the API clients of every
model it can query). Only ``bfcl_eval.eval_checker.ast_eval.ast_checker`` is imported; its one heavy import,
``bfcl_eval.constants.model_config`` (which imports every model handler, hence anthropic, openai, ...), is replaced
by a light stub first (:func:`_stub_model_config`). The checker reads that module only in ``convert_func_name``
(whether the model's API turned dots in function names into underscores): our runtimes keep the names as declared, so
the stub answers "no" for every model name.

:func:`official_verdict` is what ``bench.bfcl`` reports as correctness when :func:`official_checker` finds the
package; ``bench.bfcl.score`` (our re-implementation) is the fallback.
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

MODEL_NAME = "specagent"  # the model_name we pass: only looked up in the stubbed MODEL_CONFIG_MAPPING


def language_of(category: str) -> str:
    """``"java"`` / ``"javascript"`` / ``"python"``, as BFCL's ``is_java`` / ``is_js`` decide from the category."""
    if "javascript" in category:
        return "javascript"
    if "java" in category:
        return "java"
    return "python"


def _stub_model_config() -> None:
    """Put a light ``bfcl_eval.constants.model_config`` into ``sys.modules`` (unless one is already imported).

    The real module builds ``MODEL_CONFIG_MAPPING`` from every API and local model handler (importing their client
    libraries, not installed here). ``ast_checker`` only reads ``MODEL_CONFIG_MAPPING[name].underscore_to_dot``.
    """
    name = "bfcl_eval.constants.model_config"
    if name in sys.modules:
        return

    class _Config:
        underscore_to_dot = False  # function names stay as declared (dots kept)

    class _Mapping(dict):
        def __missing__(self, key):
            return _Config()

    stub = types.ModuleType(name)
    stub.__doc__ = "stub inserted by bench.bfcl_checker: MODEL_CONFIG_MAPPING[any].underscore_to_dot is False"
    stub.MODEL_CONFIG_MAPPING = _Mapping()
    sys.modules[name] = stub


@functools.lru_cache(maxsize=1)
def official_checker() -> tuple[Callable, Any] | None:
    """``(ast_checker, Language)`` from the installed ``bfcl_eval``, or None when it is not installed."""
    try:
        import bfcl_eval  # noqa: F401  (is the package there at all?)
    except ImportError:
        return None
    _stub_model_config()
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker, Language


def model_output(calls: list[dict]) -> list[dict]:
    """Decoded calls ``[{"name", "arguments"}]`` -> BFCL's decoded form ``[{name: {arg: value}}]``."""
    return [{c["name"]: c.get("arguments") or {}} for c in calls]


def official_verdict(functions: list[dict], calls: list[dict], ground_truth: list[dict],
                     category: str) -> tuple[bool, str]:
    """``(correct, error_type)`` of decoded ``calls`` by BFCL's ``ast_checker`` (``error_type`` "" when correct).

    ``functions`` are the question's function docs as in the data file (BFCL's evaluator loads them without the
    language hints). Raises RuntimeError when ``bfcl_eval`` is not installed.
    """
    loaded = official_checker()
    if loaded is None:
        raise RuntimeError("bfcl-eval is not installed (make setup installs it with --no-deps)")
    ast_checker, Language = loaded
    try:
        res = ast_checker(functions, model_output(calls), ground_truth, Language(language_of(category)), category,
                          MODEL_NAME)
    except Exception as e:  # the checker's own crash on an odd output (e.g. a nested value it cannot index)
        return False, f"checker_exception:{type(e).__name__}"
    return bool(res["valid"]), "" if res["valid"] else str(res.get("error_type", ""))
