"""Smoke test of the benchmark harness on a tiny random model over the real tokenizer (2 BFCL prompts, seconds)."""
from __future__ import annotations

import json

import pytest

from conftest import FIXTURES

MODES = ["constrained", "forced", "lookup", "best", "hf_unconstrained", "hf_assisted_constrained"]
OURS = ["constrained", "forced", "lookup", "best"]
LOSSLESS = ["forced", "lookup", "best", "hf_assisted_constrained"]


@pytest.fixture(scope="module")
def bench_out(tiny_target, tmp_path_factory):
    from bench import run

    out = tmp_path_factory.mktemp("bench")
    rc = run.main(["--data-dir", str(FIXTURES), "--limit", "2", "--modes", ",".join(MODES + ["mtp", "draft_model",
                   "llamacpp_constrained"]), "--max-new-tokens", "128", "--out", str(out)], loaded=tiny_target)
    assert rc == 0
    return out


def test_bench_writes_results_with_every_field(bench_out):
    from bench.aggregate import FIELDS

    for name in ("results.json", "results.md", "speedup.png", "per_prompt.jsonl"):
        assert (bench_out / name).stat().st_size > 0, name
    data = json.loads((bench_out / "results.json").read_text())
    meta = data.pop("meta")
    assert meta["n_prompts"] == 2 and meta["cpu"] and meta["torch_threads"] >= 1
    # optional modes with no checkpoint / draft model / GGUF are skipped with a reason, not reported
    assert set(meta["skipped"]) == {"mtp", "draft_model", "llamacpp_constrained"}
    assert all(meta["skipped"].values())
    assert set(data) == set(MODES)
    for mode, r in data.items():
        assert tuple(r) == FIELDS, mode
        assert r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0, mode
    assert data["constrained"]["speedup_vs_constrained"] == 1.0
    # one token per forward, plus the forward whose token is the model's end token where it ends the turn itself
    assert 0.9 < data["constrained"]["tokens_per_forward"] <= 1.0
    assert data["lookup"]["acceptance_by_position"] and data["hf_assisted_constrained"]["acceptance_by_position"]
    assert data["hf_unconstrained"]["acceptance_by_position"] is None
    assert (bench_out / "results.md").read_text().count("\n| ") >= len(MODES) + 1


def test_bench_lossless_modes_match_constrained_and_are_valid(bench_out):
    data = json.loads((bench_out / "results.json").read_text())
    for mode in LOSSLESS:
        assert data[mode]["identical_to_constrained"] == 1.0, mode
    for mode in OURS + ["hf_assisted_constrained"]:  # the HF peer's processor must keep outputs schema-valid too
        assert data[mode]["valid"] == 1.0, mode
    for mode in ("forced", "lookup", "best"):
        assert data[mode]["tokens_per_forward"] > 1.0, mode


def test_gamma_sweep(tiny_target, tmp_path):
    from bench import gamma

    assert gamma.leviathan_speedup(0.0, 4, 0.0) == 1.0
    assert gamma.leviathan_speedup(1.0, 3, 0.0) == 4.0
    assert abs(gamma.leviathan_speedup(0.5, 2, 0.1) - 1.75 / 1.2) < 1e-12
    rc = gamma.main(["--data-dir", str(FIXTURES), "--limit", "1", "--gammas", "1,3", "--max-new-tokens", "128",
                     "--out", str(tmp_path)], loaded=tiny_target)
    assert rc == 0
    data = json.loads((tmp_path / "gamma.json").read_text())
    rows = [r for r in data["rows"] if r["drafter"] == "lookup"]
    assert [r["gamma"] for r in rows] == [1, 3]
    for r in rows:
        assert r["identical_to_constrained"] == 1.0
        assert r["speedup"] > 0 and r["predicted_speedup"] is not None and 0 <= r["alpha"] <= 1
    assert (tmp_path / "gamma.md").read_text().count("| lookup |") == 2


@pytest.mark.parametrize("args, text", [(["--rows", "abc"], "comma-separated integers >= 1"),
                                        (["--repeat", "0"], "an integer >= 1"),
                                        (["--weights", "bogus"], "choose from shipped, q4_0, q8_0"),
                                        (["--rows", "2,4"], "must start with 1"),
                                        (["--out", "/nonexistent-dir/x.json"], "no such directory"),
                                        (["--out", "/tmp"], "a directory; give a file name")])
def test_rowcost_refuses_bad_flags_before_measuring(capsys, args, text):
    """A helper's finds: each of these measured first or ended in a traceback (ValueError, StatisticsError), a bad
    --out after the whole table was printed."""
    import bench.rowcost as rowcost

    with pytest.raises(SystemExit) as e:
        rowcost.main(args)
    assert e.value.code == 2 and text in capsys.readouterr().err
