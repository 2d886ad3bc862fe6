"""Run plain decoding (the baseline) and each speculative configuration on every prompt, interleaved in
one process (in a balanced order, see measured.balanced_orders) so that drift on a noisy machine hits all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from verispec.apps.bench.loader import Prompt, answer_history
from verispec.apps.bench.measured import Measured, balanced_orders
from verispec.assembly.build import build
from verispec.assembly.registry import BACKENDS, DRAFTERS
from verispec.assembly.resolve import resolve
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.assembly.store import ModelStore
from verispec.backends import is_hf_model
from verispec.backends.quant import QUANT_MODES
from verispec.backends.vocab import same_vocabulary
from verispec.core.sampling import SamplingParams
from verispec.decoding.request import Request
from verispec.names.drafters import DRAFT_FORWARDS
from verispec.names.errors import SpecError, exception_line
from verispec.names.options import to_llama_cpp, to_transformers
from verispec.pipeline.pipeline import Pipeline
from verispec.pipeline.text import encode_messages, encode_prompt

KINDS = ("plain", "spec", "hf", "hf-lookup", "llama", "llama-lookup")
LOOKUP_CONTEXT = 4096  # llama-cpp-python's prompt lookup keeps n_ctx x V float32 scores: keep n_ctx modest


@dataclass(frozen=True)
class Config:
    """One benchmarked configuration: its name in the report, its kind, and for verispec its k and drafter."""

    name: str
    # plain (the baseline), spec (verispec), hf (HF assisted generation), hf-lookup (HF prompt lookup),
    # llama (llama-cpp-python's own decoding of the target's GGUF), llama-lookup (its prompt lookup decoding)
    kind: str
    k: int | str = 0  # or "auto"
    drafter: str = "model"  # for spec: model, ngram or hybrid; model[VARIANT] / hybrid[VARIANT]: another draft setup

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown configuration kind {self.kind!r}")


def parse_draft_variant(text: str) -> tuple[str, str, int, str]:
    """'llamacpp', 'hf', 'hf-int4', 'hf-int8-v32768', 'hf-v16384', 'hf-int4-transformers' ->
    (backend, quant, vocab, forward)."""
    parts = text.strip().split("-")
    backend, quant, vocab, forward = parts[0], "none", 0, "auto"
    rest = parts[1:]
    if rest and rest[0] in QUANT_MODES:
        quant = rest.pop(0)
    if rest and rest[0].startswith("v") and rest[0][1:].isdigit():
        vocab = int(rest.pop(0)[1:])
    if rest and rest[0] in DRAFT_FORWARDS[1:]:
        forward = rest.pop(0)
    if backend not in BACKENDS or rest or (backend == "llamacpp" and (quant != "none" or vocab or forward != "auto")):
        raise SpecError(f"unknown draft variant '{text}' (e.g. llamacpp, hf, hf-int4, hf-int4-v32768, "
                        f"hf-int4-transformers)", "draft")
    return backend, quant, vocab, forward


class Bench:
    """What one benchmark run compares, built from specs: a pipeline per configuration (each with its own
    k and its own k policy), all on one ModelStore so that each model loads once, and the objects of the
    reference implementations (Hugging Face's assisted generation, llama-cpp-python). Pipelines share the
    store's models, hence their KV caches: every run resets its pipeline first (see ModelStore). verispec's runs
    time what a user gets, the text included (detokenising, stop checks); `text=False` times the rounds alone."""

    def __init__(self, target: TargetSpec, draft: DraftSpec | None, store: ModelStore | None = None,
                 text: bool = True) -> None:
        self.target, self.draft, self.text = target, draft, text
        self.store = store if store is not None else ModelStore()
        self._pipelines: dict[tuple, Pipeline] = {}
        self._references: dict[str, object] = {}

    def draft_spec(self, config: Config) -> DraftSpec | None:
        """The draft spec of a configuration: none for plain decoding and the references, a free lookup drafter, or
        the bench's draft spec with the configuration's drafter and draft variant ('model[hf-int4]': the
        variant's backend, quantisation, vocabulary and forward)."""
        if config.kind != "spec":
            return None
        drafter, _, variant = config.drafter.rstrip("]").partition("[")
        if not DRAFTERS[drafter].needs_model:
            return DraftSpec(drafter)
        if self.draft is None or self.draft.model is None:
            raise ValueError(f"configuration '{config.name}' needs a draft model")
        spec = replace(self.draft, drafter=drafter)
        if variant:
            backend, quant, vocab, forward = parse_draft_variant(variant)
            spec = replace(spec, backend=backend, quant=quant, vocab=vocab, forward=forward)
        return spec

    def pipeline(self, config: Config) -> Pipeline:
        """The configuration's pipeline (the baseline's for every kind but spec), built on first use."""
        draft = self.draft_spec(config)
        k = config.k if config.kind == "spec" else 0
        key = (draft, k, config.name if k == "auto" else None)  # an adaptive k learns per configuration
        if key not in self._pipelines:
            self._pipelines[key] = build(self.target, draft, k, store=self.store)
        return self._pipelines[key]

    @property
    def baseline(self) -> Pipeline:
        """Plain decoding of the target."""
        return self.pipeline(Config("plain", "plain"))

    def resolved_draft(self) -> DraftSpec | None:
        """The bench's own draft spec with its 'auto' choices made (backend, quantisation)."""
        if self.draft is None or self.draft.model is None:
            return None
        return resolve(self.target, self.draft)[1]

    def hf_draft(self):
        """The transformers draft HF assisted generation gets: the bench's own draft model when it is the
        plain transformers model, else (a llama.cpp, quantised, reduced-head or lean draft) the same model
        loaded plainly, in the target's dtype: HF is measured with its library defaults."""
        draft = self.resolved_draft()
        if draft is None:
            raise ValueError("Hugging Face assisted generation needs a draft model")
        if draft.backend == "hf" and draft.quant == "none" and not draft.vocab:
            model = self.pipeline(Config("hf draft", "spec", 1, "model")).draft_model
            if is_hf_model(model):
                return model.model
        target = self.baseline.engine.target
        return self.store.transformers_model(draft.model, self.baseline.device, next(target.model.parameters()).dtype)

    def hf_assistant_tokenizers(self) -> dict:
        """The tokenizers HF assisted generation needs when the draft's differ from the target's (its
        different-tokenizer assistant, UniversalSpeculativeDecodingGenerator when sampling); {} when they are one."""
        draft = self.resolved_draft()
        target_tok = self.baseline.tokenizer
        draft_tok = self.store.tokenizer(draft.model)
        if same_vocabulary(target_tok, draft_tok):
            return {}
        return {"tokenizer": target_tok, "assistant_tokenizer": draft_tok}

    def llama(self, lookup: bool):
        """llama-cpp-python's own Llama on the target's GGUF: the target's when it runs on llama.cpp (plain
        decoding), else one opened for the benchmark."""
        from verispec.backends.llamacpp import LlamaCppModel, import_llama_cpp, open_llama
        from verispec.backends.loading import resolve_gguf

        target = self.baseline.engine.target
        if not lookup and isinstance(target, LlamaCppModel):
            return target.llm
        key = "llama-lookup" if lookup else "llama"
        if key not in self._references:
            path = target.path if isinstance(target, LlamaCppModel) else resolve_gguf(self.baseline.target_ref)
            if lookup:  # its CPU advice: 2 predicted tokens ("10 ... good for gpu, 2 performs better for cpu-only")
                draft = import_llama_cpp().llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=2)
                self._references[key] = open_llama(path, n_ctx=LOOKUP_CONTEXT, logits_all=True, draft_model=draft)
            else:
                self._references[key] = open_llama(path, n_ctx=LOOKUP_CONTEXT)
        return self._references[key]


@dataclass
class Run(Measured):
    prompt_id: str
    category: str
    config: str
    new_tokens: int
    seconds: float
    token_ids: list[int] = field(repr=False)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0  # the target's prompt prefill plus the draft's catch-ups
    draft_forwards: int = 0
    target_forwards: int = 0
    speedup: float | None = None  # tokens/s over the baseline's on the same prompt (pooled over repeats)
    identical: bool | None = None  # greedy: token-identical to the baseline (in every repeat)
    first_diff: int | None = None
    repeats: int = 1
    repeat_speedups: list[float] = field(default_factory=list)  # one ratio per repeat, each against its own baseline
    repeat_tokens_per_second: list[float] = field(default_factory=list)  # each repeat's own tokens/s
    ttft: float | None = None  # seconds to the first token (mean over repeats); None where not measured
    first_tokens: int = 0  # tokens that came with the first one (a speculative round commits several)
    accepted_lengths: list[int] = field(default_factory=list, repr=False)  # per drafting round: drafts accepted
    timeline: list[tuple[float, int]] = field(default_factory=list, repr=False)  # (seconds, tokens) per round
    error: str | None = None  # a failed run: why, in one line (it measured nothing)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens/s after the first token of each repeat (those committed with it left out): what decoding
        sustains once the prompt is in."""
        if not self.ok or self.ttft is None or self.new_tokens <= self.first_tokens:
            return None
        after_first = self.seconds - self.ttft * self.repeats
        return (self.new_tokens - self.first_tokens) / after_first if after_first > 0 else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First position where two token lists differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _run_engine(pipe: Pipeline, ids: list[int], params: SamplingParams, max_new: int, k: int | str,
                warm: list[int] | None = None, text: bool = True) -> dict:
    pipe.engine.reset()  # every run prefills from scratch: no run inherits another's cache
    if warm is not None:  # the earlier turn answered first, untimed: its caches and drafter state, as in a chat
        pipe.engine.generate(warm, params, max_new_tokens=max_new, k=k)
    stream = pipe.stream(Request(prompt_ids=ids, params=params, max_new_tokens=max_new, k=k))
    first_tokens, timeline, start = 0, [], time.perf_counter()
    for committed, _ in stream.rounds(text=text):  # a round commits one token or several
        first_tokens = first_tokens or len(committed)
        timeline.append((time.perf_counter() - start, (timeline[-1][1] if timeline else 0) + len(committed)))
    result = stream.result
    s = result.stats
    return dict(
        new_tokens=s.new_tokens, seconds=s.seconds, token_ids=result.token_ids, drafted=s.drafted,
        accepted=s.accepted, rounds=s.rounds, accepted_per_position=s.accepted_per_position,
        drafted_per_position=s.drafted_per_position, draft_seconds=s.draft_seconds,
        target_seconds=s.target_seconds, prefill_seconds=s.prefill_seconds, draft_forwards=s.draft_forwards,
        target_forwards=s.target_forwards, ttft=s.first_token_seconds, first_tokens=first_tokens,
        accepted_lengths=s.accepted_lengths, timeline=timeline,
    )


def _run_hf(pipe: Pipeline, ids: list[int], params: SamplingParams, max_new: int, draft_model,
            tokenizers: dict | None = None) -> dict:
    """Hugging Face's own assisted generation on the same models (library defaults for the draft; `tokenizers`:
    the target's and the draft's when they differ), or its prompt lookup decoding when `draft_model` is None."""
    target = pipe.engine.target.model
    input_ids = torch.tensor([ids], device=pipe.device)
    kwargs: dict = dict(max_new_tokens=max_new, attention_mask=torch.ones_like(input_ids),
                        eos_token_id=sorted(pipe.engine.eos_token_ids) or None)
    if draft_model is not None:
        kwargs["assistant_model"] = draft_model
        kwargs.update(tokenizers or {})
    else:
        kwargs["prompt_lookup_num_tokens"] = 10
    kwargs.update(to_transformers(params))
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(input_ids, **kwargs)
    seconds = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    return dict(new_tokens=len(new), seconds=seconds, token_ids=new)


def _run_llama(bench: Bench, ids: list[int], params: SamplingParams, max_new: int, lookup: bool,
               warm: list[int] | None = None) -> dict:
    pipe = bench.baseline
    llm = bench.llama(lookup)
    if len(ids) + max_new > llm.n_ctx():
        raise ValueError(f"a prompt of {len(ids)} tokens + {max_new} new does not fit llama.cpp's n_ctx {llm.n_ctx()}")
    sampling = to_llama_cpp(params)
    eos = pipe.engine.eos_token_ids
    llm.reset()  # forget what this Llama believes its context holds (verispec may have used it since)

    def generate(prompt: list[int]) -> tuple[list[int], float | None]:
        """The tokens, and when the first came."""
        new: list[int] = []
        first = None
        for token in llm.generate(prompt, reset=True, **sampling):
            new.append(int(token))  # generate(reset=True) keeps the context's prefix it shares with `prompt`
            first = first or time.perf_counter()
            if token in eos or len(new) >= max_new:
                break
        return new, first

    if warm is not None:  # the earlier turn answered first, untimed (see _run_engine)
        generate(warm)
    t0 = time.perf_counter()
    new, first = generate(ids)
    seconds = time.perf_counter() - t0
    ttft = None if first is None else first - t0
    pipe.engine.reset()  # the target's llama.cpp context may be this one: its cache no longer holds ours
    return dict(new_tokens=len(new), seconds=seconds, token_ids=new, ttft=ttft, first_tokens=min(1, len(new)))


def run_benchmark(
    bench: Bench,
    prompts: list[Prompt],
    configs: list[Config],
    params: SamplingParams,
    max_new_tokens: int,
    warmup: int = 1,
    on_run: Callable[[Run], None] | None = None,
    repeats: int = 1,
    warm_history: bool = False,
) -> list[Run]:
    """Returns one Run per (prompt, configuration), the baseline's included (config 'plain'). With repeats > 1
    every prompt runs that many times per configuration (one block each, the orders balanced) and a Run pools them:
    summed tokens, seconds and counters, so its speedup is total tokens/s over the baseline's total tokens/s
    on that prompt, which averages out a noisy machine's swings that a single run cannot. Every
    configuration's pipeline is built (its models loaded) before the first run. A prompt with earlier turns
    runs on the whole conversation, its earlier answers the target's plain greedy ones (see answer_history):
    prefilled from scratch, or with `warm_history` as a chat session has it, each run first answering the
    previous turn itself, untimed, so that its caches (and drafter) already hold the conversation before it."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    plain = Config("plain", "plain")
    order = [plain] + [c for c in configs if c.kind != "plain"]
    for c in order:
        if c.kind == "hf" and bench.resolved_draft() is None:
            raise ValueError(f"configuration '{c.name}' needs a draft model")
        bench.pipeline(c)
        if c.kind in ("hf", "hf-lookup") and not is_hf_model(bench.baseline.engine.target):
            raise ValueError(f"configuration '{c.name}' runs Hugging Face generate: it needs a transformers "
                             f"target (the 'hf' backend)")
    if warm_history and any(c.kind in ("hf", "hf-lookup") for c in order):
        raise ValueError("warm history runs verispec's and llama.cpp's configurations (Hugging Face generate "
                         "keeps no cache between calls)")
    prompts = answer_history(prompts, lambda p: _plain_answer(bench.baseline, p.messages(), max_new_tokens))
    tokenizer = bench.baseline.tokenizer
    encoded = [encode_messages(tokenizer, p.messages()) if p.history
               else bench.baseline.encode_infill(p.text, p.suffix, p.files, header=True) if p.infill
               else encode_prompt(tokenizer, p.text, p.chat) for p in prompts]
    warm = [encode_messages(tokenizer, p.messages()[:-2]) if warm_history and p.history else None for p in prompts]
    if encoded and warmup:
        for config in order:  # warm-up: allocator, kernels, caches; results discarded
            for _ in range(warmup):
                _one(bench, config, encoded[0], params, min(8, max_new_tokens))
    return _interleaved(bench, prompts, list(zip(encoded, warm)), order, params, max_new_tokens, on_run, repeats)


def _plain_answer(pipe: Pipeline, messages: list[dict], max_new_tokens: int) -> str:
    """The target's plain greedy answer to a conversation (an earlier turn of a timed one; not timed)."""
    pipe.engine.reset()
    return pipe.generate(messages, max_new_tokens=max_new_tokens, k=0).text


def _interleaved(bench, prompts, encoded, order, params, max_new_tokens, on_run, repeats) -> list[Run]:
    """The measured runs, prompt after prompt. A configuration that fails on a prompt (e.g. the prompt does not
    fit its context) becomes a failed Run for that prompt, skipped in the prompt's later repeats; the others
    go on. `on_run` sees each prompt's Runs as soon as the prompt is done, so a caller keeps them when a
    later prompt is interrupted."""
    runs: list[Run] = []
    orders = balanced_orders(len(order))
    for i, (prompt, (ids, warm)) in enumerate(zip(prompts, encoded)):
        by_config: dict[str, list[Run]] = {c.name: [] for c in order}
        failed: dict[str, str] = {}
        for r in range(repeats):
            # block after block, prompt after prompt, the next order of the design
            for config in (order[j] for j in orders[(i * repeats + r) % len(orders)]):
                if config.name in failed:
                    continue
                try:
                    measured = _one(bench, config, ids, params, max_new_tokens, warm)
                except Exception as exc:  # this run's failure; KeyboardInterrupt (not an Exception) ends the benchmark
                    failed[config.name] = exception_line(exc)
                    continue
                by_config[config.name].append(Run(prompt.id, prompt.category, config.name, **measured))
        for run in _prompt_runs(prompt, order, by_config, failed, params):
            runs.append(run)
            if on_run is not None:
                on_run(run)
    return runs


def _prompt_runs(prompt: Prompt, order: list[Config], by_config: dict[str, list[Run]], failed: dict[str, str],
                 params: SamplingParams) -> list[Run]:
    """One Run per configuration for a prompt: its repeats pooled, speedup and identity against the baseline's
    (none when the baseline failed), or a failed Run."""
    base_runs = [] if "plain" in failed else by_config["plain"]
    pooled_base = _pooled(base_runs, None) if base_runs else None
    out = []
    for config in order:
        mine = by_config[config.name]
        if config.name in failed:
            out.append(Run(prompt.id, prompt.category, config.name, 0, 0.0, [], error=failed[config.name]))
            continue
        if config.kind == "plain":
            out.append(pooled_base)
            continue
        for run, base in zip(mine, base_runs):
            run.speedup = run.tokens_per_second / base.tokens_per_second if base.tokens_per_second else None
            if params.greedy:
                run.first_diff = first_difference(run.token_ids, base.token_ids)
                run.identical = run.first_diff is None
        out.append(_pooled(mine, pooled_base))
    return out


_SUMMED = ("new_tokens", "seconds", "drafted", "accepted", "rounds", "draft_seconds", "target_seconds",
           "prefill_seconds", "draft_forwards", "target_forwards", "first_tokens")


def _pooled(repeats: list[Run], base: Run | None) -> Run:
    """One Run for a prompt's repeats of one configuration: counters and times summed, per-position counts
    added, the first repeat's tokens, the mean time to first token; identical only if every repeat was;
    speedup against the pooled base."""
    if len(repeats) == 1 and base is None:
        return repeats[0]
    first = repeats[0]
    pooled = Run(first.prompt_id, first.category, first.config,
                 **{name: sum(getattr(r, name) for r in repeats) for name in _SUMMED}, token_ids=first.token_ids)
    for name in ("accepted_per_position", "drafted_per_position"):
        width = max(len(getattr(r, name)) for r in repeats)
        setattr(pooled, name, [sum(getattr(r, name)[j] for r in repeats if j < len(getattr(r, name)))
                               for j in range(width)])
    pooled.accepted_lengths = [n for r in repeats for n in r.accepted_lengths]
    pooled.timeline = first.timeline
    pooled.repeats = len(repeats)
    pooled.repeat_tokens_per_second = [r.tokens_per_second for r in repeats]
    if all(r.ttft is not None for r in repeats):
        pooled.ttft = sum(r.ttft for r in repeats) / len(repeats)
    if base is not None:
        pooled.repeat_speedups = [r.speedup for r in repeats if r.speedup is not None]
        pooled.speedup = pooled.tokens_per_second / base.tokens_per_second if base.tokens_per_second else None
        if first.identical is not None:
            mismatched = [r for r in repeats if not r.identical]
            pooled.identical = not mismatched
            pooled.first_diff = mismatched[0].first_diff if mismatched else None
    return pooled


def _one(bench: Bench, config: Config, ids: list[int], params: SamplingParams, max_new: int,
         warm: list[int] | None = None) -> dict:
    """One timed run; `warm`: a previous turn's prompt, answered first, untimed (hf configurations refuse it)."""
    if config.kind == "hf":
        return _run_hf(bench.baseline, ids, params, max_new, bench.hf_draft(), bench.hf_assistant_tokenizers())
    if config.kind == "hf-lookup":
        return _run_hf(bench.baseline, ids, params, max_new, None)
    if config.kind in ("llama", "llama-lookup"):
        return _run_llama(bench, ids, params, max_new, config.kind == "llama-lookup", warm)
    return _run_engine(bench.pipeline(config), ids, params, max_new, config.k if config.kind == "spec" else 0, warm,
                       bench.text)
