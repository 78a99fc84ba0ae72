"""The llama.cpp backend: the target's forward on llama.cpp's CPU kernels (GGUF weights as shipped, quantised),
through llama-cpp-python's low-level C API.

Everything above the forward is unchanged: drafters, schema-forced tokens, per-row bitmasks over the γ+1 verify
rows, Leviathan acceptance and rollback run exactly as with the torch backend (``decoding/speculative.py``); only
:class:`LlamaCppLM` differs from :class:`decoding.model.CausalLM`:

* ``forward(tokens, num_logits=n)`` is one ``llama_decode`` over the tokens, with logits requested for the last
  ``n`` of them only (``logit_rows=[…]``: for those rows; the batch's per-token ``logits`` flags, not
  ``logits_all``, which would keep logits for the whole context), read back in one copy from ``llama_get_logits``
  (``float32 [n, V]``);
* ``crop(length)`` is ``llama_memory_seq_rm(mem, seq, length, -1)``: the KV cache of the active slot drops every
  position from ``length`` on (O(1) bookkeeping in llama.cpp's cache);
* each thread's context keeps two cached sequences (slots) for the prefix cache, chosen per prompt as llama.cpp's
  server chooses a slot (:class:`_Context`), so an agent's answer turn does not evict the tools of the next question;
* the Hugging Face tokenizer read from the same GGUF renders the chat template and builds the grammar tokenizer, as
  on the torch backend, so one grammar means the same on both engines (token ids are the GGUF's: llama.cpp's own
  tokenizer gives the same ids, tested). ``llguidance.llamacpp.lltokenizer_from_vocab`` is not used: it marks
  every ``<…>`` user-defined token special (Qwen's ``<tool_call>``), which the HF tokenizer keeps matchable as text.

Greedy identity (speculative == one token per forward) holds when llama.cpp gives the same argmax for a row in a
k-row batch as for the same row alone. Measured on this build (llama-cpp-python 0.3.36; ``python -m
bench.rowcost``): with one thread and no weight repacking the logits are bit-identical up to 33 rows for SmolLM2's
Q4_1 and for Q4_0 / Q8_0 weights (Qwen re-quantised: ``qwen2.5-coder-0.5b:q8_0``), but not for Qwen's shipped
Q4_K_M from 8 rows on (0.39 logit on the 0.5B, 0.83 on the 1.5B; Intel Xeon, 2026-12-01); with two threads, or
with repacking (Q4_K), they differ by up to ~1 logit and a near-tie argmax flips. The backend runs on every
physical core by default, as llama.cpp's tools do (:func:`default_threads`), with ``repack=False``; the identity
configuration is ``threads=1`` on batch-invariant weights. The ``qwen2.5-coder-0.5b`` alias loads as Q8_0
(``ModelSource.llamacpp_weights``; ``qwen2.5-coder-0.5b:shipped`` for the Q4_K_M as shipped): on the AMD EPYC and
the Intel Xeon measured it prefills 1.2–1.6× faster, a verify of 8 rows or more costs 10–45% less, and it answers
the dev split as the shipped file does (docs/benchmarks.md, "Qwen2.5-Coder-0.5B runs as Q8_0 on llama.cpp"), so
the 0.5B's identity configuration is just ``threads=1``.
``tests/test_llamacpp.py`` checks both the bit-identity and the token identity; the benchmark reports
``identical_to_constrained`` per backend.

Within that configuration a row's result is one of two bit patterns, not one: llama.cpp's CPU flash attention (on
by default) takes its tiled path when a decode holds >= 64 query rows of a sequence (:data:`SMALL_UBATCH`) and its
one-chunk path below. A one-sequence prefill from an empty cache puts a prompt's tokens in the big class (decodes of
512) except a tail of < 64 past 512; verify rows and one-token steps are small. The prefix cache therefore keeps a
cached prefix only where its tokens were computed in the class a fresh prefill gives them, and feeds the rest in
those classes (:func:`prefill_classes`, :meth:`LlamaCppLM.reuse_prefix`), as the batching scheduler does; a prefix
kept across classes changed a greedy answer of SmolLM2 (logits off by 0.2–1.8). Turning flash attention off makes a
prefill split-invariant but breaks the verify rows' invariance, so it stays on.

Cost model: what a verify of n rows costs depends on the CPU, the weight type and the threads (``python -m
bench.rowcost`` prints it): on an AMD EPYC (AVX2) Qwen2.5-Coder-0.5B Q4_K_M took 47 ms for 1 row and 344 ms for 8
(about 7 forwards), 25.8 ms and 5.1 forwards at two threads; on the Intel Xeon (AVX-512) development machine 8 rows
cost 2.3–2.9 forwards. torch's fp32 forward: 44 ms for 1 row, 61 ms for 8. So the decoder does not assume a cost:
:meth:`LlamaCppModel.row_cost` measures the curve once per machine, model and threads (:func:`calibrate_row_cost`,
cached), and the speculative step drafts a token only where its row pays (``decoding/window.py``).

``llama_cpp`` is an optional dependency (``make setup-llamacpp`` builds it from source, ~10 min on 2 cores);
:class:`LlamaCppUnavailableError` says how to install it.
"""
from __future__ import annotations

import _thread
import contextlib
import ctypes
import os
import signal
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schemas.errors import SpecAgentError

from .loader import (KNOWN_MODELS, SHIPPED_TAG, ModelNotFoundError, UnsupportedModelError, WeightTagError,
                     cache_root, check_threads, end_of_generation_ids, locate_gguf, sha256_file,
                     writable_cache_dir)
from .window import RowCost

INSTALL = ('make setup-llamacpp (CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36; '
           "builds from source, ~10 min on 2 cores)")
DEFAULT_N_CTX = 8192  # KV cache positions per context (capped by the model's training context)
DEFAULT_N_BATCH = 512  # tokens per llama_decode call (a longer prefill is fed in chunks)


class LlamaCppUnavailableError(SpecAgentError, ImportError):
    """llama-cpp-python is not installed; the message gives the install command."""


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppUnavailableError(f"the llama.cpp backend needs llama-cpp-python ({e}); install it with: "
                                       f"{INSTALL}") from None
    global _log_callback
    if _log_callback is None:  # llama.cpp's own log lines: warnings and errors, less the benign load note
        _log_callback = llama_cpp.llama_log_callback(_log_line)
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
    return llama_cpp


@contextlib.contextmanager
def sigint_deferred():
    """Ctrl-C (SIGINT) recorded, not raised, while the block runs (a llama.cpp call that logs as it goes: a model's
    load, a context's creation), then raised as ``KeyboardInterrupt`` once it has returned. Raised inside the log
    callback, ctypes drops the exception ("Exception ignored on calling ctypes callback function") and the run went
    on to its end. Only in the main thread and under Python's own SIGINT handler (a server's handler is left as
    it is)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    got: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if got:
        raise KeyboardInterrupt


_log_callback = None  # the ctypes callback given to llama_log_set (kept: llama.cpp holds only its address)
_last_log_level = [0]


def _log_line(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log callback (``ggml_log_level``: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous
    line): warnings and errors to stderr, as llama-cpp-python's ``verbose=False`` means to (its own table predates
    ggml's renumbering, so it printed warnings and hid errors), less the note that a GGUF's token looks like a
    control token but is typed otherwise, which llama.cpp then retypes itself (``load: control-looking token:
    128247 '</s>' was not control-type …``: Qwen2.5-Coder's GGUFs, every load; nothing a user can act on)."""
    try:
        level = _last_log_level[0] if level == 5 else level
        _last_log_level[0] = level
        line = text.decode("utf-8", errors="replace")
        if level >= 3 and "control-looking token" not in line:
            print(line, end="", flush=True, file=sys.stderr)
    except KeyboardInterrupt:
        # a Ctrl-C that lands in this callback is dropped by ctypes ("Exception ignored on calling ctypes callback
        # function"), and the run went on: delivered again from another thread a moment later, by when llama.cpp
        # has mostly returned to Python (landing here again, it is passed on again)
        threading.Timer(0.05, _thread.interrupt_main).start()


# Weight types a known model can be re-quantised to by llama.cpp's own quantizer (``alias:q8_0``): at one thread
# their rows are bit-identical in any verify batch (``python -m bench.rowcost``), unlike Qwen's shipped Q4_K_M.
REQUANT_TYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def split_weights(spec: str) -> tuple[str, str | None]:
    """The alias and weight type a model spec names for the llama.cpp backend: ``"alias:q8_0"`` ->
    ``("alias", "q8_0")`` (tags are case-insensitive); ``"alias:shipped"`` -> ``("alias", None)`` (the GGUF as
    shipped); a bare alias -> its ``ModelSource.llamacpp_weights`` (``"qwen2.5-coder-0.5b"`` -> ``(…, "q8_0")``);
    anything else -> ``(spec, None)``.

    Raises:
        WeightTagError: an alias with a tag that is neither a key of :data:`REQUANT_TYPES` nor ``shipped``.
    """
    base, sep, tag = spec.rpartition(":")
    if sep and base in KNOWN_MODELS:
        if tag.lower() in REQUANT_TYPES:
            return base, tag.lower()
        if ":" + tag.lower() == SHIPPED_TAG:
            return base, None
        raise WeightTagError(f"unknown weight tag {tag!r} in model {spec!r}: use {base} (its default weights), "
                             + ", ".join(f"{base}:{t}" for t in REQUANT_TYPES) + f" or {base}{SHIPPED_TAG} "
                             f"(the GGUF as shipped)")
    if spec in KNOWN_MODELS:
        return spec, KNOWN_MODELS[spec].llamacpp_weights
    return spec, None


def requantized(path: Path, sha256: str, weight: str) -> tuple[Path, str]:
    """``(path, sha256)`` of the GGUF ``path`` re-quantised to ``weight`` (a key of :data:`REQUANT_TYPES`) by
    llama.cpp's quantizer (``llama_model_quantize``, ``allow_requantize``; no f16 weights ship, so the error
    compounds: measure before relying on it), made once and cached as ``<cache>/gguf/<sha256[:16]>.<weight>.gguf``
    (its own sha256 beside it, ``.sha256``). The first call says so on stderr (5-15 s on a 2-core CPU for the 0.5B);
    concurrent first calls (threads or processes) each write a file of their own and rename it into place.

    Raises:
        LlamaCppUnavailableError: llama-cpp-python is not installed. CacheNotWritableError: the cache directory
        cannot be written (set ``SPECAGENT_CACHE``). RuntimeError: the quantizer failed.
    """
    lib = _llama_cpp()
    out = cache_root() / "gguf" / f"{sha256[:16]}.{weight}.gguf"
    digest = out.with_name(out.name + ".sha256")
    if out.exists() and digest.exists():
        return out, digest.read_text().strip()
    writable_cache_dir(out.parent, f"re-quantising {path.name} to {weight.upper()}")
    print(f"specagent: re-quantising {path.name} to {weight.upper()} once with llama.cpp's quantizer -> {out}",
          file=sys.stderr, flush=True)
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, REQUANT_TYPES[weight])
    params.allow_requantize = True
    own = f".{os.getpid()}.{threading.get_ident()}.tmp"  # a name of this thread's own: first loads may race
    tmp, tmp_digest = out.with_name(out.name + own), digest.with_name(digest.name + own)
    try:
        rc = lib.llama_model_quantize(str(path).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({path} -> {weight}) failed with code {rc}")
        tmp_digest.write_text(sha256_file(tmp))
        tmp.replace(out)  # atomic; a racing writer made the same bytes
        tmp_digest.replace(digest)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_digest.unlink(missing_ok=True)
    return out, digest.read_text().strip()


def is_gguf(spec: str) -> bool:
    """Whether :func:`gguf_of` finds a GGUF for ``spec`` — an installed alias (with or without a re-quantised weight
    tag) or an existing ``.gguf`` file — without hashing a path's file or re-quantising (:func:`load_llamacpp`
    does that once)."""
    base, _ = split_weights(spec)
    if base in KNOWN_MODELS:
        try:
            locate_gguf(KNOWN_MODELS[base])
        except ModelNotFoundError:
            return False
        return True
    path = Path(spec).expanduser()
    return path.is_file() and path.suffix == ".gguf"


def gguf_of(spec: str) -> tuple[Path, str, str]:
    """``(GGUF path, display name, sha256)`` for an alias of :data:`decoding.loader.KNOWN_MODELS`, an alias with a
    re-quantised weight type (``qwen2.5-coder-0.5b:q8_0``, see :func:`requantized`) or a ``.gguf`` path.

    Raises:
        ModelNotFoundError: not an alias or an existing ``.gguf`` file (the llama.cpp backend reads GGUF only).
    """
    base, weight = split_weights(spec)
    if base in KNOWN_MODELS:
        src = KNOWN_MODELS[base]
        path, name, sha = locate_gguf(src), src.name, src.sha256
        if weight is None:
            return path, name, sha
        path, sha = requantized(path, sha, weight)
        return path, f"{name}, re-quantised to {weight.upper()}", sha
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path, path.name, sha256_file(path)
    raise ModelNotFoundError(f"the llama.cpp backend loads GGUF files: {spec!r} is neither an alias "
                             f"({', '.join(sorted(KNOWN_MODELS))}) nor a .gguf file; use backend='torch' for a "
                             f"Hugging Face directory or id")


def gguf_tokenizer(gguf: Path, sha256: str):
    """The Hugging Face tokenizer (with its chat template) stored in a GGUF, cached once per file
    (``$SPECAGENT_CACHE/tokenizers/<sha256[:16]>``; the torch backend's converted directory is used when present)."""
    from transformers import AutoTokenizer

    for d in (cache_root() / "models" / sha256[:16], cache_root() / "tokenizers" / sha256[:16]):
        if (d / "tokenizer_config.json").exists():
            return AutoTokenizer.from_pretrained(d, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    out = cache_root() / "tokenizers" / sha256[:16]
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return tok


@dataclass
class LlamaCppModel:
    """A GGUF model loaded by llama.cpp (weights shared, read-only) and its tokenizers.

    Plays the part of :class:`decoding.loader.LoadedModel` for :class:`decoding.Generator` (``tokenizer``,
    ``name``, ``sha256``, ``device``, ``vocab_size``, ``context_length``, ``eos_token_id``); every thread that decodes
    gets its own llama.cpp context (KV cache) from :meth:`new_lm`.

    Attributes:
        n_threads: CPU threads per forward (default :func:`default_threads`).
        n_ctx: KV cache positions per context; prompt + new tokens must fit.
    """

    path: Path
    name: str
    sha256: str
    tokenizer: Any
    n_threads: int
    n_ctx: int
    vocab_size: int  # logits width V (``llama_vocab_n_tokens``)
    n_batch: int = DEFAULT_N_BATCH
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: str = "gguf"
    repack: bool = False
    # sha256 of the GGUF as shipped when these weights are re-quantised from it (the key of the model's MTP head,
    # decoding.mtp.target_sha256); None: ``sha256`` is the shipped file's
    source_sha256: str | None = None
    spec: str | None = None  # the model spec it was loaded from (another process loads it again from this)
    _model: Any = None
    _vocab: Any = None
    _eog: frozenset | None = None
    _local: threading.local = field(default_factory=threading.local)
    _row_cost: RowCost | None = None

    @property
    def vocab(self):
        """llama.cpp's ``llama_vocab`` pointer (for its own tokenizer, ``llama_cpp.llama_tokenize``)."""
        return self._vocab

    @property
    def context_length(self) -> int:
        """Positions one context holds (prompt + new tokens)."""
        return self.n_ctx

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Every token that ends generation: llama.cpp's end-of-generation list for this GGUF
        (``llama_vocab_is_eog``) filtered by :func:`decoding.loader.end_of_generation_ids` (special tokens only)."""
        if self._eog is None:
            lib = _llama_cpp()
            special = [int(t) for t in self.tokenizer.all_special_ids]
            declared = [t for t in special if t < self.vocab_size and lib.llama_vocab_is_eog(self._vocab, t)]
            self._eog = end_of_generation_ids(self.tokenizer, declared)
        return self._eog

    @property
    def batch_invariant(self) -> bool:
        """The identity configuration: one thread, no repacking (a row's logits do not depend on the rows decoded
        beside it, within each :data:`SMALL_UBATCH` class; see the module docstring)."""
        return self.n_threads == 1 and not self.repack

    def row_cost(self) -> RowCost:
        """What a verify of n rows costs on this machine, in one-row forwards (:class:`decoding.window.RowCost`,
        read by the speculative step's window rule): measured once by :func:`calibrate_row_cost` and cached on disk
        per CPU model, GGUF, threads and repacking (``<cache>/rowcost/``), since machines differ (a 2-core AMD
        EPYC: 8 rows ≈ 5 forwards; an Intel Xeon: 2.3–2.9)."""
        with _ROW_COST_LOCK:  # one calibration at a time: two would slow each other's timings
            if self._row_cost is None:
                self._row_cost = _cached_row_cost(self)
        return self._row_cost

    def shared_weights(self):
        """The token embedding, final norm and LM head de-quantised from this GGUF, as torch modules (what the MTP
        head shares; :func:`decoding.gguf_weights.shared_target`, built once per process)."""
        from .gguf_weights import shared_target

        return shared_target(self.path, self.sha256)

    def new_lm(self) -> "LlamaCppLM":
        """A KV-cached forward wrapper on this thread's llama.cpp context (created on first use)."""
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = _Context(self)
            self._local.ctx = ctx
        return LlamaCppLM(self, ctx)


def load_llamacpp(spec: str, *, n_threads: int | None = None, n_ctx: int = DEFAULT_N_CTX,
                  repack: bool = False) -> LlamaCppModel:
    """Load a GGUF model (alias, ``alias:q4_0`` / ``alias:q8_0`` re-quantised, or ``.gguf`` path) on llama.cpp's CPU
    backend, offline.

    Args:
        n_threads: CPU threads per forward (default :func:`default_threads`).
        n_ctx: KV cache positions per context (capped by the model's training context).
        repack: let llama.cpp repack quantised weights into its interleaved CPU layouts (``use_extra_bufts``);
            off by default: with it, a row's logits in a k-row verify batch differ from the same row alone (measured
            on Qwen2.5-Coder Q4_K_M), which breaks greedy identity (see the module docstring).

    Raises:
        LlamaCppUnavailableError: llama-cpp-python is not installed.
        ModelNotFoundError: no such alias or file (see :func:`gguf_of`).
        UnsupportedModelError: recurrent, hybrid or sliding-window models (their KV cache cannot be cropped back
            after rejected draft tokens).
        RuntimeError: llama.cpp failed to load the file.
    """
    check_threads(n_threads)
    llama_cpp = _llama_cpp()
    path, name, sha = gguf_of(spec)
    base, weight = split_weights(spec)
    shipped, _, shipped_sha = gguf_of(base + SHIPPED_TAG) if weight else (path, name, sha)
    tok = gguf_tokenizer(shipped, shipped_sha)  # re-quantised weights: the shipped file's tokenizer
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_extra_bufts = repack
    with sigint_deferred():  # a Ctrl-C during the load is raised once it returns (never dropped in the log callback)
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    kinds = [k for k, bad in (("recurrent", llama_cpp.llama_model_is_recurrent(model)),
                              ("hybrid", llama_cpp.llama_model_is_hybrid(model)),
                              ("sliding-window", llama_cpp.llama_model_n_swa(model) > 0)) if bad]
    if kinds:
        llama_cpp.llama_model_free(model)
        raise UnsupportedModelError(f"{name}: its KV cache cannot be rolled back after rejected draft tokens "
                                    f"({', '.join(kinds)} layers); models with only full-attention layers are "
                                    f"supported")
    n_ctx = min(n_ctx, int(llama_cpp.llama_model_n_ctx_train(model)) or n_ctx)
    vocab = llama_cpp.llama_model_get_vocab(model)
    loaded = LlamaCppModel(path, name, sha, tok, n_threads or default_threads(), n_ctx,
                           int(llama_cpp.llama_vocab_n_tokens(vocab)), repack=repack, _model=model, _vocab=vocab,
                           source_sha256=shipped_sha, spec=spec)
    weakref.finalize(loaded, llama_cpp.llama_model_free, model)
    if loaded.vocab_size < len(tok):
        raise RuntimeError(f"{name}: the GGUF vocabulary ({loaded.vocab_size}) is smaller than its tokenizer's "
                           f"({len(tok)})")
    return loaded


ROW_COST_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # verify sizes the calibration times (the window cap is 32 rows)


def time_verify_rows(lm: "LlamaCppLM", window: list[int], rows=ROW_COST_ROWS, repeat: int = 3
                     ) -> tuple[dict[int, float], dict[int, torch.Tensor]]:
    """Time one ``llama_decode`` of n rows (``window[:n]``, logits for every row) after what ``lm`` holds, for each
    n in ``rows``: ``(median ms per n over repeat runs after one warm-up, row 0's logits float32 [V] per n)``; the
    KV cache is cropped back after each run."""
    import statistics
    import time

    base = lm.length
    ms, row0 = {}, {}
    for n in rows:
        times = []
        for _ in range(repeat + 1):  # the first run warms the kernels for this n
            t0 = time.perf_counter()
            logits, _ = lm.forward(window[:n])
            times.append(time.perf_counter() - t0)
            lm.crop(base)
        ms[n], row0[n] = statistics.median(times[1:]) * 1000, logits[0].clone()
    return ms, row0


_ROW_COST_LOCK = threading.Lock()


def _cached_row_cost(loaded: LlamaCppModel) -> RowCost:
    """The row-cost curve of ``loaded`` from ``<cache>/rowcost/`` (keyed by CPU model, GGUF sha256, threads,
    repacking), else :func:`calibrate_row_cost`, written there."""
    import json

    key = f"{_cpu_model()}|{loaded.sha256}|{loaded.n_threads}|{int(loaded.repack)}"
    path = cache_root() / "rowcost" / f"{_sha256_text(key)[:24]}.json"
    try:
        return RowCost.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):
        pass
    cost = calibrate_row_cost(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(cost.to_dict() | {"key": key}))
    tmp.replace(path)
    return cost


def calibrate_row_cost(loaded: LlamaCppModel, rows=ROW_COST_ROWS, prompt_tokens: int = 64,
                       repeat: int = 3) -> RowCost:
    """Measure :class:`decoding.window.RowCost` on this thread's context (emptied before and after): a
    ``prompt_tokens`` prompt, then :func:`time_verify_rows`. A few seconds (about 60 one-row forwards × repeat)."""
    text = "def add(a, b):\n    return a + b\n" * (prompt_tokens // 8 + 1)
    prompt = loaded.tokenizer.encode(text, add_special_tokens=False)[:prompt_tokens]
    window = [(7919 * i) % min(loaded.vocab_size, 30000) + 100 for i in range(max(rows))]
    lm = loaded.new_lm()
    lm.reset()
    try:
        lm.forward(prompt, num_logits=1)
        ms, _ = time_verify_rows(lm, window, rows, repeat)
    finally:
        lm.reset()
    return RowCost(tuple(rows), tuple(round(ms[n] / ms[rows[0]], 3) for n in rows), round(ms[rows[0]], 3))


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), what a row-cost curve is measured for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
        flags = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), "")
        return f"{name} [{_sha256_text(flags)[:8]}]"  # one model name can cover CPUs of other instruction sets
    except (OSError, StopIteration):
        pass
    import platform

    return platform.processor() or platform.machine()


def _sha256_text(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


PREFILL_BATCH = DEFAULT_N_BATCH  # tokens per prefill llama_decode from an empty cache
SMALL_UBATCH = 64  # measured: a row's result is one of two bit patterns: < 64 tokens of its sequence in the
#                    micro-batch, or >= 64 (llama.cpp's CPU flash attention takes its tiled path from 64 query rows
#                    on); within each class it is the same for any batch (SmolLM2 Q4_1, Qwen2.5-Coder Q4_K_M and
#                    Q8_0; one thread, no repacking)


def prefill_classes(prompt: list[int], cached: list[int], cached_big: int) -> tuple[int, int]:
    """How to prefill ``prompt[:-1]`` into a slot holding ``cached`` (of which ``cached[:cached_big]`` were computed
    in big decodes) so that every token's keys/values are those of a one-sequence prefill from an empty cache
    (``decoding.decoder.prefill``: ``prompt[:-1]`` in decodes of :data:`PREFILL_BATCH` tokens; a token is in the
    big class when its decode had >= :data:`SMALL_UBATCH` tokens).

    Returns:
        ``(big, keep)``: ``prompt[:big]`` must be big-class (fed alone, in decodes of >= SMALL_UBATCH tokens), the
        rest small-class (any chunks of < SMALL_UBATCH tokens); the slot keeps ``cached[:keep]`` (the longest common
        prefix whose classes agree, cut back so that a big part still to feed has >= SMALL_UBATCH tokens).
    """
    n = len(prompt) - 1
    tail = n % PREFILL_BATCH
    if n < SMALL_UBATCH:
        big = 0
    elif n > PREFILL_BATCH and tail < SMALL_UBATCH:
        big = n - tail  # the empty-cache prefill's last decode is small
    else:
        big = n
    keep = common_prefix(cached, prompt[:-1])
    if big != cached_big:
        keep = min(keep, big, cached_big)  # past there the cached token's class differs
    if 0 < big - keep < SMALL_UBATCH:
        keep = big - SMALL_UBATCH
    return big, keep


def equal_pieces(n: int, most: int) -> list[int]:
    """``n`` tokens split into the fewest decodes of at most ``most``, as equal as can be: how a big-class part is
    fed (each piece is >= ``min(n, most // 2)``, so >= :data:`SMALL_UBATCH` when ``n`` is)."""
    pieces = -(-n // most)
    return [n * (i + 1) // pieces - n * i // pieces for i in range(pieces)]


PREFIX_SLOTS = 2  # cached sequences per thread's context (llama.cpp server's slots, for the prefix cache)
SLOT_SIMILARITY = 0.5  # llama.cpp server's --slot-prompt-similarity: below it, a prompt takes the least recent slot


class _Context:
    """One llama.cpp context and its reusable batch; owned by one thread.

    It holds :data:`PREFIX_SLOTS` cached sequences (seq_id ``0 …``), each with its own KV stream of ``n_ctx``
    positions (``kv_unified=False``: a slot's cells are laid out as in a one-sequence context, so its rows are what a
    one-sequence context computes). One slot is active at a time; :meth:`select` picks it for a new prompt the way
    llama.cpp's server picks a slot: the slot whose cached tokens share the longest prefix with the prompt, unless
    that prefix is under :data:`SLOT_SIMILARITY` of what the slot holds — then the least recently used slot. So an
    agent's answer turn (rendered with another system prompt) does not evict the system prompt and tool list that
    the next question reuses.
    """

    def __init__(self, model: LlamaCppModel, slots: int = PREFIX_SLOTS):
        llama_cpp = _llama_cpp()
        self.lib = llama_cpp
        self.model = model  # held: the context reads its weights (freed with the model object)
        # llama.cpp splits n_ctx evenly over the sequences, in multiples of 256
        self.ctx, self.mem, self.batch = _new_context(model, slots, -(-model.n_ctx // 256) * 256, model.n_batch)
        self.n_batch = model.n_batch
        self.vocab_size = model.vocab_size
        self.n_embd = int(llama_cpp.llama_model_n_embd(model._model))
        self.slots: list[list[int]] = [[] for _ in range(slots)]  # per slot: the ids its KV cache holds, in order
        # per slot: its first ``big`` tokens were computed in decodes of >= SMALL_UBATCH tokens, the rest of its
        # first ``profiled`` in smaller ones (prefill_classes); past ``profiled`` a big decode followed small ones
        self.big = [0] * slots
        self.profiled = [0] * slots
        # per slot: the last-layer hidden states of its first positions, as float32 [n_i, d] chunks (decoded with
        # hidden=True; contiguous from position 0), so a reused prefix gives its states without a new prefill
        self.states: list[list[np.ndarray]] = [[] for _ in range(slots)]
        self.embeddings = False  # llama_set_embeddings: on while a decode asks for hidden states
        self.last_used = [0] * slots
        self.seq = 0  # the active slot (llama.cpp seq_id)
        self._clock = 0
        weakref.finalize(self, _free_context, llama_cpp, self.ctx, self.batch)

    @property
    def tokens(self) -> list[int]:
        """The ids whose keys/values the active slot holds, in order."""
        return self.slots[self.seq]

    @property
    def length(self) -> int:
        return len(self.tokens)

    def select(self, prompt: list[int]) -> int:
        """Make the slot for ``prompt`` active (see the class docstring); returns how many of its cached tokens
        ``prompt`` starts with."""
        shared = [common_prefix(c, prompt) for c in self.slots]
        best = max(range(len(self.slots)), key=lambda i: (shared[i], -self.last_used[i]))
        if self.slots[best] and shared[best] < SLOT_SIMILARITY * len(self.slots[best]):
            best = min(range(len(self.slots)), key=lambda i: self.last_used[i])
        self._clock += 1
        self.seq, self.last_used[best] = best, self._clock
        return shared[best]

    def clear(self) -> None:
        """Empty every slot."""
        self.lib.llama_memory_clear(self.mem, True)
        for cached in self.slots:
            del cached[:]
        self.big = [0] * len(self.slots)
        self.profiled = [0] * len(self.slots)
        for states in self.states:
            del states[:]

    def known_states(self) -> int:
        """Leading positions of the active slot whose hidden states are kept (see :meth:`cached_states`)."""
        return sum(len(c) for c in self.states[self.seq])

    def cached_states(self, n: int) -> np.ndarray:
        """``float32 [n, d]``: the kept hidden states of the active slot's first ``n`` positions (``n <=``
        :meth:`known_states`)."""
        if n > self.known_states():
            raise ValueError(f"hidden states of {n} positions asked for; {self.known_states()} are kept")
        chunks = _first_rows(self.states[self.seq], n)
        return np.concatenate(chunks) if chunks else np.zeros((0, self.n_embd), dtype=np.float32)

    def decode(self, tokens: list[int], rows: list[int], hidden: bool = False, chunks: list[int] | None = None
               ) -> tuple[np.ndarray, np.ndarray | None]:
        """Append ``tokens`` at positions ``length …``; returns ``(float32 [len(rows), V], hidden)``: the logits of
        the tokens at the increasing indices ``rows`` (llama.cpp computes the LM head for those only), and with
        ``hidden=True`` the last-layer hidden states of every token, ``float32 [len(tokens), d]`` (llama.cpp's
        per-token embeddings, ``llama_set_embeddings`` with no pooling: the state after the final norm, the one the
        LM head reads; llama.cpp then computes the LM head for every row, so only the rows asked for are read), else
        None. The states are kept with the slot (:meth:`cached_states`). ``chunks``: the token count of each
        ``llama_decode`` (summing to ``len(tokens)``, each <= ``n_batch``); default: ``n_batch`` at a time."""
        if hidden != self.embeddings:
            self.lib.llama_set_embeddings(self.ctx, hidden)
            self.embeddings = hidden
        out, states = [], []
        want = set(rows)
        b = self.batch
        if chunks is None:
            chunks = [min(self.n_batch, len(tokens) - a) for a in range(0, len(tokens), self.n_batch)]
        starts = np.cumsum([0] + chunks[:-1]).tolist()
        for start, size in zip(starts, chunks):
            chunk = tokens[start:start + size]
            b.n_tokens = len(chunk)
            picked = []
            for i, tok in enumerate(chunk):
                b.token[i] = tok
                b.pos[i] = self.length + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = self.seq
                keep = start + i in want
                b.logits[i] = keep or hidden  # with embeddings every token is an output
                if keep:
                    picked.append(i)
            rc = self.lib.llama_decode(self.ctx, b)
            if rc != 0:
                at = self.length
                self.clear()  # what the cache holds is unknown now: the next prompt prefills from scratch
                raise RuntimeError(f"llama_decode failed with code {rc} at position {at} "
                                   f"({len(chunk)} tokens; context {self.lib.llama_n_ctx(self.ctx)})")
            contiguous = self.known_states() == self.length
            seq, length = self.seq, self.length
            if len(chunk) >= SMALL_UBATCH and self.big[seq] == length:
                self.big[seq] += len(chunk)
            if self.profiled[seq] == length and (len(chunk) < SMALL_UBATCH or self.big[seq] == length + len(chunk)):
                self.profiled[seq] += len(chunk)
            self.tokens.extend(chunk)
            n_out = len(chunk) if hidden else len(picked)
            if picked:
                logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n_out, self.vocab_size))
                out.append(logits[picked].copy() if hidden else logits.copy())
            if hidden:
                h = np.ctypeslib.as_array(self.lib.llama_get_embeddings(self.ctx), shape=(n_out, self.n_embd)).copy()
                states.append(h)
                if contiguous:
                    self.states[self.seq].append(h)
        logits = (np.zeros((0, self.vocab_size), dtype=np.float32) if not out
                  else out[0] if len(out) == 1 else np.concatenate(out))
        if not hidden:
            return logits, None
        return logits, states[0] if len(states) == 1 else np.concatenate(states)

    def crop(self, length: int, always: bool = False) -> None:
        if always or length < self.length:
            if not self.lib.llama_memory_seq_rm(self.mem, self.seq, length, -1):
                raise UnsupportedModelError("llama.cpp could not remove positions from this model's KV cache")
            del self.tokens[length:]
            self.big[self.seq] = min(self.big[self.seq], length)
            self.profiled[self.seq] = min(self.profiled[self.seq], length)
            self._crop_states(length)

    def _crop_states(self, length: int) -> None:
        self.states[self.seq] = _first_rows(self.states[self.seq], length)


def _first_rows(chunks: list[np.ndarray], n: int) -> list[np.ndarray]:
    """The chunks (arrays ``[n_i, d]``, in order) cut to their first ``n`` rows in all."""
    out, got = [], 0
    for c in chunks:
        if got >= n:
            break
        out.append(c[:n - got])
        got += len(out[-1])
    return out


class SequenceBatchContext:
    """One llama.cpp context holding ``n_seq`` sequences (``n_seq_max``; seq_id ``0 … n_seq - 1``), each with its own
    KV cache of ``seq_ctx`` positions: continuous batching (``decoding.batch``).

    The KV cache is not unified (``kv_unified=False``, as llama.cpp's server by default): every sequence has its own
    stream of ``seq_ctx`` cells (the context is ``n_seq × seq_ctx`` positions, like the server splitting ``-c``
    across ``-np`` slots), so a sequence's cells are laid out exactly as in a one-sequence context and, with one
    thread and no repacking, each row's logits are bit-identical to the same row decoded alone (tested:
    ``tests/test_batching.py``). With a unified cache the sequences' cells interleave and the attention sums in
    another order (measured: logits differ by up to ~1).

    How llama.cpp runs a batch here (``llama_batch_allocr::split_equal(n_ubatch, sequential=true)``, the split a
    non-unified KV cache asks for): a micro-batch (one graph run) takes the same number of tokens from each of its
    sequences, and only sequences whose seq_ids follow one another (``s, s + 1, …``) in batch order. So
    :meth:`decode` lays the batch out by increasing seq_id, and the scheduler keeps the sequences it decodes on the
    lowest seq_ids (:meth:`move`): 8 sequences of one row each cost 104 ms as seq_ids 0-7 and 322 ms as 0, 4, …, 28
    (eight graph runs; Qwen2.5-Coder-0.5B Q8_0, 2 threads, Intel Xeon; docs/benchmarks.md "Server under load").
    Sequences that feed more tokens than the others have their extra tokens run in further micro-batches.

    Args:
        model: the loaded GGUF model (its ``n_threads``).
        n_seq: sequences (``n_seq_max``), >= 1.
        seq_ctx: KV positions per sequence (prompt + new tokens of one request), >= 1.
        n_batch: the most tokens one :meth:`decode` takes (all sequences together).
    Raises:
        ValueError: a size below 1.
        RuntimeError: llama.cpp could not create the context (memory).
    """

    def __init__(self, model: LlamaCppModel, n_seq: int, seq_ctx: int, n_batch: int = DEFAULT_N_BATCH):
        if min(n_seq, seq_ctx, n_batch) < 1:
            raise ValueError(f"n_seq, seq_ctx and n_batch must be >= 1, got {n_seq}, {seq_ctx}, {n_batch}")
        llama_cpp = _llama_cpp()
        self.lib = llama_cpp
        self.model = model  # held: the context reads its weights (freed with the model object)
        self.ctx, self.mem, self.batch = _new_context(model, n_seq, seq_ctx, n_batch)
        self.n_seq, self.n_batch, self.vocab_size = n_seq, n_batch, model.vocab_size
        self.seq_ctx = min(seq_ctx, int(llama_cpp.llama_n_ctx(self.ctx)) // n_seq)  # llama.cpp may round it
        self.tokens: list[list[int]] = [[] for _ in range(n_seq)]  # per sequence: the ids its KV cache holds
        weakref.finalize(self, _free_context, llama_cpp, self.ctx, self.batch)

    def decode(self, parts: list[tuple[int, list[int], list[int]]]) -> list[np.ndarray]:
        """One ``llama_decode`` over several sequences' tokens.

        Args:
            parts: ``(seq_id, tokens, rows)`` per sequence (each seq_id at most once, ``tokens`` non-empty): the
                tokens go at positions ``len(self.tokens[seq_id]) …``; ``rows`` are the increasing indices into
                ``tokens`` whose logits are wanted (may be empty).
        Returns:
            per part, ``float32 [len(rows), V]``.
        Raises:
            ValueError: more than ``n_batch`` tokens, a bad seq_id, a sequence past ``seq_ctx`` positions; nothing
                is decoded.
            RuntimeError: ``llama_decode`` failed; every sequence of the call is cropped back to what it held.
        """
        total = sum(len(t) for _, t, _ in parts)
        if total > self.n_batch:
            raise ValueError(f"{total} tokens in one decode; the batch holds {self.n_batch}")
        for s, toks, _ in parts:
            if not 0 <= s < self.n_seq or not toks:
                raise ValueError(f"bad part for seq_id {s} ({len(toks)} tokens; {self.n_seq} sequences)")
            if len(self.tokens[s]) + len(toks) > self.seq_ctx:
                raise ValueError(f"{len(self.tokens[s]) + len(toks)} positions do not fit sequence {s}'s KV cache "
                                 f"({self.seq_ctx})")
        order = sorted(range(len(parts)), key=lambda k: parts[k][0])  # by seq_id: one micro-batch (class doc)
        b = self.batch
        i = 0
        for k in order:
            s, toks, rows = parts[k]
            start, want = len(self.tokens[s]), set(rows)
            for j, tok in enumerate(toks):
                b.token[i] = tok
                b.pos[i] = start + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = s
                b.logits[i] = j in want
                i += 1
        b.n_tokens = total
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            for s, _, _ in parts:  # whatever was written past the recorded tokens goes
                self.lib.llama_memory_seq_rm(self.mem, s, len(self.tokens[s]), -1)
            raise RuntimeError(f"llama_decode failed with code {rc} ({total} tokens of {len(parts)} sequences; "
                               f"{self.seq_ctx} positions per sequence)")
        n_out = sum(len(r) for _, _, r in parts)
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(n_out, self.vocab_size)) \
            if n_out else np.zeros((0, self.vocab_size), dtype=np.float32)
        out: list[np.ndarray] = [None] * len(parts)  # type: ignore[list-item]
        at = 0
        for k in order:  # llama.cpp returns the logits in batch order
            s, toks, rows = parts[k]
            self.tokens[s].extend(toks)
            out[k] = logits[at:at + len(rows)].copy()
            at += len(rows)
        return out

    def crop(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` positions of sequence ``seq_id`` (``llama_memory_seq_rm(mem, seq_id, length,
        -1)``). Raises ``ValueError`` if it holds fewer."""
        held = self.tokens[seq_id]
        if length > len(held):
            raise ValueError(f"cannot crop sequence {seq_id} to {length}: it holds {len(held)}")
        if not self.lib.llama_memory_seq_rm(self.mem, seq_id, length, -1):
            raise UnsupportedModelError("llama.cpp could not remove positions from this model's KV cache")
        del held[length:]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Make sequence ``dst`` hold the first ``length`` positions of sequence ``src`` (prefix sharing): what
        ``dst`` held goes, ``src``'s stream is copied (``llama_memory_seq_cp(mem, src, dst, -1, -1)``: across
        streams llama.cpp copies the whole KV buffer, at the next decode) and cut at ``length``
        (``llama_memory_seq_rm``). The keys/values are ``src``'s, bit for bit; ``src`` is not changed.

        Raises:
            ValueError: ``src == dst`` or ``src`` holds fewer than ``length`` positions.
        """
        if src == dst or length > len(self.tokens[src]):
            raise ValueError(f"cannot copy {length} positions of sequence {src} to sequence {dst}")
        self.lib.llama_memory_seq_rm(self.mem, dst, -1, -1)  # removing a whole sequence never fails
        self.tokens[dst] = []
        self.lib.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        self.tokens[dst] = list(self.tokens[src])
        self.crop(dst, length)

    def move(self, src: int, dst: int) -> None:
        """Move sequence ``src`` to seq_id ``dst``: ``dst`` holds what ``src`` held (:meth:`copy` of all of it: the
        keys/values bit for bit, the buffer copied at the next decode) and ``src`` is emptied (``seq_rm``). What
        ``dst`` held goes. Raises ``ValueError`` if ``src == dst``."""
        self.copy(src, dst, len(self.tokens[src]))
        self.crop(src, 0)

    def used(self, seq_id: int) -> int:
        """KV cells sequence ``seq_id`` occupies in llama.cpp (``llama_memory_seq_pos_max + 1``; 0 when empty):
        what the tests compare with the recorded tokens."""
        return int(self.lib.llama_memory_seq_pos_max(self.mem, seq_id)) + 1


def _new_context(model: LlamaCppModel, n_seq: int, seq_ctx: int, n_batch: int):
    """``(ctx, memory, batch)``: a llama.cpp context of ``n_seq`` sequences with ``seq_ctx`` positions each, every
    sequence its own KV stream (``kv_unified=False``: its cells laid out as in a one-sequence context), and a
    reusable batch of ``n_batch`` tokens. Raises RuntimeError when llama.cpp cannot create it (memory)."""
    lib = _llama_cpp()
    p = lib.llama_context_default_params()
    p.n_ctx = n_seq * seq_ctx
    p.n_batch = p.n_ubatch = n_batch
    p.n_seq_max = n_seq
    p.kv_unified = False
    p.n_threads = p.n_threads_batch = model.n_threads
    p.no_perf = True
    with sigint_deferred():
        ctx = lib.llama_init_from_model(model._model, p)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context of {n_seq} sequences × {seq_ctx} positions for "
                           f"{model.name}")
    return ctx, lib.llama_get_memory(ctx), lib.llama_batch_init(n_batch, 0, 1)


def _free_context(lib, ctx, batch) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)


class LlamaCppLM:
    """KV-cached forwards on a llama.cpp context: the :class:`decoding.model.CausalLM` interface.

    The context holds keys/values for ``self.length`` tokens of one sequence; :meth:`forward` appends, :meth:`crop`
    removes from the end. ``forward(hidden=True)`` also returns the last-layer hidden states (the MTP head's input),
    and the context keeps them with its prefix slot, so a reused prefix gives its states back
    (``reuse_prefix(prompt, hidden=True)``, :meth:`cached_hidden`) without a new prefill.
    """

    def __init__(self, model: LlamaCppModel, ctx: _Context):
        self.loaded = model
        self.ctx = ctx
        self.device = model.device
        self.vocab_size = model.vocab_size
        self._prefill_big: int | None = None  # set by reuse_prefix for the prefill that follows it

    def reset(self) -> None:
        self.ctx.clear()

    def reuse_prefix(self, prompt: list[int], hidden: bool = False) -> int:
        """Keep the longest prefix of ``prompt[:-1]`` already in this thread's KV cache and drop the rest: prefix
        caching across decodes (llama.cpp server's ``cache_prompt``, vLLM's automatic prefix caching), so a
        request that repeats the previous one's system prompt and tools, or a conversation's next turn, prefills
        only its new tokens.

        Args:
            hidden: keep only a prefix whose hidden states are kept too (:meth:`cached_hidden`).
        Returns:
            the number of prompt tokens whose keys/values were reused (0 .. ``len(prompt) - 1``).

        In the identity configuration (:attr:`LlamaCppModel.batch_invariant`) a row's keys/values are one of two bit
        patterns: computed in a decode of < 64 tokens of its sequence, or of >= 64 (:data:`SMALL_UBATCH`: llama.cpp's
        CPU flash attention takes its tiled path from 64 query rows on). So there the prefix is kept only where its
        tokens were computed in the class an empty-cache prefill of ``prompt`` gives them, and the prefill that
        follows (the next :meth:`forward`) feeds the rest in those classes (:func:`prefill_classes`, as the batching
        scheduler does): the keys/values, and so every token decoded after, are bit-identical to a fresh prefill's
        (before, a prefix kept from a slot that held a longer prompt changed a greedy answer). Elsewhere the longest
        cached prefix is kept as is: with more threads a reused prefix can differ from a fresh prefill in the last
        bits, like the verify rows.
        """
        n = min(self.ctx.select(prompt), len(prompt) - 1)
        if hidden:
            n = min(n, self.ctx.known_states())
        self._prefill_big = None
        if self.loaded.batch_invariant:  # of the n reusable tokens, those whose class a fresh prefill gives them
            seq = self.ctx.seq
            self._prefill_big, n = prefill_classes(prompt, self.ctx.tokens[:min(n, self.ctx.profiled[seq])],
                                                   self.ctx.big[seq])
        self.ctx.crop(n, always=True)  # even at n == len(cached): nothing unrecorded may stay past n
        return n

    def cached_hidden(self, n: int) -> torch.Tensor:
        """``float32 [n, d]``: the last-layer hidden states of the first ``n`` cached positions, kept from the
        decodes that computed them with ``hidden=True``. Raises ``ValueError`` when fewer are kept (call
        ``reuse_prefix(prompt, hidden=True)`` first)."""
        return torch.from_numpy(self.ctx.cached_states(n))

    @property
    def length(self) -> int:
        """Tokens whose keys/values are in the KV cache."""
        return self.ctx.length

    def forward(self, tokens: list[int], *, num_logits: int | None = None, hidden: bool = False,
                logit_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` (``k >= 1`` ids) after the cached ones in one ``llama_decode`` (chunks of ``n_batch``).

        Args:
            num_logits: logits for the last ``num_logits`` tokens (default all ``k``).
            logit_rows: instead, the increasing indices (into ``tokens``) of the tokens whose logits are wanted;
                the LM head runs for those rows only (with ``hidden=True`` llama.cpp runs it for every row).
            hidden: also return the last-layer hidden states (after the final norm) of every token.
        Returns:
            ``(logits float32 [num_logits or len(logit_rows), V], hidden float32 [k, d] or None)``.
        Raises:
            ValueError: the context would overflow.
            RuntimeError: ``llama_decode`` failed.
        """
        if not tokens:
            raise ValueError("forward needs at least one token")
        if self.ctx.length + len(tokens) > self.loaded.n_ctx:
            raise ValueError(f"{self.ctx.length + len(tokens)} positions do not fit the llama.cpp context "
                             f"({self.loaded.n_ctx})")
        if logit_rows is None:
            n = len(tokens) if num_logits is None else num_logits
            logit_rows = list(range(len(tokens) - n, len(tokens)))
        chunks, self._prefill_big = self._chunks(len(tokens), self._prefill_big), None
        logits, h = self.ctx.decode(tokens, logit_rows, hidden=hidden, chunks=chunks)
        return torch.from_numpy(logits), None if h is None else torch.from_numpy(h)

    def _chunks(self, k: int, big: int | None) -> list[int] | None:
        """The ``llama_decode`` sizes that feed ``k`` tokens after the cached ones so that positions below ``big``
        are computed in decodes of >= SMALL_UBATCH tokens (equal pieces of at most ``n_batch``) and the rest in
        decodes of fewer (:meth:`reuse_prefix`); None (``big`` None): ``n_batch`` at a time."""
        if big is None:
            return None
        first = min(max(big - self.ctx.length, 0), k)
        chunks = equal_pieces(first, self.ctx.n_batch)
        rest = k - first
        chunks += [min(SMALL_UBATCH - 1, rest - a) for a in range(0, rest, SMALL_UBATCH - 1)]
        return chunks

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (``llama_memory_seq_rm``)."""
        if length > self.ctx.length:
            raise ValueError(f"cannot crop the KV cache to {length}: it holds {self.ctx.length}")
        self.ctx.crop(length)

    def synchronize(self) -> None:
        """Nothing to wait for: ``llama_decode`` on the CPU returns when its logits are ready."""


def default_threads() -> int:
    """Threads of the llama.cpp backend when none are given: the physical cores this process may run on
    (``os.sched_getaffinity``, so cpusets and ``taskset`` count; SMT siblings counted once; at most a cgroup v2 CPU
    quota, ``cpu.max``), as llama.cpp's own tools do.

    Not batch-invariant: with more than one thread llama.cpp splits a k-row verify differently from one row, so
    a row's logits can differ in the last bits and a near-tie argmax can flip (greedy speculative output then
    differs from one token per forward at a few positions; the benchmark's ``identical_to_constrained`` measures
    how often). The identity configuration is ``threads=1`` (``--threads 1``) on batch-invariant weights
    (SmolLM2's Q4_1, any Q4_0 / Q8_0 such as ``qwen2.5-coder-0.5b:q8_0``; not Qwen's shipped Q4_K_M from 8 rows
    on): bit-identical rows, measured (``python -m bench.rowcost``; docs/architecture.md, "Threads")."""
    import os

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        cores.add(siblings)
    return max(1, min(len(cores), _cgroup_cpus() or len(cores)))


def _cgroup_cpus() -> int | None:
    """CPUs a cgroup v2 CPU quota allows (``cpu.max``: quota / period, rounded up), or None without a quota."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, -(-int(quota) // int(period)))


def available() -> bool:
    """Whether llama-cpp-python is installed (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None
