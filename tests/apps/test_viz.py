"""Provenance made visible: library pieces, the server's streamed chunks and page, terminal colour."""

from __future__ import annotations

import io
import json
import re
import sys

import httpx
import openai
import pytest
from server_util import ServerProcess
from tiny import save_tiny_pair, text_pair

import verispec
from verispec.apps.cli import main
from verispec.pipeline.provenance import DRAFT, TARGET
from verispec.pipeline.text import REPLACEMENT

PROMPT = "The quick brown fox"
MODEL, KEY = "tiny", "viz-key"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def models():
    return text_pair()


@pytest.fixture(scope="module")
def pipe(models):
    target, draft, tok = models
    return verispec.load(target, draft, tokenizer=tok, k=3)


def _decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _engine_sources(pipe, max_new_tokens: int) -> list[str]:
    """Per generated token, DRAFT or TARGET, straight from the engine's committed chunks."""
    rounds = pipe.stream(pipe.encode(PROMPT), max_new_tokens=max_new_tokens).rounds(text=False)
    return [source for chunk, _ in rounds for source in [DRAFT] * chunk.accepted + [TARGET] * chunk.target]


def _check_pieces(pieces, result) -> None:
    assert sum(p.tokens for p in pieces) == len(result.token_ids)
    assert sum(p.accepted for p in pieces) == result.stats.accepted
    assert "".join(p.text for p in pieces) == result.text
    for p in pieces:
        assert len(p.spans) == p.tokens and "".join(text for text, _ in p.spans) == p.text
        assert sum(source == DRAFT for _, source in p.spans) == p.accepted


def test_pieces_carry_each_tokens_provenance_and_text(pipe, models):
    """The pieces' counts add up to the result's; their spans, one per token in order, carry the engine's
    own provenance and each token's text (the decoded prefix grows by exactly that text)."""
    tok = models[2]
    stream = pipe.stream(PROMPT, max_new_tokens=40)
    pieces = list(stream.pieces())
    result = stream.result
    _check_pieces(pieces, result)
    assert 0 < result.stats.accepted < len(result.token_ids)  # both kinds present: the test can tell them apart
    spans = [span for p in pieces for span in p.spans]
    assert [source for _, source in spans] == _engine_sources(pipe, 40)
    shown = ""
    for i, (text, _) in enumerate(spans[:-1]):
        shown += text
        assert shown == _decode(tok, result.token_ids[: i + 1]).rstrip(REPLACEMENT), i
    assert [p.text for p in pieces if p.text] == list(pipe.stream(PROMPT, max_new_tokens=40))  # same pieces as text


def test_stop_string_held_back_text_keeps_its_counts(pipe):
    """A stop string holds text back while it might be starting and cuts the text at the stop: the tokens
    that held or completed it still come with a piece, so the counts add up to the generated tokens."""
    base = pipe.generate(PROMPT, max_new_tokens=40).text
    stop = base[12:15]
    assert stop and base.index(stop) > 0
    stream = pipe.stream(PROMPT, max_new_tokens=40, stop=stop)
    pieces = list(stream.pieces())
    result = stream.result
    assert result.finish_reason == "stop" and result.text == base[: base.index(stop)]
    _check_pieces(pieces, result)
    assert len(_decode(pipe.tokenizer, result.token_ids)) > len(result.text)  # some tokens' text was cut
    stats = result.stats  # the per-round accepted lengths describe what was emitted, the cut round included
    assert sum(stats.accepted_lengths) == stats.accepted and len(stats.accepted_lengths) == stats.rounds


def test_chatbot_pieces_add_up(pipe):
    from verispec.apps.chat import ChatBot

    bot = ChatBot(pipe, max_new_tokens=30)
    pieces = list(bot.stream_pieces("hello"))
    stats = bot.last_turn.stats
    assert sum(p.tokens for p in pieces) == stats.new_tokens and sum(p.accepted for p in pieces) == stats.accepted
    assert "".join(p.text for p in pieces) == bot.history[-1]["content"]


# -- the server --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("viz"))


@pytest.fixture(scope="module")
def server(pair_dirs):
    target, draft = pair_dirs
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--api-key", KEY, "-k", "3"])
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _check_chunks(chunks, content_of, usage) -> None:
    """Delta chunks: spans match the content and the counts; over the stream the counts add up to the
    completion tokens and the final stats' accepted."""
    deltas = [c for c in chunks if c.choices and not c.choices[0].finish_reason and c.model_extra.get("verispec")]
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    for c in deltas:
        v = c.model_extra["verispec"]
        assert "".join(text for text, _ in v["spans"]) == (content_of(c) or "")
        assert [s for _, s in v["spans"]].count("draft") == v["accepted"]
        assert [s for _, s in v["spans"]].count("target") == v["target"] and len(v["spans"]) == v["accepted"] + v["target"]
    accepted = sum(c.model_extra["verispec"]["accepted"] for c in deltas)
    target = sum(c.model_extra["verispec"]["target"] for c in deltas)
    assert accepted + target == usage.completion_tokens
    assert accepted == final.model_extra["verispec"]["accepted"] and 0 < accepted < usage.completion_tokens
    assert "acceptance_rate" in final.model_extra["verispec"]


def test_streamed_chat_chunks_carry_provenance(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == client.chat.completions.create(**kwargs).choices[0].message.content
    _check_chunks(chunks, lambda c: c.choices[0].delta.content, chunks[-1].usage)


def test_streamed_completion_with_stop_carries_provenance(client):
    kwargs = dict(model=MODEL, prompt="xyz", max_tokens=40, temperature=0)
    base = client.completions.create(**kwargs).choices[0].text
    stop = base[10:13]
    chunks = list(client.completions.create(**kwargs, stop=[stop], stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == base[: base.index(stop)]
    assert next(c for c in chunks if c.choices and c.choices[0].finish_reason).choices[0].finish_reason == "stop"
    _check_chunks(chunks, lambda c: c.choices[0].text, chunks[-1].usage)


def test_page_loads_without_a_key_the_api_needs_one(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text):
        assert httpx.get(server.url + asset).status_code == 200, asset
    assert re.search(r"https?://", page.text) is None  # nothing from elsewhere
    assert httpx.get(server.url + "/static/..%2fapp.py").status_code == 404  # only the page's own files
    assert httpx.get(server.url + "/v1/models").status_code == 401
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    offered = models["data"][0]["verispec"]
    assert offered["drafters"] == ["model", "none"] and offered["num_draft_tokens"] == 3 and offered["k"] == 3


# -- terminal colour ---------------------------------------------------------------------------------

def _generate(pair_dirs, capsys, *flags) -> str:
    target, draft = pair_dirs
    assert main(["generate", "--target", target, "--draft", draft, "--dtype", "fp32", "--prompt", PROMPT,
                 "--max-new-tokens", "24", "-k", "3", *flags]) == 0
    return capsys.readouterr().out


def test_generate_color_on_a_terminal_plain_when_piped(pair_dirs, capsys, monkeypatch):
    plain = _generate(pair_dirs, capsys)  # captured stdout is no terminal: plain text, as ever
    text = _generate(pair_dirs, capsys, "--json")
    assert plain == json.loads(text)["text"] + "\n" and not ANSI.search(plain)
    assert _generate(pair_dirs, capsys, "--no-color") == plain
    colored = _generate(pair_dirs, capsys, "--color")
    assert ANSI.search(colored) and ANSI.sub("", colored) == plain
    assert re.search(r"\x1b\[(?:\d+;)*4(?:;\d+)*m", colored)  # underlined: drafted-and-accepted
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert _generate(pair_dirs, capsys) == colored  # a terminal: colour by default
    assert _generate(pair_dirs, capsys, "--no-color") == plain


def test_chat_color_flag(pair_dirs, capsys, monkeypatch):
    target, draft = pair_dirs
    argv = ["chat", "--target", target, "--draft", draft, "--dtype", "fp32", "--max-new-tokens", "16", "-k", "3"]
    outs = {}
    for flag in ("--color", "--no-color"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
        assert main([*argv, flag]) == 0
        outs[flag] = capsys.readouterr().out
    assert ANSI.search(outs["--color"]) and not ANSI.search(outs["--no-color"])
    assert ANSI.sub("", outs["--color"]) == outs["--no-color"]


# -- benchmark plots ---------------------------------------------------------------------------------

def test_bench_report_has_per_round_data_for_the_plots(pair_dirs, tmp_path):
    """Accepted lengths per round add up to the accepted drafts and rounds; the timeline ends at each run's
    token count; k = auto's mean k counts its plain rounds; the five plots are written."""
    from verispec.apps.bench.harness import Bench, Config, run_benchmark
    from verispec.apps.bench.loader import load_prompts, select
    from verispec.apps.bench.report import PLOTS, build_report, write_plots
    from verispec.assembly.specs import DraftSpec, TargetSpec
    from verispec.core.sampling import SamplingParams

    target, draft = pair_dirs
    bench = Bench(TargetSpec(target, device="cpu", dtype="fp32"), DraftSpec("model", draft))
    configs = [Config("k=2", "spec", 2), Config("k=auto", "spec", "auto")]
    runs = run_benchmark(bench, select(load_prompts(None), per_category=1)[:2], configs, SamplingParams(),
                         max_new_tokens=12)
    report = build_report(runs, configs, {})
    for entry in report["configs"][1:]:
        o, mine = entry["overall"], [r for r in runs if r.config == entry["name"]]
        counts = o["accepted_length_counts"]
        assert sum(counts) == sum(r.rounds for r in mine) and sum(n * c for n, c in enumerate(counts)) == sum(
            r.accepted for r in mine)
        assert o["mean_k"] == pytest.approx(sum(r.drafted for r in mine) / sum(len(r.timeline) for r in mine))
    assert 0 < report["configs"][1]["overall"]["mean_k"] <= 2
    line = report["timeline"]
    for name, points in line["configs"].items():
        run = next(r for r in runs if r.config == name and r.prompt_id == line["prompt_id"])
        assert points[-1][1] == run.new_tokens and [t for t, _ in points] == sorted(t for t, _ in points)
    assert "timeline" not in report["runs"][0] and "accepted_lengths" not in report["runs"][0]
    json.dumps(report)
    assert [p.name for p in write_plots(report, tmp_path)] == list(PLOTS)
