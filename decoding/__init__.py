"""Decoding: offline model loading, KV-cached constrained decoding and the grammar-constrained speculative decoder."""
from schemas.errors import SpecAgentError

from .decoder import decode
from .drafters import ChainDrafter, DraftModelDrafter, Drafter, PromptLookupDrafter, SchemaDrafter
from .backends import (BACKENDS, DEFAULT_BACKEND, HIDDEN_STATES, TORCH_WEIGHTS, Backend, LoadedTarget, TargetModel,
                       backend_of, get_backend)
from .generator import WINDOWS, ContextLengthError, Generator, check_window
from .llamacpp import LlamaCppLM, LlamaCppModel, LlamaCppUnavailableError, load_llamacpp
from .loader import (DEFAULT_MODEL, KNOWN_MODELS, CacheNotWritableError, LoadedModel, ModelNotFoundError,
                     UnsupportedModelError, WeightTagError, load_model, BadModelFileError)
from .model import CausalLM
from .sampling import SamplingParams
from .mtp import MTPError
from .registry import (DEFAULT_DRAFTER, DEFAULT_NUM_DRAFT_TOKENS, DRAFTERS, DrafterRow, check_drafter, drafter_choices,
                       make_drafter)
from .speculative import speculative_decode
from .stats import DecodeResult, DecodeStats

__all__ = ["BACKENDS", "Backend", "DEFAULT_BACKEND", "DrafterRow", "HIDDEN_STATES", "LoadedTarget", "TORCH_WEIGHTS",
           "TargetModel", "backend_of", "drafter_choices", "get_backend", "CausalLM", "ChainDrafter", "ContextLengthError", "DEFAULT_DRAFTER", "DEFAULT_MODEL", "DEFAULT_NUM_DRAFT_TOKENS", "DRAFTERS",
           "DecodeResult", "LlamaCppLM", "LlamaCppModel", "LlamaCppUnavailableError", "load_llamacpp", "DecodeStats", "DraftModelDrafter", "Drafter", "Generator", "KNOWN_MODELS", "LoadedModel",
           "MTPError", "ModelNotFoundError", "PromptLookupDrafter", "SamplingParams", "SchemaDrafter", "SpecAgentError",
           "UnsupportedModelError", "BadModelFileError", "WINDOWS", "WeightTagError", "CacheNotWritableError", "check_drafter", "check_window", "decode", "load_model", "make_drafter",
           "speculative_decode"]
