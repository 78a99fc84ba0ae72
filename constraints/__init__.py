"""Grammar constraints: compile JSON Schema / Lark / regex with llguidance; one ConstraintState per sequence."""
from schemas.errors import SpecAgentError

from .bitmask import (allocate_bitmask, allowed_tokens, apply_bitmask, is_allowed as is_allowed_row, single_allowed,
                      unpack_bitmask)
from .grammar import Grammar, GrammarError, json_schema_grammar, lark_grammar, lark_json, regex_grammar
from .state import ConstraintError, ConstraintState
from .tokenizer import llg_tokenizer

__all__ = ["ConstraintError", "ConstraintState", "Grammar", "GrammarError", "allocate_bitmask", "allowed_tokens",
           "apply_bitmask", "is_allowed_row", "json_schema_grammar", "lark_grammar", "lark_json", "llg_tokenizer", "regex_grammar",
           "SpecAgentError", "single_allowed", "unpack_bitmask"]
