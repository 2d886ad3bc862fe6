"""backend='auto': the choice per machine and its reason, the per-backend default drafter and k, what runs
and why surfaced to front ends, the end-of-generation set, and the warm-up at load."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from tiny import byte_tokenizer, save_tiny_pair, tiny_qwen2

from verispec.apps.cli import main
from verispec.assembly.build import build
from verispec.assembly.registry import DRAFTERS
from verispec.assembly.resolve import Machine, choose_backend, choose_dtype, default_refs, describe_machine, resolve
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.assembly.store import ModelStore, warm_up
from verispec.backends import HFModel
from verispec.backends.loading import eog_ids_of_vocab, eog_token_ids
from verispec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, MANIFEST
from verispec.names.errors import SpecError
from verispec.names.k import DEFAULTS, Defaults

SMOLLM = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("auto"))


# -- the choice, on fake machines ----------------------------------------------------------------------


@pytest.mark.parametrize("machine, backend, words", [
    (Machine(cuda=False, llama_cpp=True, gguf=True), "llamacpp", "llama-cpp-python installed"),
    (Machine(cuda=True, llama_cpp=True, gguf=True, device="cpu"), "llamacpp", "CPU"),  # CPU asked for
    (Machine(cuda=False, llama_cpp=True, gguf=True, gguf_only=True), "llamacpp", "GGUF"),
    (Machine(cuda=False, llama_cpp=False, gguf=True), "hf", "not installed"),
    (Machine(cuda=False, llama_cpp=True, gguf=False), "hf", "no GGUF"),
    (Machine(cuda=True, llama_cpp=True, gguf=True), "hf", "CUDA"),
    (Machine(cuda=False, llama_cpp=True, gguf=True, device="cuda:1"), "hf", "CUDA"),  # CUDA asked for
    (Machine(cuda=False, llama_cpp=True, gguf=False, loaded=True), "hf", "loaded"),
])
def test_choose_backend_on_fake_machines(machine, backend, words):
    chosen, reason = choose_backend(machine)
    assert chosen == backend and words in reason and "\n" not in reason
    assert reason.startswith("llama.cpp:" if backend == "llamacpp" else "transformers:")


@pytest.mark.parametrize("flags, dtype, words", [
    ({"avx512f", "amx_tile", "amx_bf16"}, "bf16", "amx_bf16"),  # Intel Xeon with AMX
    ({"avx512f", "avx512_bf16"}, "bf16", "avx512_bf16"),  # AMD EPYC Zen 4
    ({"avx512f", "avx512_vnni", "avx2"}, "fp32", "no native bf16"),  # bf16 would be emulated
    (set(), "fp32", "no native bf16"),  # no /proc/cpuinfo
])
def test_choose_dtype_on_fake_cpus(flags, dtype, words):
    chosen, reason = choose_dtype(torch.device("cpu"), frozenset(flags))
    assert chosen == dtype and words in reason and reason.startswith(f"{dtype}:")


def test_the_dtype_defaults_to_the_cpus_choice(pair_dirs, monkeypatch, capsys):
    import verispec.assembly.resolve as resolve_module

    target, draft = pair_dirs
    for flags, dtype, torch_dtype in (({"amx_bf16"}, "bf16", torch.bfloat16), ({"avx2"}, "fp32", torch.float32)):
        monkeypatch.setattr(resolve_module, "cpu_flags", lambda flags=flags: frozenset(flags))
        pipe = build(TargetSpec(target, backend="hf", device="cpu"), DraftSpec("model", draft), 2)
        assert pipe.dtype == dtype and pipe.setup()["dtype"] == dtype
        assert pipe.reason.endswith("; " + choose_dtype(torch.device("cpu"), frozenset(flags))[1])
        assert pipe.engine.target.model.dtype == torch_dtype
    assert build(TargetSpec(target, device="cpu", dtype="bf16"), None).dtype == "bf16"  # asked for: kept, no reason
    assert "bf16" not in build(TargetSpec(target, device="cpu", dtype="bf16"), None).reason
    assert main(["generate", "--target", target, "--no-speculation", "--prompt", "hi", "--max-new-tokens", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["dtype"] == "fp32" and out["reason"].endswith("fp32: the CPU has no native bf16 (neither AVX512-BF16 "
                                                            "nor AMX-BF16)")


def test_a_gguf_file_without_llama_cpp_is_a_clear_error():
    with pytest.raises(SpecError) as info:
        choose_backend(Machine(cuda=False, llama_cpp=False, gguf=True, gguf_only=True))
    exc = info.value
    assert exc.field == "target.backend" and exc.runtime and ("target.backend", "hf") in exc.fixes
    assert "llama-cpp-python" in str(exc) and "--" not in str(exc)


def _fake_install(root, name: str) -> None:
    """A model directory as `verispec models pull` leaves it, with placeholder files."""
    entry = root / "models" / name
    (entry / "hf").mkdir(parents=True)
    (entry / "hf" / "config.json").write_text("{}")
    (entry / "model.gguf").write_bytes(b"GGUF")
    (entry / MANIFEST).write_text("{}")


def test_describe_machine_reads_the_reference(pair_dirs, tmp_path, monkeypatch):
    target, _ = pair_dirs
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    _fake_install(tmp_path, DEFAULT_TARGET)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    known = describe_machine(TargetSpec(DEFAULT_TARGET))
    assert known.gguf and not known.gguf_only and not known.loaded
    as_file = describe_machine(TargetSpec(str(gguf), device="cpu"))
    assert as_file.gguf and as_file.gguf_only and as_file.device == "cpu"
    assert not describe_machine(TargetSpec(target)).gguf  # a Hugging Face directory only
    assert describe_machine(TargetSpec(tiny_qwen2(1), tokenizer=byte_tokenizer())).loaded
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    assert not describe_machine(TargetSpec(DEFAULT_TARGET)).llama_cpp


def test_auto_resolves_through_the_machine(pair_dirs, tmp_path, monkeypatch, capsys):
    """resolve and the CLI take the choice: a GGUF file on a CPU without llama-cpp-python is refused with
    its fix in flags; an explicit backend is kept as asked."""
    target, _ = pair_dirs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SpecError) as info:
        resolve(TargetSpec(str(gguf)), None)
    assert info.value.field == "target.backend"
    assert resolve(TargetSpec(str(gguf), backend="hf"), None)[0].backend == "hf"
    assert resolve(TargetSpec(target), None)[0].backend == "hf"
    assert main(["generate", "--target", str(gguf), "--no-speculation", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama-cpp-python" in err and "--backend hf" in err


# -- the default drafter and k per backend ----------------------------------------------------------------


@pytest.mark.parametrize("backend", sorted(DEFAULTS))
def test_each_backend_gets_its_default_drafter(backend):
    """DraftSpec's 'auto' drafter becomes the table's, for whatever the table holds; a draft model the user
    names is used even where the table's drafter takes none."""
    drafter = DEFAULTS[backend].drafter
    needs_model = DRAFTERS[drafter].needs_model
    target = TargetSpec("t", backend=backend, device="cpu")
    _, draft, _ = resolve(target, DraftSpec(model="d" if needs_model else None))
    assert draft.drafter == drafter
    _, draft, _ = resolve(target, DraftSpec(model="d"))
    assert draft.drafter == (drafter if needs_model else "model") and draft.model == "d"


def test_the_table_is_applied_and_explicit_settings_win(pair_dirs, monkeypatch):
    """build takes the drafter and k from DEFAULTS when neither is named (here a table changed to ngram, k=3,
    so that the test cannot pass by matching the built-in defaults); a named drafter or k wins."""
    target, draft = pair_dirs
    monkeypatch.setitem(DEFAULTS, "hf", Defaults("ngram", 3))
    t = TargetSpec(target, device="cpu", dtype="fp32")
    store = ModelStore()
    pipe = build(t, DraftSpec(), store=store)
    assert (pipe.backend, pipe.drafter, pipe.k, pipe.draft_model) == ("hf", "ngram", 3, None)
    assert "drafter ngram and k=3" in pipe.reason
    assert build(t, DraftSpec(), 5, store=store).k == 5  # k named
    named = build(t, DraftSpec("suffix"), store=store)  # drafter named: the generic default k
    assert (named.drafter, named.k) == ("suffix", 4) and "drafter" not in named.reason
    with_model = build(t, DraftSpec(model=draft), store=store)  # a draft named: the model drafter uses it
    assert with_model.drafter == "model" and with_model.draft_model is not None and with_model.k == 4
    monkeypatch.setitem(DEFAULTS, "hf", Defaults("model", 3))
    assert build(t, DraftSpec(model=draft), store=store).k == 3  # the backend's default pair


@pytest.mark.parametrize("backend", sorted(DEFAULTS))
def test_default_pair_loads_a_draft_only_for_a_drafter_that_uses_one(backend, tmp_path, monkeypatch):
    """With the default target and no drafter named, a draft is named (hence loaded) only when the backend's
    default drafter drafts with a model, or the backend pairs the default target with a draft of its own: for
    one user's generation, not for a server. A named drafter that takes a model gets the catalog's draft."""
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT, *(d.draft for d in DEFAULTS.values() if d.draft)):
        _fake_install(tmp_path, name)
    own = DEFAULTS[backend]
    alone = DEFAULT_DRAFT if DRAFTERS[own.drafter].needs_model else None
    if own.pair_drafter is not None:
        assert default_refs(None, None, "auto", backend=backend) == (DEFAULT_TARGET, own.draft, own.pair_drafter)
        assert default_refs(None, None, own.pair_drafter, backend=backend) == (DEFAULT_TARGET, DEFAULT_DRAFT,
                                                                               own.pair_drafter)
    else:
        assert default_refs(None, None, "auto", backend=backend) == (DEFAULT_TARGET, alone, "auto")
    assert default_refs(None, None, "auto", backend=backend, serving=True) == (DEFAULT_TARGET, alone, "auto")
    assert default_refs(None, None, "auto", backend=backend, k=0) == (DEFAULT_TARGET, alone, "auto")  # plain
    assert default_refs(None, None, "model", backend=backend) == (DEFAULT_TARGET, DEFAULT_DRAFT, "model")  # named
    assert default_refs(None, "other", "auto", backend=backend) == (DEFAULT_TARGET, "other", "auto")
    assert default_refs("mine", None, "auto", backend=backend) == ("mine", None, "auto")  # a target named


def test_a_pair_draft_not_installed_leaves_the_backends_drafter_with_a_warning(tmp_path, monkeypatch):
    """The default target's own pair on llama.cpp with its draft missing: the backend's default drafter drafts
    alone, with a warning saying how to install the draft; asked to pull, the pair is kept (and pulled)."""
    import verispec.assembly.resolve as resolve_module

    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    _fake_install(tmp_path, DEFAULT_TARGET)
    own = DEFAULTS["llamacpp"]
    with pytest.warns(UserWarning, match=f"'{own.draft}' is not installed.*verispec models pull"):
        assert default_refs(None, None, "auto", backend="llamacpp") == (DEFAULT_TARGET, None, "auto")
    pulled = []
    monkeypatch.setattr(resolve_module, "pull", pulled.append)
    assert default_refs(None, None, "auto", backend="llamacpp", pull_missing=True) == (DEFAULT_TARGET, own.draft,
                                                                                       own.pair_drafter)
    assert pulled == [own.draft]


def test_cli_without_a_drafter_on_a_target_alone(pair_dirs, capsys, monkeypatch):
    """No --draft, no --drafter: the backend's default drafter; one that needs a draft is refused naming the
    flags that fix it, one that needs none just runs."""
    target, _ = pair_dirs
    monkeypatch.setitem(DEFAULTS, "hf", Defaults("model", 4))
    assert main(["generate", "--target", target, "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "[--draft]" in err and "--drafter ngram" in err and "--no-speculation" in err
    monkeypatch.setitem(DEFAULTS, "hf", Defaults("suffix", "auto"))
    assert main(["generate", "--target", target, "--prompt", "a", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["drafter"], out["k"]) == ("suffix", "auto")


# -- what runs and why, in every front end ---------------------------------------------------------------


def test_generate_json_says_what_runs_and_why(pair_dirs, capsys):
    target, draft = pair_dirs
    common = ["generate", "--target", target, "--draft", draft, "--prompt", "hi", "--max-new-tokens", "3", "--json"]
    assert main([*common, "--drafter", "model"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["backend"], out["drafter"], out["k"]) == ("hf", "model", 4)
    assert out["reason"].startswith("transformers: the target has no GGUF file; ")  # then the dtype's
    assert main([*common, "--backend", "hf", "-k", "2", "--drafter", "hybrid", "--dtype", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["backend"], out["drafter"], out["k"], out["reason"]) == ("hf", "hybrid", 2, "transformers: asked for")


def test_models_endpoint_carries_the_setup(pair_dirs):
    import asyncio

    import httpx

    from verispec.apps.server.app import ServerSettings, create_app

    target, _ = pair_dirs
    pipe = build(TargetSpec(target, device="cpu", dtype="fp32"), DraftSpec("ngram"), 2)
    app = create_app(pipe, ServerSettings(model_names=("tiny", "verispec")))

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return (await client.get("/v1/models")).json()

    body = asyncio.run(get())
    assert [m["id"] for m in body["data"]] == ["tiny", "verispec"]
    for entry in body["data"]:
        setup = {key: entry["verispec"][key] for key in ("backend", "drafter", "k", "reason")}
        assert setup == {"backend": "hf", "drafter": "ngram", "k": 2, "reason": "transformers: the target has no GGUF file"}
        assert entry["verispec"]["drafters"] == ["ngram", "none"]  # what a request may ask for (the page's list)


def test_chat_stats_show_the_setup(pair_dirs, monkeypatch, capsys):
    import io

    from verispec.apps.chat import ChatBot
    from verispec.apps.repl import run_repl

    target, _ = pair_dirs
    pipe = build(TargetSpec(target, device="cpu", dtype="fp32"), DraftSpec("suffix"), "auto")
    monkeypatch.setattr("sys.stdin", io.StringIO("/stats\n"))
    assert run_repl(ChatBot(pipe, max_new_tokens=4), interactive=False) == 0
    assert "[backend hf, drafter suffix, k=auto (transformers: the target has no GGUF file)]" in capsys.readouterr().err


# -- the end-of-generation set ---------------------------------------------------------------------------


def test_eog_rule_on_a_vocabulary():
    """llama.cpp's rule: the listed texts, one FIM pad / repo / file-separator token each, the EOS id, and the
    exclusions (gpt-oss' <|end|> where <|return|> and <|call|> are there)."""
    vocab = {"a": 0, "<|im_end|>": 1, "<|endoftext|>": 2, "<|fim_pad|>": 3, "<|repo_name|>": 4, "<|file_sep|>": 5,
             "<|fim_prefix|>": 6, "<|im_start|>": 7, "<repo_name>": 8, "<reponame>": 9}
    assert eog_ids_of_vocab(vocab, [1]) == [1, 2, 3, 4, 5]  # one repo token (the first candidate), no prefix
    assert eog_ids_of_vocab({"a": 0, "<|im_start|>": 1}, [0]) == [0]
    harmony = {"<|return|>": 0, "<|call|>": 1, "<|end|>": 2, "x": 3}
    assert eog_ids_of_vocab(harmony, []) == [0, 1]
    assert eog_ids_of_vocab({"<|end|>": 2, "x": 3}, []) == [2]  # <|end|> alone ends generation


def test_the_end_set_is_the_same_on_every_backend(pair_dirs, monkeypatch):
    """build's EOS set includes the tokenizer's EOG tokens (the tiny tokenizer's <|endoftext|> besides its
    EOS <|im_end|>), whichever backend loads the model."""
    from verispec.assembly.registry import BACKENDS, Backend

    target, _ = pair_dirs
    tok = byte_tokenizer()
    expected = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert set(eog_token_ids(tok)) == expected
    hf = build(TargetSpec(target, device="cpu", dtype="fp32"), None, 0)
    # a backend that reports no EOS of its own (as a GGUF whose metadata names none would)
    monkeypatch.setitem(BACKENDS, "bare", Backend(lambda r: (BACKENDS["hf"].load(r)[0], []), True, True))
    bare = build(TargetSpec(target, backend="bare", device="cpu", dtype="fp32"), None, 0)
    assert hf.engine.eos_token_ids == bare.engine.eos_token_ids == expected


# -- warm-up ---------------------------------------------------------------------------------------------


def test_warm_up_leaves_the_cache_empty_and_outputs_unchanged():
    from verispec.backends.base import Sequence
    from verispec.backends.lean import LeanBatch, LeanNet

    ids = torch.tensor([5, 9, 2, 7, 1, 3])
    for wrap in (HFModel, lambda m: LeanBatch(LeanNet(m), slots=1)):
        cold, warm = wrap(tiny_qwen2(3).float()), wrap(tiny_qwen2(3).float())
        warm_up(warm)
        assert warm.lengths == [0]
        cold_seq, warm_seq = Sequence(cold), Sequence(warm)
        assert torch.equal(warm_seq.forward(ids), cold_seq.forward(ids))
        assert torch.equal(warm_seq.forward(ids[:1]), cold_seq.forward(ids[:1]))


def test_the_store_warms_up_each_model_once(pair_dirs, monkeypatch):
    """The target and the draft each get one warm-up at load (a model's forwards before any generation),
    not one per pipeline."""
    import verispec.assembly.store

    target, draft = pair_dirs
    warmed = []
    real = verispec.assembly.store.warm_up
    monkeypatch.setattr(verispec.assembly.store, "warm_up", lambda model: warmed.append(model) or real(model))
    store = ModelStore()
    t = TargetSpec(target, device="cpu", dtype="fp32")
    a = build(t, DraftSpec("model", draft), 2, store=store)
    b = build(t, DraftSpec("hybrid", draft), 3, store=store)
    assert warmed == [a.engine.target, a.draft_model] and b.draft_model is a.draft_model
    assert a.engine.target.lengths == [0] and a.draft_model.lengths == [0]


# -- on real models ----------------------------------------------------------------------------------------


def _installed(name: str):
    from verispec.catalog import installed

    root = installed(name)
    if root is None:
        pytest.fail(f"{name} is not installed; run `make setup` (verispec models pull {name})")
    return root


@pytest.mark.integration
@pytest.mark.parametrize("name", [SMOLLM, "qwen2.5-coder-0.5b-instruct"])
def test_eog_set_matches_llama_cpp(name):
    """The rule reproduces the set llama.cpp derives from the GGUF (llama_vocab_is_eog), so both backends
    stop where llama.cpp does."""
    from verispec.backends.llamacpp import eog_ids_of_gguf
    from verispec.backends.loading import load_tokenizer

    root = _installed(name)
    ours = eog_token_ids(load_tokenizer(name))  # the tokenizer a pull extracts (or the converted one)
    assert ours == eog_ids_of_gguf(str(root / "model.gguf"))
    assert len(ours) > 1  # more than the configured EOS: <|endoftext|> at least


@pytest.mark.integration
def test_auto_on_this_cpu_runs_llama_cpp_exactly():
    """SmolLM2 with backend auto on this CPU (llama-cpp-python installed, the model has a GGUF) runs on
    llama.cpp with its default drafter, and its greedy tokens equal plain decoding's on llama.cpp, stopping
    where llama-cpp-python's own decoding stops. Plain decoding on llama.cpp, not on transformers, is the
    oracle: llama.cpp computes the Q4_1 GGUF's matmuls against 8-bit-quantised activations, transformers the
    dequantised bf16 weights in fp32, and the two part ways within a few dozen tokens on this model."""
    import verispec

    _installed(SMOLLM)
    pipe = verispec.load(SMOLLM, device="cpu")
    assert (pipe.backend, pipe.drafter, pipe.k) == ("llamacpp", DEFAULTS["llamacpp"].drafter, DEFAULTS["llamacpp"].k)
    assert pipe.reason.startswith("llama.cpp: CPU, llama-cpp-python installed")
    hf = verispec.load(SMOLLM, backend="hf", dtype="fp32", drafter=None)
    assert hf.engine.eos_token_ids == pipe.engine.eos_token_ids  # the same end set on both backends
    plain = verispec.load(SMOLLM, drafter=None, device="cpu")
    messages = [{"role": "user", "content": "Name three colours."}]
    spec = pipe.generate(messages, max_new_tokens=96)
    reference = plain.generate(messages, max_new_tokens=96)
    assert spec.token_ids == reference.token_ids
    assert spec.token_ids == _llama_cpp_python_greedy(plain, messages, 96)


def _llama_cpp_python_greedy(pipe, prompt, n: int) -> list[int]:
    """llama-cpp-python's own greedy decoding of the pipeline's target, ended as its create_completion ends
    it: at a token llama.cpp marks end-of-generation (kept here, as verispec keeps its EOS), or after n."""
    import llama_cpp

    llm = pipe.engine.target.llm
    out: list[int] = []
    for token in llm.generate(pipe.encode(prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
        out.append(int(token))
        if len(out) == n or llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
    llm.reset()
    pipe.engine.reset()
    return out


@pytest.mark.integration
def test_warm_up_on_llama_cpp_leaves_outputs_unchanged():
    from verispec.backends.base import Sequence
    from verispec.backends.llamacpp import LlamaCppModel

    root = _installed(SMOLLM)
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 2])
    cold = LlamaCppModel(str(root / "model.gguf"), n_ctx=256)
    expected = Sequence(cold).forward(ids)
    del cold
    warm = LlamaCppModel(str(root / "model.gguf"), n_ctx=256)
    warm_up(warm)
    assert warm.lengths == [0]
    assert torch.equal(Sequence(warm).forward(ids), expected)


@pytest.mark.integration
def test_both_backends_stop_where_llama_cpp_stops():
    """Qwen2.5-Coder-0.5B ends this fill-in-the-middle answer with <|endoftext|>, which its configuration does
    not name as EOS but llama.cpp ends generation at. Both backends stop there, with the same tokens, as
    llama-cpp-python's own decoding does; without the EOG set they would run on to max_new_tokens."""
    import verispec

    name = "qwen2.5-coder-0.5b-instruct"
    _installed(name)
    prompt = "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>"
    llama = verispec.load(name, drafter=None, device="cpu")
    assert llama.backend == "llamacpp"
    ended = llama.generate(prompt, max_new_tokens=48)
    end = llama.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert ended.finish_reason == "stop" and ended.token_ids[-1] == end != llama.tokenizer.eos_token_id
    assert ended.token_ids == _llama_cpp_python_greedy(llama, prompt, 48)
    hf = verispec.load(name, backend="hf", dtype="fp32", drafter=None)
    assert hf.engine.eos_token_ids == llama.engine.eos_token_ids
    assert hf.generate(prompt, max_new_tokens=48).token_ids == ended.token_ids


@pytest.mark.parametrize("command", ["generate", "serve", "generate -k 0"])
def test_the_default_pair_is_one_users_a_server_keeps_the_backends_drafter(command, monkeypatch, tmp_path):
    """With no model named on llama.cpp, `generate` builds the backend's own pair (its pair drafter and draft
    model), `verispec serve`, whose requests share each pass, and `generate -k 0`, which drafts nothing, the
    backend's drafter without a draft (no draft model loaded)."""
    import verispec.assembly.build as build_module
    import verispec.assembly.resolve as resolve_module

    built = []

    def fake_build(target, draft, k, **_):
        built.append(draft)
        raise KeyboardInterrupt  # stops the command here: nothing loads

    monkeypatch.setattr(resolve_module, "resolve_target_backend", lambda spec: ("llamacpp", "asked"))
    monkeypatch.setattr(resolve_module, "installed", lambda name: tmp_path)
    monkeypatch.setattr(build_module, "build", fake_build)
    name, *flags = command.split()
    assert main([name, *flags, *(["--prompt", "hi"] if name == "generate" else [])]) != 0
    own = DEFAULTS["llamacpp"]
    want = (own.pair_drafter, own.draft) if command == "generate" else ("auto", None)
    assert (built[0].drafter, built[0].model) == want


def test_a_defaults_entry_is_checked():
    """An entry names a known drafter; its pair, a drafter that takes a chain-drafting model, with that model."""
    for bad in ({"drafter": "nope", "k": 4}, {"drafter": "suffix", "k": "auto", "pair_drafter": "suffix", "draft": "d"},
                {"drafter": "suffix", "k": "auto", "pair_drafter": "hybrid-suffix"}):
        with pytest.raises(ValueError):
            Defaults(**bad)
    assert Defaults("suffix", "auto", pair_drafter="hybrid-suffix", draft="d").draft == "d"
