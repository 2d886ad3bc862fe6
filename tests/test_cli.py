"""`verispec generate` end to end on tiny models saved as Hugging Face directories."""

from __future__ import annotations

import json

import pytest
from tiny import byte_tokenizer, save_tiny_pair, tiny_qwen2

from verispec.cli import main


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


def test_vocabulary_mismatch_is_refused_before_loading(pair_dirs, tmp_path, capsys):
    target, _ = pair_dirs
    other = tmp_path / "other"
    tok = byte_tokenizer()
    tok.add_tokens(["<extra>"])
    tiny_qwen2(5, vocab_size=264).save_pretrained(other)
    tok.save_pretrained(other)
    assert main(["generate", "--target", target, "--draft", str(other), "--prompt", "a"]) == 2
    err = capsys.readouterr().err.strip()
    assert "different vocabularies" in err and "\n" not in err


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
    target, draft = pair_dirs
    assert main(["generate", "--target", target, "--draft", draft, "--prompt", "a", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


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
    assert main(["generate", *common, "--draft-forward", "lean"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model type 'gpt2'" in err and "\n" not in err
    assert _run_json(capsys, *common)["draft_forward"] == "transformers"  # auto falls back


def test_default_pair_missing_says_how_to_pull(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    assert main(["generate", "--prompt", "hi"]) == 2
    assert "verispec models pull" in capsys.readouterr().err


def test_target_without_draft_needs_no_speculation(pair_dirs, capsys):
    target, _ = pair_dirs
    assert main(["generate", "--target", target, "--prompt", "a"]) == 2
    assert "--draft" in capsys.readouterr().err
    out = _run_json(capsys, "--target", target, "--prompt", "a", "--no-speculation", "--max-new-tokens", "5")
    assert len(out["token_ids"]) <= 5


def test_llamacpp_backend_without_the_extra_says_how_to_install(pair_dirs, capsys, monkeypatch):
    import sys

    from verispec.backends.llamacpp import import_llama_cpp
    from verispec.models import ModelError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    with pytest.raises(ModelError, match=r"pip install -e '\.\[llamacpp\]'"):
        import_llama_cpp()
    target, draft = pair_dirs
    assert main(["generate", "--target", str(target), "--backend", "llamacpp", "--no-speculation",
                 "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[llamacpp]" in err
    # the default draft backend (auto) falls back to transformers: the core package works without the extra
    out = _run_json(capsys, "--target", str(target), "--draft", str(draft), "--prompt", "hi",
                    "--max-new-tokens", "4")
    assert out["draft_backend"] == "hf" and len(out["token_ids"]) == 4
