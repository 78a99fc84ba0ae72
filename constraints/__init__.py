"""Grammar constraints: compile JSON Schema / Lark / regex with llguidance; one ConstraintState per sequence."""
from schemas.check import set_enforceability_check
from schemas.errors import SpecAgentError

from .bitmask import (allocate_bitmask, allow_tokens, allowed_among, allowed_tokens, apply_bitmask, is_allowed as is_allowed_row, single_allowed,
                      unpack_bitmask)
from .grammar import Grammar, GrammarError, json_schema_grammar, lark_grammar, lark_json, regex_grammar
from .json_schema import JSON_COMPILE_OPTIONS, check_enforceable, compile_json_schema, compile_options, schema_compiles
from .state import ConstraintError, ConstraintState, GrammarEngineError
from .tokenizer import llg_tokenizer

# strict registration in schemas/ asks the grammar engine whether a schema is enforceable exactly
set_enforceability_check(check_enforceable)

__all__ = ["ConstraintError", "ConstraintState", "GrammarEngineError", "Grammar", "GrammarError", "JSON_COMPILE_OPTIONS",
           "allocate_bitmask",
           "allow_tokens", "allowed_among", "allowed_tokens", "apply_bitmask", "check_enforceable", "compile_json_schema", "compile_options",
           "is_allowed_row", "json_schema_grammar", "lark_grammar", "lark_json", "llg_tokenizer", "regex_grammar",
           "schema_compiles",
           "SpecAgentError", "single_allowed", "unpack_bitmask"]
