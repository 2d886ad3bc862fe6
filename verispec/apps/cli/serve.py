"""`verispec serve`: the OpenAI-compatible HTTP server on one pipeline, with the limits a shared server needs
(queue, prompt and body sizes, concurrent requests) and a Host check and API key for a server others can reach."""

from __future__ import annotations

import argparse
import os
import sys

from verispec.apps.cli.args import add_model_args, add_subcommand, check_draft, pipeline_from_args, positive_int
from verispec.apps.cli.errors import require_extra
from verispec.apps.server.settings import ServerSettings

# serve --max-batch (the library's ServerSettings decodes one at a time unless asked): see docs/performance.md
# (Batched serving)
DEFAULT_MAX_BATCH = 8


def add_parser(sub: argparse._SubParsersAction) -> None:
    sv = add_subcommand(sub, "serve", "OpenAI-compatible HTTP server (chat/completions, streaming, metrics)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address")
    sv.add_argument("--port", type=int, default=8000, help="port")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $VERISPEC_API_KEY, "
                                      "else none)")
    sv.add_argument("--allowed-hosts", help="comma-separated host names the Host header may carry ('*': any; "
                                            "default: the bind address, with localhost names for a loopback one)")
    sv.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    sv.add_argument("--limit-concurrency", type=int, default=ServerSettings.max_in_flight,
                    help="requests handled at once (streams included); beyond it 429 with Retry-After")
    sv.add_argument("--served-model-name", help="the model name clients use; the target's name is always "
                                                "accepted (default: none besides it)")
    sv.add_argument("--max-queue", type=int, default=ServerSettings.max_queue,
                    help="requests waiting beyond this get 429")
    sv.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH, metavar="N",
                    help="requests decoded together, each round's target pass shared (continuous batching; a "
                         "pipeline that cannot batch, such as the tree drafter's, decodes one at a time and says why)")
    sv.add_argument("--max-prompt-tokens", type=int, default=ServerSettings.max_prompt_tokens,
                    help="longest prompt a request may send")
    sv.add_argument("--max-tokens-cap", type=int, default=ServerSettings.max_tokens_cap,
                    help="largest max_tokens a request may ask for")
    sv.add_argument("--default-max-tokens", type=int, default=ServerSettings.default_max_tokens,
                    help="max_tokens of a request that sets none (OpenAI's API has no default)")
    sv.add_argument("--max-body-bytes", type=int, default=ServerSettings.max_body_bytes, help="largest request body")
    sv.add_argument("--log-level", default="info", help="uvicorn's log level")
    add_model_args(sv)
    sv.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    require_extra("serve", "verispec serve")
    from verispec.apps.server.app import create_app
    from verispec.apps.server.run import serve

    api_key = args.api_key or os.environ.get("VERISPEC_API_KEY") or None
    hosts = _allowed_hosts(args.host, args.allowed_hosts)
    if not _is_loopback(args.host) and api_key is None:
        print(f"verispec serve: warning: {args.host} is reachable from other machines and no API key is set "
              f"(--api-key or VERISPEC_API_KEY): anyone who can reach it can use it", file=sys.stderr, flush=True)
    check_draft(args)
    pipe = pipeline_from_args(args, serving=True)
    names = tuple(dict.fromkeys(n for n in (args.served_model_name, pipe.target_ref, "verispec") if n))
    settings = ServerSettings(model_names=names, max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
                              max_tokens_cap=args.max_tokens_cap, default_max_tokens=args.default_max_tokens,
                              max_body_bytes=args.max_body_bytes, api_key=api_key, allowed_hosts=hosts,
                              enable_docs=args.enable_docs, max_in_flight=args.limit_concurrency,
                              max_batch=args.max_batch)
    if args.max_batch > 1 and pipe.batch_reason is not None:
        print(f"verispec serve: one request at a time: {pipe.batch_reason}", file=sys.stderr, flush=True)
    app = create_app(pipe, settings)
    print(f"verispec serve: {', '.join(names)} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn counts a connection and its task, and answers its own limit in plain text: a backstop above ours
    serve(app, args.host, args.port, args.log_level, limit_concurrency=2 * args.limit_concurrency + 16)
    print("verispec serve: stopped", file=sys.stderr, flush=True)
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _allowed_hosts(bind: str, given: str | None) -> tuple[str, ...]:
    """Host names a request's Host header may carry: those given (comma-separated, "*" = any), else the
    loopback names for a loopback bind, the bind address itself, or any for a wildcard bind (0.0.0.0, ::)."""
    if given:
        return tuple(h.strip().lower().strip("[]") for h in given.split(",") if h.strip())
    if bind in ("0.0.0.0", "::", ""):
        return ("*",)
    loopback = ("127.0.0.1", "localhost", "::1") if _is_loopback(bind) else ()
    return tuple(dict.fromkeys((bind.lower().strip("[]"), *loopback)))
