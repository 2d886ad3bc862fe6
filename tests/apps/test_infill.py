"""Fill-in-the-middle through the server: /v1/completions' suffix and llama-server's /infill (its request
fields, its answer and stream shapes, n_cmpl, response_fields), greedy answers equal to plain decoding of the same
prompt, bad input refused, and an editor's cancel-and-resend reusing the cached prefix."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_util import ServerProcess
from tiny import fim_tokenizer, save_tiny_pair

import verispec
from verispec.pipeline.fim import Budget, FimLayout

MODEL = "tiny"
PREFIX = "def add(a, b):\n    total = a + b\n"
SUFFIX = "\n    return total\n\nprint(add(1, 2))\n"
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("fim"), tok=fim_tokenizer())


@pytest.fixture(scope="module")
def server(pair_dirs):
    target, draft = pair_dirs
    srv = ServerProcess(["--target", target, "--draft", draft, "--dtype", "fp32", "--served-model-name", MODEL,
                         "--max-batch", "4", "--max-prompt-tokens", "3000"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def plain(pair_dirs):
    return verispec.load(pair_dirs[0], drafter=None, dtype="fp32")


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def infill(server, **fields) -> dict:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 16} | fields
    r = post(server, "/infill", body)
    assert r.status_code == 200, r.text
    return r.json()


def plain_text(plain, ids: list[int], n: int) -> str:
    return plain.generate(ids, max_new_tokens=n).text


def test_suffix_completes_the_middle_as_plain_decoding_does(server, plain):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 16,
                                         "temperature": 0})
    assert r.status_code == 200, r.text
    ids = plain.encode_infill(PREFIX, SUFFIX)
    assert r.json()["choices"][0]["text"] == plain_text(plain, ids, 16)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # the same prompt written out with its markers, as Continue and Twinny send it, is the same request
    raw = post(server, "/v1/completions", {"model": MODEL, "prompt": f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}"
                                           "<|fim_middle|>", "max_tokens": 16, "temperature": 0})
    assert raw.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]


def test_infill_answers_in_llama_servers_shape(server, plain):
    body = infill(server, input_extra=EXTRA, prompt="    x = ")
    tok = plain.tokenizer
    ids = FimLayout.of(tok).encode(tok, PREFIX, SUFFIX, [("util.py", EXTRA[0]["text"])], "    x = ",
                                   Budget.llama_server(len(tok("    x = ").input_ids), None), header=True)
    assert body["content"] == plain_text(plain, ids, 16)
    assert body["tokens_evaluated"] == len(ids) and body["tokens_predicted"] == len(body["tokens"]) <= 16
    assert body["stop"] is True and body["stop_type"] in ("eos", "limit") and body["model"] == MODEL
    assert body["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>util.py\n")
    assert set(body["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
                                    "cache_n"}
    assert body["generation_settings"]["n_predict"] == 16 and "verispec" in body


def test_infill_streams_without_done(server):
    whole = infill(server)["content"]
    with httpx.stream("POST", server.url + "/infill", timeout=60, json={
            "input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 16, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["stop"] is True and events[-1]["content"] == "" and "timings" in events[-1]
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole
    assert sum(e["verispec"]["accepted"] + e["verispec"]["target"] for e in events[:-1]) == \
        events[-1]["tokens_predicted"]


def test_several_completions_and_response_fields(server):
    greedy = post(server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0,
                                      "n_predict": 8, "n_cmpl": 3}).json()
    assert [b["index"] for b in greedy] == [0, 1, 2] and len({b["content"] for b in greedy}) == 1
    sampled = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "n_cmpl": 3, "seed": 7,
               "samplers": ["top_k", "top_p"], "top_k": 40, "top_p": 0.99,
               "response_fields": ["content", "timings/predicted_n", "missing/field"]}
    first, again = post(server, "/infill", sampled).json(), post(server, "/infill", sampled).json()
    assert first == again  # seeded: reproducible, each completion from its own seed
    assert len({b["content"] for b in first}) > 1
    assert set(first[0]) == {"content", "timings/predicted_n"}


def test_the_default_samplers_sample(server):
    """llama-server's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05."""
    texts = {post(server, "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8,
                                      "seed": seed}).json()["content"] for seed in range(4)}
    assert len(texts) > 1


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": SUFFIX}, "input_prefix"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "samplers": ["top_k", "mirostat_v9"]}, "samplers"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "grammar": "root ::= \"x\""}, "grammar"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"filename": "a"}]}, "input_extra.0.text"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"text": "x"}] * 65}, "input_extra"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 5000}, "n_predict"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True, "n_cmpl": 2}, "n_cmpl"),
    ({"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": "hot"}, "temperature"),
])
def test_bad_infill_requests_are_400s_naming_the_field(server, body, param):
    r = post(server, "/infill", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.parametrize("extra", [{"echo": True}, {"n": 2}])
def test_suffix_with_echo_or_several_choices_is_refused(server, extra):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4} | extra)
    assert r.status_code == 400 and r.json()["error"]["param"] in ("echo", "n")


def test_an_oversized_context_is_fitted(server):
    """As llama-server fits a prompt: the prefix keeps its last 1536 tokens, the suffix its first 510, the other
    files their last tokens within what the server's prompt limit (3000 here) leaves: the prompt is never one the
    server would refuse."""
    header = 2 + len("myproject\n") + len("filename\n")  # the byte tokenizer: a token per byte
    big = [{"filename": f"f{i}.py", "text": "x = 1\n" * 100} for i in range(16)]  # 9.6k tokens of context
    body = infill(server, input_prefix="p", input_suffix="s", input_extra=big, n_predict=4)
    assert body["tokens_evaluated"] == 3000 and body["prompt"].endswith(
        "<|file_sep|>filename\n<|fim_prefix|>p<|fim_suffix|>s<|fim_middle|>")
    long = infill(server, input_prefix="y = 2\n" * 1000, input_suffix="z = 3\n" * 1000, n_predict=4)
    assert long["tokens_evaluated"] == header + 3 + 1536 + 510


def test_cancel_and_resend_reuses_the_cached_prefix(server, plain):
    """An editor types on: the stale request is dropped mid-stream, the next one (a longer prefix) starts from
    the common prefix the cancelled one left in the cache, and answers as plain decoding does."""
    with httpx.stream("POST", server.url + "/infill", timeout=60, json={
            "input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0, "n_predict": 400, "stream": True,
            "ignore_eos": True}) as r:
        next(r.iter_lines())  # the first piece: the prompt is in the cache
    deadline = time.time() + 10
    while httpx.get(server.url + "/health").json()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["running"] == 0  # the stale row left
    body = infill(server, input_prefix=PREFIX + "    tot")
    tok = plain.tokenizer
    first = FimLayout.of(tok).encode(tok, PREFIX, SUFFIX, header=True)
    second = FimLayout.of(tok).encode(tok, PREFIX + "    tot", SUFFIX, header=True)
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert body["timings"]["cache_n"] >= shared - 1
    assert body["timings"]["prompt_n"] == len(second) - body["timings"]["cache_n"]
    assert body["content"] == plain_text(plain, second, 16)


def test_the_editor_plugins_requests_are_served(server):
    """llama.vim's and llama.vscode's /infill bodies as they send them (their sampler chain with the infill sampler,
    n_indent, t_max_predict_ms, response_fields, a cache-warming request with n_predict 0)."""
    vim = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "    ",
           "n_predict": 12, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
           "samplers": ["top_k", "top_p", "infill"],
           "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
           "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n",
                               "timings/predicted_ms", "truncated", "tokens_cached"]}
    r = post(server, "/infill", vim)
    assert r.status_code == 200, r.text
    assert set(r.json()) == set(vim["response_fields"]) and r.json()["timings/predicted_n"] <= 12
    vscode = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": "",
              "n_predict": 12, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 4,
              "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
              "t_max_predict_ms": 500}
    r = post(server, "/infill", vscode)
    assert r.status_code == 200 and [b["index"] for b in r.json()] == [0, 1, 2]
    warm = post(server, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": EXTRA, "prompt": "",
                                    "n_predict": 0, "samplers": [], "t_max_predict_ms": 1})
    assert warm.status_code == 200 and warm.json()["content"] == "" and warm.json()["tokens_predicted"] == 0
    no_top_k = post(server, "/infill", {**vscode, "samplers": ["top_p", "infill"]})
    assert no_top_k.status_code == 400 and "top_k" in no_top_k.json()["error"]["message"]
