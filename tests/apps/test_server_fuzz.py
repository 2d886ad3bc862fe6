"""Malformed and hostile requests against a live `verispec serve` on 127.0.0.1: each gets its own 4xx in
OpenAI's error format ({"error": {"message", "type", "param", "code"}}), never a 5xx, and the server
answers normally afterwards."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_util import ServerProcess, metric, series_count
from tiny import save_tiny_pair

MODEL = "tiny"
KEY = "sekret"
N_CTX = 4096  # the tiny models' max_position_embeddings; the byte tokenizer makes one token per byte
BODY_LIMIT = 50_000
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("fuzz"))
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--api-key", KEY, "--max-queue", "1", "--max-tokens-cap", "4000",
                         "--max-body-bytes", str(BODY_LIMIT), "--max-batch", "1"])  # one runs, one waits
    yield srv
    srv.stop()


def completion(**fields) -> bytes:
    return json.dumps(COMPLETION | fields).encode()


def chat(**fields) -> bytes:
    return json.dumps(CHAT | fields).encode()


def without(base: dict, field: str) -> bytes:
    return json.dumps({k: v for k, v in base.items() if k != field}).encode()


C, CH = "/v1/completions", "/v1/chat/completions"
DIGITS = "9" * 5000
# (name, method, path, body, extra headers, expected status, expected code or None)
CASES = [
    ("bad_json", "POST", C, b"{not json", {}, 400, None),
    ("truncated_json", "POST", C, completion()[:-5], {}, 400, None),
    ("empty_body", "POST", C, b"", {}, 400, None),
    ("json_array", "POST", C, b"[1, 2]", {}, 400, None),
    ("json_string", "POST", C, b'"prompt"', {}, 400, None),
    ("json_null", "POST", C, b"null", {}, 400, None),
    ("invalid_utf8", "POST", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', {}, 400, None),
    ("5000_digit_max_tokens", "POST", C, completion()[:-1] + b', "max_tokens": ' + DIGITS.encode() + b"}", {}, 400, None),
    ("5000_digit_unknown_field", "POST", C, completion()[:-1] + b', "x": ' + DIGITS.encode() + b"}", {}, 400, None),
    ("nested_20k_deep", "POST", C, b"[" * 20_000 + b"]" * 20_000, {}, 400, None),
    ("nested_50_deep_field", "POST", C, completion()[:-1] + b', "x": ' + b"[" * 50 + b"]" * 50 + b"}", {}, 400, None),
    ("lone_surrogate_prompt", "POST", C, completion()[:-1] + b', "prompt": "a\\ud800b"}', {}, 400, None),
    ("lone_surrogate_chat", "POST", CH,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', {}, 400, None),
    ("seed_2_pow_64", "POST", C, completion(seed=2**64), {}, 400, None),
    ("seed_minus_2_pow_70", "POST", C, completion(seed=-(2**70)), {}, 400, None),
    ("max_tokens_negative", "POST", C, completion(max_tokens=-3), {}, 400, None),
    ("max_tokens_zero", "POST", C, completion(max_tokens=0), {}, 400, None),
    ("max_tokens_string", "POST", C, completion(max_tokens="5"), {}, 400, None),
    ("max_tokens_over_cap", "POST", C, completion(max_tokens=100_000), {}, 400, None),
    ("temperature_5", "POST", C, completion(temperature=5), {}, 400, None),
    ("temperature_nan", "POST", C, completion()[:-1] + b', "temperature": NaN}', {}, 400, None),
    ("temperature_infinity", "POST", C, completion()[:-1] + b', "temperature": Infinity}', {}, 400, None),
    ("top_p_zero", "POST", C, completion(top_p=0), {}, 400, None),
    ("presence_penalty_3", "POST", C, completion(presence_penalty=3), {}, 400, None),
    ("stream_string", "POST", C, completion(stream="yes"), {}, 400, None),
    ("missing_prompt", "POST", C, without(COMPLETION, "prompt"), {}, 400, None),
    ("missing_model", "POST", C, without(COMPLETION, "model"), {}, 400, None),
    ("unknown_model", "POST", C, completion(model="no-such-model"), {}, 404, "model_not_found"),
    ("empty_messages", "POST", CH, chat(messages=[]), {}, 400, None),
    ("bad_role", "POST", CH, chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400, None),
    ("image_part", "POST", CH, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), {}, 400, None),
    ("two_prompts", "POST", C, completion(prompt=["a", "b"]), {}, 400, None),
    ("n_17", "POST", C, completion(n=17), {}, 400, None),
    ("best_of_3", "POST", C, completion(best_of=3), {}, 400, "unsupported_parameter"),
    ("echo", "POST", C, completion(echo=True), {}, 400, "unsupported_parameter"),
    ("suffix_without_fim_tokens", "POST", C, completion(suffix="x"), {}, 400, "fim_not_supported"),
    ("logit_bias_key_not_an_id", "POST", C, completion(logit_bias={"x": 5}), {}, 400, None),
    ("logit_bias_value_500", "POST", C, completion(logit_bias={"1": 500}), {}, 400, None),
    ("logit_bias_id_out_of_vocab", "POST", C, completion(logit_bias={"99999": 5}), {}, 400, None),
    ("tool_choice_required_without_tools", "POST", CH, chat(tool_choice="required"), {}, 400, None),
    ("tool_choice_unknown_tool", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                  tool_choice={"type": "function", "function": {"name": "g"}}),
     {}, 400, None),
    ("tool_bad_name", "POST", CH, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), {}, 400, None),
    ("tool_bad_parameters", "POST", CH, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}}}], tool_choice="required"), {}, 400, None),
    ("functions_legacy", "POST", CH, chat(functions=[{"name": "f"}]), {}, 400, "unsupported_parameter"),
    ("response_format_unknown_type", "POST", CH, chat(response_format={"type": "yaml"}), {}, 400, None),
    ("json_schema_not_an_object", "POST", CH, chat(guided_json="[1, 2]"), {}, 400, None),
    ("json_schema_invalid", "POST", CH, chat(guided_json={"type": "no-such-type"}), {}, 400, None),
    ("regex_unclosed", "POST", C, completion(guided_regex="(a"), {}, 400, None),
    ("choice_empty", "POST", C, completion(guided_choice=[]), {}, 400, None),
    ("grammar_undefined_rule", "POST", C, completion(guided_grammar="start: nothing"), {}, 400, None),
    ("two_constraints", "POST", C, completion(guided_regex="a", guided_choice=["a"]), {}, 400, None),
    ("grammar_with_min_tokens", "POST", C, completion(guided_regex="a+", min_tokens=2), {}, 400, None),
    ("logprobs_streaming", "POST", C, completion(logprobs=1, stream=True), {}, 400, None),
    ("top_logprobs_without_logprobs", "POST", CH, chat(top_logprobs=2), {}, 400, None),
    ("completion_logprobs_6", "POST", C, completion(logprobs=6), {}, 400, None),
    ("too_many_stops", "POST", C, completion(stop=[f"s{i}" for i in range(33)]), {}, 400, None),
    ("stop_1000_chars", "POST", C, completion(stop="x" * 1000), {}, 400, None),
    ("stop_empty", "POST", C, completion(stop=""), {}, 400, None),
    ("stop_token_id_out_of_vocab", "POST", C, completion(stop_token_ids=[99999]), {}, 400, None),
    ("stop_token_id_negative", "POST", C, completion(stop_token_ids=[-1]), {}, 400, None),
    ("min_tokens_over_max", "POST", C, completion(min_tokens=10, max_tokens=4), {}, 400, None),
    ("drafter_not_served", "POST", C, completion(drafter="ngram"), {}, 400, None),
    ("num_draft_tokens_99", "POST", C, completion(num_draft_tokens=99), {}, 400, None),
    ("prompt_exactly_n_ctx", "POST", C, completion(prompt="a" * N_CTX), {}, 400, "context_length_exceeded"),
    ("prompt_over_n_ctx", "POST", C, completion(prompt="a" * (N_CTX + 900)), {}, 400, "context_length_exceeded"),
    ("prompt_plus_max_tokens_over_n_ctx", "POST", C, completion(prompt="a" * (N_CTX - 100), max_tokens=200), {}, 400,
     "context_length_exceeded"),
    ("body_over_limit", "POST", C, completion(prompt="a" * BODY_LIMIT), {}, 413, None),
    ("content_type_text_plain", "POST", C, completion(), {"content-type": "text/plain"}, 415, None),
    ("content_type_form", "POST", C, completion(), {"content-type": "application/x-www-form-urlencoded"}, 415, None),
    ("no_api_key", "POST", C, completion(), {"authorization": None}, 401, "invalid_api_key"),
    ("wrong_api_key", "POST", C, completion(), {"authorization": "Bearer nope"}, 401, "invalid_api_key"),
    ("non_ascii_api_key", "POST", C, completion(), {"authorization": "Bearer sekrét".encode()}, 401, "invalid_api_key"),
    ("foreign_host_header", "POST", C, completion(), {"host": "evil.example"}, 400, None),
    ("foreign_host_get_metrics", "GET", "/metrics", None, {"host": "rebound.example:8000"}, 400, None),
    ("unknown_path", "GET", "/random", None, {}, 404, None),
    ("unknown_v1_path", "POST", "/v1/embeddings", completion(), {}, 404, None),
    ("get_on_post_route", "GET", C, None, {}, 405, None),
    ("delete_models", "DELETE", "/v1/models", None, {}, 405, None),
    ("docs_closed", "GET", "/docs", None, {}, 404, None),
    ("openapi_closed", "GET", "/openapi.json", None, {}, 404, None),
]


def _send(url: str, method: str, path: str, body: bytes | None, extra: dict) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    for name, value in extra.items():
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    return httpx.request(method, url + path, content=body, headers=headers, timeout=30)


def _assert_openai_error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


@pytest.mark.parametrize("name,method,path,body,extra,status,code", CASES, ids=[c[0] for c in CASES])
def test_fuzz_case(server, name, method, path, body, extra, status, code):
    r = _send(server.url, method, path, body, extra)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    err = _assert_openai_error(r)
    if code is not None:
        assert err["code"] == code, err


def test_enough_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 40


def _raw_reply(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one response, read up to its Content-Length (the server may reset the connection
    afterwards, having left part of an over-long body unread)."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(65536)
    head, _, payload = reply.partition(b"\r\n\r\n")
    headers = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int({k.lower(): v for k, v in headers.items()}[b"content-length"])
    while len(payload) < length:
        payload += sock.recv(65536)
    return head, payload


def test_chunked_body_over_limit_is_refused_while_reading(server):
    """No Content-Length: the limit applies to the bytes as they arrive. The client sends 60 KB of a 50 KB
    limit and then stalls without ending the body: the 413 must come anyway, not after the whole body."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(15):
                sock.sendall(b"1000\r\n" + b" " * 4096 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):  # refused before all was sent: the answer is waiting
            pass
        head, payload = _raw_reply(sock)
    assert head.startswith(b"HTTP/1.1 413") and json.loads(payload)["error"]["message"]
    assert _send(server.url, "POST", C, completion(), {}).status_code == 200


def test_non_ascii_authorization_on_raw_socket(server):
    """A Latin-1 byte in the header (httpx would refuse to send it): 401 JSON, not a plain-text 500."""
    host, port = server.url.removeprefix("http://").split(":")
    body = completion()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xe9\xff\r\n"
                     b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\nConnection: close\r\n\r\n" + body)
        head, payload = _raw_reply(sock)
    assert head.startswith(b"HTTP/1.1 401") and json.loads(payload)["error"]["code"] == "invalid_api_key"


def test_unknown_paths_add_no_metric_series(server):
    httpx.get(f"{server.url}/random")  # the one series all unknown paths share now exists
    series_count(server.url)  # and the one of /metrics' own answers
    before = series_count(server.url)
    with httpx.Client() as client:
        for i in range(200):
            client.get(f"{server.url}/random-{i}/{i * 7}")
    assert series_count(server.url) == before
    assert metric(server.url, "verispec_requests_total", 'route="unmatched",status="404"') >= 200


def _in_system(url: str) -> int:
    health = httpx.get(url + "/health").json()
    return health["queue_length"] + health["busy"]


def test_queue_full_is_429_with_retry_after(server):
    """--max-queue 1: one running, one waiting, the third is refused with a Retry-After."""
    auth = {"authorization": f"Bearer {KEY}"}
    long = json.loads(completion(max_tokens=4000, ignore_eos=True, num_draft_tokens=1))
    results = []

    def fire(prompt):
        try:
            results.append(httpx.post(server.url + C, json=long | {"prompt": prompt}, headers=auth, timeout=3))
        except httpx.TimeoutException:  # the test leaves before these finish: the timeout disconnects them
            results.append(None)

    threads = [threading.Thread(target=fire, args=(p,)) for p in ("one", "two")]
    for n, t in enumerate(threads, 1):
        t.start()
        while _in_system(server.url) < n:
            pass
    r = httpx.post(server.url + C, json=long | {"prompt": "three"}, headers=auth)
    assert r.status_code == 429 and r.headers["retry-after"].isdigit()
    assert _assert_openai_error(r)["code"] == "server_busy"
    for t in threads:
        t.join()
    assert results == [None, None]


def test_requests_beyond_the_concurrency_limit_get_429_json(tmp_path_factory):
    """--limit-concurrency 2: two requests held open (bodies stalled mid-way) fill it; a third gets 429 in
    OpenAI's format with Retry-After (uvicorn's own limit, a plain-text 503, sits above as a backstop); once
    they go away the server serves again."""
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("limit"))
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--limit-concurrency", "2"])
    try:
        _fill_and_drain(srv)
    finally:
        srv.stop()


def _fill_and_drain(srv: ServerProcess) -> None:
    """Two stalled bodies fill a limit of 2: the next request gets 429; once they close, 200."""
    host, port = srv.url.removeprefix("http://").split(":")
    held = []
    try:
        for _ in range(2):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
            held.append(sock)
        deadline, r = time.time() + 10, None
        while time.time() < deadline:
            r = httpx.post(srv.url + C, json=COMPLETION)
            if r.status_code == 429:
                break
            time.sleep(0.1)
        assert r.status_code == 429 and r.headers["retry-after"].isdigit()
        assert _assert_openai_error(r)["code"] == "too_many_requests"
    finally:
        for sock in held:
            sock.close()
    deadline = time.time() + 10
    while (r := httpx.post(srv.url + C, json=COMPLETION)).status_code == 429 and time.time() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200


def test_server_still_serves(server):
    r = _send(server.url, "POST", C, completion(max_tokens=3), {})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    r = _send(server.url, "POST", CH, chat(max_tokens=3), {})
    assert r.status_code == 200
