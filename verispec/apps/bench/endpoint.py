"""Benchmark any OpenAI-compatible server on the bench's prompt sets: `verispec serve`, vLLM, SGLang,
llama.cpp's llama-server, llama-cpp-python's server.

Each prompt is one streaming request (`stream_options.include_usage`), timed on this side:
- time to first token (TTFT): request sent -> first non-empty content delta;
- total: request sent -> end of the stream; tokens/s = completion tokens / total;
- decode tokens/s: the tokens after the first over the time after the first.
Completion tokens come from the server's own usage counts; a server that sends none in a stream has its
content deltas counted instead, and the run says so (`usage`: "server" | "counted"). Speculation stats come
from verispec's `verispec` extension object, or from vLLM's Prometheus counters
(vllm:spec_decode_num_draft_tokens_total, vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_drafts_total)
read before and after the request. Endpoints run interleaved, prompt by prompt, in a rotating order; the first
endpoint is the baseline every other one's speedup is measured against, prompt by prompt. A failed prompt
is a failed row with its one-line reason; the run goes on.

Under load (`concurrency` N) each endpoint runs alone in turn, N requests in flight (the next prompt sent as
soon as one ends; N = 1: one after another), and reports its aggregate tokens/s (all completion tokens over the phase's wall time) beside the
per-request figures. A server that remembers earlier answers (verispec's suffix drafter) must be fresh for each
phase: the warm-up request asks a question of its own, never one of the timed prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from urllib.parse import urlparse

import httpx

from verispec.apps.bench.loader import Prompt, answer_history
from verispec.apps.bench.measured import Measured
from verispec.names.errors import exception_line
from verispec.names.options import SamplingParams, openai_to_llama_server, to_openai

LLAMA_STOP_TYPES = {"eos": "stop", "word": "stop", "limit": "length"}  # llama-server's stop_type -> finish_reason
VLLM_COUNTERS = {"vllm:spec_decode_num_draft_tokens_total": "drafted",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted",
                 "vllm:spec_decode_num_drafts_total": "rounds"}


class EndpointError(RuntimeError):
    """A one-line, user-facing error: the endpoint cannot be benchmarked at all."""


@dataclass(frozen=True)
class Endpoint:
    name: str
    base_url: str  # ends in /v1
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None

    def __post_init__(self) -> None:
        parsed = urlparse(self.base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"endpoint URL must be http(s)://host:port[/v1], got {self.base_url!r}")
        if not self.name:
            raise ValueError("an endpoint needs a name")

    @property
    def root(self) -> str:
        return self.base_url[: -len("/v1")]


def parse_endpoint(text: str, api_key: str | None = None) -> Endpoint:
    """'URL' or 'NAME=URL' (URL: http(s)://host:port, with or without /v1); the name defaults to host:port."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    url = url.strip().rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    return Endpoint(name.strip() or urlparse(url).netloc, url, api_key=api_key)


@dataclass
class EndpointRun(Measured):
    prompt_id: str
    category: str
    config: str
    new_tokens: int = 0
    seconds: float = 0.0
    ttft: float | None = None
    prompt_tokens: int | None = None
    usage: str = "server"  # or "counted": the server sent no usage, content deltas were counted
    finish_reason: str | None = None
    drafted: int | None = None
    accepted: int | None = None
    rounds: int | None = None
    error: str | None = None
    speedup: float | None = None  # tokens/s over the baseline endpoint's on the same prompt
    text: str = field(default="", repr=False)

    @property
    def decode_tokens_per_second(self) -> float | None:
        if not self.ok or self.ttft is None or self.new_tokens < 2 or self.seconds <= self.ttft:
            return None
        return (self.new_tokens - 1) / (self.seconds - self.ttft)


# -- the wire ------------------------------------------------------------------------------------

def request_for(prompt: Prompt, model: str, sampling: dict, max_tokens: int) -> tuple[str, dict]:
    """The streaming request for a prompt (its path from the server's root): chat prompts to
    /v1/chat/completions, raw ones (HumanEval) to /v1/completions, infills to llama-server's /infill (which
    llama-server and verispec serve; OpenAI's suffix llama-server refuses), its sampling in llama-server's names."""
    if prompt.infill:
        return "/infill", {"input_prefix": prompt.text, "input_suffix": prompt.suffix, "n_predict": max_tokens,
                           "input_extra": [{"filename": name, "text": text} for name, text in prompt.files],
                           "stream": True, **openai_to_llama_server(sampling)}
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            **sampling}
    if prompt.chat:
        return "/v1/chat/completions", body | {"messages": prompt.messages()}
    return "/v1/completions", body | {"prompt": prompt.text}


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]` (or its end: llama-server's own API
    sends none)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise EndpointError(f"not an OpenAI stream: undecodable event {data[:60]!r}") from None
        if not isinstance(event, dict):
            raise EndpointError(f"not an OpenAI stream: event {data[:60]!r}")
        yield event


def _delta_text(event: dict) -> str:
    if isinstance(event.get("content"), str):  # llama-server's own API
        return event["content"]
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def consume(events: Iterable[dict], run: EndpointRun, t0: float, clock: Callable[[], float]) -> None:
    """Fill a run from a stream's events: text, TTFT, usage, finish reason, verispec's speculation stats."""
    deltas, usage_seen = 0, False
    pieces: list[str] = []
    for event in events:
        if "error" in event:
            err = event["error"]
            raise EndpointError(f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
        piece = _delta_text(event)
        if piece:
            if run.ttft is None:
                run.ttft = clock() - t0
            deltas += 1
            pieces.append(piece)
        for choice in event.get("choices") or []:
            run.finish_reason = choice.get("finish_reason") or run.finish_reason
        if event.get("usage"):
            usage_seen = True
            run.new_tokens = int(event["usage"].get("completion_tokens", 0))
            run.prompt_tokens = event["usage"].get("prompt_tokens")
        if event.get("stop") is True:  # llama-server's own API: its last event
            usage_seen = True
            run.new_tokens, run.prompt_tokens = int(event.get("tokens_predicted", 0)), event.get("tokens_evaluated")
            run.finish_reason = LLAMA_STOP_TYPES.get(event.get("stop_type"), event.get("stop_type"))
            timings = event.get("timings") or {}
            if "draft_n" in timings:
                run.drafted, run.accepted = timings["draft_n"], timings.get("draft_n_accepted")
        if isinstance(event.get("verispec"), dict) and "drafted" in event["verispec"]:
            ext = event["verispec"]
            run.drafted, run.accepted, run.rounds = ext.get("drafted"), ext.get("accepted"), ext.get("rounds")
    run.seconds = clock() - t0
    run.text = "".join(pieces)
    if not usage_seen:
        run.usage, run.new_tokens = "counted", deltas


def _headers(endpoint: Endpoint) -> dict:
    return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def run_prompt(client: httpx.Client, endpoint: Endpoint, model: str, prompt: Prompt, sampling: dict,
               max_tokens: int, counters: bool = False,
               clock: Callable[[], float] = time.perf_counter) -> EndpointRun:
    """One streamed request; any failure becomes a failed run with a one-line reason. `counters`: read the
    server's speculation counters before and after."""
    run = EndpointRun(prompt.id, prompt.category, endpoint.name)
    path, body = request_for(prompt, model, sampling, max_tokens)
    before = spec_counters(client, endpoint) if counters else None
    try:
        t0 = clock()
        with client.stream("POST", endpoint.root + path, json=body, headers=_headers(endpoint)) as response:
            if response.status_code != 200:
                response.read()
                raise EndpointError(f"HTTP {response.status_code}: {response.text.strip()[:200]}")
            consume(sse_events(response.iter_lines()), run, t0, clock)
    except (httpx.HTTPError, EndpointError, ValueError, TypeError, AttributeError) as exc:
        return EndpointRun(prompt.id, prompt.category, endpoint.name, error=exception_line(exc))
    if before is not None and run.drafted is None:
        after = spec_counters(client, endpoint) or {}
        run.drafted, run.accepted, run.rounds = (int(after.get(k, 0) - before.get(k, 0))
                                                 for k in ("drafted", "accepted", "rounds"))
    return run


def parse_prometheus(text: str, names: dict[str, str]) -> dict[str, float]:
    """Sum each named counter over its label sets: {our key: value}."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        key = names.get(metric.split("{", 1)[0].strip())
        if key is not None:
            try:
                found[key] = found.get(key, 0.0) + float(value)
            except ValueError:
                continue
    return found


def spec_counters(client: httpx.Client, endpoint: Endpoint) -> dict[str, float] | None:
    """vLLM's speculation counters from the server's /metrics, or None where it has none."""
    try:
        response = client.get(endpoint.root + "/metrics", headers=_headers(endpoint), timeout=5.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    found = parse_prometheus(response.text, VLLM_COUNTERS)
    return found if "drafted" in found else None


def served_model(client: httpx.Client, endpoint: Endpoint) -> str:
    """The model to ask for: the endpoint's own, else the first the server lists at /v1/models."""
    url = endpoint.base_url + "/models"
    try:
        response = client.get(url, headers=_headers(endpoint), timeout=10.0)
    except httpx.HTTPError as exc:
        raise EndpointError(f"{endpoint.name}: cannot reach {url}: {exception_line(exc)}") from None
    try:
        listed = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        listed = None
    if response.status_code != 200 or not listed:
        raise EndpointError(f"{endpoint.name}: {url} answered HTTP {response.status_code} without a model list: "
                            "not an OpenAI-compatible server")
    return endpoint.model or listed[0]


# -- the run -------------------------------------------------------------------------------------

def _greedy_answer(client: httpx.Client, endpoint: Endpoint, model: str, prompt: Prompt, max_tokens: int) -> str:
    """The endpoint's greedy answer to a prompt (an earlier turn of a timed conversation; not recorded)."""
    run = run_prompt(client, endpoint, model, prompt, to_openai(SamplingParams()), max_tokens)
    if not run.ok:
        raise EndpointError(f"{endpoint.name}: answering an earlier turn failed: {run.error}")
    return run.text


def _check_names(endpoints: list[Endpoint]) -> None:
    names = [e.name for e in endpoints]
    if len(set(names)) != len(names):
        raise ValueError(f"endpoint names must differ, got {names} (name them NAME=URL)")


def _prepare(client: httpx.Client, endpoints: list[Endpoint], prompts: list[Prompt],
             max_tokens: int) -> tuple[dict[str, str], list[Prompt]]:
    """Each endpoint's model, and the prompts with their earlier turns answered by the first endpoint."""
    models = {e.name: served_model(client, e) for e in endpoints}
    baseline = endpoints[0]
    prompts = answer_history(prompts, lambda p: _greedy_answer(client, baseline, models[baseline.name], p, max_tokens))
    return models, prompts


def _warm_up(client: httpx.Client, endpoint: Endpoint, model: str, prompts: list[Prompt], sampling: dict,
             max_tokens: int, warmup: int) -> None:
    for _ in range(warmup):
        run_prompt(client, endpoint, model, warmup_prompt(prompts[0]), sampling, max_tokens)


def run_endpoints(endpoints: list[Endpoint], prompts: list[Prompt], sampling: dict, max_tokens: int,
                  warmup: int = 1, timeout: float = 600.0,
                  on_run: Callable[[EndpointRun], None] | None = None) -> tuple[list[EndpointRun], dict[str, str]]:
    """Every prompt on every endpoint, interleaved (prompt i starts at endpoint i mod n); the warm-up requests
    (`warmup` per endpoint, see warmup_prompt) are not recorded. A prompt's earlier turns are answered
    first by the first endpoint (greedy, not recorded), so that every endpoint gets the same conversation.
    Returns the runs and each endpoint's model."""
    _check_names(endpoints)
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        models, prompts = _prepare(client, endpoints, prompts, max_tokens)
        counters = {e.name: spec_counters(client, e) is not None for e in endpoints}
        for e in endpoints:
            _warm_up(client, e, models[e.name], prompts, sampling, max_tokens, warmup)
        runs = []
        for i, prompt in enumerate(prompts):
            for j in range(len(endpoints)):
                e = endpoints[(i + j) % len(endpoints)]
                runs.append(run_prompt(client, e, models[e.name], prompt, sampling, max_tokens, counters[e.name]))
                if on_run:
                    on_run(runs[-1])
    set_speedups(runs, endpoints[0].name)
    return runs, models


WARMUP_TEXT = "Say hello in one short sentence."


def warmup_prompt(like: Prompt) -> Prompt:
    """A warm-up request of the same kind (chat, completion or infill) as `like`, asking what no timed prompt
    asks."""
    return replace(like, id="warm-up", text=WARMUP_TEXT, history=(), answers=(),
                   suffix=None if like.suffix is None else "", files=())


def run_concurrent(endpoints: list[Endpoint], prompts: list[Prompt], sampling: dict, max_tokens: int,
                   concurrency: int, warmup: int = 1, timeout: float = 600.0,
                   on_run: Callable[[EndpointRun], None] | None = None,
                   ) -> tuple[list[EndpointRun], dict[str, str], dict[str, float]]:
    """Every prompt on each endpoint in turn, `concurrency` requests in flight; returns the runs (in prompt order
    per endpoint), each endpoint's model and each endpoint's wall time from its first request to its last answer.
    Earlier turns are answered by the first endpoint (greedy, not recorded), as in run_endpoints."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    _check_names(endpoints)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    runs, walls = [], {}
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        models, prompts = _prepare(client, endpoints, prompts, max_tokens)
        for e in endpoints:
            _warm_up(client, e, models[e.name], prompts, sampling, max_tokens, warmup)

            def one(prompt: Prompt, e: Endpoint = e) -> EndpointRun:
                run = run_prompt(client, e, models[e.name], prompt, sampling, max_tokens)
                if on_run:
                    on_run(run)
                return run

            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                runs += list(pool.map(one, prompts))
            walls[e.name] = time.perf_counter() - t0
    set_speedups(runs, endpoints[0].name)
    return runs, models, walls


def set_speedups(runs: list[EndpointRun], baseline: str) -> None:
    base = {r.prompt_id: r for r in runs if r.config == baseline and r.ok}
    for r in runs:
        b = base.get(r.prompt_id)
        if r.ok and b is not None and b.tokens_per_second > 0:
            r.speedup = r.tokens_per_second / b.tokens_per_second
