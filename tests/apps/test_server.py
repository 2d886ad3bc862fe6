"""`verispec serve` with the official openai client, bad input, limits, disconnects, shutdown, load."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pydantic
import pytest
from server_util import ServerProcess, metric
from tiny import save_tiny_pair

from verispec.apps.cli import main

MODEL = "tiny"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(pair_dirs):
    target, draft = pair_dirs
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--max-prompt-tokens", "600", "--max-tokens-cap", "4000", "--max-body-bytes", "20000"])
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
        (json.dumps({"model": MODEL, "prompt": "x", "n": 17}).encode(), 400),
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


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)
    member: bool


def test_structured_output(client, server):
    """The openai SDK's parse with a pydantic model (a strict json_schema response_format), streamed too; json_object;
    vLLM's guided_regex and guided_choice: every answer matches (the tiny model writes random bytes, so only the
    grammar makes them match); greedy answers the same with and without speculation. Bad schemas, regexes and two
    constraints at once: a 400 naming the field."""
    messages = [{"role": "user", "content": "who?"}]
    for seed in range(3):
        parsed = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Person,
                                               max_tokens=120, temperature=1.0, seed=seed)
        assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Person)
    greedy = dict(model=MODEL, messages=messages, max_tokens=120, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                                          "schema": Person.model_json_schema()}})
    spec = client.chat.completions.create(**greedy).choices[0].message.content
    plain = client.chat.completions.create(**greedy, extra_body={"drafter": "none"}).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**greedy, stream=True)
                       if c.choices)
    assert spec == plain == streamed and Person.model_validate_json(spec)
    anything = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                              response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:
        assert anything.choices[0].message.content.startswith("{")
    date = client.completions.create(model=MODEL, prompt="when?", max_tokens=20, temperature=1.0, seed=1,
                                     extra_body={"guided_regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}).choices[0]
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text) and date.finish_reason == "stop"
    pick = client.completions.create(model=MODEL, prompt="pick", max_tokens=20, temperature=0,
                                     extra_body={"guided_choice": ["red", "green", "blue"]}).choices[0]
    assert pick.text in ("red", "green", "blue")
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format"),
           ({"guided_regex": "(unclosed"}, "guided_regex"),
           ({"guided_regex": "a", "guided_choice": ["a"]}, "response_format"),
           ({"response_format": {"type": "json_schema"}}, "response_format"),
           ({"guided_grammar": "start: undefined_rule"}, "guided_grammar")]
    for extra, param in bad:
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None  # still up


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 8},
                                               "unit": {"enum": ["C", "F"]}},
                                               "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
             "required": ["zone"], "additionalProperties": False}}}]


def _check_call(call):
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and len(arguments["city"]) <= 8 and arguments["unit"] in "CF"
    else:
        assert call.function.name == "get_time" and set(arguments) == {"zone"} and -12 <= arguments["zone"] <= 14
    assert call.id.startswith("call_") and call.type == "function"


def test_tool_calls(client, server):
    """tool_choice required and named: the calls parse and match their function's parameters (the grammar makes the
    tiny model's random bytes into calls), in message.tool_calls with finish_reason tool_calls; streamed as
    delta.tool_calls, the same calls as not streamed; with and without speculation alike. A conversation with calls
    and tool results in its history renders; auto answers; a choice naming no given tool is a 400."""
    messages = [{"role": "user", "content": "weather?"}]
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=1000, temperature=1.0, seed=seed, parallel_tool_calls=seed > 0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            _check_call(call)
    named = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = client.chat.completions.create(**named).choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    _check_call(calls[0])
    plain = client.chat.completions.create(**named, extra_body={"drafter": "none"}).choices[0].message.tool_calls
    assert plain[0].function.arguments == calls[0].function.arguments
    streamed, finish = {}, None
    for c in client.chat.completions.create(**named, stream=True):
        if c.choices and c.choices[0].delta.tool_calls:
            for d in c.choices[0].delta.tool_calls:
                streamed.setdefault(d.index, {"name": "", "arguments": ""})
                streamed[d.index]["name"] += d.function.name or ""
                streamed[d.index]["arguments"] += d.function.arguments or ""
        if c.choices and c.choices[0].finish_reason:
            finish = c.choices[0].finish_reason
    assert streamed == {0: {"name": "get_time", "arguments": calls[0].function.arguments}} and finish == "tool_calls"
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 1}'}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "10:00"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS[1:], max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for body, param in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                         "tool_choice"), ({"tool_choice": "required"}, None)):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, **body})
        assert r.status_code == 400 and "tool" in r.json()["error"]["message"], r.text


def test_logit_bias(client):
    """A bias of 100 on one token makes every greedy token that one, with and without speculation; of two tokens
    biased so, -100 on the one chosen first leaves the other."""
    from tiny import byte_tokenizer

    ids = byte_tokenizer()
    kwargs = dict(model=MODEL, prompt="bias", max_tokens=6, temperature=0)
    forced = client.completions.create(**kwargs, logit_bias={"70": 100}).choices[0].text
    plain = client.completions.create(**kwargs, logit_bias={"70": 100}, extra_body={"drafter": "none"}).choices[0].text
    assert forced == plain and ids(forced, add_special_tokens=False).input_ids == [70] * 6
    two = {"70": 100, "71": 100}
    first = ids(client.completions.create(**kwargs, logit_bias=two).choices[0].text).input_ids[0]
    banned = client.completions.create(**kwargs, logit_bias=two | {str(first): -100}).choices[0].text
    assert first in (70, 71) and ids(banned).input_ids[0] == 141 - first


def test_penalties_logprobs_and_stop_token_ids(client, pair_dirs):
    """Penalised greedy output is the same with and without speculation and differs from unpenalised;
    logprobs come back in OpenAI's shapes; a stop token id ends generation right after it."""
    from transformers import AutoTokenizer

    kwargs = dict(model=MODEL, prompt="penalties", max_tokens=40, temperature=0)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    spec = client.completions.create(**kwargs, extra_body=penalties)
    plain = client.completions.create(**kwargs, extra_body=penalties | {"drafter": "none"})
    free = client.completions.create(**kwargs)
    assert spec.choices[0].text == plain.choices[0].text != free.choices[0].text
    lp = client.completions.create(**kwargs, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 40
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    tokens = lp.tokens  # the greedy completion's tokens, as text (byte tokens: one ASCII character each)
    char = next(t for t in tokens[3:] if len(t) == 1 and t.isascii() and t.isprintable())
    stop_id = AutoTokenizer.from_pretrained(pair_dirs[0])(char).input_ids[0]
    cut = client.completions.create(**kwargs, extra_body={"stop_token_ids": [stop_id]})
    assert cut.usage.completion_tokens == tokens.index(char) + 1 and cut.choices[0].finish_reason == "stop"
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True, "min_tokens": 40})
    assert full.usage.completion_tokens == 40


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


LONG = {"model": MODEL, "prompt": "long", "max_tokens": 4000, "temperature": 0, "num_draft_tokens": 1,
        "ignore_eos": True}


def _post_raw(url: str, body: dict) -> socket.socket:
    """Send a POST on a raw socket (so that the test decides when the connection closes)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _tokens(url: str) -> float:
    return metric(url, "verispec_generated_tokens_total")


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_cancels_running_request(server, stream):
    """A client that leaves mid-generation costs at most the round in flight: the generated-token counter
    stops within one round (k = 1: at most 2 tokens) of the disconnect, far short of max_tokens."""
    start = _tokens(server.url)
    late = metric(server.url, "verispec_generated_after_cancel_tokens_total")
    sock = _post_raw(server.url, LONG | {"stream": stream})
    assert _wait_for(lambda: _tokens(server.url) > start + 20)  # running, tokens counted as they come
    sock.close()
    at_close = _tokens(server.url)
    assert _wait_for(lambda: httpx.get(server.url + "/health").json()["busy"] is False, timeout=5)
    after = _tokens(server.url)
    time.sleep(0.3)
    assert _tokens(server.url) == after  # nothing keeps generating
    assert after - at_close <= 2 * 20, (at_close, after)  # a few rounds at most while /metrics was read
    assert after - start < 4000
    assert metric(server.url, "verispec_generated_after_cancel_tokens_total") - late <= 2  # one round, k = 1


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_frees_queued_request(server, stream):
    """A queued request whose client leaves (every batch slot is taken) frees its queue slot at once and
    never generates a token."""
    slots = httpx.get(server.url + "/v1/models").json()["data"][0]["verispec"]["max_batch"]
    running = [_post_raw(server.url, LONG | {"prompt": f"run {i}"}) for i in range(slots)]
    assert _wait_for(lambda: httpx.get(server.url + "/health").json()["running"] == slots)
    cancelled = metric(server.url, "verispec_cancelled_requests_total")
    queued = _post_raw(server.url, LONG | {"stream": stream, "prompt": "queued"})
    assert _wait_for(lambda: httpx.get(server.url + "/health").json()["queue_length"] == 1)
    queued.close()
    assert _wait_for(lambda: httpx.get(server.url + "/health").json()["queue_length"] == 0, timeout=3)
    assert httpx.get(server.url + "/health").json()["running"] == slots  # the running ones still run
    assert metric(server.url, "verispec_cancelled_requests_total") == cancelled + 1
    for sock in running:
        sock.close()
    assert _wait_for(lambda: httpx.get(server.url + "/health").json()["busy"] is False, timeout=5)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data][0] == MODEL
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("verispec_requests_total", "verispec_generated_tokens_total", "verispec_drafted_tokens_total",
                 "verispec_accepted_tokens_total", "verispec_acceptance_length_tokens_bucket",
                 "verispec_time_per_output_token_seconds_bucket", "verispec_num_requests_waiting",
                 "verispec_time_to_first_token_seconds_bucket", "verispec_e2e_request_latency_seconds_bucket",
                 "verispec_request_queue_time_seconds_bucket", "verispec_cancelled_requests_total"):
        assert name in text, name


def test_api_key_queue_limit_and_graceful_shutdown(pair_dirs):
    """The key from VERISPEC_API_KEY; a full queue answers 429 with Retry-After; SIGTERM answers the waiting
    requests 503 at once and the server exits 0 once the running one is gone."""
    target, draft = pair_dirs
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--max-queue", "2", "--max-tokens-cap", "4000", "--max-batch", "1"],
                        env={"VERISPEC_API_KEY": "sekret"})
    try:
        body = {"model": MODEL, "prompt": "q", "max_tokens": 100, "temperature": 0, "num_draft_tokens": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
        auth = {"authorization": "Bearer sekret"}
        replies = []

        def fire(payload, timeout=60):
            try:
                replies.append(httpx.post(srv.url + "/v1/completions", json=payload, headers=auth, timeout=timeout))
            except httpx.TimeoutException:
                replies.append(None)

        threads = [threading.Thread(target=fire, args=(body,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        statuses = [r.status_code for r in replies]
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        assert all(r.headers["retry-after"].isdigit() for r in replies if r.status_code == 429)
        replies.clear()
        with httpx.stream("POST", srv.url + "/v1/completions", json=LONG | {"stream": True}, headers=auth,
                          timeout=60) as r:
            lines = r.iter_lines()  # kept: a discarded iterator closes the connection
            next(lines)
            waiting = [threading.Thread(target=fire, args=(body, 10)) for _ in range(2)]
            for t in waiting:
                t.start()
            assert _wait_for(lambda: httpx.get(srv.url + "/health").json()["queue_length"] == 2)
            srv.proc.send_signal(signal.SIGTERM)
            for t in waiting:
                t.join()
            assert [r and r.status_code for r in replies] == [503, 503]
            assert replies[0].json()["error"]["message"] == "the server is shutting down"
        assert srv.proc.wait(timeout=30) == 0  # the stream's client left: the running job was cancelled
    finally:
        srv.stop()


def _in_process_app(target_dir: str, tokenizer=None, max_batch: int = 1):
    """The app over a plain (no draft) pipeline of the tiny target, for tests that patch its parts."""
    from tiny import byte_tokenizer
    from transformers import AutoModelForCausalLM

    import verispec
    from verispec.apps.server.app import ServerSettings, create_app

    model = AutoModelForCausalLM.from_pretrained(target_dir).float().eval()
    pipeline = verispec.load(model, tokenizer=tokenizer or byte_tokenizer(), drafter=None)
    return pipeline.engine, create_app(pipeline, ServerSettings(model_names=(MODEL,), max_batch=max_batch))


def _in_process_client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")


def test_a_draft_of_another_tokenizer_serves_batches(pair_dirs, tmp_path):
    """A draft with a SentencePiece vocabulary behind the server: /v1/models says what the pair shares, and
    concurrent greedy requests (decoded together) each get plain decoding's answer."""
    import asyncio

    from tiny import sentencepiece_tokenizer, tiny_qwen2

    import verispec
    from verispec.apps.server.app import ServerSettings, create_app

    target, _ = pair_dirs
    other = tmp_path / "sp-draft"
    tok = sentencepiece_tokenizer()
    tiny_qwen2(7, vocab_size=len(tok)).save_pretrained(other)
    tok.save_pretrained(other)
    pipe = verispec.load(target, draft=str(other), drafter="model", k=3, backend="hf", dtype="fp32", device="cpu")
    plain = verispec.load(target, drafter=None, backend="hf", dtype="fp32", device="cpu")
    prompts = ["hello", "the quick brown", "def f(x):", "abc"]
    want = [plain.generate(p, max_new_tokens=16).text for p in prompts]
    app = create_app(pipe, ServerSettings(model_names=(MODEL,), max_batch=4))

    async def run():
        async with app.router.lifespan_context(app), _in_process_client(app) as http:
            models = (await http.get("/v1/models")).json()["data"][0]["verispec"]
            body = [{"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0} for p in prompts]
            replies = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in body))
            return models, [r.json()["choices"][0]["text"] for r in replies]

    models, texts = asyncio.run(run())
    assert "tokens in common" in models["shared_vocab"] and models["max_batch"] == 4
    assert texts == want


@pytest.mark.parametrize("json_answer", [False, True])
def test_tokenisation_does_not_block_the_event_loop(pair_dirs, json_answer):
    """While a slow tokenisation runs (here 1 s a call), /health still answers at once; also for a JSON answer, whose
    prompt is tokenised again as lookup texts (on the tokenizing thread, the tokenizer's only user)."""
    import asyncio

    from tiny import byte_tokenizer

    tok = byte_tokenizer()

    class Slow:
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *args, **kwargs):
            time.sleep(1.0)
            return tok(*args, **kwargs)

    _, app = _in_process_app(pair_dirs[0], Slow())

    async def scenario():
        async with app.router.lifespan_context(app), _in_process_client(app) as client:
            body, path = {"model": MODEL, "prompt": "x", "max_tokens": 2}, "/v1/completions"
            if json_answer:  # a chat offering tools: its answer may be a call, in JSON
                body, path = {"model": MODEL, "messages": [{"role": "user", "content": "x\ny"}], "tools": TOOLS,
                              "max_tokens": 2}, "/v1/chat/completions"
            slow = asyncio.create_task(client.post(path, json=body))
            waits = []
            while not slow.done():  # the slow request tokenises its prompt (and its lookup texts) meanwhile
                t0 = time.perf_counter()
                await asyncio.sleep(0.1)  # a blocked event loop shows here too
                assert (await client.get("/health")).status_code == 200
                waits.append(time.perf_counter() - t0)
            answer = await slow
            assert answer.status_code == 200, answer.text
            return waits

    waits = asyncio.run(scenario())
    assert len(waits) >= 8 and max(waits) < 0.6  # 0.1 s of sleep: the tokenizer's seconds are off the loop


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_worker_is_reported(pair_dirs, monkeypatch):
    """A worker thread that dies: its running stream ends with an error event (no hang), /health says
    unhealthy (503), and new requests get 503."""
    import asyncio

    engine, app = _in_process_app(pair_dirs[0])

    def die(*args, **kwargs):
        raise SystemExit("the worker thread ends")

    monkeypatch.setattr(engine, "step", die)  # the worker runs every round through step

    async def scenario():
        async with app.router.lifespan_context(app), _in_process_client(app) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True, "temperature": 0}  # no EOS in 5
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=10)
            events = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
            for _ in range(100):  # the thread finishes dying after it answered its job
                health = await client.get("/health")
                if health.status_code != 200:
                    break
                await asyncio.sleep(0.05)
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
            r = await client.post("/v1/completions", json=body | {"stream": False})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_unavailable"

    asyncio.run(scenario())


def test_a_job_submitted_as_the_worker_dies_is_refused_not_stranded(monkeypatch):
    """submit checks that the worker is alive, then queues; if the thread finishes dying (its last act answers
    every waiting job) in between, the job must be refused, not left in a queue nobody reads."""
    import asyncio
    from types import SimpleNamespace

    from verispec.apps.server.worker import Job, ShuttingDown, Worker
    from verispec.decoding.request import Request

    gauge = SimpleNamespace(set=lambda value: None)
    pipeline = SimpleNamespace(slots=lambda max_batch: SimpleNamespace(size=1, free=1))
    worker = Worker(pipeline, max_queue=4, metrics=SimpleNamespace(waiting=gauge, running=gauge))
    worker.jobs.put(None)  # the thread leaves at once (as if it died), answering what waits
    worker.start()
    worker._thread.join(10)
    assert not worker.alive
    monkeypatch.setattr(Worker, "alive", property(lambda self: True))  # the check passed before it died
    monkeypatch.setattr(worker, "_stopping", False)
    loop = asyncio.new_event_loop()
    try:
        job = Job(Request(prompt_ids=[1], max_new_tokens=4, k=0), loop)
        with pytest.raises(ShuttingDown, match="stopped unexpectedly"):
            worker.submit(job)
        assert len(worker.jobs) == 0
    finally:
        loop.close()


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_failed_round_answers_its_jobs_and_serving_goes_on(pair_dirs, monkeypatch, max_batch):
    """A round that raises (alone or batched): its job gets an error event (no hang), the slots start afresh,
    /health stays ok and the next request is answered in full."""
    import asyncio

    _, app = _in_process_app(pair_dirs[0], max_batch=max_batch)
    slots = app.state.worker.slots
    assert slots.size == max_batch
    real, calls = slots.step, []

    def failing():  # this server's slots only: no other engine in the process can take the failing call
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real()

    monkeypatch.setattr(slots, "step", failing)

    async def scenario():
        async with app.router.lifespan_context(app), _in_process_client(app) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True, "temperature": 0}  # no EOS in 5
            r = await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=10)
            events = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert '"error"' in events[-2] and "boom" in events[-2] and events[-1] == "data: [DONE]", (calls, events)
            r = await asyncio.wait_for(client.post("/v1/completions", json=body | {"stream": False}), timeout=10)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["running"] == 0

    asyncio.run(scenario())


class _FakeSlot:
    done = False

    def push(self, chunk):
        return None

    def finish(self):
        from verispec.pipeline.completion import Completion

        return None, Completion("x", [5, 5, 5], "length")


class _FlakySlots:
    """One slot whose generation commits a token a round for three rounds; its first `cancel` raises;
    `on_round` runs inside each round (a client leaving meanwhile)."""

    size = 1

    def __init__(self):
        self.held, self.rounds, self.cancels, self.on_round = None, 0, 0, lambda: None

    @property
    def free(self):
        return 0 if self.held else 1

    def add(self, request):
        self.held, self.rounds = _FakeSlot(), 0
        return self.held

    def step(self):
        from verispec.decoding.request import Committed

        self.rounds += 1
        self.on_round()
        self.held.done = self.rounds == 3
        if self.held.done:
            held, self.held = self.held, None
            return [(held, Committed([5], 0))]
        return [(self.held, Committed([5], 0))]

    def cancel(self, slot):
        self.cancels += 1
        if self.cancels == 1:
            raise RuntimeError("cancel failed")
        self.held = None

    def abort(self):
        self.held = None


def test_a_failing_cancel_answers_its_job_and_the_worker_serves_on():
    """A cancel that raises is a lost round, not a dead worker: the job gets an error event, the next job runs to
    its end."""
    import asyncio
    from types import SimpleNamespace

    from verispec.apps.server.metrics import Metrics
    from verispec.apps.server.worker import Job, Worker
    from verispec.decoding.request import Request

    slots = _FlakySlots()
    worker = Worker(SimpleNamespace(slots=lambda max_batch: slots), max_queue=4, metrics=Metrics())

    async def scenario():
        loop = asyncio.get_running_loop()
        first, second = (Job(Request(prompt_ids=[1], max_new_tokens=3), loop) for _ in range(2))
        slots.on_round = first.cancelled.set  # the first job's client leaves during its first round
        worker.start()
        worker.submit(first)
        first_kind, first_message = await asyncio.wait_for(first.events.get(), 10)
        slots.on_round = lambda: None
        worker.submit(second)
        kinds = []
        while not kinds or kinds[-1] not in ("done", "error", "unavailable"):
            kinds.append((await asyncio.wait_for(second.events.get(), 10))[0])
        return first_kind, first_message, kinds

    try:
        first_kind, first_message, kinds = asyncio.run(scenario())
        assert first_kind == "error" and "cancel failed" in first_message
        assert kinds[-1] == "done" and worker.alive
    finally:
        worker.stop()


def test_load_script(pair_dirs, tmp_path):
    """The repo's load test, scaled down (bench/load_test.py runs 1,000): 150 requests at concurrency 16, 20%
    malformed, 10% dropped mid-way, a burst provoking 429s, 1,000 unknown paths, solo re-runs compared."""
    target, draft = pair_dirs
    script = Path(__file__).resolve().parents[2] / "bench" / "load_test.py"
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(script), "--target", target, "--draft", draft, "--dtype", "fp32",
                           "--requests", "150", "--concurrency", "16", "--solo-checks", "40", "--drop-max-tokens",
                           "300", "--timeout-s", "240", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=400)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, report
    assert report["requests"] == 150 and report["server_crashed"] is False and report["all_5xx"] == 0
    assert report["valid_completed"] == report["valid_sent"] > 0 and report["valid_error_events"] == 0
    assert report["malformed_4xx"] == report["malformed_sent"] == 30
    assert report["solo_greedy_identical"] == report["solo_greedy_compared"] > 0
    assert report["burst"]["429_with_retry_after"] > 0
    assert report["series_after_unknown_paths"] == report["series_before_unknown_paths"]
    assert report["cancelled_requests"] > 0 and report["rss_growth_percent"] < 5.0


def test_allowed_hosts_follow_the_bind_address():
    from verispec.apps.cli.serve import _allowed_hosts, _is_loopback
    from verispec.apps.server.guard import host_name

    assert _allowed_hosts("127.0.0.1", None) == ("127.0.0.1", "localhost", "::1")
    assert _allowed_hosts("0.0.0.0", None) == ("*",)
    assert _allowed_hosts("10.1.2.3", None) == ("10.1.2.3",)
    assert _allowed_hosts("127.0.0.1", "Example.com, [::1]") == ("example.com", "::1")
    assert _is_loopback("localhost") and _is_loopback("::1") and not _is_loopback("192.168.0.4")
    assert [host_name(h) for h in ("127.0.0.1:8000", "[::1]:8000", "LOCALHOST", "::1")] == [
        "127.0.0.1", "::1", "localhost", "::1"]


def test_concurrent_requests_share_rounds_and_stay_exact(server, client):
    """Eight concurrent requests (greedy with stops and different lengths, seeded sampling, streaming or not)
    and one that leaves, on a server that batches: each answer equals the same request sent alone, and requests did run together;
    a client that leaves mid-batch takes nothing from the others."""
    from concurrent.futures import ThreadPoolExecutor

    from verispec.apps.cli.serve import DEFAULT_MAX_BATCH

    slots = httpx.get(server.url + "/v1/models").json()["data"][0]["verispec"]["max_batch"]
    assert slots == DEFAULT_MAX_BATCH
    bodies = [dict(model=MODEL, prompt=f"request {i}: " + "ab" * i, max_tokens=8 + 5 * i, temperature=0,
                   extra_body={"num_draft_tokens": i % 4}, stop=["zz"] if i % 2 else None) for i in range(6)]
    bodies += [dict(model=MODEL, prompt="seeded", max_tokens=20, temperature=1.0, top_p=0.9, seed=s,
                    extra_body={"num_draft_tokens": 3}) for s in (5, 6)]

    def ask(body, stream=False):
        if not stream:
            return client.completions.create(**body).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)

    alone = [ask(b) for b in bodies]
    seen = []
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            seen.append(httpx.get(server.url + "/health").json()["running"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    leaver = _post_raw(server.url, LONG | {"stream": True, "prompt": "leaves"})
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(ask, bodies, [i % 2 == 0 for i in range(len(bodies))]))
    finally:
        leaver.close()
        watching.set()
        watcher.join()
    assert together == alone
    assert max(seen) >= 2, seen
    assert _wait_for(lambda: httpx.get(server.url + "/health").json()["busy"] is False, timeout=5)


def test_fill_in_the_middle_needs_fim_tokens(server):
    """The tiny pair's byte tokenizer has no fill-in-the-middle markers: both doors say so in a 400."""
    for path, body in (("/infill", {"input_prefix": "a", "input_suffix": "b"}),
                       ("/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "b"})):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "fim_not_supported", r.text
        assert "fill-in-the-middle" in r.json()["error"]["message"]


def test_several_choices(client):
    """n choices: seeded ones reproduce, differ from one another and each equals that seed alone (choice i is seed
    + i); greedy ones are the same; streamed chunks name their choice and add up to the same texts; usage counts
    every choice's tokens."""
    kwargs = dict(model=MODEL, prompt="choose", max_tokens=12, temperature=1.0, seed=40)
    r = client.completions.create(**kwargs, n=3)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert texts[1] == client.completions.create(**{**kwargs, "seed": 41}).choices[0].text
    assert r.usage.completion_tokens == sum(
        client.completions.create(**{**kwargs, "seed": 40 + i}).usage.completion_tokens for i in range(3))
    streamed = ["", "", ""]
    for c in client.completions.create(**kwargs, n=3, stream=True):
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    greedy = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                            max_tokens=8, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    long = dict(kwargs, prompt="a prompt the choices share, long enough to be computed once: " * 2)
    shared = client.completions.create(**long, n=3)  # the first choice feeds it, the others copy its cache
    assert [c.text for c in sorted(shared.choices, key=lambda c: c.index)] == [
        client.completions.create(**{**long, "seed": 40 + i}).choices[0].text for i in range(3)]
    again = client.completions.create(**long)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_json_answers_get_the_prompt_json_escaped_to_copy(pair_dirs, monkeypatch):
    """A chat that offers tools (auto or required) or asks for a JSON schema hands its drafter the messages' text
    as JSON strings write it (Request.lookup_texts: code's newlines and quotes escaped); a plain chat does not."""
    import asyncio

    from verispec.pipeline.text import json_string_texts

    engine, app = _in_process_app(pair_dirs[0])
    seen = []
    resolve = engine.resolve
    monkeypatch.setattr(engine, "resolve", lambda request: seen.append(request) or resolve(request))
    code = 'def f(x):\n    return "x"'
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": code}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    bodies = [{}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "required"}, {"response_format": schema}]

    async def scenario():
        async with app.router.lifespan_context(app), _in_process_client(app) as client:
            for body in bodies:
                r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                    "max_tokens": 2, **body})
                assert r.status_code == 200, r.text

    asyncio.run(scenario())
    escaped = json_string_texts(app.state.server.pipeline.tokenizer, [code])
    requests = list({id(r): r for r in seen}.values())  # each is resolved when checked and when admitted
    assert len(escaped) == 1 and [r.lookup_texts for r in requests] == [(), escaped, escaped, escaped]
