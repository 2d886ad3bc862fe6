"""The benchmark harness on tiny models: prompt formats, JSON schema, identity check, bound, plots."""

from __future__ import annotations

import gzip
import json
import math

import pytest
from tiny import save_tiny_pair

import verispec.bench.harness as harness
from verispec.bench.harness import Bench, Config, balanced_orders, first_difference, run_benchmark
from verispec.bench.loader import load_prompts, select
from verispec.bench.report import (
    alpha_from_mean_length,
    build_report,
    leviathan_bound,
    write_plots,
)
from verispec.build import BACKENDS, Backend, DraftSpec, TargetSpec
from verispec.cli import main
from verispec.sampling import SamplingParams

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("bench"))


def test_leviathan_bound_known_values():
    # alpha = 0.8, k = 4, c = 0.1: (1 - 0.8^5) / (0.2 * 1.4) = 0.67232 / 0.28
    assert math.isclose(leviathan_bound(0.8, 4, 0.1), 0.67232 / 0.28, rel_tol=1e-12)
    assert leviathan_bound(0.0, 4, 0.5) == pytest.approx(1 / 3)  # nothing accepted: pure cost
    assert leviathan_bound(1.0, 3, 0.0) == 4.0  # all accepted, free draft: k + 1
    assert leviathan_bound(0.5, 1, 0.0) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        leviathan_bound(1.5, 2, 0.1)


@pytest.mark.parametrize("alpha, k", [(0.3, 2), (0.8, 4), (0.95, 8)])
def test_alpha_inverts_expected_length(alpha, k):
    mean_len = (1 - alpha ** (k + 1)) / (1 - alpha)
    assert alpha_from_mean_length(mean_len, k) == pytest.approx(alpha, abs=1e-9)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_prompt_formats(tmp_path):
    spec = tmp_path / "q.jsonl"
    spec.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "writing", "turns": ["a", "b"]},
        {"question_id": 2, "category": "coding", "turns": ["c"]},
        {"question_id": 3, "category": "qa", "turns": ["d"]},
        {"question_id": 4, "category": "qa", "turns": ["e"]},
    ]))
    prompts = load_prompts(spec, group_mt_bench=True)
    assert [(p.category, p.text, p.chat) for p in prompts] == [
        ("mt_bench", "a", True), ("mt_bench", "c", True), ("qa", "d", True), ("qa", "e", True)]
    assert [p.id for p in select(prompts, per_category=1)] == ["1", "3"]
    assert len(select(prompts, limit=3)) == 3
    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    assert load_prompts(he)[0].chat is False and load_prompts(he)[0].category == "humaneval"
    txt = tmp_path / "p.txt"
    txt.write_text("one\ntwo\n")
    assert [p.text for p in load_prompts(txt)] == ["one", "two"]
    assert len(load_prompts(None)) >= 12 and {"chat", "code", "code-editing", "summarization", "qa", "math"} <= {
        p.category for p in load_prompts(None)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="expected a 'turns'"):
        load_prompts(bad)


def _tiny_bench(pair_dirs) -> Bench:
    target, draft = pair_dirs
    return Bench(TargetSpec(target, device="cpu", dtype="fp32"), DraftSpec("model", draft))


def _bench(pair_dirs, monkeypatch=None, params=SamplingParams()):
    target, draft = pair_dirs
    bench = _tiny_bench(pair_dirs)
    prompts = select(load_prompts(None), per_category=1)[:4]
    configs = [Config("verispec k=2", "spec", 2), Config("verispec k=4", "spec", 4), Config("hf assisted", "hf"),
               Config("ngram k=3", "spec", 3, "ngram"), Config("hf prompt lookup", "hf-lookup")]
    runs = run_benchmark(bench, prompts, configs, params, max_new_tokens=12)
    return build_report(runs, configs, {"target": target, "draft": draft}), runs


def test_report_schema_and_identity(pair_dirs, tmp_path):
    report, runs = _bench(pair_dirs)
    assert len(runs) == 4 * 6
    names = [c["name"] for c in report["configs"]]
    assert names == ["plain", "verispec k=2", "verispec k=4", "hf assisted", "ngram k=3", "hf prompt lookup"]
    assert report["configs"][4]["overall"]["identity"]["mismatches"] == 0  # n-gram drafts are exact too
    for entry in report["configs"][1:3]:
        o = entry["overall"]
        for key in ("tokens_per_second", "speedup_median", "speedup_p25", "speedup_p75", "acceptance_rate",
                    "mean_accepted_length", "acceptance_by_position", "cost_ratio_c", "alpha", "bound", "efficiency"):
            assert key in o, key
        assert o["identity"] == {"checked": 4, "mismatches": 0, "first_diff": {}}
        assert len(o["acceptance_by_position"]) == entry["k"]
        assert set(entry["by_category"]) == set(report["categories"])
    assert "identity" in report["configs"][3]["overall"]  # HF's output is checked too
    json.dumps(report)  # serialisable
    paths = write_plots(report, tmp_path / "plots")
    assert [p.name for p in paths] == ["speedup_by_category.png", "acceptance_by_position.png", "speedup_vs_k.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000


def test_identity_check_catches_planted_mismatch(pair_dirs, monkeypatch):
    real = harness._run_engine

    def planted(pipe, ids, params, max_new, k):
        out = real(pipe, ids, params, max_new, k)
        if k == 4:  # corrupt one token of one configuration
            out["token_ids"] = out["token_ids"][:5] + [(out["token_ids"][5] + 1) % 200] + out["token_ids"][6:]
        return out

    monkeypatch.setattr(harness, "_run_engine", planted)
    report, _ = _bench(pair_dirs)
    ident = {c["name"]: c["overall"]["identity"] for c in report["configs"][1:3]}
    assert ident["verispec k=2"]["mismatches"] == 0
    assert ident["verispec k=4"]["mismatches"] == 4
    assert set(ident["verispec k=4"]["first_diff"].values()) == {5}


def test_cli_bench_end_to_end(pair_dirs, tmp_path, capsys):
    target, draft = pair_dirs
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\nworld\n")
    out_json = tmp_path / "r.json"
    code = main(["bench", "--target", target, "--draft", draft, "--dtype", "fp32", "--prompts", str(prompts),
                 "--max-new-tokens", "10", "-k", "2,auto", "--compare", "hf", "--drafters", "model,hybrid",
                 "--json-out", str(out_json),
                 "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])
    assert last == json.loads(out_json.read_text())
    assert "speedup" in out and "bound" in out
    assert len(last["plots"]) == 3
    assert [c["name"] for c in last["configs"]] == ["plain", "model k=2", "model k=auto", "hybrid k=2", "hybrid k=auto",
                                                    "hf assisted"]
    assert main(["bench", "--target", target, "--draft", draft, "-k", "0"]) == 2
    assert main(["bench", "--target", target, "--draft", draft, "--repeats", "0"]) == 2


def test_cli_bench_draft_variants_same_run(pair_dirs, tmp_path, capsys):
    """Extra draft setups run beside the pipeline's own draft, each checked for identity against plain."""
    target, draft = pair_dirs
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert main(["bench", "--target", target, "--draft", draft, "--prompts", str(prompts), "--max-new-tokens", "12",
                 "-k", "3", "--draft-variants", "hf-int4,hf-int8-v128", "--drafters", "model,ngram"]) == 0
    captured = capsys.readouterr()
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert "bench 5/5 " in captured.err  # not a terminal: one progress line per run
    names = [c["name"] for c in last["configs"]]
    assert names == ["plain", "model k=3", "ngram k=3", "model[hf-int4] k=3", "model[hf-int8-v128] k=3"]
    for config in last["configs"][1:]:
        assert config["overall"]["identity"]["mismatches"] == 0
    assert last["configs"][3]["overall"]["acceptance_rate"] > 0
    assert main(["bench", "--target", target, "--draft", draft, "--draft-variants", "hf-int5"]) == 2
    assert "unknown draft variant 'hf-int5'" in capsys.readouterr().err


def test_parse_draft_variant():
    from verispec.bench.harness import parse_draft_variant
    from verispec.models import ModelError

    assert parse_draft_variant("llamacpp") == ("llamacpp", "none", 0, "auto")
    assert parse_draft_variant("hf-int4-v32768") == ("hf", "int4", 32768, "auto")
    assert parse_draft_variant("hf-v100") == ("hf", "none", 100, "auto")
    assert parse_draft_variant("hf-int4-transformers") == ("hf", "int4", 0, "transformers")
    assert parse_draft_variant("hf-lean") == ("hf", "none", 0, "lean")
    for bad in ("llamacpp-int4", "hf-v", "cuda", "hf-int4-x", "llamacpp-lean", "hf-lean-int4"):
        with pytest.raises(ModelError):
            parse_draft_variant(bad)


def test_repeats_pool_runs_per_prompt(pair_dirs, monkeypatch):
    """--repeats: every configuration runs N times per prompt, the order balanced; a Run pools them (summed
    tokens, seconds, counters) and its speedup is pooled tokens/s over the pooled baseline's; one mismatching
    repeat makes the prompt non-identical."""
    bench = _tiny_bench(pair_dirs)
    prompts = select(load_prompts(None), per_category=1)[:2]
    configs = [Config("verispec k=3", "spec", 3)]
    real = harness._run_engine
    calls = []

    def recorded(pipe, ids, params, max_new, k):
        out = real(pipe, ids, params, max_new, k)
        calls.append(k)
        out["seconds"] = {0: 2.0, 3: 1.0}[k] * len([c for c in calls if c == k])  # fake, distinct timings
        if k == 3 and len([c for c in calls if c == 3]) == 5:  # corrupt one repeat (prompt 2, repeat 2)
            out["token_ids"] = out["token_ids"][:2] + [(out["token_ids"][2] + 1) % 200] + out["token_ids"][3:]
        return out

    monkeypatch.setattr(harness, "_run_engine", recorded)
    runs = run_benchmark(bench, prompts, configs, SamplingParams(), max_new_tokens=8, warmup=0, repeats=3)
    assert calls == [0, 3, 3, 0, 0, 3] + [3, 0, 0, 3, 3, 0]  # A B, B A, ... across prompts and repeats
    assert [(r.prompt_id, r.config, r.repeats) for r in runs] == [
        (prompts[0].id, "plain", 3), (prompts[0].id, "verispec k=3", 3),
        (prompts[1].id, "plain", 3), (prompts[1].id, "verispec k=3", 3)]
    plain, spec = runs[2], runs[3]
    assert plain.seconds == 2.0 * (4 + 5 + 6) and spec.seconds == 1.0 * (4 + 5 + 6)
    assert plain.new_tokens == spec.new_tokens == 3 * 8
    assert spec.speedup == pytest.approx(2.0)
    assert spec.repeat_speedups == pytest.approx([2.0, 2.0, 2.0])
    assert spec.rounds > 0 and sum(spec.drafted_per_position) == spec.drafted
    assert runs[1].identical and spec.identical is False and spec.first_diff == 2
    report = build_report(runs, configs, {})
    overall = report["configs"][1]["overall"]
    assert overall["repeats"] == 3 and overall["speedup_aggregate"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_benchmark(bench, prompts, configs, SamplingParams(), max_new_tokens=8, warmup=0, repeats=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_orders(n):
    """The Williams design: every configuration in every position equally often, and every one directly after
    every other one equally often."""
    from collections import Counter

    orders = balanced_orders(n)
    assert len(orders) == (n if n % 2 == 0 else 2 * n) and all(sorted(o) == list(range(n)) for o in orders)
    for position in range(n):
        assert len(Counter(o[position] for o in orders)) == n
        assert len(set(Counter(o[position] for o in orders).values())) == 1
    follows = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    if n > 1:
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(follows.values())) == 1


def test_runs_follow_the_balanced_orders(pair_dirs, monkeypatch):
    """Blocks (prompt after prompt, repeat after repeat) take the design's orders in turn: with 4
    configurations and 2 prompts x 2 repeats, each configuration runs right after each other one once.
    (Rotating one order made the baseline always follow the same configuration.)"""
    from collections import Counter

    bench = _tiny_bench(pair_dirs)
    prompts = select(load_prompts(None), per_category=1)[:2]
    configs = [Config("a", "spec", 1), Config("b", "spec", 2), Config("ngram", "spec", 3, "ngram")]
    seen = []

    def fake(bench, config, ids, params, max_new):
        seen.append(config.name)
        return dict(new_tokens=4, seconds=1.0, token_ids=[1, 2, 3, 4])

    monkeypatch.setattr(harness, "_one", fake)
    runs = run_benchmark(bench, prompts, configs, SamplingParams(), max_new_tokens=4, warmup=0, repeats=2)
    assert len(seen) == 2 * 2 * 4 and len(runs) == 2 * 4
    blocks = [seen[i : i + 4] for i in range(0, len(seen), 4)]
    assert blocks[0] == ["plain", "a", "ngram", "b"]
    follows = Counter((x, y) for block in blocks for x, y in zip(block, block[1:]))
    assert len(follows) == 12 and set(follows.values()) == {1}
    for name in ("plain", "a", "b", "ngram"):
        assert sorted(block.index(name) for block in blocks) == [0, 1, 2, 3]

def test_bench_configurations_are_pipelines_sharing_models(pair_dirs, monkeypatch):
    """Each configuration is a pipeline built from specs (its own k, its own k policy), on one store: the
    target and each draft setup load once however many configurations use them."""
    target, draft = pair_dirs
    loads = []
    real = BACKENDS["hf"]
    monkeypatch.setitem(BACKENDS, "hf", Backend(lambda r: loads.append((r.model, r.quant)) or real.load(r), True, True))
    bench = _tiny_bench(pair_dirs)
    configs = [Config("model k=2", "spec", 2), Config("model k=auto", "spec", "auto"),
               Config("hybrid k=auto", "spec", "auto", "hybrid"), Config("ngram k=3", "spec", 3, "ngram"),
               Config("model[hf-int8] k=auto", "spec", "auto", "model[hf-int8]"), Config("hf assisted", "hf")]
    prompts = select(load_prompts(None), per_category=1)[:1]
    runs = run_benchmark(bench, prompts, configs, SamplingParams(), max_new_tokens=6, warmup=0)
    assert sorted(loads) == sorted([(target, "none"), (draft, "int4"), (draft, "int8")])
    assert bench.hf_draft() is bench.hf_draft()  # HF assisted's plain draft (the pipelines' is int4): loaded once
    pipes = {c.name: bench.pipeline(c) for c in configs}
    assert pipes["model k=2"].draft_model is pipes["hybrid k=auto"].draft_model
    assert pipes["model[hf-int8] k=auto"].draft_quant == "int8" and pipes["model k=2"].draft_quant == "int4"
    policies = {id(pipes[name].generator.k_policy) for name in ("model k=auto", "hybrid k=auto", "model[hf-int8] k=auto")}
    assert len(policies) == 3  # each adaptive configuration learns its own costs
    assert pipes["ngram k=3"].draft_model is None and pipes["hf assisted"] is bench.baseline
    assert all(r.identical for r in runs if r.config not in ("plain", "hf assisted"))
    with pytest.raises(ValueError, match="needs a draft model"):
        run_benchmark(Bench(TargetSpec(target, device="cpu", dtype="fp32"), None), prompts,
                      [Config("model k=2", "spec", 2)], SamplingParams(), max_new_tokens=4, warmup=0)
