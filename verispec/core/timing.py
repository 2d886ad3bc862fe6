"""Timing work that runs on a device without making the host wait for it.

On a GPU the host only queues kernels: a host clock read between two stages of a round (drafting, then
verifying) measures how long queueing took, not how long the stages ran, and the wait for the kernels all
lands on whichever later stage makes the first device -> host copy. A `Clock` on a CUDA device therefore
marks points with events recorded on the device's current stream and reads the time between them only after
the round's one sync (`seconds`): the stages' real durations on the device's timeline, at no extra sync. On the
CPU (and for llama.cpp, whose calls return when the work is done) it is the host's perf_counter.

One-off timings that are needed before the next sync (a draft's timed step) call `sync` instead: once per
generation, not per round. Host values a round sends to the device (positions, indices, looked-up drafts) go with
`device_tensor`, which does not wait for the device either.
"""

from __future__ import annotations

import time

import torch


def device_tensor(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of host values (a list of ints, say) on `device`, copied without waiting for the device's queue:
    `torch.tensor(values, device="cuda")` copies synchronously, which waits for every kernel queued before it."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA); nothing elsewhere, where calls return finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """`mark()` points in a round; `seconds(a, b)` between two marks, once the work before b has finished."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, a: float | torch.cuda.Event, b: float | torch.cuda.Event) -> float:
        if not self.cuda:
            return b - a
        return a.elapsed_time(b) / 1000.0  # milliseconds between the events on the stream
