"""`verispec export`: each engine's exact argv for a configuration, the notes for what has no equivalent,
known names resolved to the cache, and the CLI's one-line errors."""

from __future__ import annotations

import json
import shlex

import pytest

from verispec.apps.cli import main
from verispec.apps.export import AUTO_K, ExportSpec, Launch, export, locate

PAIR = ExportSpec(target="/m/target", draft="/m/draft", k=5)


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_draft_model():
    launch = export("vllm", ExportSpec(target="/m/t", draft="/m/d", k=5, tensor_parallel_size=4,
                                       draft_tensor_parallel_size=1, port=9000))
    assert launch.argv[:3] == ("vllm", "serve", "/m/t")
    assert _flag(launch.argv, "--tensor-parallel-size") == "4"
    assert _flag(launch.argv, "--port") == "9000"
    assert json.loads(_flag(launch.argv, "--speculative-config")) == {
        "method": "draft_model", "model": "/m/d", "num_speculative_tokens": 5, "draft_tensor_parallel_size": 1}
    assert launch.notes == ()


def test_vllm_ngram_needs_no_draft():
    launch = export("vllm", ExportSpec(target="/m/t", drafter="ngram", k=3))
    assert json.loads(_flag(launch.argv, "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert "--tensor-parallel-size" not in launch.argv


def test_sglang_standalone_chain():
    argv = export("sglang", PAIR).argv
    assert argv[:5] == ("python3", "-m", "sglang.launch_server", "--model-path", "/m/target")
    assert _flag(argv, "--speculative-algorithm") == "STANDALONE"
    assert _flag(argv, "--speculative-draft-model-path") == "/m/draft"
    assert (_flag(argv, "--speculative-num-steps"), _flag(argv, "--speculative-eagle-topk"),
            _flag(argv, "--speculative-num-draft-tokens")) == ("5", "1", "6")
    ngram = export("sglang", ExportSpec(target="/m/t", drafter="ngram", tensor_parallel_size=2)).argv
    assert _flag(ngram, "--speculative-algorithm") == "NGRAM" and _flag(ngram, "--tp-size") == "2"


def test_llama_server_draft_and_ngram():
    argv = export("llama-server", ExportSpec(target="/m/t.gguf", draft="/m/d.gguf", k=6, gpu_layers=99)).argv
    assert argv[:3] == ("llama-server", "-m", "/m/t.gguf")
    assert _flag(argv, "--spec-type") == "draft-simple"
    assert (_flag(argv, "-md"), _flag(argv, "--spec-draft-n-max"), _flag(argv, "--spec-draft-n-min"),
            _flag(argv, "--draft-p-min"), _flag(argv, "-ngl"), _flag(argv, "-ngld")) == (
        "/m/d.gguf", "6", "0", "0", "99", "99")
    ngram = export("llama-server", ExportSpec(target="/m/t.gguf", drafter="ngram", k=3)).argv
    assert _flag(ngram, "--spec-type") == "ngram-simple" and _flag(ngram, "--spec-ngram-simple-size-m") == "3"
    assert "-md" not in ngram


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama-server"])
def test_settings_without_equivalent_become_notes(engine):
    launch = export(engine, ExportSpec(target="/m/t", draft="/m/d", drafter="hybrid", k="auto", draft_vocab=32768))
    text = " ".join(launch.notes)
    assert "cost-aware k" in text and "hybrid" in text and "reduced-vocabulary" in text
    assert str(AUTO_K) in launch.render()


def test_extra_flags_pass_through_and_render_is_shell_ready():
    launch = export("vllm", ExportSpec(target="/m/my target", draft="/m/d", extra=("--max-model-len", "8192")))
    assert launch.argv[-2:] == ("--max-model-len", "8192")
    rendered = launch.render()
    command = " ".join(line.rstrip("\\").strip() for line in rendered.splitlines() if not line.startswith("#"))
    assert tuple(shlex.split(command)) == launch.argv


def test_render_puts_notes_first():
    text = Launch(("prog", "-a", "1"), ("no equivalent",)).render()
    assert text.splitlines()[0] == "# no equivalent" and text.splitlines()[1] == "prog \\"


@pytest.mark.parametrize("kwargs, message", [
    (dict(drafter="model"), "needs a draft model"),
    (dict(draft="/d", drafter="tree"), "unknown drafter"),
    (dict(draft="/d", k=0), "k must be"),
    (dict(draft="/d", tensor_parallel_size=0), "tensor parallel"),
    (dict(draft="/d", port=70000), "port"),
])
def test_spec_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExportSpec(target="/t", **kwargs)


def test_unknown_engine():
    with pytest.raises(ValueError, match="unknown engine"):
        export("tgi", PAIR)


def test_known_names_resolve_to_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    entry = tmp_path / "models" / "smollm2-135m-instruct"
    (entry / "hf").mkdir(parents=True)
    (entry / "model.gguf").write_bytes(b"")
    (entry / "manifest.json").write_text("{}")
    assert locate("vllm", "smollm2-135m-instruct") == str(entry / "hf")
    assert locate("llama-server", "smollm2-135m-instruct") == str(entry / "model.gguf")


def test_a_gguf_is_refused_for_vllm(tmp_path):
    from verispec.names.errors import ModelError

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ModelError, match="GGUF"):
        locate("vllm", str(gguf))
    assert locate("llama-server", str(gguf)) == str(gguf)


def test_cli_prints_the_command(tmp_path, capsys):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"")
    draft.write_bytes(b"")
    rc = main(["export", "llama-server", "--target", str(target), "--draft", str(draft), "-k", "auto",
               "--engine-args", "-c 4096"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("# cost-aware k") and "-md " + str(draft) in out and out.rstrip().endswith("-c 4096")


def test_cli_errors_are_one_line(capsys):
    assert main(["export", "vllm", "--target", "/nowhere/model.gguf", "--drafter", "ngram"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("verispec: error:") and "\n" not in err
