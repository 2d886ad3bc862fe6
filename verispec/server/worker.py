"""One thread owns the model pair and runs generations one at a time from a bounded queue.

The asyncio side submits a Job and reads its events (deltas: `verispec.provenance.Piece`s, text with its
tokens' provenance; then done or error) from an asyncio queue fed thread-safely. A cancelled job (client gone, shutdown) leaves the queue at once if it is still
waiting, and stops at the next round boundary if it is running, which leaves the engine's caches consistent.
If the thread itself dies, every job it held or would have run gets an error event: nobody waits forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from verispec.engine import GenerationResult
from verispec.pipeline import Pipeline
from verispec.sampling import SamplingParams
from verispec.provenance import ProvenanceText


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    num_draft_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: the chosen token's logprob and the n most likely
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
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

    def __len__(self) -> int:
        return sum(job is not None for job in self._jobs)

    def put(self, job: Job | None) -> None:
        """Add a job (QueueFull when maxsize are waiting); None wakes the worker to stop."""
        with self._ready:
            if job is not None and len(self) >= self.maxsize:
                raise QueueFull(f"the server is busy: {self.maxsize} requests are already waiting")
            self._jobs.append(job)
            self._ready.notify()

    def get(self) -> Job | None:
        with self._ready:
            while not self._jobs:
                self._ready.wait()
            return self._jobs.popleft()

    def remove(self, job: Job) -> bool:
        with self._ready:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            return True

    def drain(self) -> list[Job]:
        with self._ready:
            jobs = [job for job in self._jobs if job is not None]
            self._jobs = deque(job for job in self._jobs if job is None)
            return jobs


class Worker:
    def __init__(self, pipeline: Pipeline, max_queue: int, metrics) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.jobs = JobQueue(max_queue)
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="verispec-worker", daemon=True)
        self._stopping = False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

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
        """Answer every waiting job with an error (shutdown): they would not run anyway."""
        self._stopping = True
        for job in self.jobs.drain():
            job.emit("unavailable", message)
        self._update_gauges()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse queued jobs, cancel the running one, and join the thread."""
        self.refuse_waiting("the server is shutting down")
        current = self.current
        if current is not None:
            current.cancelled.set()
        self.jobs.put(None)
        self._thread.join(timeout)

    def _update_gauges(self) -> None:
        self.metrics.waiting.set(len(self.jobs))
        self.metrics.running.set(self.current is not None)

    def _run(self) -> None:
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                self.current = job
                self._update_gauges()
                try:
                    self._generate(job)
                except Exception as exc:  # a failed request must never take the worker down
                    job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
                except BaseException:  # the thread dies (SystemExit, ...): its job must not wait for it
                    job.emit("unavailable", "the model worker stopped unexpectedly")
                    raise
                finally:
                    self.current = None
                    self._update_gauges()
        finally:  # also when the thread dies of a BaseException: nobody may wait for it
            self.refuse_waiting("the server is shutting down" if self._stopping
                                else "the model worker stopped unexpectedly")

    def _generate(self, job: Job) -> None:
        engine, metrics = self.pipeline.generator, self.metrics
        if job.cancelled.is_set():  # cancelled between leaving the queue and starting
            metrics.cancelled.inc()
            job.emit("cancelled")
            return
        started = time.perf_counter()
        metrics.queue_time.observe(started - job.submitted)
        text = ProvenanceText(self.pipeline.tokenizer, job.stop)
        generation = engine.stream(job.prompt_ids, job.params, job.max_tokens, job.num_draft_tokens,
                                   stop=text.assembler.stop_index if job.stop else None,
                                   stop_token_ids=job.stop_token_ids, ignore_eos=job.ignore_eos,
                                   logprobs=job.logprobs)
        first = None
        try:
            for chunk in generation:
                was_cancelled = job.cancelled.is_set()  # the round ran after the client left
                metrics.tokens.inc(len(chunk))
                if was_cancelled:
                    metrics.tokens_after_cancel.inc(len(chunk))
                    break
                if first is None:
                    first = time.perf_counter()
                    metrics.time_to_first_token.observe(first - job.submitted)
                metrics.acceptance_length.observe(len(chunk))
                piece = text.push(chunk)
                if piece is not None:
                    job.emit("delta", piece)
        finally:
            generation.close()
        result = generation.result
        job.result, job.text = result, text.text
        stats = result.stats
        metrics.drafted.inc(stats.drafted)
        metrics.accepted.inc(stats.accepted)
        if job.cancelled.is_set():
            metrics.cancelled.inc()
            job.emit("cancelled")
            return
        rest = text.finish()
        if rest is not None:
            job.emit("delta", rest)
        job.text = text.text
        end = time.perf_counter()
        if first is not None and stats.new_tokens > 1:  # decoding only: the prefill is in time to first token
            metrics.time_per_token.observe((end - first) / (stats.new_tokens - 1))
        metrics.e2e.observe(end - job.submitted)
        job.emit("done", result)
