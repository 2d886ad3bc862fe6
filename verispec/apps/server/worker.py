"""One thread owns the model pair and runs generations from a bounded queue, in the pipeline's Slots
(verispec.pipeline.slots): one at a time, or (max_batch > 1, on a pipeline that can batch) continuously batched.

The asyncio side submits a Job and reads its events (deltas: `verispec.pipeline.provenance.Piece`s, text with its
tokens' provenance; then done or error) from an asyncio queue fed thread-safely. One loop serves both ways: between
two rounds, waiting jobs take every free slot (so a job waits at most one round once a slot is free) and cancelled
jobs (client gone, shutdown) leave, which leaves the caches consistent; then one round runs for all. A cancelled
job still waiting leaves the queue at once. A round that raises answers its jobs with an error and serving goes on;
if the thread itself dies, every job it held or would have run gets an error event: nobody waits forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from verispec.decoding.request import Committed, Request
from verispec.pipeline.pipeline import Completion, Pipeline
from verispec.pipeline.provenance import Piece
from verispec.pipeline.slots import Slot

EMPTY = object()  # JobQueue.get(block=False) with nothing waiting


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass
class Job:
    """A client's request and what the worker answers it with: events as it runs, then `result` (and its text)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: Completion | None = None
    text: str = ""
    submitted: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, payload=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass


class JobQueue:
    """A bounded FIFO of jobs from which a cancelled job can be removed at once (freeing its slot)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._jobs: deque[Job | None] = deque()
        self._ready = threading.Condition()
        self._closed: str | None = None  # why no job is taken any more (see close)

    def __len__(self) -> int:
        return sum(job is not None for job in self._jobs)

    def put(self, job: Job | None) -> None:
        """Add a job (QueueFull when maxsize are waiting, ShuttingDown once closed); None wakes the worker to
        stop."""
        with self._ready:
            if job is not None and self._closed is not None:
                raise ShuttingDown(self._closed)
            if job is not None and len(self) >= self.maxsize:
                raise QueueFull(f"the server is busy: {self.maxsize} requests are already waiting")
            self._jobs.append(job)
            self._ready.notify()

    def get(self, block: bool = True) -> Job | None | object:
        """The next job (None: stop); with block=False, EMPTY when none is waiting."""
        with self._ready:
            while not self._jobs:
                if not block:
                    return EMPTY
                self._ready.wait()
            return self._jobs.popleft()

    def remove(self, job: Job) -> bool:
        with self._ready:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            return True

    def close(self, reason: str) -> list[Job]:
        """Take no more jobs (a later put raises ShuttingDown(reason)); returns the waiting ones, removed. One
        lock for both: a job is either returned here, to be answered, or refused, never left waiting for a
        worker that has gone."""
        with self._ready:
            self._closed = self._closed or reason
            jobs = [job for job in self._jobs if job is not None]
            self._jobs = deque(job for job in self._jobs if job is None)
            return jobs


@dataclass
class _Running:
    """A job that is generating: when it started and its first token came."""

    job: Job
    started: float
    first: float | None = None


class Worker:
    def __init__(self, pipeline: Pipeline, max_queue: int, metrics, max_batch: int = 1) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.jobs = JobQueue(max_queue)
        self.slots = pipeline.slots(max_batch)
        self.max_batch = self.slots.size
        self.running: list[Job] = []
        self._thread = threading.Thread(target=self._run, name="verispec-worker", daemon=True)
        self._stopping = False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def current(self) -> Job | None:
        """A running job (None: none is running)."""
        running = self.running
        return running[0] if running else None

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down")
        if not self.alive:
            raise ShuttingDown("the model worker is not running")
        self.jobs.put(job)
        self._update_gauges()

    def cancel(self, job: Job) -> None:
        """The client went away: a waiting job leaves the queue now, a running one stops after its round."""
        job.cancelled.set()
        if self.jobs.remove(job):
            self.metrics.cancelled.inc()
            self._update_gauges()

    def refuse_waiting(self, message: str) -> None:
        """Answer every waiting job with an error and refuse new ones (shutdown): they would not run anyway."""
        self._stopping = True
        for job in self.jobs.close(message):
            job.emit("unavailable", message)
        self._update_gauges()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse queued jobs, cancel the running ones, and join the thread."""
        self.refuse_waiting("the server is shutting down")
        for job in list(self.running):
            job.cancelled.set()
        self.jobs.put(None)
        self._thread.join(timeout)

    def _update_gauges(self) -> None:
        self.metrics.waiting.set(len(self.jobs))
        self.metrics.running.set(len(self.running))

    def _run(self) -> None:
        runs: dict[Slot, _Running] = {}  # the jobs in the slots
        try:
            self._serve(runs)
        finally:  # also when the thread dies of a BaseException: nobody may wait for it
            message = "the server is shutting down" if self._stopping else "the model worker stopped unexpectedly"
            for run in runs.values():
                run.job.emit("unavailable", message)
            self.refuse_waiting(message)

    # -- one job's life, alone or in a batch -----------------------------------------------------------

    def _begin(self, job: Job) -> _Running | None:
        """A job leaves the queue to run (None: it was cancelled meanwhile, and is answered)."""
        if job.cancelled.is_set():  # cancelled between leaving the queue and starting
            self.metrics.cancelled.inc()
            job.emit("cancelled")
            return None
        started = time.perf_counter()
        self.metrics.queue_time.observe(started - job.submitted)
        return _Running(job, started)

    def _deliver(self, run: _Running, chunk: Committed, piece: Piece | None) -> bool:
        """Hand a round's committed tokens (and the text piece they completed) to the job's client; False when
        the client had already left."""
        job, metrics = run.job, self.metrics
        metrics.tokens.inc(len(chunk))
        if job.cancelled.is_set():  # the round ran after the client left
            metrics.tokens_after_cancel.inc(len(chunk))
            return False
        if chunk:
            if run.first is None:
                run.first = time.perf_counter()
                metrics.time_to_first_token.observe(run.first - job.submitted)
            metrics.acceptance_length.observe(len(chunk))
        if piece is not None:
            job.emit("delta", piece)
        return True

    def _end(self, run: _Running, result: Completion) -> None:
        """The job's generation ended (finished, or stopped because its client left): answer it."""
        job, metrics = run.job, self.metrics
        job.result, job.text = result, result.text
        stats = result.stats
        metrics.drafted.inc(stats.drafted)
        metrics.accepted.inc(stats.accepted)
        if job.cancelled.is_set():
            metrics.cancelled.inc()
            job.emit("cancelled")
            return
        end = time.perf_counter()
        if run.first is not None and stats.new_tokens > 1:  # decoding only: the prefill is in time to first token
            metrics.time_per_token.observe((end - run.first) / (stats.new_tokens - 1))
        metrics.e2e.observe(end - job.submitted)
        job.emit("done", result)

    # -- the loop ------------------------------------------------------------------------------------

    def _serve(self, runs: dict[Slot, _Running]) -> None:
        stopping = False
        while True:
            while self.slots.free and not stopping:  # every free slot takes a waiting job, before the round
                job = self.jobs.get(block=not runs)
                if job is EMPTY:
                    break
                if job is None:
                    stopping = True
                    break
                self._admit(job, runs)
            if not runs:
                if stopping:
                    return
                continue
            try:
                self._round(runs)
            except Exception as exc:  # the round is lost, the server is not: answer its jobs, start afresh
                self.slots.abort()
                for run in runs.values():
                    run.job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
                runs.clear()
                self._set_running(runs)

    def _round(self, runs: dict[Slot, _Running]) -> None:
        """Jobs whose client left leave the slots; one round runs for the rest; its tokens go out, and the jobs
        whose generation ended are answered."""
        slots = self.slots
        for slot, run in list(runs.items()):
            if run.job.cancelled.is_set():  # between rounds: the caches stay consistent
                slots.cancel(slot)
                self._close(slot, runs)
        if not runs:
            return
        for slot, chunk in slots.step():
            run = runs[slot]
            try:
                delivered = self._deliver(run, chunk, slot.push(chunk))
            except Exception as exc:  # this job's text failed: it alone ends
                slots.cancel(slot)
                runs.pop(slot)
                self._set_running(runs)
                run.job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
                continue
            if not delivered:
                slots.cancel(slot)
        for slot in [slot for slot in runs if slot.done]:
            self._close(slot, runs)

    def _set_running(self, runs: dict) -> None:
        self.running = [run.job for run in runs.values()]
        self._update_gauges()

    def _admit(self, job: Job, runs: dict[Slot, _Running]) -> None:
        try:
            run = self._begin(job)
            if run is None:
                return
            slot = self.slots.add(job.request)
        except Exception as exc:
            job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
            return
        except BaseException:
            job.emit("unavailable", "the model worker stopped unexpectedly")
            raise
        runs[slot] = run
        self._set_running(runs)

    def _close(self, slot: Slot, runs: dict[Slot, _Running]) -> None:
        """The job's generation ended: out of `runs`, then answered (an answer that fails is an error event)."""
        run = runs.pop(slot)
        self._set_running(runs)
        try:
            rest, completion = slot.finish()
            if rest is not None and not run.job.cancelled.is_set():
                run.job.emit("delta", rest)
            self._end(run, completion)
        except Exception as exc:
            run.job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
        except BaseException:  # the thread dies: this job, out of `runs` already, must not wait for it
            run.job.emit("unavailable", "the model worker stopped unexpectedly")
            raise
