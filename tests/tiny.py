"""Tiny random-weight causal LMs built in-process from a transformers config (real transformers code)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verispec.backends import HFModel
from verispec.backends.lean import LeanBatch, LeanNet
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.decoding.request import Committed, GenerationResult
from verispec.proposers import DraftModel, HybridDrafter, LookupDrafter, NgramProposer


def tiny_qwen2(seed: int, vocab_size: int = 64, hidden: int = 64, layers: int = 2, scale: float = 1.0, init: float = 0.2):
    """A Qwen2 LM with random weights; `scale` sharpens the output distribution (less uniform logits)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=init,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def perturbed(model, seed: int, noise: float):
    """A draft that agrees with `model` more often than chance: same weights plus Gaussian noise."""
    copy = tiny_qwen2(seed=0, vocab_size=model.config.vocab_size, hidden=model.config.hidden_size,
                      layers=model.config.num_hidden_layers, scale=1.0)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    return copy


def make_engine(target, draft=None, k: int = 4, eos=(), drafter: str = "model", slots: int = 1) -> SpeculativeEngine:
    """An engine over transformers models (or Models already): `drafter` model (draft: a model), ngram, hybrid
    (n-gram matches of >= 2 tokens, else the draft model), or a Drafter or Lookup given as `drafter`. `slots` > 1:
    that many sequences at once, the transformers models on the lean path (LeanBatch), which batches."""
    t, draft = as_model(target, slots), None if draft is None else as_model(draft, slots)
    return SpeculativeEngine(t, drafter_for(drafter, draft, t.vocab_size, slots), eos_token_ids=eos, k=k,
                             auto_policy=CostAwareK())


def as_model(model, slots: int = 1):
    """A Model for a transformers model (HFModel; LeanBatch of `slots` where there are several), or the Model given."""
    if hasattr(model, "forward_rows"):
        return model
    return HFModel(model) if slots == 1 else LeanBatch(LeanNet(model), slots)


def lone_rounds(engine: SpeculativeEngine, prompt, **fields) -> tuple[Iterator[Committed], GenerationResult]:
    """One request alone in `engine` (`add`'s arguments): an iterator of its rounds' committed tokens (the engine's
    `step`, round by round) and its result, filled as they come."""
    row = engine.add(prompt, **fields)

    def rounds() -> Iterator[Committed]:
        while not row.done:
            for _, chunk in engine.step():
                yield chunk

    return rounds(), row.result


def drafter_for(drafter, draft, vocab_size: int, slots: int = 1):
    """A Drafter: a name (model, ngram, hybrid) with `draft` (a Model) where it needs one, a Lookup (one slot), or a
    Drafter as it is."""
    if not isinstance(drafter, str):
        return LookupDrafter([drafter]) if hasattr(drafter, "end") else drafter
    model = DraftModel(draft, vocab_size) if draft is not None else None
    if drafter == "ngram":
        return LookupDrafter([NgramProposer(max_ngram=3, min_ngram=1) for _ in range(slots)])
    if drafter == "hybrid":
        lookups = [NgramProposer(max_ngram=3, min_ngram=1, min_confident=2) for _ in range(slots)]
        return HybridDrafter(LookupDrafter(lookups), model)
    return model


CHAT_TEMPLATE = (  # ChatML; with tools, a system turn listing them and calls in the Hermes format, as Qwen2.5 writes
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>\n{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + 3 specials, no merges): multi-byte characters span
    several tokens, which is what streaming detokenisation must handle."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def sentencepiece_tokenizer():
    """A Llama-style SentencePiece tokenizer (BPE over '▁'-joined words, byte fallback for characters it never saw,
    the leading space dropped at the start of a decode), trained on a few sentences: a prefix's decode is not always
    a prefix of the whole's, and characters outside its alphabet span byte tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, this is a test of the tokenizer",
              "def f(x):\n    return x + 1\n", "speculative decoding is lossless"] * 20
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizer
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(spec["vocab"], key=spec["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizer
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def save_tiny_pair(root, vocab_size: int = 264, tok=None):
    """Write a tiny target and draft (sharing `tok`, default the byte tokenizer) as HF directories; returns their
    paths."""
    tok = tok or byte_tokenizer()
    target = tiny_qwen2(21, vocab_size=vocab_size, init=0.1)
    draft = perturbed(target, seed=22, noise=0.1)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(str(path))
    return paths


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")


def fim_tokenizer(markers: tuple[str, ...] = FIM_TOKENS):
    """byte_tokenizer with fill-in-the-middle markers as special tokens after its own (Qwen2.5-Coder's names:
    prefix, suffix, middle, repository, file separator; ids 259-263 with the default `markers`, inside
    text_pair's vocabulary of 264)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>", *markers]})
    return tok


def text_pair():
    """(target, perturbed draft, byte tokenizer): a tiny pair that speaks text, for API and streaming tests."""
    target = tiny_qwen2(21, vocab_size=264, init=0.1)
    return target, perturbed(target, seed=22, noise=0.1), byte_tokenizer()


def bpe_tokenizer(vocab: list[str], merges: list[tuple[str, str]] = (), specials: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer over exactly `vocab` (strings in the byte-level alphabet: 'Ġ' is a space), id =
    position, then `specials` as added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


def permuted_byte_tokenizer(seed: int):
    """byte_tokenizer's tokens under other ids (the 256 byte tokens shuffled, the specials where they were), and
    the permutation: new id = perm[old id]."""
    alphabet = sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet())
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(seed)).tolist()
    vocab = [""] * 256
    for old, ch in enumerate(alphabet):
        vocab[perm[old]] = ch
    tok = bpe_tokenizer(vocab)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    return tok, perm + list(range(256, len(tok)))


def permuted_model(model, perm: list[int]):
    """`model` speaking a permuted vocabulary: token old's embedding and output rows moved to id perm[old], so that
    on the same text it computes the same distribution, permuted."""
    copy = tiny_qwen2(seed=0, vocab_size=model.config.vocab_size, hidden=model.config.hidden_size,
                      layers=model.config.num_hidden_layers)
    copy.load_state_dict(model.state_dict())
    index = torch.tensor(perm + list(range(len(perm), model.config.vocab_size)))
    with torch.no_grad():
        for weight in (copy.model.embed_tokens.weight, copy.lm_head.weight):
            weight[index] = weight.clone()
    return copy
