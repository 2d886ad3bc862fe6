"""`verispec bench --endpoint`: the stream parsing and timing on canned events, then two real servers started
and stopped here on 127.0.0.1 (`verispec serve` on tiny models, llama-cpp-python's own OpenAI server on
SmolLM2's GGUF) benchmarked in one run; failed prompts as failed rows; bad endpoints as one-line errors."""

from __future__ import annotations

import http.server
import importlib.util
import json
import sys
import threading

import pytest
from server_util import CommandServer, ServerProcess, free_port
from tiny import save_tiny_pair

from verispec.apps.bench.endpoint import (
    Endpoint,
    EndpointRun,
    consume,
    parse_endpoint,
    parse_prometheus,
    request_for,
    set_speedups,
    sse_events,
)
from verispec.apps.bench.endpoint_report import summarize
from verispec.apps.bench.loader import Prompt
from verispec.apps.cli import main

SMOLLM = "smollm2-135m-instruct"


def _ticks(*times: float):
    it = iter(times)
    return lambda: next(it)


# -- canned ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, name, url", [
    ("http://127.0.0.1:8000", "127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("http://h:1/v1/", "h:1", "http://h:1/v1"),
    ("llama=http://h:2", "llama", "http://h:2/v1"),
])
def test_parse_endpoint(text, name, url):
    e = parse_endpoint(text)
    assert (e.name, e.base_url, e.root) == (name, url, url[:-3])


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "ftp://h/v1", "x=nothing"])
def test_parse_endpoint_refuses_non_http(bad):
    with pytest.raises(ValueError, match="http"):
        parse_endpoint(bad)


def test_request_for_chat_and_completion():
    path, body = request_for(Prompt("a", "c", "hi", True), "m", {"temperature": 0.0}, 8)
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 8
    path, body = request_for(Prompt("b", "humaneval", "def f():", False), "m", {}, 8)
    assert path == "/v1/completions" and body["prompt"] == "def f():"
    _, body = request_for(Prompt("c", "writing", "again", True, ("hi",), ("hello",)), "m", {}, 8)
    assert body["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                {"role": "user", "content": "again"}]


def _chunk(text=None, finish=None, usage=None, **extra):
    delta = {} if text is None else {"content": text}
    event = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    if usage is not None:
        event = {"choices": [], "usage": usage, **extra}
    return "data: " + json.dumps(event)


def test_consume_times_first_token_and_reads_usage_and_extension():
    lines = [_chunk(""), _chunk("Hel"), "", _chunk("lo"), _chunk(None, "stop"),
             _chunk(usage={"prompt_tokens": 5, "completion_tokens": 3},
                    verispec={"drafted": 8, "accepted": 6, "rounds": 2}), "data: [DONE]", _chunk("ignored")]
    run = EndpointRun("p", "c", "e")
    consume(sse_events(lines), run, t0=10.0, clock=_ticks(10.5, 12.0))  # first content at 10.5, end at 12
    assert (run.text, run.ttft, run.seconds, run.new_tokens, run.prompt_tokens) == ("Hello", 0.5, 2.0, 3, 5)
    assert (run.usage, run.finish_reason, run.drafted, run.accepted, run.rounds) == ("server", "stop", 8, 6, 2)
    assert run.tokens_per_second == 1.5
    assert run.decode_tokens_per_second == 2 / 1.5


def test_consume_counts_deltas_without_usage_and_completions_text():
    lines = ["data: " + json.dumps({"choices": [{"text": t, "finish_reason": None}]}) for t in ("a", "b", "c")]
    run = EndpointRun("p", "c", "e")
    consume(sse_events(lines), run, t0=0.0, clock=_ticks(0.1, 1.0))
    assert (run.usage, run.new_tokens, run.text) == ("counted", 3, "abc")


def test_stream_errors_are_reported():
    with pytest.raises(RuntimeError, match="server error: boom"):
        consume(sse_events(['data: {"error": {"message": "boom"}}']), EndpointRun("p", "c", "e"), 0.0, _ticks(1.0))
    with pytest.raises(RuntimeError, match="not an OpenAI stream"):
        list(sse_events(["data: <html>"]))


def test_parse_prometheus_sums_label_sets():
    text = ("# HELP x\nvllm:spec_decode_num_draft_tokens_total{engine=\"0\"} 30\n"
            "vllm:spec_decode_num_draft_tokens_total{engine=\"1\"} 10\n"
            "vllm:spec_decode_num_accepted_tokens_total{engine=\"0\"} 12.0\nother_total 5\n")
    found = parse_prometheus(text, {"vllm:spec_decode_num_draft_tokens_total": "drafted",
                                    "vllm:spec_decode_num_accepted_tokens_total": "accepted"})
    assert found == {"drafted": 40.0, "accepted": 12.0}


def test_summary_pools_and_compares_with_the_baseline():
    runs = [EndpointRun("1", "c", "base", new_tokens=10, seconds=2.0, ttft=0.2),
            EndpointRun("1", "c", "fast", new_tokens=10, seconds=1.0, ttft=0.1, drafted=8, accepted=4, rounds=2),
            EndpointRun("2", "c", "base", new_tokens=20, seconds=2.0, ttft=0.4),
            EndpointRun("2", "c", "fast", error="HTTP 500: no")]
    set_speedups(runs, "base")
    fast = summarize(runs, "fast")
    assert (fast["prompts"], fast["failed"], fast["new_tokens"], fast["tokens_per_second"]) == (2, 1, 10, 10.0)
    assert fast["speedup_median"] == 2.0 and fast["acceptance_rate"] == 0.5 and fast["mean_accepted_length"] == 3.0
    base = summarize(runs, "base")
    assert base["tokens_per_second"] == 7.5 and base["ttft_median"] == pytest.approx(0.3)
    assert base["decode_tokens_per_second"] == pytest.approx(28 / 3.4)


def test_endpoint_validation():
    with pytest.raises(ValueError, match="name"):
        Endpoint("", "http://h/v1")


# -- bad input: one line, non-zero ---------------------------------------------------------------------

def _bench(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["bench", "--limit", "2", "--max-new-tokens", "8", "--warmup", "0", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_unreachable_endpoint_is_one_line_error(capsys):
    rc, out, err = _bench(["--endpoint", f"http://127.0.0.1:{free_port()}"], capsys)
    assert rc == 2 and out == ""
    assert err.startswith("verispec: error:") and "cannot reach" in err and err.count("\n") == 1


def test_non_openai_server_is_one_line_error(capsys):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"<html>nothing here</html>")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, _, err = _bench(["--endpoint", f"http://127.0.0.1:{server.server_address[1]}"], capsys)
    finally:
        server.shutdown()
    assert rc == 2 and "not an OpenAI-compatible server" in err and err.count("\n") == 1


def test_local_only_flags_are_refused(capsys):
    rc, _, err = _bench(["--endpoint", "http://127.0.0.1:1", "--top-k", "5"], capsys)
    assert rc == 2 and "--top-k" in err


# -- two real servers --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def verispec_server(tmp_path_factory):
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("endpoint"))
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--device", "cpu",
                         "--max-prompt-tokens", "200", "-k", "3"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llama_server():
    from verispec.catalog import installed

    root = installed(SMOLLM)
    if root is None:
        pytest.fail(f"{SMOLLM} is not installed; run `make setup` (verispec models pull {SMOLLM})")
    missing = [m for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"llama-cpp-python's server needs {', '.join(missing)}: pip install -e '.[test,llamacpp]'")
    srv = CommandServer([sys.executable, "-m", "llama_cpp.server", "--model", str(root / "model.gguf"),
                         "--host", "127.0.0.1", "--port", "{port}", "--n_ctx", "1024", "--n_threads", "1",
                         "--verbose", "false"])
    yield srv
    srv.stop()


@pytest.mark.integration
def test_bench_two_real_servers_in_one_run(verispec_server, llama_server, tmp_path, capsys):
    out_file = tmp_path / "report.json"
    rc, out, _ = _bench(["--endpoint", f"verispec={verispec_server.url}/v1", "--endpoint",
                         f"llama-cpp-python={llama_server.url}", "--json-out", str(out_file), "--warmup", "1"], capsys)
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report == json.loads(out_file.read_text())
    assert "verispec bench: endpoints" in out and "llama-cpp-python" in out
    assert report["baseline"] == "verispec" and report["failures"] == []
    configs = {c["name"]: c for c in report["configs"]}
    assert set(configs) == {"verispec", "llama-cpp-python"}
    runs = report["runs"]
    assert len(runs) == 4 and {r["prompt_id"] for r in runs if r["config"] == "verispec"} == {
        r["prompt_id"] for r in runs if r["config"] == "llama-cpp-python"}
    for r in runs:
        assert 0 < r["new_tokens"] <= 8 and 0 < r["ttft"] <= r["seconds"]
    mine = [r for r in runs if r["config"] == "verispec"]
    assert all(r["usage"] == "server" and r["drafted"] > 0 for r in mine)  # verispec's extension
    assert 0.0 <= configs["verispec"]["overall"]["acceptance_rate"] <= 1.0
    assert all(r["speedup"] == 1.0 for r in mine)  # the baseline against itself
    assert configs["llama-cpp-python"]["overall"]["speedup_median"] > 0


@pytest.mark.integration
def test_a_failed_prompt_is_a_failed_row_and_the_run_goes_on(verispec_server, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short prompt\n" + "far too long " * 40 + "\n")  # > --max-prompt-tokens 200 bytes
    rc, out, err = _bench(["--endpoint", f"{verispec_server.url}/v1", "--prompts", str(prompts)], capsys)
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    ok, failed = report["runs"]
    assert ok["error"] is None and ok["new_tokens"] > 0
    assert failed["error"].startswith("EndpointError: HTTP 400") and "\n" not in failed["error"]
    assert report["configs"][0]["overall"]["failed"] == 1 and "FAILED" in err


@pytest.mark.integration
def test_second_turns_carry_the_first_answer(verispec_server, tmp_path, capsys):
    """With --turn 2 the baseline endpoint answers turn 1 first, and every endpoint gets the whole conversation."""
    first, second = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    first.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Again, louder."]}) + "\n")
    second.write_text(json.dumps({"question_id": 1, "category": "writing",
                                  "turns": ["Say hello.", "Again, louder."]}) + "\n")
    prompt_tokens = []
    for path, turn in ((first, "1"), (second, "2")):
        rc, out, _ = _bench(["--endpoint", f"{verispec_server.url}/v1", "--prompts", str(path), "--turn", turn], capsys)
        assert rc == 0
        report = json.loads(out.strip().splitlines()[-1])
        (run,) = report["runs"]
        assert run["error"] is None and report["turn"] == int(turn)
        prompt_tokens.append(run["prompt_tokens"])
    assert prompt_tokens[1] > prompt_tokens[0] + len("Say hello.")  # byte tokenizer: turn 1 and its answer too


def test_infills_go_to_llama_servers_infill_with_every_option_set():
    prompt = Prompt("f", "fim", "def f(x):\n", False, suffix="\n    return y\n", files=(("u.py", "U"),))
    path, body = request_for(prompt, "m", {"temperature": 0.0, "top_p": 1.0, "stop": ["\n\n"]}, 32)
    assert path == "/infill" and body["stream"] is True and body["n_predict"] == 32
    assert (body["input_prefix"], body["input_suffix"], body["input_extra"]) == (
        "def f(x):\n", "\n    return y\n", [{"filename": "u.py", "text": "U"}])
    # llama-server's own defaults (top_k 40, min_p 0.05) must not apply: every option is sent, off where unset
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"], body["repeat_penalty"],
            body["seed"], body["stop"]) == (0.0, 0, 1.0, 0.0, 1.0, -1, ["\n\n"])


def test_consume_reads_llama_servers_own_stream():
    lines = ["data: " + json.dumps({"content": c, "stop": False, "tokens_predicted": i + 1})
             for i, c in enumerate(("    y", " = x"))]
    lines.append("data: " + json.dumps({"content": "", "stop": True, "tokens_predicted": 5, "tokens_evaluated": 40,
                                        "stop_type": "eos", "timings": {"draft_n": 6, "draft_n_accepted": 4}}))
    run = EndpointRun("p", "c", "e")
    consume(sse_events(lines), run, t0=0.0, clock=_ticks(0.2, 1.0))  # no [DONE]: the stream's end ends it
    assert (run.text, run.new_tokens, run.prompt_tokens, run.finish_reason) == ("    y = x", 5, 40, "stop")
    assert (run.usage, run.drafted, run.accepted, run.ttft) == ("server", 6, 4, 0.2)
