"""Timing a round's stages on the device's timeline (CUDA events) rather than the host's queueing of them."""

from __future__ import annotations

import time

import pytest
import torch
from tiny import make_engine, perturbed, tiny_qwen2

from verispec.core.timing import Clock, sync


class DeviceTimeline:
    """A clock on a simulated device's timeline: a mark reads the time the device has reached (the sum of the
    passes queued so far, see `Timed`), whatever the host spent queueing them."""

    def __init__(self) -> None:
        self.now, self.marks = 0.0, []

    def mark(self) -> int:
        self.marks.append(self.now)
        return len(self.marks) - 1

    def seconds(self, a: int, b: int) -> float:
        assert a < b
        return self.marks[b] - self.marks[a]


class Timed:
    """A Model whose every pass takes `cost` seconds on the timeline (the rest is the wrapped model's)."""

    def __init__(self, model, timeline: DeviceTimeline, cost: float) -> None:
        self.model, self.timeline, self.cost = model, timeline, cost

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_rows(self, slots, feeds, last_only=False, logits_for=None):
        self.timeline.now += self.cost
        return self.model.forward_rows(slots, feeds, last_only, logits_for)


def test_cpu_clock_is_the_host_clock():
    clock = Clock(torch.device("cpu"))
    a = clock.mark()
    time.sleep(0.01)
    assert 0.01 <= clock.seconds(a, clock.mark()) < 1.0
    sync(torch.device("cpu"))  # nothing to wait for


@pytest.mark.parametrize("k", [2, "auto"])
def test_round_stages_are_timed_by_the_engine_clock(k):
    """The engine reads each round's draft and verify times from its clock (on CUDA: events, read after the
    round's sync), not from host clock reads between stages, and adaptive k learns its costs from them: on a
    timeline where a target pass takes 0.5 s and a draft step 0.25 s, the verify stages add up to 0.5 s a round
    and the draft stages to 0.25 s a draft step (the draft's catch-up, its own stage, is not drafting)."""
    target = tiny_qwen2(1)
    plain = make_engine(target).generate([3, 1, 4], max_new_tokens=30).token_ids
    eng = make_engine(target, perturbed(target, seed=2, noise=0.05), k=k)
    eng._clock = clock = DeviceTimeline()
    eng.target = Timed(eng.target, clock, 0.5)
    eng.drafter.model = Timed(eng.drafter.model, clock, 0.25)
    out = eng.generate([3, 1, 4], max_new_tokens=30)
    assert out.token_ids == plain
    stats = out.stats
    assert stats.target_forwards >= 3 and stats.draft_forwards > 0
    assert stats.target_seconds == pytest.approx(0.5 * stats.target_forwards)
    assert stats.draft_seconds == pytest.approx(0.25 * stats.draft_forwards)
    if k == "auto":
        assert eng.k_policy.by_source["model"].costs.target.t_verify[0] == pytest.approx(0.5)  # learnt from the clock: every pass cost 0.5 s


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clock_times_queued_work():
    """Kernels queued on a GPU run after the host moves on: the events measure their run, a host clock
    around the queueing does not, and the engine's greedy output stays plain decoding's."""
    device = torch.device("cuda")
    clock = Clock(device)
    x = torch.randn(2048, 2048, device=device)
    sync(device)
    a, host = clock.mark(), time.perf_counter()
    for _ in range(50):
        x = x @ x
        x = x / x.norm()
    b, host = clock.mark(), time.perf_counter() - host
    sync(device)
    assert clock.seconds(a, b) > 0 and clock.seconds(a, b) >= 0.5 * host

    target = tiny_qwen2(1)
    draft = perturbed(target, seed=2, noise=0.05).to(device)
    target.to(device)
    plain = make_engine(target).generate([3, 1, 4], max_new_tokens=30)
    out = make_engine(target, draft, k="auto").generate([3, 1, 4], max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.stats.target_seconds > 0
