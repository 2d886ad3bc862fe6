"""The llama.cpp backend on a real GGUF (SmolLM2-135M, Q4_1, from the verispec cache): rollback, greedy
identity (llama.cpp target and/or draft, every drafter), per-position distributions alone and in a batch of
several sequences sharing one context, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from stats_util import chi2_pvalue, generation_histograms

from verispec import SamplingParams
from verispec.backends import HFModel, Sequence
from verispec.backends.lean import LeanBatch, LeanNet
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.proposers import DraftModel, HybridDrafter, LookupDrafter, NgramProposer

pytestmark = pytest.mark.integration

NAME = "smollm2-135m-instruct"
ALPHA = 1e-4
TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "# the same function, with a loop instead of recursion\n")


@pytest.fixture(scope="module")
def paths():
    from verispec.catalog import installed, to_transformers

    root = installed(NAME)
    if root is None:
        pytest.fail(f"{NAME} is not installed; run `make setup` (verispec models pull {NAME})")
    return root / "model.gguf", to_transformers(NAME)


@pytest.fixture(scope="module")
def llama(paths):
    from verispec.backends.llamacpp import LlamaCppModel

    return LlamaCppModel(str(paths[0]), n_ctx=1024)


@pytest.fixture(scope="module")
def llama_draft(paths):
    from verispec.backends.llamacpp import LlamaCppModel

    return LlamaCppModel(str(paths[0]), n_ctx=1024)


@pytest.fixture(scope="module")
def tokenizer(paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(paths[1])


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer(TEXT)["input_ids"]


@pytest.fixture(scope="module")
def short_prompt(tokenizer):
    """The distribution tests' prompt, one token: a seeded row prefills its draft anew (its draws may not depend on
    what ran before it), and a prompt of one token is fed by the draft's first step, beside the first generated
    token, in the round's batched step (a longer one: a catch-up pass per row, hundreds of them)."""
    ids = tokenizer(TEXT[: TEXT.index(" ")])["input_ids"]
    assert len(ids) == 1, ids
    return ids


@pytest.fixture(scope="module")
def hf_model(paths):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def noisy_hf(paths):
    """SmolLM2 with Gaussian noise on its weights: a draft (or target) that agrees with the GGUF often,
    not always, so both acceptance and recovery are exercised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(paths[1], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.15 * p.std())
    return model


def _plain_llama_cpp(llm, ids: list[int], n: int) -> list[int]:
    """llama-cpp-python's own greedy decoding (its Llama.generate), the reference for identity."""
    llm.reset()
    out = []
    for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    llm.reset()
    return out


# -- the backend itself --------------------------------------------------------------------------------


def test_rollback_then_decode_equals_fresh(llama, prompt):
    ids = torch.tensor(prompt)
    llama = Sequence(llama)
    llama.reset()
    fresh = llama.forward(ids)
    assert fresh.shape == (len(prompt), llama.vocab_size) and fresh.dtype == torch.float32
    llama.rollback(10)
    assert llama.length == 10
    again = torch.cat([llama.forward(ids[10:13]), llama.forward(ids[13:])])
    assert torch.equal(again, fresh[10:])  # same cells, same batch shapes: bitwise equal
    llama.rollback(len(prompt) - 1)
    last = llama.forward(ids[-1:], last_only=True)
    assert torch.equal(last, fresh[-1:])
    with pytest.raises(ValueError):
        llama.rollback(llama.length + 1)
    llama.reset()
    assert llama.length == 0


def test_a_copied_prefix_decodes_as_its_source(llama, prompt):
    """copy(src, dst, n): dst continues from src's first n positions bitwise as src does (its cells' keys and
    values, read out and written into dst's own cells), whatever dst held before; src is untouched."""
    model = llama.with_slots(3)
    ids, tail = torch.tensor(prompt), torch.tensor(prompt[:5])
    model.forward_rows([2], [ids[:7]])  # something to replace
    model.forward_rows([0], [ids])
    model.copy(0, 2, 20)
    assert model.lengths == [len(prompt), 0, 20]
    copied = model.forward_rows([2, 1], [ids[20:], tail])[0]
    model.rollback(0, 20)
    assert torch.equal(copied, model.forward_rows([0], [ids[20:]])[0])
    model.copy(2, 1, len(prompt))
    model.rollback(0, len(prompt))
    assert torch.equal(model.forward_rows([1], [tail])[0], model.forward_rows([0], [tail])[0])
    with pytest.raises(ValueError, match="holds"):
        model.copy(1, 2, len(prompt) + 6)


def test_a_batch_context_parks_the_one_slot_model(llama, prompt):
    """with_slots frees the one-slot model's own llama.cpp context (the batch's KV cache takes its memory): the
    model holds nothing meanwhile, rollback and reset have nothing to do, and its next pass opens an empty context
    that computes what the old one did, bitwise; llama-cpp-python's own decoding runs on the reopened one too."""
    ids = torch.tensor(prompt)
    llama.reset()
    before = llama.forward_rows([0], [ids])[0]
    reference = _plain_llama_cpp(llama.llm, prompt, 4)
    llama.reset()
    llama.forward_rows([0], [ids[:5]])
    batch = llama.with_slots(2)
    assert llama.parked and llama.lengths == [0]
    assert batch.forward_rows([1], [ids[:5]])[0].shape == (5, llama.vocab_size)  # the batch decodes meanwhile
    llama.rollback(0, 0)
    llama.reset()
    assert llama.parked
    assert torch.equal(llama.forward_rows([0], [ids])[0], before)
    assert not llama.parked and llama.lengths == [len(prompt)]
    llama.park()
    assert _plain_llama_cpp(llama.llm, prompt, 4) == reference
    one = llama.with_slots(1)  # one slot: the Llama's own context again, parked by with_slots and reopened
    assert torch.equal(one.forward_rows([0], [ids])[0], before)
    one.reset()
    llama.reset()


def test_batched_matches_single_token_decode(llama, prompt):
    """llama.cpp's batched evaluation (verification) against one token at a time (plain decoding): same
    argmax on every position; the logits may differ in the last bits (kernel choice by batch size)."""
    ids = torch.tensor(prompt[:24])
    llama = Sequence(llama)
    llama.reset()
    batched = llama.forward(ids)
    llama.reset()
    single = torch.cat([llama.forward(ids[i : i + 1]) for i in range(len(ids))])
    llama.reset()
    assert torch.equal(batched.argmax(-1), single.argmax(-1))
    assert (batched - single).abs().max().item() < 0.05 * single.abs().max().item()


def test_bad_input(llama):
    llama = Sequence(llama)
    llama.reset()
    with pytest.raises(ValueError):
        llama.forward(torch.tensor([llama.vocab_size]))
    with pytest.raises(ValueError):
        llama.forward(torch.arange(llama.max_length + 1) % 100)
    assert llama.length == 0


def test_missing_gguf_is_a_clear_error(tmp_path):
    from verispec.backends.loading import resolve_gguf
    from verispec.names.errors import ModelError

    with pytest.raises(ModelError, match="GGUF"):
        resolve_gguf(str(tmp_path))


def test_plain_decoding_evaluates_what_llama_cpp_python_does(llama, prompt, monkeypatch):
    """verispec's plain decoding on llama.cpp makes the same evals as llama-cpp-python's: the whole prompt in
    one, then one token each, n evals for n tokens (no extra eval of the prompt's last token)."""
    import llama_cpp

    sizes: list[int] = []
    original = llama_cpp.llama_cpp.llama_decode

    def counting(ctx, batch):
        sizes.append(batch.n_tokens)
        return original(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", counting)
    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_decode", counting)
    n = 12
    reference = _plain_llama_cpp(llama.llm, prompt, n)
    theirs = sizes[:]
    sizes.clear()
    llama.reset()
    ours = SpeculativeEngine(llama).generate(prompt, max_new_tokens=n).token_ids
    assert ours == reference
    assert sizes == theirs == [len(prompt)] + [1] * (n - 1)


# -- greedy identity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["llama", "hf", "ngram", "hybrid"])
@pytest.mark.parametrize("k", [1, 4])
def test_llama_target_greedy_identical(llama, llama_draft, hf_model, prompt, drafter, k):
    """A llama.cpp target with each drafter: the same tokens as plain decoding through the same backend
    (k = 0) and as llama-cpp-python's own greedy decoding."""
    n = 40
    plain = SpeculativeEngine(llama).generate(prompt, max_new_tokens=n)
    reference = _plain_llama_cpp(llama.llm, prompt, n)
    llama.reset()
    model_drafter = DraftModel(llama_draft if drafter == "llama" else HFModel(hf_model), llama.vocab_size)
    lookup = LookupDrafter([NgramProposer()])
    chosen = {"ngram": lookup, "hybrid": HybridDrafter(lookup, model_drafter)}.get(drafter, model_drafter)
    spec = SpeculativeEngine(llama, chosen, k=k).generate(prompt, max_new_tokens=n)
    assert plain.token_ids == reference
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted > 0
    if drafter == "llama":  # the draft is the target's own GGUF
        assert spec.stats.acceptance_rate > 0.9


@pytest.mark.parametrize("k", [2, 6])
def test_llama_draft_hf_target_greedy_identical(llama_draft, hf_model, prompt, k):
    """Mixed backends: llama.cpp drafts for a transformers target; output = the transformers target's."""
    target = HFModel(hf_model)
    plain = SpeculativeEngine(target).generate(prompt, max_new_tokens=40)
    drafter = DraftModel(llama_draft, target.vocab_size)
    spec = SpeculativeEngine(target, drafter, k=k).generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.acceptance_rate > 0.5


def test_auto_k_on_llama(llama, llama_draft, prompt):
    drafter = DraftModel(llama_draft, llama.vocab_size)
    plain = SpeculativeEngine(llama).generate(prompt, max_new_tokens=40)
    spec = SpeculativeEngine(llama, drafter, k="auto", auto_policy=CostAwareK())
    spec = spec.generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids


# -- distributions -------------------------------------------------------------------------------------


def _marginals(model, prompt: list[int], params: SamplingParams, steps: int = 3) -> list[torch.Tensor]:
    """Exact marginals of the first `steps` tokens under plain sampling from a Model, every sequence enumerated
    (top-k keeps it small: k^(steps - 1) one-token passes)."""
    from verispec.core.sampling import probs_from_logits

    model = Sequence(model)
    model.reset()
    marginals = [torch.zeros(model.vocab_size, dtype=torch.float64) for _ in range(steps)]

    def walk(length: int, logits: torch.Tensor, weight: float, depth: int) -> None:
        probs = probs_from_logits(logits, params)[0].double()
        marginals[depth] += weight * probs
        if depth + 1 < steps:
            for t in probs.nonzero().flatten().tolist():
                model.rollback(length)
                walk(length + 1, model.forward(torch.tensor([t])), weight * float(probs[t]), depth + 1)

    walk(len(prompt), model.forward(torch.tensor(prompt), last_only=True), 1.0, 0)
    model.reset()
    return marginals


PARAMS = SamplingParams(temperature=1.0, top_k=8)
N_GEN = 400  # the draft is far from the target (TV ~0.8): the negative control fails at a glance
# every generation reaches the three positions counted (token 1 from the prefill, token 2 the first draft's, token
# 3 its bonus or the next round's); top-k 8 leaves 8 categories, so 400 samples resolve TV ~0.1
SLOTS = 8  # generations decoded at once, in one context: each row's tokens follow from its own seed, as alone


def _histograms(engine, prompt, params, n, seed0=0):
    """Counts [3, V] of the first three tokens of n seeded generations, SLOTS at a time."""
    return generation_histograms(engine, prompt, params, n, 3, engine.target.vocab_size, seed0)[0]


def _llama_target_engine(llama, noisy_hf) -> SpeculativeEngine:
    """The llama.cpp target, SLOTS sequences in one context, each with a noisy lean draft (a draft that agrees with
    the GGUF often, not always: acceptance and recovery both exercised)."""
    draft = DraftModel(LeanBatch(LeanNet(noisy_hf), SLOTS), llama.vocab_size)
    return SpeculativeEngine(llama.with_slots(SLOTS), draft, k=2)


def test_llama_target_marginals(llama, noisy_hf, short_prompt):
    """llama.cpp target, noisy draft, T = 1, top-k 8, eight sequences sharing each pass: every row's tokens 1-3 follow
    the target's exact marginals (N = 400 generations, V = 49,152 pooled by expected count; detects TV >= ~0.1;
    false-failure probability 3e-4)."""
    exact = _marginals(llama, short_prompt, PARAMS)
    engine = _llama_target_engine(llama, noisy_hf)
    counts = _histograms(engine, short_prompt, PARAMS, n=N_GEN, seed0=90_000)
    assert 0.2 < engine_acceptance(engine, short_prompt) < 0.98  # both paths exercised
    for pos in range(3):
        assert chi2_pvalue(counts[pos], exact[pos], min_samples=N_GEN) > ALPHA, pos


def test_llama_draft_marginals(llama_draft, noisy_hf, short_prompt):
    """Mixed: a llama.cpp draft (eight sequences in one context) for a noisy target on the transformers weights (the
    lean path); tokens 1-3 follow the target's marginals."""
    target = LeanBatch(LeanNet(noisy_hf), SLOTS)
    exact = _marginals(target, short_prompt, PARAMS)
    engine = SpeculativeEngine(target, DraftModel(llama_draft.with_slots(SLOTS), target.vocab_size), k=2)
    counts = _histograms(engine, short_prompt, PARAMS, n=N_GEN, seed0=50_000)
    for pos in range(3):
        assert chi2_pvalue(counts[pos], exact[pos], min_samples=N_GEN) > ALPHA, pos


def test_llama_negative_control_fails(llama, noisy_hf, short_prompt, monkeypatch):
    """The target's test on a verifier that accepts every draft must fail: it emits the draft's marginals."""

    def always_accept(draft_tokens, draft_probs, target_probs, rng):
        k = draft_tokens.shape[1]
        bonus = torch.multinomial(target_probs[:, k], 1, generator=rng).squeeze(-1)
        return torch.full((draft_tokens.shape[0],), k), bonus

    exact = _marginals(llama, short_prompt, PARAMS)
    monkeypatch.setattr("verispec.core.rows.rejection_sample", always_accept)
    counts = _histograms(_llama_target_engine(llama, noisy_hf), short_prompt, PARAMS, n=N_GEN // 2)
    assert min(chi2_pvalue(counts[pos], exact[pos], min_samples=N_GEN // 2) for pos in range(3)) < ALPHA


def engine_acceptance(engine, prompt) -> float:
    result = engine.generate(prompt, SamplingParams(temperature=1.0, top_k=8, seed=1), max_new_tokens=64)
    return result.stats.acceptance_rate


# -- the command line ----------------------------------------------------------------------------------


def test_cli_generate_llamacpp(capsys):
    from verispec.apps.cli import main

    common = ["generate", "--target", NAME, "--draft", NAME, "--chat", "--prompt", "What is the capital of France?",
              "--max-new-tokens", "24", "--json"]
    assert main([*common, "--backend", "llamacpp"]) == 0
    spec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*common, "--backend", "llamacpp", "--no-speculation"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert spec["text"] and spec["token_ids"] == plain["token_ids"]  # (Q4_1 on llama.cpp does not say Paris)
    assert plain["num_draft_tokens"] == 0 and plain["stats"]["target_forwards"] == len(plain["token_ids"])
    assert spec["backend"] == "llamacpp" and spec["draft_backend"] == "llamacpp"
    assert spec["num_draft_tokens"] == "auto"  # a fixed k can be slower than plain decoding on llama.cpp
    assert main([*common, "--backend", "hf", "--draft-backend", "llamacpp", "--dtype", "fp32"]) == 0  # mixed
    mixed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert mixed["backend"] == "hf" and mixed["draft_backend"] == "llamacpp" and "Paris" in mixed["text"]
    assert mixed["num_draft_tokens"] == "auto"
    assert main([*common, "--backend", "llamacpp", "-k", "3"]) == 0  # what the user asks for stands
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_draft_tokens"] == 3


@pytest.mark.parametrize("warm", [False, True])
def test_cli_bench_compares_llama_cpp_python_on_second_turns(capsys, tmp_path, warm):
    """`verispec bench --backend llamacpp --compare llama --turn 2` (cold and --warm-history): llama-cpp-python's
    own plain decoding of the same GGUF gives verispec plain's tokens, and every run measures its first token."""
    from verispec.apps.cli import main

    mt = tmp_path / "mt.jsonl"
    mt.write_text("\n".join(json.dumps({"question_id": i, "category": "writing", "turns": turns}) for i, turns in
                            enumerate([["Name three colours.", "Now three more."], ["Say hi.", "Say bye."]])))
    args = ["bench", "--target", NAME, "--backend", "llamacpp", "--drafters", "ngram", "-k", "auto", "--compare",
            "llama", "--prompts", str(mt), "--turn", "2", "--max-new-tokens", "16", "--warmup", "0", "--json"]
    assert main(args + ["--warm-history"] * warm) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["warm_history"] is warm
    runs = {(r["prompt_id"], r["config"]): r for r in report["runs"]}
    for pid in ("0", "1"):
        theirs = next(r for (p, c), r in runs.items() if p == pid and "llama" in c)
        assert theirs["identical"] and theirs["new_tokens"] == runs[(pid, "plain")]["new_tokens"]
        assert all(r["ttft"] and r["ttft"] > 0 for (p, _), r in runs.items() if p == pid)


def test_cli_llamacpp_bad_inputs(capsys, tmp_path):
    from verispec.apps.cli import main

    not_gguf = tmp_path / "empty"
    not_gguf.mkdir()
    assert main(["generate", "--target", str(not_gguf), "--backend", "llamacpp", "--no-speculation",
                 "--prompt", "hi"]) != 0
    err = capsys.readouterr().err
    assert "error" in err.lower() and len(err.strip().splitlines()) == 1
    assert main(["generate", "--target", NAME, "--draft", NAME, "--draft-backend", "llamacpp", "--draft-quant", "int8",
                 "--prompt", "hi"]) != 0
    assert "already quantized" in capsys.readouterr().err
    assert main(["generate", "--target", NAME, "--draft", NAME, "--draft-backend", "llamacpp", "--draft-vocab",
                 "4096", "--prompt", "hi"]) != 0
    assert "--draft-backend hf" in capsys.readouterr().err


def test_server_on_llamacpp():
    """`verispec serve --backend llamacpp`: streamed and whole answers agree, bad input gets a 4xx, the
    server stays up and exits cleanly."""
    import httpx
    from server_util import ServerProcess

    server = ServerProcess(["--target", NAME, "--draft", NAME, "--backend", "llamacpp", "--num-draft-tokens", "auto"])
    try:
        body = {"model": NAME, "messages": [{"role": "user", "content": "Count from 1 to 10."}], "max_tokens": 24,
                "temperature": 0}
        whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
        text = whole["choices"][0]["message"]["content"]
        assert text and whole["usage"]["completion_tokens"] > 0
        streamed = ""
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        assert streamed == text
        bad = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400 and "error" in bad.json()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        assert server.stop() == 0
