"""Real models from the verispec cache (`make setup` installs them). Selected with `-m integration`."""

from __future__ import annotations

import json

import pytest

from verispec.apps.cli import main
from verispec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, installed

pytestmark = pytest.mark.integration

PROMPT = "Write a Python function that checks whether a number is prime."


def _need(*names: str) -> None:
    missing = [n for n in names if installed(n) is None]
    if missing:
        pytest.fail(f"models not installed: {missing}; run `make setup` (verispec models pull ...)")


def _generate(capsys, *argv) -> dict:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_smollm2_chat_answer(capsys):
    _need("smollm2-135m-instruct")
    m = "smollm2-135m-instruct"
    common = ["--target", m, "--draft", m, "--chat", "--prompt", "What is the capital of France?",
              "--max-new-tokens", "24", "--backend", "hf", "--dtype", "fp32", "--draft-backend", "hf",
              "--draft-quant", "none"]
    spec = _generate(capsys, *common)
    plain = _generate(capsys, *common, "--no-speculation")
    assert "Paris" in spec["text"]
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["stats"]["acceptance_rate"] > 0.9  # the draft is the target itself, unquantised
    int4 = _generate(capsys, *common[:-1], "int4")
    assert int4["token_ids"] == plain["token_ids"] and int4["draft_quant"] == "int4"


def _answer(pipe, max_new_tokens: int = 32, **settings) -> dict:
    """The answer to PROMPT as `verispec generate --json` gives it (token_ids, stats), from a fresh engine (a
    ModelStore's pipelines share their loaded models, whose caches hold the last pipeline's sequence)."""
    pipe.engine.reset()
    out = pipe.generate([{"role": "user", "content": PROMPT}], max_new_tokens=max_new_tokens, **settings)
    return {"token_ids": out.token_ids, "stats": out.stats.to_dict()}


def test_default_target_on_transformers_fp32_greedy_identical_with_each_draft():
    """The default target on transformers, fp32, one chat prompt decoded plainly once, the target loaded once (a
    ModelStore): the same tokens with the default draft (k = 4) and with SmolLM2-135M drafting (another tokenizer:
    49,152 tokens), whose tokens are accepted, and whose sampled run reproduces from its seed."""
    import verispec
    from verispec.assembly.store import ModelStore

    _need(DEFAULT_TARGET, DEFAULT_DRAFT, "smollm2-135m-instruct")
    store = ModelStore()
    # the pair first, in one load; the plain pipeline then takes its target from the store
    pair = verispec.load(DEFAULT_TARGET, DEFAULT_DRAFT, backend="hf", dtype="fp32", k=4, store=store)
    plain = _answer(verispec.load(DEFAULT_TARGET, backend="hf", dtype="fp32", drafter=None, store=store))
    spec = _answer(pair)
    assert spec["token_ids"] == plain["token_ids"]
    s = spec["stats"]
    speedup = s["tokens_per_second"] / plain["stats"]["tokens_per_second"]
    print(f"\ndefault pair fp32: acceptance {s['acceptance_rate']:.3f}, mean accepted length "
          f"{s['mean_accepted_length']:.2f}, speedup {speedup:.2f}x (same run)")
    assert s["acceptance_rate"] > 0.3  # a real draft of the same family agrees often
    _check_smollm2_drafts(store, plain["token_ids"], backend="hf", draft_backend="hf", dtype="fp32")


def _check_smollm2_drafts(store, plain_ids: list[int], **settings):
    """SmolLM2-135M drafting for the default target (k = 4; `settings`: the backends): greedy output
    token-identical to plain decoding; the draft's tokens are accepted; a sampled run reproduces from its seed."""
    import verispec

    pipe = verispec.load(DEFAULT_TARGET, "smollm2-135m-instruct", k=4, store=store, **settings)
    assert "39,237 tokens in common" in pipe.setup()["shared_vocab"]
    spec = _answer(pipe)
    assert spec["token_ids"] == plain_ids
    s = spec["stats"]
    print(f"\nsmollm2 -> default target ({settings['backend']}): acceptance {s['acceptance_rate']:.3f}, mean accepted "
          f"length {s['mean_accepted_length']:.2f}")
    assert s["acceptance_rate"] > 0.3
    sampled = [_answer(pipe, 16, temperature=0.7, seed=3) for _ in range(2)]
    assert sampled[0]["token_ids"] == sampled[1]["token_ids"] and sampled[0]["stats"]["accepted"] > 0


def test_smollm2_drafts_for_the_default_target_on_llama_cpp():
    """SmolLM2-135M drafting for the default target, both on llama.cpp (transformers: the test above)."""
    import verispec
    from verispec.assembly.store import ModelStore

    _need(DEFAULT_TARGET, "smollm2-135m-instruct")
    store = ModelStore()
    plain = _answer(verispec.load(DEFAULT_TARGET, backend="llamacpp", drafter=None, store=store))
    _check_smollm2_drafts(store, plain["token_ids"], backend="llamacpp", draft_backend="llamacpp")


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", DEFAULT_DRAFT])
def test_real_tokenizer_extraction(tmp_path, name):
    """The tokenizer a pull extracts from the GGUF (what llama.cpp's text path loads), unmocked: the converted
    model's tokenizer (vocabulary, special tokens, chat template, encoding), ending generation where llama.cpp
    does."""
    from transformers import AutoTokenizer

    from verispec.backends.llamacpp import eog_ids_of_gguf
    from verispec.backends.loading import eog_token_ids
    from verispec.catalog import GGUF_NAME, extract_tokenizer, to_transformers

    _need(name)
    gguf = installed(name) / GGUF_NAME
    extract_tokenizer(gguf, tmp_path / "tokenizer")
    ours = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    converted = AutoTokenizer.from_pretrained(to_transformers(name))
    assert ours.get_vocab() == converted.get_vocab() and ours.chat_template == converted.chat_template
    assert ours.all_special_ids == converted.all_special_ids
    text = "def f(x):\n    return x + 1  # héllo wörld 你好 🙂"
    assert ours(text).input_ids == converted(text).input_ids
    assert eog_token_ids(ours) == eog_ids_of_gguf(str(gguf))


def test_real_gguf_conversion(tmp_path):
    """The GGUF -> safetensors conversion a first use on transformers runs, unmocked, on SmolLM2's GGUF: every library it
    needs (transformers' GGUF reader, gguf, accelerate) must be installed, and the result must load and
    score exactly as the installed conversion of the same file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec.catalog import GGUF_NAME, convert_gguf, to_transformers

    _need("smollm2-135m-instruct")
    installed_dir = installed("smollm2-135m-instruct")
    to_transformers("smollm2-135m-instruct")  # the installed conversion (made on first use)
    stages = []
    convert_gguf(installed_dir / GGUF_NAME, tmp_path / "hf", lambda stage, done, total: stages.append(done))
    assert stages[-1] == 3 and (tmp_path / "hf" / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.chat_template and tok("Paris").input_ids == AutoTokenizer.from_pretrained(installed_dir / "hf")(
        "Paris").input_ids
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.no_grad():
        fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(input_ids=ids).logits
        cached = AutoModelForCausalLM.from_pretrained(installed_dir / "hf")(input_ids=ids).logits
    assert torch.equal(fresh, cached)
