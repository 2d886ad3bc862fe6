"""Requests decoding side by side, with their text: what a serving loop drives.

`Slots` holds the requests of one engine (verispec.decoding.engine: `Pipeline.slots(max_batch)` gives one of
`max_batch` slots where the pipeline can batch, else the pipeline's own engine, one slot). It takes a Request into
a free slot (`add`), runs one round for every request it holds (`step`) and hands back each request's newly
committed tokens; the request's `Slot` turns them into text pieces (stop strings applied at the text level) and, at
its end, into a Completion. Between two rounds a serving loop fills free slots and drops the slots whose client
left, then it steps. `drain` is that loop for a list of requests (Pipeline.generate_batch); the server's worker runs
it over its queue.
"""

from __future__ import annotations

from collections.abc import Sequence

from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.request import Committed, GenerationResult, Request
from verispec.decoding.row import Row
from verispec.pipeline.completion import Completion
from verispec.pipeline.provenance import Piece, ProvenanceText


class Slot:
    """One request in Slots: its text so far, and whether its generation has ended (`done`)."""

    def __init__(self, request: Request, tokenizer) -> None:
        self.request = request
        self.text = ProvenanceText.of(tokenizer, request)
        self.result: GenerationResult | None = None  # set by the Slots that took the request
        self.done = False

    def push(self, chunk: Committed) -> Piece | None:
        """The text piece a round's committed tokens complete (None: text held back for now)."""
        return self.text.push(chunk)

    def finish(self) -> tuple[Piece | None, Completion]:
        """The text held back to the end (None: none), and the Completion so far (final once `done`)."""
        rest = self.text.finish()
        return rest, Completion.of(self.text.text, self.result, self.text.stop_reason)


class Slots:
    """The requests of one engine, every one decoding in the same rounds. `size`: how many at most; `free`: how many
    more `add` takes now."""

    def __init__(self, engine: SpeculativeEngine, tokenizer) -> None:
        self.engine, self.tokenizer, self.size = engine, tokenizer, engine.max_batch
        self._rows: dict[Row, Slot] = {}

    @property
    def free(self) -> int:
        return self.engine.free_slots

    def check(self, request: Request) -> None:
        """ValueError with a one-line reason when `add` would refuse the request."""
        self.engine.resolve(request)

    def add(self, request: Request) -> Slot:
        """Take a request into a free slot; it joins the next round (ValueError: a bad request)."""
        slot = Slot(request, self.tokenizer)
        row = self.engine.add(request, stop=slot.text.stop_test)
        slot.result = row.result
        self._rows[row] = slot
        return slot

    def step(self) -> list[tuple[Slot, Committed]]:
        """One round for every request held: each request's newly committed tokens (a request that committed
        nothing is absent). A request whose generation ended is `done` and leaves."""
        out = [(self._rows[row], chunk) for row, chunk in self.engine.step()]
        for row in [row for row in self._rows if row.done]:
            self._rows.pop(row).done = True
        return out

    def cancel(self, slot: Slot) -> None:
        """Take a request out now, between rounds (its result keeps what was committed)."""
        row = next((row for row, held in self._rows.items() if held is slot), None)
        if row is not None:
            self.engine.cancel(row)
            del self._rows[row]
        slot.done = True

    def abort(self) -> None:
        """Drop every request after a round failed part-way (no cache is trusted)."""
        self.engine.abort()
        for slot in self._rows.values():
            slot.done = True
        self._rows.clear()


def drain(slots: Slots, requests: Sequence[Request]) -> list[Completion]:
    """Generate every request in `slots`, the next admitted as soon as a slot frees; their Completions, in order.
    When this fails (a round raised, or an interrupt), every request held leaves and no cache is trusted."""
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
    except BaseException:
        slots.abort()
        raise
    return out
