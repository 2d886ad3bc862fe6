"""Many requests at once on the default backend (llama.cpp, the default target's Q4_K/Q6_K GGUF, whose kernels are
batch-invariant): each greedy request's tokens are bitwise those it gets alone, whatever arrives beside it and when,
whatever was cancelled before, and whatever the drafter remembers of earlier answers; through the library's slots
and through `verispec serve`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

import verispec
from verispec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.decoding.request import GenerationResult, Request
from verispec.names.k import DEFAULTS

pytestmark = pytest.mark.integration

QUESTIONS = ["Write a Python function that reverses a string.", "What is a closure? Answer in two sentences.",
             "List the first ten prime numbers.", "Write a haiku about autumn leaves.",
             "Explain recursion to a child.", "Write a SQL query that counts the rows of a table named users."]
NEW = 32


@pytest.fixture(scope="module")
def pipes():
    from verispec.catalog import installed

    if installed(DEFAULT_TARGET) is None:
        pytest.fail(f"{DEFAULT_TARGET} is not installed; run `make setup`")
    suffix = verispec.load(DEFAULT_TARGET, backend="llamacpp")  # a named target's default: suffix, k = auto
    if suffix.kernels is None or "; batch-invariant" not in suffix.kernels:
        pytest.skip(f"the kernels here are not batch-invariant: {suffix.kernels}")
    model = verispec.load(DEFAULT_TARGET, DEFAULT_DRAFT, backend="llamacpp", drafter="model", k=4)
    pair = verispec.load(backend="llamacpp")  # the default pair for one user: SmolLM2 beside the suffix lookups
    own = DEFAULTS["llamacpp"]
    assert (pair.drafter, pair.k, pair.draft_ref) == (own.pair_drafter, own.k, own.draft)
    return {"suffix": suffix, "model": model, "hybrid": pair}


@pytest.fixture(scope="module")
def greedy():
    """Greedy answers by a key, decoded once in the module: they are the default target's own, whichever drafter's
    pipeline (or the server) decodes them, and the tests ask each of them to reproduce them."""
    answers = {}

    def answer(key, pipe, *args, **kwargs) -> GenerationResult:
        if key not in answers:
            answers[key] = pipe.generate(*args, **kwargs)
        return answers[key]

    return answer


def _request(pipe, question: str) -> Request:
    return pipe.request([{"role": "user", "content": question}], max_new_tokens=NEW)


def _run_schedule(slots, requests: list[Request]) -> tuple[dict[int, list[int]], list[int], int]:
    """Requests 0 and 1 join first, 2 after two rounds; after five rounds request 1 is cancelled and 3, 4, 5 and
    request 1 again join as slots free. Returns each finished request's tokens (by index), the cancelled one's
    partial tokens and the drafts accepted in all."""
    schedule = [(0, 0), (0, 1), (2, 2), (5, 3), (5, 4), (5, 5), (5, 1)]  # (the round it may join from, request)
    held, done, cancelled, step, accepted = {}, {}, None, 0, 0
    while schedule or held:
        if step == 5 and cancelled is None:
            slot = next(s for s, i in held.items() if i == 1)
            cancelled = list(slot.result.token_ids)
            slots.cancel(slot)
            del held[slot]
        while schedule and schedule[0][0] <= step and slots.free:
            index = schedule.pop(0)[1]
            held[slots.add(requests[index])] = index
        for slot, chunk in slots.step():
            slot.push(chunk)
        for slot in [s for s in held if s.done]:
            done[held.pop(slot)] = list(slot.result.token_ids)
            accepted += slot.result.stats.accepted
        step += 1
    return done, cancelled, accepted


@pytest.mark.parametrize("drafter", ["suffix", "model", "hybrid"])
def test_staggered_batched_requests_equal_their_solo_outputs(pipes, greedy, drafter):
    """Six greedy requests through 4 slots, arriving at different rounds, one cancelled part-way and sent again:
    every answer is bitwise its solo answer, and the cancelled one had committed a prefix of it; with each drafter,
    the default pair's among them (SmolLM2-135M, of another tokenizer, beside the suffix lookups). With the suffix
    drafter the schedule runs twice: the second time it remembers every answer (its drafts change, the tokens do
    not)."""
    pipe = pipes[drafter]
    requests = [_request(pipe, q) for q in QUESTIONS]
    solo = [greedy(("solo", q), pipe, r).token_ids for q, r in zip(QUESTIONS, requests)]
    slots = pipe.slots(4)
    assert slots.size == 4
    accepted = []
    for _ in range(2 if drafter == "suffix" else 1):
        done, cancelled, n = _run_schedule(slots, requests)
        assert done == dict(enumerate(solo))
        assert cancelled and solo[1][: len(cancelled)] == cancelled
        accepted.append(n)
    assert accepted[-1] > 0  # drafts were verified beside other rows (the suffix drafter: from remembered answers)


def test_concurrent_server_answers_equal_lone_answers(pipes, greedy):
    """`verispec serve` on the default backend: four greedy requests sent at once get the answers each gets alone
    (the library's, decoded in this process: the same tokens, a request at a time), and /v1/models says the batch's
    kernels are batch-invariant. (That the suffix drafter's memory of earlier answers changes no token: the staggered
    test's second schedule.)"""
    import httpx
    from server_util import ServerProcess

    server = ServerProcess(["--target", DEFAULT_TARGET, "--backend", "llamacpp", "--max-batch", "4"])
    try:
        def ask(question: str) -> str:
            body = {"model": DEFAULT_TARGET, "messages": [{"role": "user", "content": question}], "max_tokens": NEW,
                    "temperature": 0}
            reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["message"]["content"]

        pipe = pipes["suffix"]
        alone = [greedy(("solo", q), pipe, _request(pipe, q)).text for q in QUESTIONS[:4]]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, QUESTIONS[:4]))
        assert together == alone
        info = httpx.get(server.url + "/v1/models", timeout=10).json()
        setup = json.dumps(info)
        assert "batch-invariant" in setup and "not batch-invariant" not in setup
    finally:
        assert server.stop() == 0


# -- fill in the middle on the default target --------------------------------------------------------------

CODE = ("def running_mean(values):\n    \"\"\"Means of the first 1, 2, ... values.\"\"\"\n    total, out = 0.0, []\n"
        "    for i, v in enumerate(values):\n        total += v\n        out.append(total / (i + 1))\n    return out\n")
CUTS = [("        total += v\n", "        out.append"), ("    total, out = 0.0, []\n", "    for i, v"),
        ("    return out\n", "")]  # (the line cut out, where the text after it starts)
FILES = [("stats/util.py", "def mean(values):\n    return sum(values) / len(values)\n")]


def test_fim_prompt_is_llama_servers(pipes):
    """The infill prompt verispec builds from the Hugging Face tokenizer is, token for token, the one llama-server
    builds (format_prompt_infill) from llama.cpp's own vocabulary: its FIM markers (llama_vocab_fim_*) and its
    tokenisation of each part with special tokens read as text."""
    import llama_cpp

    pipe = pipes["suffix"]
    llm = pipe.engine.target.llm
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    pre, suf, mid, rep, sep = (f(vocab) for f in (llama_cpp.llama_vocab_fim_pre, llama_cpp.llama_vocab_fim_suf,
                                                    llama_cpp.llama_vocab_fim_mid, llama_cpp.llama_vocab_fim_rep,
                                                    llama_cpp.llama_vocab_fim_sep))

    def tok(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=False) if text else []

    prefix, suffix, typed = CODE[:120] + "<|fim_middle|>", CODE[120:], "  x = "
    want = [rep, *tok("myproject\n"), sep, *tok("stats/util.py\n"), *tok(FILES[0][1]), sep, *tok("filename\n"), pre,
            *tok(prefix), *tok(typed), suf, *tok(suffix), mid]
    got = pipe.fim.fitted(pipe.tokenizer, prefix, suffix, FILES, typed, 8192)
    assert got == want


@pytest.mark.parametrize("drafter", ["suffix", "model"])
def test_infills_equal_plain_decoding(pipes, greedy, drafter):
    """Infills of a cut line with the default drafter and the draft model: the tokens of plain decoding of the same
    prompt; then each sent again with a longer prefix (an editor typing on) reuses the cached prefix."""
    pipe = pipes[drafter]
    for line, after in CUTS:
        at = CODE.index(line)
        prefix, suffix = CODE[:at], CODE[at + len(line) - 1:]
        plain = greedy(("infill", prefix), pipe, prefix, suffix=suffix, files=FILES, max_new_tokens=24, k=0).token_ids
        spec = pipe.generate(prefix, suffix=suffix, files=FILES, max_new_tokens=24)
        assert spec.token_ids == plain, line
        typed = prefix + line[:6]
        resent = pipe.generate(typed, suffix=suffix, files=FILES, max_new_tokens=24)
        assert resent.stats.cached_tokens >= len(pipe.encode_infill(prefix, "", FILES)) - 2
        assert resent.token_ids == greedy(("infill", typed), pipe, typed, suffix=suffix, files=FILES, max_new_tokens=24,
                                          k=0).token_ids
    assert pipe.fim is not None and "return" in pipe.generate(CODE[:CODE.index("    return")], suffix="\n",
                                                                max_new_tokens=8).text


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}]


WRITE = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"], "additionalProperties": False}}}]
GREET = 'def greet(name):\n    """Say hello to "name"."""\n    return "Hello, " + name + "!"\n'


def test_a_tool_call_copying_code_drafts_from_the_prompt_json_escaped(pipes, greedy):
    """On the real target: a required write_file call whose content copies the prompt's code, with the code
    JSON-escaped as lookup texts and without, each from an empty suffix history: both answers are plain decoding's
    token for token, and the escaped code gets more drafts accepted."""
    from verispec.pipeline.text import encode_messages, json_string_texts, prompt_strings
    from verispec.pipeline.tools import ToolFormat

    pipe = pipes["suffix"]
    task = "Call write_file with path greet.py and this code as its content."
    messages = [{"role": "user", "content": f"{task}\n\n{GREET}"}]
    call = Request(prompt_ids=encode_messages(pipe.tokenizer, messages, WRITE), max_new_tokens=64,
                   constraint=ToolFormat.of(pipe.tokenizer).constraint(WRITE, parallel=False),
                   lookup_texts=json_string_texts(pipe.tokenizer, prompt_strings(messages)))
    plain = greedy("copy", pipe, replace(call, k=0)).token_ids
    answers = {}
    for texts in ((), call.lookup_texts):
        for lookup in pipe.engine.drafter.lookups:
            lookup.history.clear()  # nothing to copy from an earlier answer
        answers[texts] = pipe.generate(replace(call, lookup_texts=texts))
        assert answers[texts].token_ids == plain
    assert '\\n    return \\"Hello, \\" + name' in pipe.tokenizer.decode(plain)  # the call copied the code, escaped
    assert answers[call.lookup_texts].stats.accepted > answers[()].stats.accepted


@pytest.mark.parametrize("drafter", ["suffix", "model"])
def test_structured_output_equals_plain_decoding_under_the_grammar(pipes, greedy, drafter):
    """On the real default pair: a JSON schema's greedy answer and a required tool call are valid and token for token
    plain decoding's under the same grammar (the draft model masking its q, the suffix drafter's drafts cut); the two
    requests decoded side by side in one batch are each as alone."""
    from verispec.pipeline.text import encode_messages
    from verispec.pipeline.tools import ToolFormat, parse_calls

    pipe = pipes[drafter]
    person = pipe.request([{"role": "user", "content": "Ada Lovelace, 36, wrote in English and French. As JSON."}],
                          max_new_tokens=80, json_schema=PERSON)
    tools = ToolFormat.of(pipe.tokenizer)
    ids = encode_messages(pipe.tokenizer, [{"role": "user", "content": "Is it raining in Lyon?"}], WEATHER)
    call = Request(prompt_ids=ids, max_new_tokens=80, constraint=tools.constraint(WEATHER, parallel=False))
    answers = []
    for key, request in (("person", person), ("call", call)):
        spec = pipe.generate(request)
        assert spec.token_ids == greedy(key, pipe, replace(request, k=0)).token_ids and spec.finish_reason == "stop", \
            spec.text
        answers.append(spec)
    data = json.loads(answers[0].text)
    assert set(data) == {"name", "age", "languages"} and "Ada" in data["name"] and answers[0].stats.accepted > 0
    content, calls = parse_calls(answers[1].text)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments)["unit"] in ("celsius", "fahrenheit")
    slots = pipe.slots(4)
    held = {slots.add(r): i for i, r in enumerate((person, call))}
    while not all(s.done for s in held):
        for slot, chunk in slots.step():
            slot.push(chunk)
    assert [s.result.token_ids for s in held] == [a.token_ids for a in answers]
