"""Pipeline.slots (verispec.pipeline.slots): a serving loop over one slot or a batch gives each request the text and
tokens Pipeline.generate gives it, and a request taken out between rounds leaves the slots consistent."""

from __future__ import annotations

import pytest
from tiny import text_pair

import verispec
from verispec.pipeline.slots import Slots

PROMPTS = ["def f(x):", "hello world", "abc", "The quick brown fox"]


@pytest.fixture(scope="module")
def pipe():
    target, draft, tok = text_pair()
    return verispec.load(target, draft, tokenizer=tok, drafter="model", draft_quant="none", k=3)


def serve(slots, requests):
    """Serve requests the way the server's worker does (free slots filled before each round, done slots
    closed after it); returns each request's (text from its pieces, Completion)."""
    waiting, held, out = list(enumerate(requests)), {}, {}
    while waiting or held:
        while slots.free and waiting:
            index, request = waiting.pop(0)
            held[slots.add(request)] = (index, [])
        for slot, chunk in slots.step():
            piece = slot.push(chunk)
            if piece is not None:
                held[slot][1].append(piece.text)
        for slot in [slot for slot in held if slot.done]:
            index, texts = held.pop(slot)
            rest, completion = slot.finish()
            out[index] = ("".join(texts) + (rest.text if rest is not None else ""), completion)
    return [out[i] for i in range(len(requests))]


@pytest.mark.parametrize("max_batch", [1, 3])
def test_slots_give_what_generate_gives(pipe, max_batch):
    slots = pipe.slots(max_batch)
    assert isinstance(slots, Slots) and slots.size == max_batch
    assert (slots.engine is pipe.engine) == (max_batch == 1)  # one slot: the pipeline's own engine
    settings = [dict(max_new_tokens=20), dict(max_new_tokens=30, k=1), dict(max_new_tokens=20, stop=["Y"]),
                dict(max_new_tokens=16, temperature=0.8, seed=5)]
    requests = [pipe.request(prompt, **s) for prompt, s in zip(PROMPTS, settings)]
    results = serve(slots, requests)
    for (text, got), prompt, s in zip(results, PROMPTS, settings):
        want = pipe.generate(prompt, **s)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert text == got.text == want.text
    assert results[2][1].finish_reason == "stop" and "Y" not in results[2][0]  # the stop string cut it
    assert slots.free == max_batch


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_request_cancelled_between_rounds_keeps_its_tokens_and_frees_its_slot(pipe, max_batch):
    slots = pipe.slots(max_batch)
    full = pipe.generate(PROMPTS[0], max_new_tokens=40)
    slot = slots.add(pipe.request(PROMPTS[0], max_new_tokens=40))
    for _ in range(3):
        slots.step()
    slots.cancel(slot)
    _, cut = slot.finish()
    assert slot.done and slots.free == max_batch
    assert 0 < len(cut.token_ids) < len(full.token_ids) and full.token_ids[: len(cut.token_ids)] == cut.token_ids
    (_, again), = serve(slots, [pipe.request(PROMPTS[1], max_new_tokens=24)])
    assert again.token_ids == pipe.generate(PROMPTS[1], max_new_tokens=24).token_ids


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_bad_request_is_refused_and_the_slot_stays_free(pipe, max_batch):
    slots = pipe.slots(max_batch)
    with pytest.raises(ValueError, match="out of range"):
        slots.add(verispec.Request(prompt_ids=[1, 10**6], max_new_tokens=4))
    assert slots.free == max_batch
    (_, done), = serve(slots, [pipe.request(PROMPTS[2], max_new_tokens=8)])
    assert done.token_ids == pipe.generate(PROMPTS[2], max_new_tokens=8).token_ids


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_list_with_a_bad_prompt_fails_before_any_is_generated(pipe, max_batch, monkeypatch):
    from verispec.pipeline.pipeline import Pipeline

    added, real = [], Pipeline.slots

    def spied(self, n=1):
        slots = real(self, n)
        add = slots.add
        slots.add = lambda request: added.append(request) or add(request)
        return slots

    monkeypatch.setattr(Pipeline, "slots", spied)
    with pytest.raises(ValueError, match="out of range"):
        pipe.generate([PROMPTS[0], [1, 10**6]], max_new_tokens=4, max_batch=max_batch)
    assert added == []
    assert len(pipe.generate(PROMPTS[:2], max_new_tokens=4, max_batch=max_batch)) == 2 and len(added) == 2
