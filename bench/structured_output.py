"""Structured output under speculation: requests with a JSON schema, built from public prompts (../shared/bench-data:
GSM8K, MIT; HumanEval, MIT), decoded by the pipeline's default (its drafter and k) and by plain decoding under the
same schema, in the same process, taking turns (each request's runs in a balanced order).

    python bench/structured_output.py [--n 30] [--max-new-tokens 256] [--target ...] [--draft ...] [--json out.json]
        [--kinds extract,plan,tool] [--no-lookup-texts-too]
    python bench/structured_output.py --endpoint http://127.0.0.1:8080/v1 [--n 30] [--json out.json]

With --endpoint, the same requests go to an OpenAI-compatible server one at a time, greedy (response_format
json_schema with strict; the tool requests as tools with tool_choice "required"), timed end to end: what
bench/structured_vs_llama_server.sh runs against llama-server and verispec serve.

Three kinds of request, --n / 3 of each:
- extract: a GSM8K problem's quantities and question as JSON (an array of {what, value}, a string);
- plan: a GSM8K problem planned and solved as JSON ({steps: [...], answer: number});
- tool: a HumanEval function implemented through a required tool call (the chat template's tools, the call's
  grammar and parser the server's: verispec.pipeline.tools), write_file's content copying the prompt's code, as an
  agent's edit does; valid when every call parses and its arguments validate against its function's parameters.
With --no-lookup-texts-too the default also runs without the prompt's strings JSON-escaped for its drafter to copy
(Request.lookup_texts), in the same turns: what copying them adds.
Prints, per kind and overall: tokens/s of both, the ratio (the default's over plain's, aggregate tokens over
aggregate seconds), answers that parse and validate against their schema (the jsonschema package), greedy answers
identical to plain's, and the grammar's cost per generated token (walking drafts, masks, commits) against one
plain target pass."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

from verispec.pipeline.tools import parse_calls

DATA = Path(os.environ.get("BENCH_DATA", Path(__file__).resolve().parents[2] / "shared" / "bench-data"))
SYSTEM = "You answer with one JSON object that follows the given JSON schema, nothing else."

EXTRACT = {"type": "object", "properties": {
    "quantities": {"type": "array", "maxItems": 8, "items": {
        "type": "object", "properties": {"what": {"type": "string", "maxLength": 60}, "value": {"type": "number"}},
        "required": ["what", "value"], "additionalProperties": False}},
    "question": {"type": "string", "maxLength": 200}},
    "required": ["quantities", "question"], "additionalProperties": False}
SOLVE = {"type": "object", "properties": {
    "steps": {"type": "array", "maxItems": 6, "items": {"type": "string", "maxLength": 160}},
    "answer": {"type": "number"}},
    "required": ["steps", "answer"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "write_file", "description": "Write a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 80},
                                         "content": {"type": "string", "maxLength": 3000}},
        "required": ["path", "content"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run a test file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 80}}, "required": ["path"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_docs", "description": "Search Python's documentation",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 120}},
                                          "required": ["query"], "additionalProperties": False}}}]


def requests(n: int) -> list[dict]:
    """n requests, a third of each kind: {kind, messages, schema} (a tool request: tools instead of a schema)."""
    with open(DATA / "gsm8k_test.jsonl", encoding="utf-8") as f:
        gsm = [json.loads(line) for line in f]
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        humaneval = [json.loads(line) for line in f]
    each, out = max(1, n // 3), []
    for i in range(each):
        problem = gsm[i]["question"]
        out.append({"kind": "extract", "schema": EXTRACT, "messages": _chat(
            f"List the quantities this problem gives and the question it asks.\n\n{problem}", EXTRACT)})
        out.append({"kind": "plan", "schema": SOLVE, "messages": _chat(
            f"Plan how to solve this problem in a few short steps, then answer.\n\n{gsm[each + i]['question']}",
            SOLVE)})
        code = humaneval[i]["prompt"]
        out.append({"kind": "tool", "tools": TOOLS, "messages": [{"role": "user", "content": (
            "Implement this function: call write_file with path solution.py and the whole file (this code with the "
            f"body written) as its content.\n\n{code}")}]})
    return out


def _chat(task: str, schema: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{task}\n\nJSON schema:\n{json.dumps(schema)}"}]


class GrammarClock:
    """Seconds spent in the grammar's work on the decode loop (walking drafts, masking logits, committing)."""

    def __init__(self) -> None:
        from verispec.core import grammar
        from verispec.decoding import engine
        from verispec.proposers import draft_model

        self.seconds = 0.0
        row = grammar.GrammarRow
        for owner, name in ((row, "walk"), (row, "commit"), (row, "forced"), (row, "draft_mask"), (row, "drafted"),
                            (engine, "apply_masks"), (draft_model, "apply_masks")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def fresh(pipe) -> None:
    """Before a run: drop the caches (the other configuration's run of the same prompt must not leave its prefill)
    and the suffix drafter's history of earlier answers (nor its answer to copy): each run is a first request."""
    pipe.engine.reset()
    drafter = pipe.engine.drafter
    lookups = getattr(getattr(drafter, "lookup", drafter), "lookups", [])
    for history in {id(h): h for h in (getattr(lookup, "history", None) for lookup in lookups) if h}.values():
        history.clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30, help="requests (a third of each kind)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--target", default=None, help="the target (default: the default pair's)")
    ap.add_argument("--draft", default=None, help="the draft model (default: the default pair's)")
    ap.add_argument("--drafter", default="auto", help="the drafter (default: the pipeline's own choice)")
    ap.add_argument("--json", default=None, help="write every run's record here")
    ap.add_argument("--endpoint", default=None, help="an OpenAI-compatible server's /v1 URL instead of the library")
    ap.add_argument("--kinds", default="extract,plan,tool", help="the kinds of request to run (comma-separated)")
    ap.add_argument("--no-lookup-texts-too", action="store_true",
                    help="also run the default without the prompt's JSON-escaped strings to copy from (lookup_texts)")
    args = ap.parse_args()
    if args.endpoint:
        return endpoint(args)
    try:
        import jsonschema
    except ImportError:
        print("bench/structured_output.py needs jsonschema: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    import dataclasses

    import verispec
    from verispec.apps.bench.measured import balanced_orders
    from verispec.decoding.request import Request
    from verispec.pipeline.text import encode_messages, json_string_texts, prompt_strings
    from verispec.pipeline.tools import ToolFormat

    pipe = verispec.load(args.target, args.draft, drafter=args.drafter)
    clock = GrammarClock()
    configs = {"default": None, "plain": 0} | ({"no-texts": None} if args.no_lookup_texts_too else {})
    kinds = set(args.kinds.split(","))
    print(f"target {pipe.target_ref}, drafter {pipe.drafter}, k {pipe.k}, backend {pipe.backend}; "
          f"{args.n} requests, max_new_tokens {args.max_new_tokens}", flush=True)
    pipe.generate("warm up", max_new_tokens=4, json_schema=SOLVE)
    tool_format = ToolFormat.of(pipe.tokenizer)
    records, orders = [], balanced_orders(len(configs))
    for i, req in enumerate(requests(args.n)):
        if req["kind"] not in kinds:
            continue
        if "tools" in req:
            request = Request(prompt_ids=encode_messages(pipe.tokenizer, req["messages"], req["tools"]),
                              max_new_tokens=args.max_new_tokens,
                              constraint=tool_format.constraint(req["tools"], parallel=False),
                              lookup_texts=json_string_texts(pipe.tokenizer, prompt_strings(req["messages"])))
        else:
            request = pipe.request(req["messages"], json_schema=req["schema"], max_new_tokens=args.max_new_tokens)
        answers = {}
        for c in orders[i % len(orders)]:
            name = list(configs)[c]
            fresh(pipe)
            before = clock.seconds
            t0 = time.perf_counter()
            out = pipe.generate(dataclasses.replace(request, k=configs[name], **(
                {"lookup_texts": ()} if name == "no-texts" else {})))
            seconds = time.perf_counter() - t0
            valid = _valid(jsonschema, out.text, req)
            stats = out.stats
            answers[name] = out.text
            records.append({"request": i, "kind": req["kind"], "config": name, "tokens": stats.new_tokens,
                            "seconds": seconds, "valid": valid, "finish_reason": out.finish_reason,
                            "grammar_seconds": clock.seconds - before, "target_seconds": stats.target_seconds,
                            "target_forwards": stats.target_forwards, "accepted": stats.accepted})
        same = len(set(answers.values())) == 1
        for r in records[-len(configs):]:
            r["identical"] = same
        last = {r["config"]: r for r in records[-len(configs):]}
        speeds = "  ".join(f"{c} {r['tokens'] / r['seconds']:5.1f} tok/s" for c, r in last.items())
        print(f"{i:2d} {req['kind']:8s} {last['plain']['tokens']:4d} tokens  {speeds}  valid "
              f"{last['default']['valid']}/{last['plain']['valid']}  identical {same}", flush=True)
    report(records)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


def _valid(jsonschema, text: str, req: dict) -> bool:
    """The answer parses and validates: against the schema, or (a tool request) each call against its function's
    parameters, with at least one call."""
    try:
        if "tools" not in req:
            jsonschema.validate(json.loads(text), req["schema"])
            return True
        content, calls = parse_calls(text)
        params = {t["function"]["name"]: t["function"]["parameters"] for t in req["tools"]}
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), params[call.name])
        return bool(calls) and content is None
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def endpoint(args) -> int:
    """The requests against a server, one at a time: each one's tokens, seconds, validity and answer."""
    import httpx
    import jsonschema

    records = []
    with httpx.Client(timeout=600) as client:
        model = client.get(args.endpoint.rstrip("/") + "/models").json()["data"][0]["id"]
        for i, req in enumerate(requests(args.n)):
            if req["kind"] not in args.kinds.split(","):
                continue
            body = {"model": model, "messages": req["messages"], "max_tokens": args.max_new_tokens, "temperature": 0}
            if "tools" in req:
                body.update(tools=req["tools"], tool_choice="required", parallel_tool_calls=False)
            else:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": req["kind"], "schema": req["schema"], "strict": True}}
            t0 = time.perf_counter()
            r = client.post(args.endpoint.rstrip("/") + "/chat/completions", json=body)
            seconds = time.perf_counter() - t0
            record = {"request": i, "kind": req["kind"], "seconds": seconds, "status": r.status_code, "tokens": 0,
                      "valid": False, "answer": None}
            if r.status_code == 200:
                message = r.json()["choices"][0]["message"]
                record["tokens"] = r.json()["usage"]["completion_tokens"]
                calls = message.get("tool_calls") or []
                record["answer"] = json.dumps(calls and [c["function"] for c in calls]) if "tools" in req \
                    else message.get("content")
                record["valid"] = _valid_reply(jsonschema, message, req)
            records.append(record)
            print(f"{i:2d} {req['kind']:8s} {r.status_code} {record['tokens']:4d} tokens "
                  f"{record['tokens'] / seconds:6.1f} tok/s valid {record['valid']}", flush=True)
    tokens, seconds = sum(r["tokens"] for r in records), sum(r["seconds"] for r in records)
    print(f"all: {tokens / seconds:.2f} tok/s, valid {sum(r['valid'] for r in records)}/{len(records)}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


def _valid_reply(jsonschema, message: dict, req: dict) -> bool:
    """A server's reply parses and validates: the content against the schema, or each tool call's arguments against
    its function's parameters (at least one call)."""
    try:
        if "tools" not in req:
            jsonschema.validate(json.loads(message.get("content") or ""), req["schema"])
            return True
        params = {t["function"]["name"]: t["function"]["parameters"] for t in req["tools"]}
        calls = message.get("tool_calls") or []
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])
        return bool(calls)
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False


def report(records: list[dict]) -> None:
    print(f"\n{'kind':8s} {'n':>3s} {'default tok/s':>13s} {'plain tok/s':>11s} {'ratio':>6s} {'valid':>7s} "
          f"{'identical':>9s}  grammar per token (default, plain) / a plain target pass")
    for kind in sorted({r["kind"] for r in records}) + ["all"]:
        rows = [r for r in records if kind in ("all", r["kind"])]
        by = {c: [r for r in rows if r["config"] == c] for c in ("default", "plain")}
        speed = {c: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for c, rs in by.items()}
        valid = sum(r["valid"] for r in rows)
        same = sum(r["identical"] for r in by["default"])
        grammar = {c: sum(r["grammar_seconds"] for r in rs) / sum(r["tokens"] for r in rs) for c, rs in by.items()}
        plain_pass = sum(r["target_seconds"] for r in by["plain"]) / sum(r["target_forwards"] for r in by["plain"])
        print(f"{kind:8s} {len(by['default']):3d} {speed['default']:13.1f} {speed['plain']:11.1f} "
              f"{speed['default'] / speed['plain']:5.2f}x {valid:3d}/{len(rows):<3d} "
              f"{same:4d}/{len(by['default']):<4d}  "
              f"{grammar['default'] * 1e3:.2f} ms, {grammar['plain'] * 1e3:.2f} ms / {plain_pass * 1e3:.1f} ms = "
              f"{grammar['default'] / plain_pass:.1%}, {grammar['plain'] / plain_pass:.1%}")
        bare = [r for r in rows if r["config"] == "no-texts"]
        if bare:
            bare_speed = sum(r["tokens"] for r in bare) / sum(r["seconds"] for r in bare)
            print(f"{'':8s} without lookup texts: {bare_speed:.1f} tok/s, {bare_speed / speed['plain']:.2f}x plain; "
                  f"the default {speed['default'] / bare_speed:.2f}x that")


if __name__ == "__main__":
    sys.exit(main())
