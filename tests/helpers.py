"""Test helpers: random schemas, prompts and reference computations (no cache, full forwards)."""
from __future__ import annotations

import random

import torch

from constraints import ConstraintState, allocate_bitmask, apply_bitmask


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded random object schema (every output finishes): strings, integers, booleans, enums, arrays, objects."""
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array", "object" if depth == 0 else "string"])
        if kind == "string":
            s = {"type": "string", "maxLength": rng.randint(1, 6)}
        elif kind == "integer":
            s = {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99, 999])}
        elif kind == "boolean":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"enum": rng.sample(["red", "green", "blue", "cyan", "x"], rng.randint(1, 3))}
        elif kind == "array":
            s = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": rng.randint(1, 3)}
        else:
            s = random_schema(rng, depth + 1)
        props[f"k{i}_{kind[:3]}"] = s
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


PROMPTS = ["Call the tool for Paris and 42.", "Give me the blue one with 7 items please",
           '{"k0_str": "ab", "k1_int": 3}', "x"]


@torch.inference_mode()
def reference_greedy_check(model, prompt: list[int], tokens: list[int], state_factory) -> None:
    """Assert each emitted token is the argmax of the grammar-masked logits of a full (cache-free) forward."""
    state = state_factory()
    vocab = model.config.vocab_size
    bm = allocate_bitmask(1, vocab)
    seq = list(prompt)
    for i, t in enumerate(tokens):
        logits = model(torch.tensor([seq])).logits[0, -1:].float()
        state.fill_bitmask(bm, 0)
        masked = apply_bitmask(logits.clone(), bm)
        assert int(masked.argmax()) == t, f"step {i}: emitted {t}, masked argmax {int(masked.argmax())}"
        state.consume(t)
        seq.append(t)
