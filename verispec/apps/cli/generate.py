"""`verispec generate`: one prompt's completion, streamed as text (coloured by provenance on a terminal) or
printed as one JSON object with the run's settings and acceptance statistics."""

from __future__ import annotations

import argparse
import json
import sys

from verispec.apps.cli.args import add_generation_args, add_subcommand, checked_sampling, pipeline_from_args, use_color
from verispec.apps.cli.errors import CommandError, UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = add_subcommand(sub, "generate", "generate text for one prompt")
    g.add_argument("--prompt", required=True, help="the prompt; - reads it from standard input (less one final "
                                                   "newline)")
    g.add_argument("--suffix", help="fill in the middle: the text after the gap, the prompt being the text before it "
                                    "(a code model with fill-in-the-middle tokens, e.g. the default target); - reads "
                                    "it from standard input (default: none, a plain completion)")
    g.add_argument("--file", action="append", default=[], metavar="PATH",
                   help="with --suffix: another file of the repository, put before the gap as context (repeatable)")
    g.add_argument("--chat", action="store_true", help="apply the chat template (the prompt is a user message)")
    g.add_argument("--system", help="system message (implies --chat) (default: none)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--json-schema", metavar="FILE", help="structured output: the answer is JSON valid under the JSON "
                                                          "schema in FILE (default: free text)")
    g.add_argument("--regex", help="structured output: the answer matches this regular expression (default: free "
                                   "text)")
    g.add_argument("--grammar", metavar="FILE",
                   help="structured output: the answer follows the grammar in FILE (Lark as llguidance reads it, or "
                        "llama.cpp's GBNF) (default: free text)")
    add_generation_args(g)
    g.set_defaults(func=cmd_generate)


def _prompt_text(prompt: str, flag: str = "--prompt") -> str:
    """A text flag's value; '-' reads standard input (less one final newline, which `echo` adds)."""
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text:
        raise UsageError(f"{flag} -: standard input is empty")
    return text


def _files(paths: list[str]) -> list[tuple[str, str]]:
    """--file: (path, text) of each file, read as UTF-8."""
    out = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                out.append((path, f.read()))
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--file {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    return out


def _constraint(args):
    """--json-schema, --regex or --grammar as the library's Constraint (None: free text); a file that cannot be read
    or a schema that is not JSON is a usage error."""
    from verispec.core.grammar import Constraint

    texts = {}
    for flag, path in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    texts[flag] = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise UsageError(f"{flag} {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    try:
        return Constraint.of(json_schema=texts.get("--json-schema"), regex=args.regex, grammar=texts.get("--grammar"))
    except ValueError as exc:
        raise UsageError(str(exc).replace("json_schema", "--json-schema")) from None


def _prompt_ids(pipe, args) -> tuple[list[int], list[str]]:
    """The prompt's ids: plain text, a chat user message (a system message implies the chat template), or the
    fill-in-the-middle prompt of --prompt and --suffix with --file's files; and the texts they were made of (each
    read once: one may be standard input)."""
    from verispec.pipeline.text import encode_prompt

    if args.suffix is None:
        if args.file:
            raise UsageError("--file is the context of a fill-in-the-middle prompt: give --suffix too")
        text = _prompt_text(args.prompt)
        ids = encode_prompt(pipe.tokenizer, text, args.chat or args.system is not None, args.system)
        return ids, [t for t in (args.system, text) if t]
    if args.chat or args.system is not None:
        raise UsageError("--suffix fills in the middle of a text: it takes no --chat or --system")
    if args.prompt == "-" and args.suffix == "-":
        raise UsageError("--prompt and --suffix cannot both read standard input")
    prefix, suffix, files = _prompt_text(args.prompt), _prompt_text(args.suffix, "--suffix"), _files(args.file)
    try:
        ids = pipe.encode_infill(prefix, suffix, files)
    except ValueError as exc:  # a target without fill-in-the-middle tokens
        raise UsageError(f"--suffix: {exc}") from None
    return ids, [text for _, text in files] + [prefix, suffix]


def cmd_generate(args) -> int:
    from verispec.apps.repl import LEGEND, TokenWriter
    from verispec.decoding.request import Request
    from verispec.pipeline.text import json_string_texts

    params = checked_sampling(args)
    constraint = _constraint(args)
    pipe = pipeline_from_args(args)
    prompt_ids, texts = _prompt_ids(pipe, args)
    # a JSON answer may copy the prompt's strings as JSON escapes them (Request.lookup_texts)
    lookup = json_string_texts(pipe.tokenizer, texts) if constraint is not None and constraint.is_json else ()
    color = use_color(args) and not args.json
    out = TokenWriter(sys.stdout, color)
    if color:
        print(LEGEND, file=sys.stderr, flush=True)
    try:
        stream = pipe.stream(Request(prompt_ids=prompt_ids, params=params, max_new_tokens=args.max_new_tokens,
                                     stop=args.stop, constraint=constraint, lookup_texts=lookup))
        for piece in stream.pieces():
            if not args.json:
                out.write(piece)
    except ValueError as exc:  # the engine refusing this prompt (e.g. too long for the context) is a failure
        raise CommandError(f"generation failed: {exc}") from exc
    result = stream.result
    if args.json:
        print(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(prompt_ids),
            "target": pipe.target_ref,
            "draft": pipe.draft_ref,
            "drafter": pipe.drafter,
            "num_draft_tokens": pipe.k,
            "k": pipe.k,
            "backend": pipe.backend,
            "dtype": pipe.dtype,
            "reason": pipe.reason,
            "kernels": pipe.kernels,
            "shared_vocab": pipe.setup()["shared_vocab"],
            "draft_backend": pipe.draft_backend,
            "draft_quant": pipe.draft_quant,
            "draft_forward": pipe.draft_forward,
            "load_seconds": pipe.load_seconds,
            "stats": result.stats.to_dict(),
        }))
    else:
        out.text("\n")
        print(result.stats.summary(), file=sys.stderr)
    return 0
