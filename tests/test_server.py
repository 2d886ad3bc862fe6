"""`verispec serve` with the official openai client, bad input, limits, disconnects, shutdown, load."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_util import ServerProcess
from tiny import save_tiny_pair

from verispec.cli import main

MODEL = "tiny"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(pair_dirs):
    target, draft = pair_dirs
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--max-prompt-tokens", "600", "--max-tokens-cap", "200", "--max-body-bytes", "20000"])
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    spec = r.model_extra["verispec"]
    assert {"acceptance_rate", "mean_accepted_length", "drafted", "accepted"} <= set(spec)


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0)
    assert isinstance(r.choices[0].text, str) and r.usage.completion_tokens <= 10


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    streamed = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == client.completions.create(
        model=MODEL, prompt="abc", max_tokens=8, temperature=0).choices[0].text


def test_stop_sequences(client):
    base = client.completions.create(model=MODEL, prompt="xyz", max_tokens=30, temperature=0).choices[0].text
    assert len(base) > 6
    stop = base[3:5]
    cut = client.completions.create(model=MODEL, prompt="xyz", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == base[: base.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="seeded", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(**kwargs, seed=11).choices[0].text
    b = client.completions.create(**kwargs, seed=11).choices[0].text
    c = client.completions.create(**kwargs, seed=12).choices[0].text
    assert a == b and a != c


def test_error_cases(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100000)
    cases = [
        (b"{not json", 400), (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -3}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "5"}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x" * 700}).encode(), 400),
        (json.dumps({"model": MODEL, "prompt": "x" * 30000}).encode(), 413),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(), 400),
        (json.dumps([1, 2]).encode(), 400),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400),
    ]
    for body, status in cases:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body[:60], r.text)
        assert "message" in r.json()["error"]
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                           "unknown_field": 1, "temperature": 0})
    assert ok.status_code == 200  # unknown fields are ignored


def test_greedy_equals_cli_generate(client, pair_dirs, capsys):
    target, draft = pair_dirs
    prompt = "Compare me"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                       temperature=0)
    assert main(["generate", "--target", target, "--draft", draft, "--dtype", "fp32", "--chat", "--prompt", prompt,
                 "--max-new-tokens", "24", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r.choices[0].message.content == cli["text"]
    assert r.usage.completion_tokens == len(cli["token_ids"])


def test_disconnect_mid_stream_frees_work(server, client):
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "long", "max_tokens": 200, "temperature": 0, "stream": True,
                            "num_draft_tokens": 1}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first chunk
    for _ in range(50):
        if httpx.get(server.url + "/health").json()["busy"] is False:
            break
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").json()["busy"] is False
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=3).usage.completion_tokens > 0


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data][0] == MODEL
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("verispec_requests_total", "verispec_generated_tokens_total", "verispec_drafted_tokens_total",
                 "verispec_accepted_tokens_total", "verispec_acceptance_length_bucket",
                 "verispec_time_per_output_token_seconds_bucket", "verispec_queue_length"):
        assert name in text, name


def test_api_key_queue_limit_and_graceful_shutdown(pair_dirs):
    target, draft = pair_dirs
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--api-key", "sekret", "--max-queue", "1"])
    try:
        body = {"model": MODEL, "prompt": "q", "max_tokens": 150, "temperature": 0, "num_draft_tokens": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
        auth = {"authorization": "Bearer sekret"}
        statuses = []

        def fire():
            statuses.append(httpx.post(srv.url + "/v1/completions", json=body, headers=auth, timeout=60).status_code)

        threads = [threading.Thread(target=fire) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        # SIGTERM while a stream is in flight: the server stops cleanly
        with httpx.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True}, headers=auth,
                          timeout=60) as r:
            next(r.iter_lines())
            assert srv.stop(timeout=40) == 0
    finally:
        srv.stop()


def test_load_script(pair_dirs, tmp_path):
    """The repo's load test: 1,000 requests at concurrency 16, 20% malformed, mid-stream disconnects."""
    target, draft = pair_dirs
    script = Path(__file__).resolve().parents[1] / "bench" / "load_test.py"
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(script), "--target", target, "--draft", draft, "--dtype", "fp32",
                           "--requests", "1000", "--concurrency", "16", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["requests"] == 1000 and report["server_crashed"] is False
    assert report["valid_5xx"] == 0 and report["valid_completed"] == report["valid_sent"]
    assert report["rss_growth_percent"] < 5.0
