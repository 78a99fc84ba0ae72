"""The llama.cpp peer: llama-cpp-python on the same GGUF, constrained by a GBNF grammar built from the call schema
with ``json_schema_to_gbnf`` (what ``LlamaGrammar.from_json_schema`` does), wrapped in the same
``<tool_call>[ … ]</tool_call>`` envelope. Greedy (``temp=0``), one token per llama.cpp eval.

``llama_cpp`` is an optional dependency (it builds from source); the benchmark skips this mode when the import
fails. Differences from our grammar that the numbers carry: llama.cpp's JSON grammar allows free whitespace where
ours fixes the separators and ignores some keywords (e.g. ``multipleOf``), so its token ids are not expected to
equal the constrained modes'. Unconstrained (``gbnf=None``) it is the ``llamacpp_unconstrained`` mode. With
``draft_tokens`` it is llama-cpp-python's own speculative decoding, ``Llama(draft_model=LlamaPromptLookupDecoding(
num_pred_tokens=…))`` (prompt lookup: the draft is the continuation of the last n-gram's previous occurrence), under
the same GBNF grammar: the ``llamacpp_lookup_constrained`` mode, the fastest thing a llama.cpp user can run today.
Our own decoder on the same kernels is the llama.cpp backend (``decoding/llamacpp.py``, modes ``llamacpp_engine_*``).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from decoding.llamacpp import gguf_of
from schemas.errors import SpecAgentError


class LlamaCppUnavailable(SpecAgentError, RuntimeError):
    """llama.cpp cannot run this benchmark (not installed, no GGUF, grammar conversion failed)."""


_SHAPE_KEYS = {"type", "$ref", "anyOf", "oneOf", "allOf", "enum", "const", "properties", "items", "pattern", "format"}
_ANY = {"anyOf": [{"type": t} for t in ("string", "number", "boolean", "object", "array", "null")]}


def _typed(schema):
    """``schema`` with every sub-schema that says nothing of its shape (``{}``, ``{"description": …}``) written as
    an explicit ``anyOf`` of the JSON types: llama.cpp's converter rejects an untyped schema."""
    if isinstance(schema, list):
        return [_typed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "required", "default", "examples") else
               {n: _typed(sub) for n, sub in v.items()} if k in ("properties", "$defs", "definitions") and
               isinstance(v, dict) else _typed(v)) for k, v in schema.items()}
    if not _SHAPE_KEYS & set(out):
        out.update(_ANY)
    return out


def call_gbnf(call_schema: dict, root: str) -> str:
    """GBNF ``root ::= <root>`` with ``call`` the JSON of ``call_schema`` (llama.cpp's converter); ``root`` is the tool
    format's layout around one call (``ToolFormat.gbnf_root()``, e.g. the generic format's
    ``"<tool_call>[" call "]</tool_call>"``)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    body = json_schema_to_gbnf(json.dumps(_typed(call_schema)))
    body, n = re.subn(r"^root\s*::=", "call ::=", body, count=1, flags=re.M)
    if n != 1:
        raise LlamaCppUnavailable("unexpected GBNF from json_schema_to_gbnf (no root rule)")
    return f"root ::= {root}\n" + body


@dataclass
class LlamaCppRun:
    tokens: list[int]
    truncated: bool
    seconds: float  # wall time, prefill included (s)
    prefill_seconds: float  # time to the first token (s)
    forwards: int  # llama.cpp evals: the prompt's (it gives the first token), then one per token or draft window


class LlamaCppPeer:
    """One llama.cpp model; :meth:`generate` decodes a prompt (token ids) under a GBNF grammar.

    Args:
        model_spec: a model name or GGUF path (the file the llama.cpp backend loads).
        n_threads: llama.cpp threads (decode and prefill).
        draft_tokens: None: one token per eval; n: llama-cpp-python's prompt-lookup speculative decoding,
            ``LlamaPromptLookupDecoding(num_pred_tokens=n)`` (its default is 10; its docs suggest 2 on CPU).
    """

    def __init__(self, model_spec: str, *, n_threads: int, n_ctx: int = 4096, gpu: bool = False,
                 draft_tokens: int | None = None):
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as e:  # optional dependency
            raise LlamaCppUnavailable(f"llama_cpp is not installed ({e}); pip install llama-cpp-python") from None
        path, _, _ = gguf_of(model_spec)  # the file the llama.cpp backend loads (ModelNotFoundError if not a GGUF)
        draft = None if draft_tokens is None else LlamaPromptLookupDecoding(num_pred_tokens=draft_tokens)
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                         n_gpu_layers=-1 if gpu else 0, verbose=False, seed=0, draft_model=draft)
        self.eos = self.llm.token_eos()
        self.evals = 0
        evaluate = self.llm.eval

        def counted(tokens):  # Llama.generate calls self.eval once per forward (prefill, then each step)
            self.evals += 1
            return evaluate(tokens)

        self.llm.eval = counted

    def generate(self, prompt: list[int], gbnf: str | None, *, max_new_tokens: int) -> LlamaCppRun:
        """Greedy decode of ``prompt`` under ``gbnf`` (None: unconstrained, until EOS or ``max_new_tokens``)."""
        from llama_cpp import LlamaGrammar

        # fresh per decode: the grammar is stateful
        grammar = None if gbnf is None else LlamaGrammar.from_string(gbnf, verbose=False)
        tokens: list[int] = []
        truncated = True
        t0 = time.perf_counter()
        t_first = None
        self.evals = 0
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                     reset=True, grammar=grammar):
            if t_first is None:
                t_first = time.perf_counter()
            if tok == self.eos:
                truncated = False
                break
            tokens.append(int(tok))
            if len(tokens) >= max_new_tokens:
                break
        t1 = time.perf_counter()
        return LlamaCppRun(tokens, truncated, t1 - t0, (t_first or t1) - t0, self.evals)
