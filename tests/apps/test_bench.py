"""The benchmark harness on tiny models: prompt formats, JSON schema, identity check, bound, plots."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math

import pytest
from tiny import save_tiny_pair

import verispec.apps.bench.harness as harness
from verispec.apps.bench.harness import Bench, Config, first_difference, run_benchmark
from verispec.apps.bench.loader import Prompt, answer_history, load_prompts, select
from verispec.apps.bench.measured import balanced_orders
from verispec.apps.bench.plan import caveats
from verispec.apps.bench.report import alpha_from_mean_length, build_report, leviathan_bound, write_plots
from verispec.apps.cli import main
from verispec.assembly.registry import BACKENDS, Backend
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.core.sampling import SamplingParams
from verispec.pipeline.text import encode_messages

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


def test_caveat_on_transformers_different_tokenizer_sampling():
    """Only HF's sampled assisted generation with a draft of another tokenizer is flagged as not lossless."""
    sampled, greedy = SamplingParams(temperature=0.7), SamplingParams()
    (line,) = caveats(["hf", "llama"], sampled, other_tokenizer=True)
    assert line.startswith("hf assisted:") and "lossless" in line
    assert caveats(["hf"], greedy, other_tokenizer=True) == []
    assert caveats(["hf"], sampled, other_tokenizer=False) == []
    assert caveats(["llama"], sampled, other_tokenizer=True) == []


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
    assert len(load_prompts(None)) >= 12 and {"chat", "code", "code-editing", "summarization", "qa", "math", "fim"} <= {
        p.category for p in load_prompts(None)}
    fim = [p for p in load_prompts(None) if p.category == "fim"]
    assert fim and all(p.infill and p.expected and not p.chat for p in fim) and any(p.files for p in fim)
    records = tmp_path / "fim.jsonl"
    records.write_text(json.dumps({"question_id": "x", "prefix": "a", "suffix": "b", "expected": "m",
                                   "files": [{"filename": "u.py", "text": "U"}, {"text": "V"}]}) + "\n")
    (infill,) = load_prompts(records)
    assert (infill.text, infill.suffix, infill.files, infill.expected, infill.category) == (
        "a", "b", (("u.py", "U"), ("tmp", "V")), "m", "fim")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="expected a 'turns'"):
        load_prompts(bad)


def test_later_turns_carry_their_history(tmp_path):
    mt = tmp_path / "mt.jsonl"
    mt.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 81, "category": "writing", "turns": ["a", "b"]},
        {"question_id": 82, "category": "writing", "turns": ["c"]},
        {"question_id": 83, "category": "coding", "turns": ["d", "e", "f"]},
    ]))
    second = load_prompts(mt, turn=2)
    assert [(p.id, p.text, p.history) for p in second] == [("81", "b", ("a",)), ("83", "e", ("d",))]
    assert [(p.id, p.text, p.history) for p in load_prompts(mt, turn=3)] == [("83", "f", ("d", "e"))]
    assert [p.history for p in load_prompts(mt)] == [(), (), ()]
    with pytest.raises(ValueError, match="no question has 4 turns"):
        load_prompts(mt, turn=4)
    he = tmp_path / "he.jsonl"
    he.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    txt = tmp_path / "p.txt"
    txt.write_text("one\n")
    for one_turn in (he, txt):
        with pytest.raises(ValueError, match="turn 2 needs multi-turn"):
            load_prompts(one_turn, turn=2)

    asked = []

    def answer(p):
        asked.append(p.messages())
        return f"answer to {p.text}"

    answered = answer_history(load_prompts(mt, turn=3), answer)
    assert asked == [[{"role": "user", "content": "d"}],
                     [{"role": "user", "content": "d"}, {"role": "assistant", "content": "answer to d"},
                      {"role": "user", "content": "e"}]]
    assert answered[0].messages()[-2:] == [{"role": "assistant", "content": "answer to e"},
                                           {"role": "user", "content": "f"}]
    with pytest.raises(ValueError, match="answers"):
        load_prompts(mt, turn=3)[0].messages()  # earlier turns not answered yet


def test_a_second_turn_runs_on_the_whole_conversation(pair_dirs, monkeypatch):
    """Every configuration is timed on [turn 1, the target's plain greedy answer, turn 2]."""
    bench = _tiny_bench(pair_dirs)
    prompt = Prompt("81", "writing", "Now say it again.", True, ("Say something.",))
    seen = []
    one = harness._one
    monkeypatch.setattr(harness, "_one", lambda b, c, ids, *a: seen.append(ids) or one(b, c, ids, *a))
    runs = run_benchmark(bench, [prompt], [Config("verispec k=2", "spec", 2)], SamplingParams(), max_new_tokens=6,
                         warmup=0)
    first = bench.baseline.generate([{"role": "user", "content": "Say something."}], max_new_tokens=6).text
    assert first
    expected = encode_messages(bench.baseline.tokenizer, [
        {"role": "user", "content": "Say something."}, {"role": "assistant", "content": first},
        {"role": "user", "content": "Now say it again."}])
    assert seen == [expected, expected]  # the baseline and the speculative configuration
    assert all(r.ok for r in runs) and runs[1].identical


def test_warm_history_times_a_turn_with_the_conversation_already_cached(pair_dirs, monkeypatch):
    """--warm-history: each run first answers turn 1 itself (untimed), so the timed turn 2 prefills only what
    turn 1 left out of the target's cache (its answer's end and turn 2), not the whole conversation; outputs
    stay the same tokens."""
    from verispec.decoding.engine import SpeculativeEngine

    bench = _tiny_bench(pair_dirs)
    prompt = Prompt("81", "writing", "Now say it again.", True, ("Say something.",))
    fed, admit = [], SpeculativeEngine._admit

    def recording(self, *args):  # (prompt tokens, those the slot's cache lacks: what the first round feeds)
        row = admit(self, *args)
        fed.append((len(row.seq), len(row.seq) - self.target.lengths[row.slot]))
        return row

    monkeypatch.setattr(SpeculativeEngine, "_admit", recording)
    configs = [Config("verispec k=2", "spec", 2)]
    cold = run_benchmark(bench, [prompt], configs, SamplingParams(), max_new_tokens=6, warmup=0)
    answering = len(fed) - 2  # the history's answer (plain, untimed), then the two timed runs
    assert all(n == length for length, n in fed[answering:])  # the whole conversation prefilled
    fed.clear()
    warm = run_benchmark(bench, [prompt], configs, SamplingParams(), max_new_tokens=6, warmup=0, warm_history=True)
    turn1 = len(encode_messages(bench.baseline.tokenizer, [{"role": "user", "content": "Say something."}]))
    runs = fed[answering:]  # per configuration: the warm answer's prefill (from scratch), then the timed one's
    assert len(runs) == 4 and [n for _, n in runs[::2]] == [turn1, turn1]
    assert all(n <= length - turn1 for length, n in runs[1::2]), runs
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold] and warm[1].identical
    with pytest.raises(ValueError, match="warm history"):
        run_benchmark(bench, [prompt], [Config("hf", "hf")], SamplingParams(), max_new_tokens=6, warmup=0,
                      warm_history=True)


def test_cli_bench_second_turns(pair_dirs, tmp_path, capsys):
    target, draft = pair_dirs
    mt = tmp_path / "mt.jsonl"
    mt.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": turns}) for i, (c, turns) in
                            enumerate([("writing", ["a", "b"]), ("coding", ["c"]), ("math", ["d", "e"])])))
    code = main(["bench", "--target", target, "--draft", draft, "--dtype", "fp32", "--prompts", str(mt),
                 "--turn", "2", "--max-new-tokens", "6", "-k", "2", "--warmup", "0", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["turn"] == 2
    assert sorted({r["prompt_id"] for r in report["runs"]}) == ["0", "2"]
    assert main(["bench", "--target", target, "--draft", draft, "--turn", "0"]) == 2
    assert main(["bench", "--target", target, "--draft", draft, "--warm-history"]) == 2  # turn 1 has no history


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
    assert [p.name for p in paths] == ["speedup_by_category.png", "accepted_length_histogram.png",
                                       "acceptance_by_position.png", "tokens_over_time.png", "speedup_vs_k.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000


def test_identity_check_catches_planted_mismatch(pair_dirs, monkeypatch):
    real = harness._run_engine

    def planted(pipe, ids, params, max_new, k, warm=None, text=True):
        out = real(pipe, ids, params, max_new, k, warm, text)
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
    assert len(last["plots"]) == 5
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
    from verispec.apps.bench.harness import parse_draft_variant
    from verispec.names.errors import ModelError

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

    def recorded(pipe, ids, params, max_new, k, warm=None, text=True):
        out = real(pipe, ids, params, max_new, k, warm, text)
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

    def fake(bench, config, ids, params, max_new, warm=None):
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

# -- failures, interruptions, time to first token ------------------------------------------------------


def _cli_bench(pair_dirs, tmp_path, lines: list[str], *extra: str) -> list[str]:
    target, draft = pair_dirs
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(lines) + "\n")
    return ["bench", "--target", target, "--draft", draft, "--dtype", "fp32", "--prompts", str(prompts),
            "--max-new-tokens", "8", "-k", "2", "--warmup", "0", "--json-out", str(tmp_path / "r.json"), *extra]


def test_cli_bench_json_only_on_stdout_with_ttft(pair_dirs, tmp_path, capsys):
    """--json: stdout is the JSON report alone (the table goes to stderr), the same document as --json-out;
    plain and speculative runs report their time to first token and decode tokens/s, HF's loop does not."""
    assert main(_cli_bench(pair_dirs, tmp_path, ["hello", "world"], "--json", "--compare", "hf")) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert captured.out.count("\n") == 1 and "speedup" in captured.err and "TTFT" in captured.err
    assert report == json.loads((tmp_path / "r.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "r.json"]  # no temporary file left
    assert report["status"] == "complete" and report["failures"] == [] and report["caveats"] == []
    for run in report["runs"]:
        if run["config"] == "hf assisted":
            assert run["ttft"] is None and run["decode_tokens_per_second"] is None
        else:
            assert 0 < run["ttft"] < run["seconds"]
            assert run["first_tokens"] == 1 if run["config"] == "plain" else 1 <= run["first_tokens"] <= 3
            after_first = (run["new_tokens"] - run["first_tokens"]) / (run["seconds"] - run["ttft"])
            assert run["decode_tokens_per_second"] == pytest.approx(after_first)
    overall = {c["name"]: c["overall"] for c in report["configs"]}
    for name in ("plain", "model k=2"):
        ttfts = [r["ttft"] for r in report["runs"] if r["config"] == name]
        assert overall[name]["ttft_median"] == pytest.approx(sum(ttfts) / 2)  # two prompts: the mean
        assert overall[name]["decode_tokens_per_second"] > 0
    assert overall["hf assisted"]["ttft_median"] is None


def test_cli_bench_failed_prompt_is_a_row_and_the_run_goes_on(pair_dirs, tmp_path, capsys):
    """A prompt too long for the context fails in every configuration: failed rows with the reason, left out
    of the aggregates; the prompts after it are measured and the report is written."""
    assert main(_cli_bench(pair_dirs, tmp_path, ["hello", "x" * 5000, "world"])) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "r.json").read_text())
    failed = [r for r in report["runs"] if r["error"]]
    assert [(r["prompt_id"], r["config"]) for r in failed] == [("line-2", "plain"), ("line-2", "model k=2")]
    assert all(r["error"].startswith("ValueError: the prompt has ") and r["new_tokens"] == 0 for r in failed)
    assert report["failures"] == [f"{r['config']} line-2: {r['error']}" for r in failed]
    assert "FAILED" in captured.err and "failed: plain line-2: ValueError" in captured.err
    for config in report["configs"]:
        ok = [r for r in report["runs"] if r["config"] == config["name"] and not r["error"]]
        assert [r["prompt_id"] for r in ok] == ["line-1", "line-3"]
        overall = config["overall"]
        assert (overall["prompts"], overall["failed"]) == (3, 1)
        tokens = sum(r["new_tokens"] for r in ok)
        assert overall["new_tokens"] == tokens
        assert overall["tokens_per_second"] == pytest.approx(tokens / sum(r["seconds"] for r in ok))
    assert report["configs"][1]["overall"]["identity"]["checked"] == 2


def test_cli_bench_interrupted_keeps_what_was_measured(pair_dirs, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the third prompt: the report (JSON file, stdout, plots) holds the first two prompts' runs,
    says it was interrupted, and the exit status is 130."""
    real, calls = harness._one, []

    def interrupted(*args):
        calls.append(args[1].name)
        if len(calls) == 5:  # two configurations per prompt: the third prompt's first run
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(harness, "_one", interrupted)
    argv = _cli_bench(pair_dirs, tmp_path, ["one", "two", "three"], "--plot-dir", str(tmp_path / "plots"))
    assert main(argv) == 130
    captured = capsys.readouterr()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report == json.loads(captured.out.strip().splitlines()[-1])
    assert report["status"] == "interrupted"
    assert [(r["prompt_id"], r["config"]) for r in report["runs"]] == [
        ("line-1", "plain"), ("line-1", "model k=2"), ("line-2", "plain"), ("line-2", "model k=2")]
    assert report["configs"][1]["overall"]["speedup_median"] > 0
    assert len(report["plots"]) == 5 and all((tmp_path / "plots" / name).is_file() for name in (
        "speedup_by_category.png", "accepted_length_histogram.png", "acceptance_by_position.png",
        "tokens_over_time.png", "speedup_vs_k.png"))
    assert captured.err.strip().splitlines()[-1] == "verispec: interrupted: the report holds the 4 runs measured before"
    assert not list(tmp_path.glob(".r.json.*"))


def test_cli_bench_failure_keeps_what_was_measured(pair_dirs, tmp_path, capsys, monkeypatch):
    """An error that ends the benchmark (not one run's): the report holds what was measured, exit status 1,
    one line on stderr."""
    real, calls = harness._prompt_runs, []

    def broken(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("lost the device\ndetails")
        return real(*args)

    monkeypatch.setattr(harness, "_prompt_runs", broken)
    assert main(_cli_bench(pair_dirs, tmp_path, ["one", "two"])) == 1
    captured = capsys.readouterr()
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["status"], report["error"]) == ("failed", "RuntimeError: lost the device")
    assert [r["prompt_id"] for r in report["runs"]] == ["line-1", "line-1"]
    assert captured.err.strip().splitlines()[-1] == (
        "verispec: error: RuntimeError: lost the device (the report holds the 2 runs measured before)")


def test_failed_configuration_is_left_out_of_the_aggregates(pair_dirs, monkeypatch):
    """One configuration failing on one prompt: a failed Run for it (not retried in that prompt's later
    repeats), the others measured; its aggregate speedup pairs its prompts with the baseline's same prompts.
    A failed baseline leaves that prompt without speedups. TTFT pools as the mean over repeats."""
    bench = _tiny_bench(pair_dirs)
    prompts = select(load_prompts(None), per_category=1)[:3]
    configs = [Config("a", "spec", 1), Config("b", "spec", 2)]
    seconds = {("plain", 0): 1.0, ("plain", 1): 4.0, ("a", 0): 0.5, ("a", 1): 2.0, ("b", 0): 0.5}
    calls = []

    def fake(bench, config, ids, params, max_new, warm=None):
        i = ids[0]  # the prompt's index, see encode_prompt below
        calls.append((config.name, i))
        if (config.name, i) in (("b", 1), ("plain", 2)):
            raise ValueError(f"{config.name} cannot run prompt {i}\nmore")
        return dict(new_tokens=4, seconds=seconds.get((config.name, i), 1.0), token_ids=[1, 2, 3, 4],
                    ttft=0.1 * (i + 1), first_tokens=1)

    texts = [p.text for p in prompts]
    monkeypatch.setattr(harness, "_one", fake)
    monkeypatch.setattr(harness, "encode_prompt", lambda tokenizer, text, chat: [texts.index(text)])
    runs = run_benchmark(bench, prompts, configs, SamplingParams(), max_new_tokens=4, warmup=0, repeats=2)
    assert calls.count(("b", 1)) == 1 and calls.count(("a", 1)) == 2  # the failed one is not retried
    by = {(r.prompt_id, r.config): r for r in runs}
    p0, p1, p2 = (p.id for p in prompts)
    assert by[(p1, "b")].error == "ValueError: b cannot run prompt 1" and by[(p1, "b")].speedup is None
    assert by[(p1, "a")].ok and by[(p1, "a")].speedup == pytest.approx(2.0)
    assert by[(p2, "plain")].error and by[(p2, "a")].ok and by[(p2, "a")].speedup is None
    assert by[(p0, "a")].ttft == pytest.approx(0.1) and by[(p1, "a")].ttft == pytest.approx(0.2)
    assert by[(p0, "a")].decode_tokens_per_second == pytest.approx((8 - 2) / (2 * 0.5 - 2 * 0.1))
    report = build_report(runs, configs, {})
    b = report["configs"][2]["overall"]
    assert (b["prompts"], b["failed"], b["new_tokens"]) == (3, 1, 16)
    assert b["speedup_aggregate"] == pytest.approx(2.0)  # prompt 0 against plain on prompt 0 alone
    assert b["ttft_median"] == pytest.approx(0.2)  # prompts 0 and 2: 0.1 and 0.3
    assert report["configs"][0]["overall"]["failed"] == 1
    assert report["failures"] == [f"b {p1}: ValueError: b cannot run prompt 1",
                                  f"plain {p2}: ValueError: plain cannot run prompt 2"]


def test_cli_endpoint_bench_interrupted_keeps_what_was_measured(tmp_path, capsys, monkeypatch):
    """Against endpoints too: Ctrl-C keeps the runs measured so far, with their speedups, and exits 130."""
    import verispec.apps.bench.endpoint as endpoint

    def interrupted(endpoints, prompts, sampling, max_tokens, warmup, on_run):
        for name, seconds in (("a", 2.0), ("b", 1.0), ("a", 2.0)):  # prompt 1 on both, prompt 2 on a
            prompt = prompts[0] if len(calls) < 2 else prompts[1]
            calls.append(name)
            on_run(endpoint.EndpointRun(prompt.id, prompt.category, name, new_tokens=8, seconds=seconds, ttft=0.5))
        raise KeyboardInterrupt

    calls: list[str] = []
    monkeypatch.setattr(endpoint, "run_endpoints", interrupted)
    out = tmp_path / "r.json"
    rc = main(["bench", "--endpoint", "a=http://127.0.0.1:1/v1", "--endpoint", "b=http://127.0.0.1:2/v1",
               "--limit", "2", "--json", "--json-out", str(out)])
    assert rc == 130
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report == json.loads(out.read_text()) and report["status"] == "interrupted"
    assert [(r["config"], r["speedup"]) for r in report["runs"]] == [("a", 1.0), ("b", 2.0), ("a", 1.0)]
    assert captured.err.strip().splitlines()[-1] == "verispec: interrupted: the report holds the 3 runs measured before"


def test_cli_bench_refuses_an_unwritable_json_out_before_measuring(tmp_path, capsys):
    assert main(["bench", "--json-out", str(tmp_path / "missing" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: --json-out ") and "no such directory" in err and err.count("\n") == 1


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
    policies = {id(pipes[name].engine.k_policy) for name in ("model k=auto", "hybrid k=auto", "model[hf-int8] k=auto")}
    assert len(policies) == 3  # each adaptive configuration learns its own costs
    assert pipes["ngram k=3"].draft_model is None and pipes["hf assisted"] is bench.baseline
    assert all(r.identical for r in runs if r.config not in ("plain", "hf assisted"))
    with pytest.raises(ValueError, match="needs a draft model"):
        run_benchmark(Bench(TargetSpec(target, device="cpu", dtype="fp32"), None), prompts,
                      [Config("model k=2", "spec", 2)], SamplingParams(), max_new_tokens=4, warmup=0)


@pytest.mark.parametrize("text", [True, False])
def test_bench_times_the_text_unless_rounds_only(pair_dirs, monkeypatch, text):
    """By default every verispec run turns its tokens into text as a user gets them (detokenising, stop checks),
    plain and speculative alike; `--rounds-only` (Bench(text=False)) times the rounds alone."""
    from verispec.pipeline.text import TextAssembler

    pushed = []
    real = TextAssembler.push
    monkeypatch.setattr(TextAssembler, "push", lambda self, tokens: pushed.append(len(tokens)) or real(self, tokens))
    target, draft = pair_dirs
    bench = Bench(TargetSpec(target, device="cpu", dtype="fp32"), DraftSpec("model", draft), text=text)
    prompts = select(load_prompts(None), per_category=1)[:1]
    runs = run_benchmark(bench, prompts, [Config("verispec k=2", "spec", 2)], SamplingParams(), max_new_tokens=6,
                         warmup=0)
    tokens = sum(r.new_tokens for r in runs)
    assert sum(pushed) == (tokens if text else 0) and tokens == 12


@pytest.mark.parametrize("backend, target, drafters, k, want", [
    ("llamacpp", "mine", None, None, ("suffix", "auto", None)),  # what generate runs there
    ("llamacpp", None, None, None, ("hybrid-suffix", "auto", "smollm2-135m-instruct")),  # the default target's pair
    ("llamacpp", None, "hybrid-suffix", None, ("hybrid-suffix", "auto", None)),  # named: the catalog's draft
    ("hf", "mine", None, None, ("model", "4", None)),
    ("hf", None, None, None, ("model", "4", None)),
    ("llamacpp", "mine", "ngram", None, ("ngram", "auto", None)),  # another drafter: that backend's default k
    ("hf", "mine", "ngram", None, ("ngram", "4", None)),
    ("llamacpp", "mine", None, "2", ("suffix", "2", None)),
])
def test_bench_measures_what_generate_runs_unless_told(monkeypatch, pair_dirs, tmp_path, backend, target, drafters,
                                                       k, want):
    import argparse

    import verispec.assembly.resolve as resolve
    from verispec.apps.cli.bench import _generate_defaults

    monkeypatch.setattr(resolve, "resolve_target_backend", lambda spec: (backend, "asked"))
    monkeypatch.setattr(resolve, "installed", lambda name: tmp_path)  # the default models, as if pulled
    args = argparse.Namespace(drafters=drafters, num_draft_tokens=k, draft_backend="auto",
                              target=pair_dirs[0] if target == "mine" else target, draft=None, pull=False,
                              backend="auto", device="cpu", dtype="fp32", ctx_size=None, exact_kernels=False)
    got_drafters, got_k, got_draft, note = _generate_defaults(args)
    assert (got_drafters, got_k, got_draft) == want and backend in note and f"-k {want[1]}" in note
    assert (f"--draft {want[2]}" in note) == (want[2] is not None)


@pytest.mark.parametrize("target, drafters, want", [
    ("mine", None, "6"),  # the backend's default drafter, unnamed: its own k
    ("mine", "suffix", "auto"),  # the same drafter named: default_k, as build decides
    (None, None, "6"),  # the default target's pair
])
def test_bench_takes_the_k_build_would(monkeypatch, pair_dirs, tmp_path, target, drafters, want):
    """Where DEFAULTS' k and default_k differ, `verispec bench` reports and measures the k build gives."""
    import argparse

    import verispec.assembly.resolve as resolve
    from verispec.apps.cli.bench import _generate_defaults
    from verispec.names.k import DEFAULTS

    monkeypatch.setitem(DEFAULTS, "llamacpp", dataclasses.replace(DEFAULTS["llamacpp"], k=6))
    monkeypatch.setattr(resolve, "resolve_target_backend", lambda spec: ("llamacpp", "asked"))
    monkeypatch.setattr(resolve, "installed", lambda name: tmp_path)
    args = argparse.Namespace(drafters=drafters, num_draft_tokens=None, draft_backend="auto",
                              target=pair_dirs[0] if target == "mine" else target, draft=None, pull=False,
                              backend="auto", device="cpu", dtype="fp32", ctx_size=None, exact_kernels=False)
    assert _generate_defaults(args)[1] == want


def test_builtin_infills_are_left_out_for_a_target_without_fim_tokens(pair_dirs, tmp_path, capsys):
    target, draft = pair_dirs
    code = main(["bench", "--target", target, "--draft", draft, "--dtype", "fp32", "--categories", "fim,qa",
                 "--max-new-tokens", "2", "--warmup", "0", "--json-out", str(tmp_path / "r.json")])
    assert code == 0 and "fill-in-the-middle prompts are left out" in capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    assert {r["category"] for r in report["runs"]} == {"qa"} and report["defaults"].startswith("--drafters model -k 4")


def test_bench_without_flags_loads_the_pairs_draft(monkeypatch, tmp_path):
    """`verispec bench` naming no model on llama.cpp measures the default target's own pair: its Bench drafts with
    the pair's draft model (not the catalog's default draft, which a named hybrid-suffix would take)."""
    from verispec.apps.bench import harness
    from verispec.assembly import resolve
    from verispec.names.k import DEFAULTS

    built = []

    def fake_bench(target, draft, **_):
        built.append(draft)
        raise KeyboardInterrupt  # nothing loads

    monkeypatch.setattr(resolve, "resolve_target_backend", lambda spec: ("llamacpp", "asked"))
    monkeypatch.setattr(resolve, "installed", lambda name: tmp_path)
    monkeypatch.setattr(harness, "Bench", fake_bench)
    assert main(["bench", "--limit", "1"]) != 0
    assert built and built[0].model == DEFAULTS["llamacpp"].draft
