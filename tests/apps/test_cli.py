"""`verispec generate` end to end on tiny models saved as Hugging Face directories."""

from __future__ import annotations

import json
import re

import pytest
from tiny import bpe_tokenizer, byte_tokenizer, save_tiny_pair, sentencepiece_tokenizer, tiny_qwen2

from verispec.apps.cli import main


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tiny"))


def _run_json(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("k", ["1", "4"])
def test_generate_greedy_same_ids_with_and_without_speculation(pair_dirs, capsys, chat, k):
    target, draft = pair_dirs
    common = ["--target", target, "--draft", draft, "--prompt", "Hello, wörld!", "--max-new-tokens", "30",
              "--dtype", "fp32", "--device", "cpu"] + (["--chat"] if chat else [])
    spec = _run_json(capsys, *common, "--num-draft-tokens", k)
    plain = _run_json(capsys, *common, "--no-speculation")
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) > 0
    assert spec["text"] == plain["text"]
    for key in ("drafted", "accepted", "acceptance_rate", "mean_accepted_length", "target_forwards", "new_tokens",
                "seconds", "tokens_per_second"):
        assert key in spec["stats"]
    assert spec["stats"]["drafted"] > 0 and plain["stats"]["drafted"] == 0
    assert plain["stats"]["target_forwards"] == plain["stats"]["new_tokens"]
    assert spec["num_draft_tokens"] == int(k)
    if chat and k == "4":  # without -k: 4 on transformers (auto is the default only where llama.cpp runs)
        assert _run_json(capsys, *common)["num_draft_tokens"] == 4


def test_structured_output_flags(pair_dirs, capsys, tmp_path):
    """--json-schema FILE and --regex: the answer matches, the same with and without speculation; a missing file, a
    schema that is not JSON, an invalid regex or two constraints: one line on stderr, a non-zero exit."""
    target, draft = pair_dirs
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 999}},
                                  "required": ["n"], "additionalProperties": False}))
    common = ["--target", target, "--draft", draft, "--prompt", "count", "--max-new-tokens", "40", "--dtype", "fp32"]
    spec = _run_json(capsys, *common, "--json-schema", str(schema))
    assert _run_json(capsys, *common, "--json-schema", str(schema), "--no-speculation")["text"] == spec["text"]
    assert set(json.loads(spec["text"])) == {"n"} and spec["finish_reason"] == "stop"
    assert re.fullmatch("[a-c]{3}x", _run_json(capsys, *common, "--regex", "[a-c]{3}x")["text"])
    (tmp_path / "bad.json").write_text("{not json")
    for flags in (["--json-schema", str(tmp_path / "missing.json")], ["--json-schema", str(tmp_path / "bad.json")],
                  ["--regex", "(a"], ["--regex", "a", "--json-schema", str(schema)]):
        assert main(["generate", *common, *flags]) != 0, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("verispec"), (flags, err)


def test_a_json_answer_drafts_from_the_prompt_as_json_escapes_it(pair_dirs, capsys, monkeypatch, tmp_path):
    """--json-schema: the request carries the prompt's text JSON-escaped for the lookup drafters
    (Request.lookup_texts, as Pipeline.request makes them), standard input read once for it and the ids; a regex
    answer carries none."""
    import io

    from verispec.pipeline.pipeline import Pipeline
    from verispec.pipeline.text import json_string_texts

    target, draft = pair_dirs
    seen = []
    real = Pipeline.stream
    monkeypatch.setattr(Pipeline, "stream", lambda self, request, **kw: seen.append((self, request))
                        or real(self, request, **kw))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object"}))
    prompt = 'print("a")\n\tb'
    common = ["--target", target, "--draft", draft, "--prompt", "-", "--max-new-tokens", "4", "--dtype", "fp32"]
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt + "\n"))
    _run_json(capsys, *common, "--json-schema", str(schema))
    pipe, request = seen[-1]
    assert request.lookup_texts == json_string_texts(pipe.tokenizer, [prompt]) != ()
    assert list(request.prompt_ids) == pipe.encode(prompt)
    monkeypatch.setattr("sys.stdin", io.StringIO(prompt))
    _run_json(capsys, *common, "--regex", "[a-c]{3}")
    assert seen[-1][1].lookup_texts == ()


def test_streamed_text_equals_json_text(pair_dirs, capsys):
    target, draft = pair_dirs
    common = ["--target", target, "--draft", draft, "--prompt", "abc", "--max-new-tokens", "25", "--dtype", "fp32"]
    as_json = _run_json(capsys, *common)
    assert main(["generate", *common]) == 0
    captured = capsys.readouterr()
    assert captured.out == as_json["text"] + "\n"
    assert "acceptance" in captured.err


def test_sampling_with_seed_reproduces(pair_dirs, capsys):
    target, draft = pair_dirs
    common = ["--target", target, "--draft", draft, "--prompt", "xyz", "--max-new-tokens", "20", "--dtype", "fp32",
              "--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--min-p", "0.01",
              "--repetition-penalty", "1.1", "--seed", "7"]
    a = _run_json(capsys, *common)
    b = _run_json(capsys, *common)
    assert a["token_ids"] == b["token_ids"]


def test_draft_of_another_tokenizer_generates_the_targets_tokens(pair_dirs, tmp_path, capsys):
    """A draft whose tokenizer differs (a SentencePiece vocabulary) drafts through the shared tokens: greedy output
    is plain decoding's, and --json says what the pair shares."""
    target, _ = pair_dirs
    other = tmp_path / "other"
    tok = sentencepiece_tokenizer()
    tiny_qwen2(5, vocab_size=len(tok)).save_pretrained(other)
    tok.save_pretrained(other)
    common = ["--target", target, "--prompt", "hello world", "--max-new-tokens", "24", "--dtype", "fp32",
              "--device", "cpu"]
    plain = _run_json(capsys, *common, "--no-speculation")
    crossed = _run_json(capsys, *common, "--draft", str(other), "-k", "3")
    assert crossed["token_ids"] == plain["token_ids"] and crossed["stats"]["drafted"] > 0
    assert "tokens in common" in crossed["shared_vocab"] and plain["shared_vocab"] is None


def test_token_trees_refuse_a_draft_of_another_tokenizer(pair_dirs, tmp_path, capsys):
    target, _ = pair_dirs
    other = tmp_path / "other-tree"
    tok = sentencepiece_tokenizer()
    tiny_qwen2(5, vocab_size=len(tok)).save_pretrained(other)
    tok.save_pretrained(other)
    assert main(["generate", "--target", target, "--draft", str(other), "--drafter", "tree", "--prompt", "a",
                 "--dtype", "fp32", "--device", "cpu"]) != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (saving the models printed progress before it)
    assert err == "verispec: error: token trees need a draft of the target's vocabulary [--drafter]"


def test_a_pair_sharing_few_tokens_warns_on_one_line(pair_dirs, tmp_path, capsys):
    target, _ = pair_dirs
    other = tmp_path / "few"
    tok = bpe_tokenizer(["a", "b", "Ġ"] + [f"w{i}" for i in range(61)])
    tiny_qwen2(6, vocab_size=len(tok)).save_pretrained(other)
    tok.save_pretrained(other)
    assert main(["generate", "--target", target, "--draft", str(other), "--prompt", "ab", "--max-new-tokens", "4",
                 "--dtype", "fp32"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith("verispec: warning: the draft and the target share only ")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--num-draft-tokens", "-2"], "num-draft-tokens"),
        (["--device", "tpu"], "unknown device"),
        (["--draft-vocab", "-5"], "draft-vocab"),
    ],
)
def test_bad_input_is_one_line_error(pair_dirs, capsys, extra, message):
    """A bad flag value is a usage error: exit status 2, one line."""
    target, draft = pair_dirs
    assert main(["generate", "--target", target, "--draft", draft, "--prompt", "a", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("verispec: error:") and message in err and "\n" not in err


@pytest.mark.parametrize("forward", ["auto", "lean", "transformers"])
def test_int4_reduced_vocab_draft_same_ids(pair_dirs, capsys, forward):
    target, draft = pair_dirs
    common = ["--target", target, "--draft", draft, "--prompt", "Hello!", "--max-new-tokens", "24",
              "--device", "cpu"]
    spec = _run_json(capsys, *common, "--draft-quant", "int4", "--draft-vocab", "128", "-k", "3",
                     "--draft-forward", forward)
    plain = _run_json(capsys, *common, "--no-speculation")
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["drafted"] > 0
    assert spec["draft_backend"] == "hf"
    assert spec["draft_forward"] == ("lean" if forward == "auto" else forward)  # a Qwen2 draft: lean by default


def test_lean_forward_for_an_unsupported_draft_is_one_line_error(pair_dirs, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    target, _ = pair_dirs
    tok = byte_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    gpt2.save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    common = ["--target", target, "--draft", str(tmp_path / "gpt2"), "--prompt", "Hi", "--max-new-tokens", "6"]
    assert main(["generate", *common, "--draft-forward", "lean"]) == 1  # found out on loading the model
    err = capsys.readouterr().err.strip()
    assert "model type 'gpt2'" in err and "\n" not in err
    assert _run_json(capsys, *common)["draft_forward"] == "transformers"  # auto falls back


def test_default_pair_missing_says_how_to_pull(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    assert main(["generate", "--prompt", "hi"]) == 1  # a model missing: a runtime failure
    err = capsys.readouterr().err
    assert "verispec models pull" in err and err.count("\n") == 1


def test_target_without_draft_needs_no_speculation(pair_dirs, capsys):
    target, _ = pair_dirs
    assert main(["generate", "--target", target, "--prompt", "a"]) == 2
    assert "--draft" in capsys.readouterr().err
    out = _run_json(capsys, "--target", target, "--prompt", "a", "--no-speculation", "--max-new-tokens", "5")
    assert len(out["token_ids"]) <= 5


def test_llamacpp_backend_without_the_extra_says_how_to_install(pair_dirs, capsys, monkeypatch):
    import sys

    from verispec.backends.llamacpp import import_llama_cpp
    from verispec.names.errors import ModelError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    with pytest.raises(ModelError, match=r"pip install -e '\.\[llamacpp\]'"):
        import_llama_cpp()
    target, draft = pair_dirs
    assert main(["generate", "--target", str(target), "--backend", "llamacpp", "--no-speculation",
                 "--prompt", "hi", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[llamacpp]" in err
    # the default draft backend (auto) falls back to transformers: the core package works without the extra
    out = _run_json(capsys, "--target", str(target), "--draft", str(draft), "--prompt", "hi",
                    "--max-new-tokens", "4")
    assert out["draft_backend"] == "hf" and len(out["token_ids"]) == 4


@pytest.mark.parametrize("argv, extra, module", [
    (["serve"], "serve", "fastapi"),
    (["bench", "--endpoint", "http://127.0.0.1:9/v1"], "bench", "httpx"),
    (["bench", "--plot-dir", "plots", "--limit", "1"], "bench", "matplotlib"),
])
def test_a_missing_extra_is_named_in_one_line(capsys, monkeypatch, argv, extra, module):
    """The core install is the library and the command line: a command that needs an extra says which, and how to
    install it, before loading anything."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find(name, *a))
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"pip install 'verispec[{extra}]'" in err and module in err


def test_the_core_install_needs_no_extra():
    """pyproject's dependencies hold none of the extras' packages (the server's, the plots', the HTTP client)."""
    import tomllib
    from pathlib import Path

    from verispec.apps.cli.errors import EXTRAS

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower().replace("-", "_")
    for extra, modules in EXTRAS.items():
        assert all(m not in core for m in modules), extra
        assert extra in project["optional-dependencies"]


def test_llamacpp_installed_but_broken_says_what_fails(monkeypatch):
    """A llama-cpp-python whose own dependency is missing is not reported as not installed."""
    import builtins

    from verispec.backends.llamacpp import import_llama_cpp
    from verispec.names.errors import ModelError

    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ModuleNotFoundError("No module named 'diskcache'", name="diskcache")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(ModelError, match=r"installed but does not import \(No module named 'diskcache'\)"):
        import_llama_cpp()


# -- conventions: version, help, prompt sources, exit statuses -----------------------------------------


def test_version(capsys):
    import verispec

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"verispec {verispec.__version__}\n"


def test_help_shows_every_flags_default(capsys):
    """Every flag has help text that states its default (argparse's "(default: X)" or in words); rendering
    every command's help also catches a stray '%' in a help string."""
    import argparse

    from verispec.apps.cli import build_parser

    assert main(["generate", "--help"]) == 0
    assert "--max-new-tokens N most tokens to generate (default: 256)" in " ".join(capsys.readouterr().out.split())
    assert main(["bench", "--help"]) == 0
    assert "--max-new-tokens N most tokens to generate (default: 128)" in " ".join(capsys.readouterr().out.split())
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {"generate", "chat", "bench", "serve", "export", "models"}
    for name, command in commands.items():
        command.format_help()
        formatter = command._get_formatter()
        for action in command._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction) or action.required:
                continue
            assert action.help, (name, action.dest)
            assert "default" in formatter._expand_help(action), (name, action.dest)


def test_system_message_reaches_the_chat_prompt(pair_dirs, capsys, monkeypatch):
    """--system becomes the chat template's system message, before the user's (and implies --chat)."""
    import verispec.pipeline.text

    target, draft = pair_dirs
    real, prompts = verispec.pipeline.text.encode_prompt, []

    def spy(tokenizer, prompt, chat, system=None):
        ids = real(tokenizer, prompt, chat, system)
        prompts.append(tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(verispec.pipeline.text, "encode_prompt", spy)
    common = ["--target", target, "--draft", draft, "--prompt", "Hi there", "--max-new-tokens", "4"]
    with_system = _run_json(capsys, *common, "--system", "Answer in French.")
    chat = _run_json(capsys, *common, "--chat")
    assert prompts[0] == ("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert prompts[1] == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert with_system["prompt_tokens"] > chat["prompt_tokens"]


def test_prompt_from_stdin(pair_dirs, capsys, monkeypatch):
    """--prompt - reads the prompt from standard input, less the final newline `echo` adds."""
    import io

    target, draft = pair_dirs
    common = ["--target", target, "--draft", draft, "--max-new-tokens", "12", "--dtype", "fp32"]
    given = _run_json(capsys, *common, "--prompt", "Once upon")
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon\n"))
    piped = _run_json(capsys, *common, "--prompt", "-")
    assert piped["prompt_tokens"] == given["prompt_tokens"] == len("Once upon")
    assert piped["token_ids"] == given["token_ids"]
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", *common, "--prompt", "-"]) == 2
    assert "standard input is empty" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--max-new-tokens", "x"], ["--no-such-flag"], ["--dtype", "int3"]])
def test_usage_error_exits_2_with_one_line(pair_dirs, capsys, argv):
    target, draft = pair_dirs
    assert main(["generate", "--target", target, "--draft", draft, "--prompt", "a", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("verispec: error:") and captured.err.count("\n") == 1 and captured.out == ""


def test_runtime_failure_exits_1_with_one_line(pair_dirs, tmp_path, capsys):
    """A model that is not there, or a generation that fails (a prompt longer than the context), exits 1."""
    target, _ = pair_dirs
    assert main(["generate", "--target", str(tmp_path / "missing"), "--no-speculation", "--prompt", "a"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: model ") and "not found" in err and err.count("\n") == 1
    assert main(["generate", "--target", target, "--no-speculation", "--prompt", "x" * 5000]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: generation failed: the prompt has 5000 tokens") and err.count("\n") == 1


def test_unexpected_error_is_one_line_unless_asked(pair_dirs, capsys, monkeypatch):
    """An exception verispec does not expect: its type and first line, exit 1; VERISPEC_TRACEBACK=1 raises it."""
    import verispec.apps.cli.generate

    def broken(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(verispec.apps.cli.generate, "pipeline_from_args", broken)
    assert main(["generate", "--prompt", "a", "--no-speculation"]) == 1
    assert capsys.readouterr().err == "verispec: error: RuntimeError: boom\n"
    monkeypatch.setenv("VERISPEC_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["generate", "--prompt", "a", "--no-speculation"])
