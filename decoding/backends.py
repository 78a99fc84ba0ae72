"""Backends: what runs the target model's forward. One declared interface (:class:`TargetModel`, the KV-cached
forward of one sequence; :class:`LoadedTarget`, the loaded weights and tokenizer) and one table (:data:`BACKENDS`)
of how to load a model on each backend and what each can give a drafter.

Two backends exist:
    ``torch``     transformers (``decoding/model.py``): fp32/bf16 weights de-quantised from the GGUF, CPU or CUDA;
                  hidden states and torch weights for the MTP head.
    ``llamacpp``  llama.cpp's CPU kernels on the GGUF (``decoding/llamacpp.py``; as shipped, or re-quantised where a
                  model's ``llamacpp_weights`` says: the default 0.5B runs as Q8_0); hidden states from
                  llama.cpp's per-token embeddings, and the MTP head's shared weights de-quantised from the GGUF
                  (``decoding/gguf_weights.py``); a row-cost curve measured on the machine (``decoding/window.py``).

A drafter row (:data:`decoding.registry.DRAFTERS`) says what it needs from the backend (:data:`HIDDEN_STATES`,
:data:`TORCH_WEIGHTS`); a backend row says what it provides, and :meth:`Backend.supports` is the one check
(``Generator``, the CLI's help and the benchmark's modes all ask it). Adding a backend is one module with a loader
and a :class:`TargetModel` class, and one row here (docs/architecture.md, "Add a backend").

"Engine" is the agent's word for whatever decodes one assistant turn (``agent.engine``); a backend runs forwards.
``engine=`` / ``--engine`` are kept as aliases of ``backend=`` / ``--backend``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch


from .llamacpp import DEFAULT_N_CTX, LlamaCppModel, available as llamacpp_available, is_gguf, load_llamacpp
from .loader import LoadedModel, check_threads, load_model, naming_a_bad_gguf
from .model import CausalLM

HIDDEN_STATES = "hidden_states"  # forward(hidden=True): the target's last-layer states [k, d] (the MTP head)
TORCH_WEIGHTS = "torch_weights"  # the MTP head's shared embedding, final norm and LM head as torch modules
#                                   (Backend.mtp_target: the torch model itself; llama.cpp: de-quantised from the GGUF)


@runtime_checkable
class TargetModel(Protocol):
    """The KV-cached forward of one sequence on a backend: what the decoders (``decoding.decoder``,
    ``decoding.speculative``) and the drafters see of the target.

    Invariant: the KV cache holds keys/values of ``length`` tokens; ``forward`` appends, ``crop`` removes from the
    end (rollback after rejected draft tokens). One object per decode; it may reuse a cache the backend keeps per
    thread (``reuse_prefix``).

    Several sequences in one forward (continuous batching) do not go through this protocol: a backend row that
    batches names its scheduler (:attr:`Backend.batcher`; llama.cpp: ``decoding.batch.BatchScheduler``, one
    ``seq_id`` per sequence).
    """

    device: torch.device
    vocab_size: int

    @property
    def length(self) -> int:
        """Tokens whose keys/values are in the KV cache."""
        ...

    def forward(self, tokens: list[int], *, num_logits: int | None = None, hidden: bool = False,
                logit_rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``tokens`` (``k >= 1`` ids) after the cached ones.

        Args:
            num_logits: logits for the last ``num_logits`` tokens (default all ``k``).
            logit_rows: instead, the increasing indices (into ``tokens``) of the tokens whose logits are wanted
                (the LM head runs for those rows only; may be empty).
            hidden: also return the last-layer hidden states (backends that provide :data:`HIDDEN_STATES`).
        Returns:
            ``(logits float32 [rows, V], hidden float [k, d] or None)`` on ``device``.
        Raises:
            ValueError: ``hidden=True`` on a backend without hidden states; the context would overflow.
        """
        ...

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens. Raises ``ValueError`` if more than the cache holds."""
        ...

    def reset(self) -> None:
        """Empty the KV cache."""
        ...

    def reuse_prefix(self, prompt: list[int], hidden: bool = False) -> int:
        """Keep the longest prefix of ``prompt[:-1]`` still cached from the previous decode, drop the rest, and
        return its length in tokens (0 for a backend without prefix caching, after emptying the cache). With
        ``hidden``, only a prefix whose last-layer hidden states are kept too (:meth:`cached_hidden`)."""
        ...

    def cached_hidden(self, n: int) -> torch.Tensor:
        """``float [n, d]``: the kept last-layer hidden states of the first ``n`` cached positions (after
        ``reuse_prefix(prompt, hidden=True)`` returned at least ``n``). Raises ``ValueError`` when fewer are kept."""
        ...

    def synchronize(self) -> None:
        """Wait for queued device work before a timer is read (``torch.cuda.synchronize`` on CUDA; a no-op where
        the forward returns only when its logits are ready)."""
        ...


@runtime_checkable
class LoadedTarget(Protocol):
    """A loaded model on some backend (weights shared read-only by every decode) and its Hugging Face tokenizer
    (chat template; token ids equal the backend's). :class:`decoding.loader.LoadedModel` (torch) and
    :class:`decoding.llamacpp.LlamaCppModel` implement it."""

    tokenizer: Any
    name: str
    sha256: str | None
    device: torch.device

    @property
    def vocab_size(self) -> int:
        """Logits width V (may exceed the tokenizer's vocabulary)."""
        ...

    @property
    def context_length(self) -> int | None:
        """Positions one sequence may hold (prompt + new tokens), or None when unknown."""
        ...

    @property
    def eos_token_id(self) -> int:
        """The tokenizer's EOS (the grammar tokenizer's end token)."""
        ...

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Every token that ends generation (the EOS included): each ends a turn wherever the grammar accepts."""
        ...


@dataclass(frozen=True)
class Backend:
    """One row of :data:`BACKENDS`.

    Attributes:
        name: the row's key (``backend=``, ``--backend``).
        summary: one line for the CLI's help.
        model_type: the class of the loaded models this backend produces (how a loaded model finds its row).
        load: ``load(spec, device=, dtype=, threads=, ctx_size=) -> LoadedTarget`` (offline; raises
            ``ModelNotFoundError``, ``ValueError`` for arguments that do not apply to the backend, and the backend's
            own errors).
        new_target: ``new_target(loaded, kv_cache) -> TargetModel``, a fresh forward wrapper for one decode.
        provides: what drafters may need that this backend gives (:data:`HIDDEN_STATES`, :data:`TORCH_WEIGHTS`).
        portable: ``portable(loaded) -> (model, load kwargs)`` to rebuild the loaded model in another process (Ray):
            the model itself where it pickles, else its file and the arguments it was loaded with.
        describe: ``describe(loaded) -> str``, where it runs, for start-up lines (``"torch on cpu"``).
        draft_args: ``draft_args(loaded) -> load kwargs``: how a draft model is loaded beside the target ``loaded``
            (``load(draft_spec, **draft_args(loaded))``: the target's device and dtype, or its threads and context),
            so the ``draft_model`` drafter runs on the target's backend.
        mtp_target: ``mtp_target(loaded) -> nn.Module``: what the MTP head shares (token embedding, final norm, LM
            head, config; ``decoding.mtp.load_head``'s ``target``), where the row provides :data:`TORCH_WEIGHTS`.
        row_cost: ``row_cost(loaded) -> decoding.window.RowCost``: what a verify of n rows costs, measured on this
            machine (the speculative window rule reads it); None where a verify costs about one forward (torch).
        bench_prefix: prefix of the benchmark's mode names for this backend's decoding modes.
        batcher: ``batcher(loaded, max_batch=, seq_ctx=, max_rows=, exact_prefill=) -> scheduler``, or its
            ``"module:name"`` (imported when batching is asked for: ``decoding.batch`` imports the decoders, which
            import this table): continuous batching of several sequences in one forward
            (``Generator.enable_batching``); None where the backend decodes one sequence per forward.
    """

    name: str
    summary: str
    model_type: type
    load: Callable[..., Any]
    new_target: Callable[[Any, str | None], TargetModel]
    provides: frozenset[str] = field(default_factory=frozenset)
    portable: Callable[[Any], tuple[Any, dict]] = lambda loaded: (loaded, {})
    describe: Callable[[Any], str] = lambda loaded: str(loaded.device)
    draft_args: Callable[[Any], dict] = lambda loaded: {}
    mtp_target: Callable[[Any], Any] | None = None
    row_cost: Callable[[Any], Any] | None = None
    bench_prefix: str = ""
    batcher: Callable[..., Any] | str | None = None

    def supports(self, needs: frozenset[str] | set[str]) -> bool:
        """Whether this backend provides everything in ``needs``."""
        return set(needs) <= self.provides


def _load_torch(spec: str, *, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
                ctx_size: int | None = None) -> LoadedModel:
    check_threads(threads)
    if ctx_size is not None:
        raise ValueError(f"ctx_size={ctx_size} sizes the llama.cpp backend's KV cache (backend='llamacpp'); the torch "
                         f"backend's cache grows with the sequence up to the model's context")
    if threads is not None:  # torch's intra-op threads are per process
        torch.set_num_threads(threads)
    with naming_a_bad_gguf(spec):
        return load_model(spec, device=device, dtype=dtype)


def _load_llamacpp(spec: str, *, device: str = "cpu", dtype: str = "float32",
                   threads: int | None = None, ctx_size: int | None = None) -> LlamaCppModel:
    if device != "cpu" or dtype not in ("float32", "fp32"):
        given = ", ".join(f"{k}={v!r}" for k, v, default in (("device", device, device == "cpu"),
                                                             ("dtype", dtype, dtype in ("float32", "fp32")))
                          if not default)
        raise ValueError(f"backend='llamacpp' runs the GGUF on the CPU at its own weight type: {given} "
                         f"{'applies' if ', ' not in given else 'apply'} to backend='torch' only")
    if ctx_size is not None and ctx_size < 2:
        raise ValueError(f"ctx_size must be >= 2 KV cache positions (prompt + output), got {ctx_size}")
    with naming_a_bad_gguf(spec):
        return load_llamacpp(spec, n_threads=threads, n_ctx=DEFAULT_N_CTX if ctx_size is None else ctx_size)


BACKENDS: dict[str, Backend] = {
    "torch": Backend(
        "torch", "transformers: fp32/bf16 weights de-quantised from the GGUF, CPU or CUDA; every drafter",
        LoadedModel, _load_torch, lambda loaded, kv_cache: CausalLM(loaded, cache=kv_cache),
        provides=frozenset({HIDDEN_STATES, TORCH_WEIGHTS}),
        describe=lambda loaded: f"torch on {loaded.device}",
        draft_args=lambda loaded: {"device": str(loaded.device), "dtype": loaded.dtype},
        mtp_target=lambda loaded: loaded.model),
    "llamacpp": Backend(
        "llamacpp", "llama.cpp's CPU kernels on the GGUF (needs `make setup-llamacpp`); every drafter",
        LlamaCppModel, _load_llamacpp, lambda loaded, kv_cache: loaded.new_lm(),
        provides=frozenset({HIDDEN_STATES, TORCH_WEIGHTS}),
        portable=lambda loaded: (loaded.spec or str(loaded.path), {"backend": "llamacpp", "threads": loaded.n_threads,
                                                    "ctx_size": loaded.n_ctx}),
        describe=lambda loaded: f"llama.cpp (CPU, {loaded.n_threads} thread{'s' if loaded.n_threads != 1 else ''})",
        draft_args=lambda loaded: {"threads": loaded.n_threads, "ctx_size": loaded.n_ctx},
        mtp_target=lambda loaded: loaded.shared_weights(), row_cost=lambda loaded: loaded.row_cost(),
        bench_prefix="llamacpp_engine_", batcher="decoding.batch:BatchScheduler"),
}
DEFAULT_BACKEND = "llamacpp" if llamacpp_available() else "torch"  # where a backend is not named (see choose_backend)


def get_backend(name: str) -> Backend:
    """The row named ``name``. Raises ``ValueError`` naming the choices."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def backend_of(loaded: Any) -> Backend:
    """The row whose models ``loaded`` is (exactly, else an instance of a subclass of). Raises ``TypeError`` for a
    model of no backend."""
    for row in BACKENDS.values():
        if type(loaded) is row.model_type:
            return row
    for row in BACKENDS.values():
        if isinstance(loaded, row.model_type):
            return row
    raise TypeError(f"{type(loaded).__name__} is not a loaded model of any backend ({', '.join(BACKENDS)})")


def backend_name(backend: str | None, engine: str | None, *, model: str | None = None, device: str = "cpu",
                 dtype: str = "float32", needs: frozenset[str] = frozenset()) -> str:
    """The backend asked for by ``backend=`` or its alias ``engine=``; where neither names one,
    :func:`choose_backend` for ``model``, ``device``, ``dtype`` and a drafter that ``needs`` these.

    Raises:
        ValueError: both given and different, or an unknown name.
    """
    if backend is not None and engine is not None and backend != engine:
        raise ValueError(f"backend={backend!r} and engine={engine!r} disagree (engine= is an alias of backend=)")
    if backend or engine:
        return get_backend(backend or engine).name
    return choose_backend(model, device=device, dtype=dtype, needs=needs)


def choose_backend(model: str | None, *, device: str = "cpu", dtype: str = "float32",
                   needs: frozenset[str] = frozenset()) -> str:
    """The default backend for a model spec: ``llamacpp`` (llama.cpp's CPU kernels on the GGUF: loads in
    about a second, the fastest decode on a CPU) where llama-cpp-python is installed, the model is a GGUF (an alias or
    a ``.gguf`` file), it runs on the CPU in the default dtype and the drafter ``needs`` nothing llama.cpp lacks;
    else ``torch`` (GPUs, Hugging Face directories)."""
    cpp = BACKENDS.get("llamacpp")
    if cpp is None or DEFAULT_BACKEND != "llamacpp" or device != "cpu" or dtype not in ("float32", "fp32"):
        return "torch"
    if not cpp.supports(needs):
        return "torch"
    if model is not None and not is_gguf(model):
        return "torch"
    return "llamacpp"
