"""Timing a round's stages on the device's timeline (CUDA events) rather than the host's queueing of them."""

from __future__ import annotations

import time

import pytest
import torch
from tiny import make_engine, perturbed, tiny_qwen2

from verispec.core.timing import Clock, sync


class StageClock:
    """A clock whose marks are numbered: every round makes four (start, caught up, drafted, verified), and the
    time between them is what a device would report, whatever the host spent queueing (no catch-up here)."""

    def __init__(self, draft: float, verify: float) -> None:
        self.draft, self.verify, self.marks = draft, verify, 0

    def mark(self) -> int:
        self.marks += 1
        return self.marks - 1

    def seconds(self, a: int, b: int) -> float:
        assert b == a + 1
        return (0.0, self.draft, self.verify)[a % 4]


def test_cpu_clock_is_the_host_clock():
    clock = Clock(torch.device("cpu"))
    a = clock.mark()
    time.sleep(0.01)
    assert 0.01 <= clock.seconds(a, clock.mark()) < 1.0
    sync(torch.device("cpu"))  # nothing to wait for


@pytest.mark.parametrize("k", [2, "auto"])
def test_round_stages_are_timed_by_the_engine_clock(k):
    """The engine reads each round's draft and verify times from its clock (on CUDA: events, read after the
    round's sync), not from host clock reads between stages, and adaptive k learns its costs from them."""
    target = tiny_qwen2(1)
    plain = make_engine(target).generate([3, 1, 4], max_new_tokens=30).token_ids
    eng = make_engine(target, perturbed(target, seed=2, noise=0.05), k=k)
    eng._clock = clock = StageClock(draft=0.25, verify=0.5)
    out = eng.generate([3, 1, 4], max_new_tokens=30)
    assert out.token_ids == plain
    rounds = clock.marks // 4
    assert clock.marks == 4 * rounds and rounds >= 3
    assert out.stats.target_seconds == pytest.approx(0.5 * rounds)
    assert out.stats.draft_seconds == pytest.approx(0.25 * rounds)
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
