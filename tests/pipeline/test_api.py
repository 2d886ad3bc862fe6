"""The public API on tiny transformers models passed as objects: verispec.load, Pipeline.generate / stream,
transformers streamers and GenerationConfig, ChatBot."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny import perturbed, text_pair
from transformers import GenerationConfig, TextIteratorStreamer

import verispec
from verispec.pipeline.text import encode_messages, json_string_texts

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def models():
    return text_pair()


@pytest.fixture(scope="module")
def pipe(models):
    target, draft, tok = models
    return verispec.load(target, draft, tokenizer=tok, k=3)


@pytest.fixture(scope="module")
def plain(models):
    target, _, tok = models
    return verispec.load(target, tokenizer=tok, drafter=None)


def _decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_load_from_objects_and_generate_text(pipe, plain, models):
    _, _, tok = models
    assert isinstance(pipe, verispec.Pipeline) and pipe.drafter == "model" and pipe.draft_backend == "hf"
    assert pipe.draft_quant == "none"  # a loaded draft is used as given
    result = pipe.generate(PROMPT, max_new_tokens=24)
    assert isinstance(result, verispec.Completion) and isinstance(result.stats, verispec.SpecStats)
    assert len(result.token_ids) == 24 and result.finish_reason == "length"  # the tiny models emit no EOS here
    assert result.text == _decode(tok, result.token_ids) and result.text
    assert result.stats.drafted > 0 and result.stats.new_tokens == 24
    baseline = plain.generate(PROMPT, max_new_tokens=24)
    assert baseline.token_ids == result.token_ids and baseline.stats.drafted == 0  # greedy: exact


def test_prompt_forms(pipe, models):
    _, _, tok = models
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    from_messages = pipe.generate(messages, max_new_tokens=10)
    ids = encode_messages(tok, messages)
    assert pipe.generate(ids, max_new_tokens=10).token_ids == from_messages.token_ids
    assert pipe.generate(torch.tensor([ids]), max_new_tokens=10).token_ids == from_messages.token_ids
    assert pipe.generate("Hi there", max_new_tokens=10).token_ids != from_messages.token_ids  # the template applied
    with pytest.raises(ValueError, match="one prompt at a time"):
        pipe.generate(torch.tensor([ids, ids]), max_new_tokens=2)
    with pytest.raises(TypeError):
        pipe.generate([1.5, 2.5], max_new_tokens=2)


def test_a_json_answer_copies_the_prompt_json_escaped(pipe, plain, models):
    """Under a JSON schema the request carries the prompt's strings JSON-escaped for the drafter to copy
    (lookup_texts); without one it does not; greedy JSON answers equal plain decoding's either way."""
    _, _, tok = models
    messages = [{"role": "user", "content": 'say "hi"\nthen stop'}]
    request = pipe.request(messages, json_schema={"type": "object"}, max_new_tokens=12)
    assert request.lookup_texts == json_string_texts(tok, [messages[0]["content"]]) != ()
    assert pipe.request(messages, max_new_tokens=12).lookup_texts == ()
    assert pipe.request(messages, regex="[a-z]+", max_new_tokens=12).lookup_texts == ()
    ids = encode_messages(tok, messages)
    for prompt in (ids, torch.tensor([ids])):  # token ids hold no strings to escape
        assert pipe.request(prompt, json_schema={"type": "object"}, max_new_tokens=12).lookup_texts == ()
    answer = pipe.generate(request)
    assert answer.token_ids == plain.generate(messages, json_schema={"type": "object"}, max_new_tokens=12).token_ids


def test_stream_yields_the_generated_text(pipe):
    whole = pipe.generate(PROMPT, max_new_tokens=30)
    stream = pipe.stream(PROMPT, max_new_tokens=30)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == whole.text
    assert stream.result.token_ids == whole.token_ids and stream.result.text == whole.text


def test_stream_is_a_request_in_the_engines_slots(pipe):
    """A stream takes the pipeline's engine's one slot when it starts and gives it back when it ends or is closed:
    a second stream meanwhile is refused (the first goes on, unharmed), a closed one keeps what it committed and
    the next stream decodes as on a fresh engine."""
    whole = pipe.generate(PROMPT, max_new_tokens=30)
    first = pipe.stream(PROMPT, max_new_tokens=30)
    assert first.result.token_ids == [] and first.result.stats.prompt_tokens == len(pipe.encode(PROMPT))
    assert not pipe.engine.active  # not started: the slot is free
    next(first)
    with pytest.raises(RuntimeError, match="batch is full"):
        next(pipe.stream(PROMPT, max_new_tokens=30))
    first.close()
    committed = first.result.token_ids
    assert not pipe.engine.active and 0 < len(committed) < 30 and committed == whole.token_ids[: len(committed)]
    assert pipe.generate(PROMPT, max_new_tokens=30).token_ids == whole.token_ids


def test_a_failing_streamer_leaves_the_request_not_the_caches(pipe):
    """A streamer that raises between rounds ends its request (the error reaches the caller, the slot is free) but
    not the caches, which are consistent there: the next request keeps the prompt's cached prefix."""

    class Broken:
        def put(self, value: torch.Tensor) -> None:
            if value.dim() == 1:  # the first round's ids (the prompt came first, as [1, n])
                raise OSError("the consumer went away")

        def end(self) -> None:
            pass

    with pytest.raises(OSError, match="consumer"):
        pipe.generate(PROMPT, max_new_tokens=20, streamer=Broken())
    assert not pipe.engine.active
    assert pipe.generate(PROMPT, max_new_tokens=5).stats.cached_tokens > 0


def test_stop_string_cuts_the_text(pipe):
    whole = pipe.generate(PROMPT, max_new_tokens=30)
    stop = whole.text[5:8]
    cut = pipe.generate(PROMPT, max_new_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == whole.text[: whole.text.index(stop)]
    assert "".join(pipe.stream(PROMPT, max_new_tokens=30, stop=stop)) == cut.text


def test_streamer_protocol(pipe):
    """As transformers' generate does: the prompt first ([1, n]), then the new ids, then end() once."""

    class Recorder:
        def __init__(self) -> None:
            self.puts, self.ends = [], 0

        def put(self, value: torch.Tensor) -> None:
            self.puts.append(value.clone())

        def end(self) -> None:
            self.ends += 1

    recorder = Recorder()
    result = pipe.generate(PROMPT, max_new_tokens=20, streamer=recorder)
    assert recorder.puts[0].tolist() == [pipe.encode(PROMPT)]
    assert all(p.dim() == 1 for p in recorder.puts[1:]) and len(recorder.puts) > 2
    assert torch.cat(recorder.puts[1:]).tolist() == result.token_ids and recorder.ends == 1
    stream = pipe.stream(PROMPT, max_new_tokens=20, streamer=(early := Recorder()))
    next(stream)
    stream.close()  # an early close still ends the streamer: a consumer thread must not wait forever
    assert early.ends == 1


def test_text_iterator_streamer_from_a_thread(pipe, models):
    _, _, tok = models
    expected = pipe.generate(PROMPT, max_new_tokens=40)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60, skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False)
    done = {}
    thread = threading.Thread(target=lambda: done.update(result=pipe.generate(PROMPT, max_new_tokens=40,
                                                                              streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join(timeout=60)
    assert text == expected.text and done["result"].token_ids == expected.token_ids


def test_generation_config_honoured_and_keywords_win(pipe, monkeypatch):
    sampled = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=12)
    by_config = pipe.generate(PROMPT, generation_config=sampled, seed=3)
    by_keywords = pipe.generate(PROMPT, temperature=0.7, top_k=5, max_new_tokens=12, seed=3)
    greedy = pipe.generate(PROMPT, max_new_tokens=12)
    assert len(by_config.token_ids) == 12 and by_config.token_ids == by_keywords.token_ids
    assert by_config.token_ids != greedy.token_ids  # it did sample
    # do_sample unset: greedy, as transformers has it
    assert pipe.generate(PROMPT, generation_config=GenerationConfig(max_new_tokens=12)).token_ids == greedy.token_ids
    # explicit keywords win over the config
    assert pipe.generate(PROMPT, generation_config=sampled, temperature=0.0).token_ids == greedy.token_ids
    assert len(pipe.generate(PROMPT, generation_config=sampled, max_new_tokens=5, seed=3).token_ids) == 5
    seen = []
    real = pipe.engine.add
    monkeypatch.setattr(pipe.engine, "add", lambda request, **kw: seen.append(request.params) or real(request, **kw))
    pipe.generate(PROMPT, generation_config=GenerationConfig(do_sample=True, temperature=0.5, top_k=7, top_p=0.9,
                                                             min_p=0.05, repetition_penalty=1.2), top_k=3)
    params = seen[-1]
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty) == \
        (0.5, 3, 0.9, 0.05, 1.2)


def test_chatbot_over_a_loaded_pipeline(pipe):
    bot = verispec.ChatBot(pipe, max_new_tokens=16)
    reply = bot.generate_response("Hello")
    pipe.engine.reset()
    assert reply == pipe.generate([{"role": "user", "content": "Hello"}], max_new_tokens=16).text
    assert bot.history[-1] == {"role": "assistant", "content": reply}


def test_load_refuses_what_it_cannot_build(models):
    target, draft, tok = models
    with pytest.raises(verispec.SpecError, match="needs its tokenizer"):
        verispec.load(target, draft)
    with pytest.raises(verispec.SpecError, match="needs a draft model"):
        verispec.load(target, tokenizer=tok)
    with pytest.raises(verispec.SpecError, match="takes no draft model"):
        verispec.load(target, draft, tokenizer=tok, drafter=None)
    ngram = verispec.load(target, tokenizer=tok, drafter="ngram", k=2)
    assert ngram.drafter == "ngram" and ngram.draft_model is None and ngram.generate(PROMPT, max_new_tokens=4).text


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_context_length_is_the_shorter_of_the_pair(models, drafter):
    from verispec.apps.server.app import context_length

    target, _, tok = models
    short = perturbed(target, seed=5, noise=0.1)
    short.config.max_position_embeddings = 512
    pipe = verispec.load(target, short, tokenizer=tok, drafter=drafter)
    assert pipe.engine.target.max_length == 4096 and context_length(pipe) == pipe.context_length == 512
    assert verispec.load(target, tokenizer=tok, drafter="ngram").context_length == 4096


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "hybrid", "hybrid-suffix"])
def test_every_drafter_loads_and_decodes_exactly(models, plain, drafter):
    """Each registered drafter builds through verispec.load and gives plain decoding's greedy tokens; the
    suffix drafters learn from the pipeline's earlier outputs, so the second identical request drafts more."""
    target, draft, tok = models
    pipe = verispec.load(target, None if drafter in ("ngram", "suffix") else draft, tokenizer=tok, drafter=drafter, k=4)
    prompt = PROMPT + " jumps over the lazy dog. " * 3
    expected = plain.generate(prompt, max_new_tokens=40).token_ids
    first = pipe.generate(prompt, max_new_tokens=40)
    second = pipe.generate(prompt, max_new_tokens=40)
    assert first.token_ids == expected and second.token_ids == expected
    if "suffix" in drafter:
        assert second.stats.accepted > first.stats.accepted


def test_cli_drafter_names_are_the_registry():
    from verispec.apps.cli.args import DRAFTER_NAMES, FREE_DRAFTERS
    from verispec.assembly.registry import DRAFTERS

    assert DRAFTER_NAMES == tuple(DRAFTERS)
    assert FREE_DRAFTERS == tuple(name for name, d in DRAFTERS.items() if not d.needs_model)
