"""Requests decoding side by side, with their text: what a serving loop drives.

`Pipeline.slots(max_batch)` gives `BatchSlots` (continuous batching on verispec.decoding.batch) where the pipeline
can batch and more than one slot is asked for, else `LoneSlots` (one request at a time on the pipeline's
generator). Both take a Request into a free slot (`add`), run one round for every request they hold (`step`)
and hand back each request's newly committed tokens; the request's `Slot` turns them into text pieces (stop
strings applied at the text level) and, at its end, into a Completion. So one loop serves either: between two
rounds it fills free slots and drops the slots whose client left, then it steps. `drain` is that loop for a list
of requests (Pipeline.generate_batch); the server's worker runs it over its queue.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from verispec.decoding.batch import BatchGenerator, BatchRequest
from verispec.decoding.engine import SpeculativeGenerator
from verispec.decoding.request import Committed, GenerationResult, Request
from verispec.pipeline.completion import Completion
from verispec.pipeline.provenance import Piece, ProvenanceText


class Slot:
    """One request in Slots: its text so far, and whether its generation has ended (`done`)."""

    def __init__(self, request: Request, tokenizer) -> None:
        self.request = request
        self.text = ProvenanceText(tokenizer, request.stop)
        self.result: GenerationResult | None = None  # set by the Slots that took the request
        self.done = False

    def push(self, chunk: Committed) -> Piece | None:
        """The text piece a round's committed tokens complete (None: text held back for now)."""
        return self.text.push(chunk)

    def finish(self) -> tuple[Piece | None, Completion]:
        """The text held back to the end (None: none), and the Completion so far (final once `done`)."""
        rest = self.text.finish()
        return rest, Completion.of(self.text.text, self.result)


class Slots(Protocol):
    """Requests decoding together. `size`: how many at most; `free`: how many more `add` takes now."""

    size: int

    @property
    def free(self) -> int: ...

    def check(self, request: Request) -> None:
        """ValueError with a one-line reason when `add` would refuse the request."""

    def add(self, request: Request) -> Slot:
        """Take a request into a free slot; it joins the next round (ValueError: a bad request)."""

    def step(self) -> list[tuple[Slot, Committed]]:
        """One round for every request held: each request's newly committed tokens (a request that committed
        nothing is absent). A request whose generation ended is `done` and leaves."""

    def cancel(self, slot: Slot) -> None:
        """Take a request out now, between rounds (its result keeps what was committed)."""

    def abort(self) -> None:
        """Drop every request after a round failed part-way (no cache is trusted)."""


class BatchSlots:
    """Slots over a BatchGenerator: every request held decodes in the same rounds."""

    def __init__(self, batch: BatchGenerator, tokenizer) -> None:
        self.batch, self.tokenizer, self.size = batch, tokenizer, batch.max_batch
        self._rows: dict[BatchRequest, Slot] = {}

    @property
    def free(self) -> int:
        return self.batch.free_slots

    def check(self, request: Request) -> None:
        self.batch.resolve(request)

    def add(self, request: Request) -> Slot:
        slot = Slot(request, self.tokenizer)
        row = self.batch.add(request, stop=slot.text.stop_test)
        slot.result = row.result
        self._rows[row] = slot
        return slot

    def step(self) -> list[tuple[Slot, Committed]]:
        out = [(self._rows[row], chunk) for row, chunk in self.batch.step()]
        for row in [row for row in self._rows if row.done]:
            self._rows.pop(row).done = True
        return out

    def cancel(self, slot: Slot) -> None:
        row = next((row for row, held in self._rows.items() if held is slot), None)
        if row is not None:
            self.batch.cancel(row)
            del self._rows[row]
        slot.done = True

    def abort(self) -> None:
        self.batch.abort()
        for slot in self._rows.values():
            slot.done = True
        self._rows.clear()


class LoneSlots:
    """One slot on the pipeline's generator (a pipeline that cannot batch, or a server asked for one)."""

    size = 1

    def __init__(self, generator: SpeculativeGenerator, tokenizer) -> None:
        self.generator, self.tokenizer = generator, tokenizer
        self._slot: Slot | None = None
        self._rounds: Iterator[Committed] | None = None
        self._close = lambda: None

    @property
    def free(self) -> int:
        return 0 if self._slot is not None else 1

    def check(self, request: Request) -> None:
        self.generator.resolve(request)

    def add(self, request: Request) -> Slot:
        if self._slot is not None:
            raise RuntimeError("the slot is taken (1 sequence)")
        slot = Slot(request, self.tokenizer)
        generation = self.generator.stream(request, stop=slot.text.stop_test)
        slot.result, self._slot, self._rounds, self._close = generation.result, slot, iter(generation), generation.close
        return slot

    def step(self) -> list[tuple[Slot, Committed]]:
        slot = self._slot
        if slot is None:
            return []
        try:
            return [(slot, next(self._rounds))]
        except StopIteration:
            self._leave()
            return []

    def cancel(self, slot: Slot) -> None:
        if slot is self._slot:
            self._close()  # between rounds: the generator's caches stay consistent
            self._leave()
        slot.done = True

    def abort(self) -> None:
        if self._slot is not None:
            self._close()  # a round that raised has already reset the generator's caches
            self._leave()

    def _leave(self) -> None:
        self._slot.done = True
        self._slot, self._rounds, self._close = None, None, lambda: None


def drain(slots: Slots, requests: Sequence[Request]) -> list[Completion]:
    """Generate every request in `slots`, the next admitted as soon as a slot frees; their Completions, in order.
    Requests still held when this fails leave the slots."""
    waiting, held = list(enumerate(requests)), {}
    out: list[Completion] = [None] * len(requests)  # type: ignore[list-item]
    try:
        while waiting or held:
            while waiting and slots.free:
                index, request = waiting.pop(0)
                held[slots.add(request)] = index
            for slot, chunk in slots.step():
                slot.push(chunk)
            for slot in [slot for slot in held if slot.done]:
                out[held.pop(slot)] = slot.finish()[1]
    finally:
        for slot in held:
            slots.cancel(slot)
    return out
