"""Specs, registries, combination rules, the model store and llama.cpp's context rule (tiny models, no network)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from tiny import byte_tokenizer, save_tiny_pair, tiny_qwen2

from verispec.apps.cli import main
from verispec.assembly.build import build
from verispec.assembly.registry import BACKENDS, DRAFTERS, Backend
from verispec.assembly.resolve import choose_draft_quant, default_refs, resolve
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.assembly.store import ModelStore
from verispec.backends.gguf import CONTEXT_STEP, context_size, kv_bytes_per_token
from verispec.catalog.gguf import gguf_metadata
from verispec.names.errors import SpecError
from verispec.names.k import DEFAULTS, default_k, unasked_k


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("build"))


def _refused(target: TargetSpec, draft: DraftSpec | None) -> SpecError:
    with pytest.raises(SpecError) as info:
        resolve(target, draft)
    assert "--" not in str(info.value)  # library errors speak of specs, not of command-line flags
    return info.value


def test_specs_are_frozen():
    target, draft = TargetSpec("t"), DraftSpec("model", "d")
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.backend = "llamacpp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        draft.quant = "int8"
    assert dataclasses.replace(draft, quant="int8").quant == "int8" and draft.quant == "auto"


@pytest.mark.parametrize("make, field, words", [
    (lambda: TargetSpec("t", backend="vllm"), "target.backend", "unknown backend 'vllm'"),
    (lambda: TargetSpec("t", device="tpu"), "target.device", "unknown device 'tpu'"),
    (lambda: TargetSpec("t", device="cpu:1"), "target.device", "unknown device"),
    (lambda: TargetSpec("t", dtype="int3"), "target.dtype", "unknown dtype"),
    (lambda: TargetSpec("t", ctx_size=0), "target.ctx_size", "context size"),
    (lambda: TargetSpec(""), "target.model", "a model is"),
    (lambda: TargetSpec(3), "target.model", "a model is"),
    (lambda: DraftSpec("medusa"), "draft.drafter", "unknown drafter 'medusa'"),
    (lambda: DraftSpec("model", "d", backend="vllm"), "draft.backend", "unknown draft backend"),
    (lambda: DraftSpec("model", "d", quant="int5"), "draft.quant", "unknown draft quantisation 'int5'"),
    (lambda: DraftSpec("model", "d", vocab=-5), "draft.vocab", "must be >= 0"),
    (lambda: DraftSpec("model", "d", vocab=True), "draft.vocab", "must be >= 0"),
    (lambda: DraftSpec("model", "d", forward="fast"), "draft.forward", "unknown draft forward"),
])
def test_each_field_is_checked_when_the_spec_is_made(make, field, words):
    with pytest.raises(SpecError) as info:
        make()
    assert info.value.field == field and words in str(info.value) and "--" not in str(info.value)


def test_registries_name_every_backend_and_drafter():
    assert set(BACKENDS) == {"hf", "llamacpp"}
    assert set(DRAFTERS) == {"model", "ngram", "suffix", "hybrid", "hybrid-suffix", "tree"}
    assert BACKENDS["hf"].draft_options and not BACKENDS["llamacpp"].draft_options
    assert {name for name, d in DRAFTERS.items() if d.needs_model} == {"model", "hybrid", "hybrid-suffix", "tree"}
    draft = SimpleNamespace(slots=2)  # a draft Model of two slots, as far as making a drafter looks at it

    def lookups(drafter, kind: str) -> list:
        """The drafter's lookups, one per slot, all of `kind`."""
        assert type(drafter).__name__ == "LookupDrafter" and len(drafter.lookups) == 2
        assert {type(lookup).__name__ for lookup in drafter.lookups} == {kind}
        return drafter.lookups

    for name, lookup in (("hybrid", "NgramProposer"), ("hybrid-suffix", "SuffixProposer")):
        drafter = DRAFTERS[name].make(draft, 64, 2)
        assert type(drafter).__name__ == "HybridDrafter" and drafter.model.vocab_size == 64
        assert drafter.model.model is draft
        lookups(drafter.lookup, lookup)
    lookups(DRAFTERS["ngram"].make(None, 64, 2), "NgramProposer")
    a, b = lookups(DRAFTERS["suffix"].make(None, 64, 2), "SuffixProposer")
    assert a.history is b.history  # a process's suffix lookups draft from one history


def test_build_loads_through_the_backend_registry(pair_dirs, monkeypatch):
    """A backend registered under a new name is a valid spec value, and build loads through its loader."""
    target, _ = pair_dirs
    asked = []

    def fake_load(request):
        asked.append(request)
        return BACKENDS["hf"].load(request)

    monkeypatch.setitem(BACKENDS, "fake", Backend(fake_load, draft_options=True, loaded_models=True))
    pipe = build(TargetSpec(target, backend="fake", device="cpu", dtype="fp32"), None, 0)
    assert pipe.backend == "fake" and len(asked) == 1 and asked[0].dtype == torch.float32
    assert len(pipe.generate("ab", max_new_tokens=3).token_ids) == 3


@pytest.mark.parametrize("target, draft, field, words", [
    (TargetSpec("t"), DraftSpec("model"), "draft.model", "the 'model' drafter needs a draft model"),
    (TargetSpec("t"), DraftSpec("hybrid"), "draft.model", "the 'hybrid' drafter needs a draft model"),
    (TargetSpec("t"), DraftSpec("ngram", "d"), "draft.model", "takes no draft model"),
    (TargetSpec("t"), DraftSpec("ngram", quant="int8"), "draft.quant", "applies to a draft model"),
    (TargetSpec("t"), DraftSpec("ngram", vocab=100), "draft.vocab", "applies to a draft model"),
    (TargetSpec("t"), DraftSpec("model", "d", backend="llamacpp", quant="int8"), "draft.quant", "already quantized"),
    (TargetSpec("t", backend="llamacpp"), DraftSpec("model", "d", quant="int4"), "draft.quant", "already quantized"),
    (TargetSpec("t"), DraftSpec("model", "d", backend="llamacpp", vocab=4096), "draft.vocab",
     "reduced draft vocabulary applies to a transformers draft"),
    (TargetSpec("t"), DraftSpec("model", "d", backend="llamacpp", forward="lean"), "draft.forward",
     "applies to a transformers draft"),
])
def test_combination_rules_refuse(target, draft, field, words):
    exc = _refused(target, draft)
    assert exc.field == field and words in str(exc)


def test_refusals_offer_what_would_be_accepted():
    assert ("draft.backend", "hf") in _refused(TargetSpec("t"), DraftSpec("model", "d", backend="llamacpp",
                                                                          vocab=64)).fixes
    assert ("draft.drafter", "ngram") in _refused(TargetSpec("t"), DraftSpec("model")).fixes


def test_loaded_models_rules():
    model = tiny_qwen2(1)
    assert _refused(TargetSpec(model), None).field == "target.tokenizer"
    assert _refused(TargetSpec(model, backend="llamacpp", tokenizer=byte_tokenizer()), None).field == "target.backend"
    assert _refused(TargetSpec(model, dtype="bf16", tokenizer=byte_tokenizer()), None).field == "target.dtype"
    assert _refused(TargetSpec(model, device="cuda", tokenizer=byte_tokenizer()), None).field == "target.device"
    assert _refused(TargetSpec("t"), DraftSpec("model", tiny_qwen2(2), quant="int4")).field == "draft.quant"
    assert _refused(TargetSpec("t"), DraftSpec("model", tiny_qwen2(2), vocab=32)).field == "draft.vocab"
    # auto leaves a loaded draft as it is (quantisation would rebuild its layers in place)
    _, draft, _ = resolve(TargetSpec(model, tokenizer=byte_tokenizer()), DraftSpec("model", tiny_qwen2(2)))
    assert draft.quant == "none" and draft.backend == "hf"


def test_resolution_accepts_and_decides_auto():
    cpu = TargetSpec("t", device="cpu")
    _, draft, device = resolve(cpu, DraftSpec("model", "d", vocab=128))
    assert device == torch.device("cpu") and (draft.backend, draft.quant, draft.vocab) == ("hf", "int4", 128)
    _, draft, _ = resolve(TargetSpec("t", backend="llamacpp", device="cpu"), DraftSpec("model", "d"))
    assert (draft.backend, draft.quant) == ("llamacpp", "none")  # the target's backend; a GGUF is quantised
    _, draft, _ = resolve(cpu, DraftSpec("model", "d", backend="llamacpp"))
    assert (draft.backend, draft.quant) == ("llamacpp", "none")
    target, draft, _ = resolve(cpu, DraftSpec("ngram"))
    assert target.backend == "hf" and draft.model is None  # auto: 't' has no GGUF
    assert resolve(cpu, None)[1] is None


def test_choose_draft_quant_and_default_k():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_draft_quant("auto", "hf", cpu) == "int4"
    assert choose_draft_quant("auto", "llamacpp", cpu) == "none"
    assert choose_draft_quant("auto", "hf", cuda) == "none"
    assert choose_draft_quant("int8", "hf", cuda) == "int8"
    assert default_k("hf", "hf") == 4 and default_k("hf", None) == 4
    assert default_k("llamacpp", None) == "auto" and default_k("hf", "llamacpp") == "auto"


@pytest.mark.parametrize("backend, drafter, model, draft_backend, named, want", [
    ("llamacpp", None, None, None, False, 0),  # no drafter: plain decoding
    ("hf", "tree", "d", "hf", True, "auto"),
    ("llamacpp", "suffix", None, None, False, 6),  # the backend's default drafter, unnamed: DEFAULTS' k
    ("llamacpp", "suffix", None, None, True, "auto"),  # named: default_k
    ("llamacpp", "hybrid-suffix", "smollm2-135m-instruct", "llamacpp", True, 6),  # the backend's own pair
    ("llamacpp", "hybrid-suffix", "other", "llamacpp", True, "auto"),
    ("llamacpp", "hybrid-suffix", "smollm2-135m-instruct", "hf", True, "auto"),  # the pair's draft elsewhere
    ("hf", "model", "d", "hf", False, 5),
    ("hf", "model", "d", "hf", True, 4),
    ("hf", None, None, None, False, 0),
])
def test_the_k_a_request_gets_unasked(monkeypatch, backend, drafter, model, draft_backend, named, want):
    """One rule (names.k.unasked_k), read by build and by `verispec bench`; DEFAULTS' k set apart from default_k's
    here, so that a caller taking one for the other shows."""
    monkeypatch.setitem(DEFAULTS, "llamacpp", dataclasses.replace(DEFAULTS["llamacpp"], k=6))
    monkeypatch.setitem(DEFAULTS, "hf", dataclasses.replace(DEFAULTS["hf"], k=5))
    assert unasked_k(backend, drafter, model, draft_backend, named) == want


def test_k_is_checked():
    for bad in (-1, "fast", 2.5, True):
        with pytest.raises(SpecError) as info:
            build(TargetSpec("t"), None, bad)
        assert info.value.field == "k"


def test_default_pair_missing_is_refused_with_its_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    with pytest.raises(SpecError) as info:
        default_refs(None, None, "model")
    assert "verispec models pull" in str(info.value) and info.value.fixes == (("pull", True),)
    assert default_refs("t", "d", "model") == ("t", "d", "model")  # given references are not looked up here


def test_store_loads_each_model_once(pair_dirs, monkeypatch):
    """Configurations with different drafters and k share the target and the draft the store loaded once; a
    target and a draft naming the same model are two models (one generation uses both caches at once)."""
    target, draft = pair_dirs
    loads = []
    real = BACKENDS["hf"]
    monkeypatch.setitem(BACKENDS, "hf", Backend(lambda r: loads.append(r.model) or real.load(r), True, True))
    store = ModelStore()
    t = TargetSpec(target, device="cpu", dtype="fp32")
    a = build(t, DraftSpec("model", draft), 2, store=store)
    b = build(t, DraftSpec("hybrid", draft), "auto", store=store)
    plain = build(t, None, 0, store=store)
    assert sorted(loads) == sorted([target, draft])
    assert a.engine.target is b.engine.target is plain.engine.target
    assert a.draft_model is b.draft_model is not None
    assert a.engine.k_policy is not b.engine.k_policy  # each pipeline learns its own k
    build(t, DraftSpec("model", draft, quant="int8"), 2, store=store)  # another draft setup: loaded anew
    assert loads.count(draft) == 2
    same = build(t, DraftSpec("model", target), 2, store=store)
    assert same.draft_model is not same.engine.target
    # the reset rule: a pipeline reset after another used the shared models generates as a fresh one does
    ids = list(a.tokenizer("hello").input_ids)
    fresh = build(t, DraftSpec("hybrid", draft), "auto").engine.generate(ids, max_new_tokens=12).token_ids
    a.engine.generate(ids[:2], max_new_tokens=12)
    b.engine.reset()
    assert b.engine.generate(ids, max_new_tokens=12).token_ids == fresh


def _fake_meta(layers=24, heads=14, kv_heads=2, embedding=896, trained=32768, **extra):
    meta = {"general.architecture": "qwen2", "qwen2.block_count": layers, "qwen2.attention.head_count": heads,
            "qwen2.attention.head_count_kv": kv_heads, "qwen2.embedding_length": embedding,
            "qwen2.context_length": trained}
    return meta | {f"qwen2.{k}": v for k, v in extra.items()}


def test_llama_context_from_the_model_bounded_by_memory():
    meta = _fake_meta()
    per_token = 24 * 2 * (64 + 64) * 2  # layers x KV heads x (key + value head size) x f16
    assert kv_bytes_per_token(meta) == per_token
    assert kv_bytes_per_token(_fake_meta(**{"attention.key_length": 128, "attention.value_length": 96})) == \
        24 * 2 * (128 + 96) * 2
    assert kv_bytes_per_token(_fake_meta(layers=3, kv_heads=[1, 2, 4])) == 7 * 128 * 2  # per-layer head counts
    assert context_size(meta, 64 << 30) == 32768  # plenty of memory: the trained context
    assert context_size(meta, None) == 32768  # memory unknown: no bound
    assert context_size(meta, 64 << 30, requested=1000) == 1000  # asked for: as asked
    # 1 GiB available: a quarter of it holds 21845 tokens of KV cache; rounded down to a multiple of 256
    assert context_size(meta, 1 << 30) == 21760 == (1 << 30) // 4 // per_token // CONTEXT_STEP * CONTEXT_STEP
    assert context_size(meta, 1 << 20) == CONTEXT_STEP  # never below one step


def test_gguf_metadata_reads_the_header(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_token_list(["a", "bb", "ccc"])
    writer.add_name("tiny")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = gguf_metadata(str(path))
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "tiny"
    assert meta["llama.context_length"] == 4096 and meta["llama.attention.head_count_kv"] == 2
    assert "tokenizer.ggml.tokens" not in meta  # skipped, not read
    assert kv_bytes_per_token(meta) == 3 * 2 * (16 + 16) * 2
    assert context_size(meta, None) == 4096


def test_cli_names_its_flags_for_a_refused_spec(pair_dirs, capsys):
    target, draft = pair_dirs
    assert main(["generate", "--target", target, "--draft", draft, "--draft-backend", "llamacpp", "--draft-vocab",
                 "64", "--prompt", "a"]) == 2
    err = capsys.readouterr().err.strip()
    assert "[--draft-vocab]" in err and "--draft-backend hf" in err and "\n" not in err
    assert main(["generate", "--target", target, "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "--draft" in err and "--drafter ngram" in err and "--no-speculation" in err
