"""`verispec bench --endpoint`: the prompt set against OpenAI-compatible servers, interleaved prompt by prompt or
each loaded with concurrent requests in turn; the first endpoint is the baseline."""

from __future__ import annotations

from verispec.apps.cli.args import endpoint_sampling, sampling_from_args, stderr_console
from verispec.apps.cli.bench_common import bench_outcome, bench_prompts, command_line, emit_json, print_table
from verispec.apps.cli.errors import require_extra


def cmd_bench_endpoints(args) -> int:
    """`verispec bench --endpoint URL ...`: the prompt set against OpenAI-compatible servers, one table."""
    require_extra("bench", "verispec bench --endpoint", ("httpx",))
    from verispec.apps.bench.endpoint import EndpointError, parse_endpoint, run_concurrent, run_endpoints, set_speedups
    from verispec.apps.bench.endpoint_report import build_endpoint_report, render_endpoint_table
    from verispec.apps.bench.plan import endpoint_metadata

    local = [flag for flag, value in (("--target", args.target), ("--draft", args.draft), ("--compare", args.compare),
                                      ("--draft-variants", args.draft_variants),
                                      ("--warm-history", args.warm_history),
                                      ("--rounds-only", args.rounds_only)) if value]
    if local:
        raise ValueError(f"--endpoint benchmarks servers only: drop {', '.join(local)}")
    sampling = endpoint_sampling(args)
    prompts = bench_prompts(args)
    endpoints = [parse_endpoint(text, args.endpoint_api_key) for text in args.endpoint]
    console = stderr_console()
    measured: list = []  # kept as it comes: an interrupted run still reports it

    def on_run(r) -> None:
        measured.append(r)
        state = f"{r.tokens_per_second:.1f} tok/s" if r.ok else f"FAILED: {r.error}"
        console.print(f"bench {r.config} {r.prompt_id}: {state}", highlight=False, markup=False, soft_wrap=True)

    status, walls = "complete", None
    try:
        if args.concurrency is not None:
            runs, models, walls = run_concurrent(endpoints, prompts, sampling, args.max_new_tokens, args.concurrency,
                                                 warmup=args.warmup, on_run=on_run)
        else:
            runs, models = run_endpoints(endpoints, prompts, sampling, args.max_new_tokens, warmup=args.warmup,
                                         on_run=on_run)
    except EndpointError as exc:
        raise ValueError(str(exc)) from None
    except KeyboardInterrupt:
        runs, models, status = measured, {}, "interrupted"
        set_speedups(runs, endpoints[0].name)
    meta = endpoint_metadata(command_line(), sampling_from_args(args), max_new_tokens=args.max_new_tokens,
                             prompts_file=args.prompts, turn=args.turn, status=status,
                             concurrency=args.concurrency or 1)
    report = build_endpoint_report(runs, endpoints, models, meta, walls)
    print_table(render_endpoint_table(report), args.json)
    emit_json(report, args.json_out)
    return bench_outcome(status, None, None, len(runs))
