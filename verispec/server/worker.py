"""One thread owns the model pair and runs generations one at a time from a bounded queue.

The asyncio side submits a Job and reads its events (text deltas, then done or error) from an asyncio
queue fed thread-safely. A cancelled job (client gone, shutdown) stops at the next round boundary,
which leaves the engine's caches consistent.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from verispec.engine import GenerationResult
from verispec.pipeline import Pipeline
from verispec.sampling import SamplingParams
from verispec.text import TextAssembler


class QueueFull(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    num_draft_tokens: int
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    text: str = ""

    def emit(self, kind: str, payload=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening
            pass


class Worker:
    def __init__(self, pipeline: Pipeline, max_queue: int, metrics) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="verispec-worker", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise QueueFull("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self.jobs.maxsize} requests are already waiting") from None
        self.metrics.queue_length.set(self.jobs.qsize())

    def stop(self, timeout: float = 30.0) -> None:
        """Abort queued jobs, cancel the running one, and join the thread."""
        self._stopping = True
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", "the server is shutting down")
        if self.current is not None:
            self.current.cancelled.set()
        self.jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            self.metrics.queue_length.set(self.jobs.qsize())
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self.current = job
            try:
                self._generate(job)
            except Exception as exc:  # a failed request must never take the worker down
                job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
            finally:
                self.current = None

    def _generate(self, job: Job) -> None:
        engine = self.pipeline.generator
        text = TextAssembler(self.pipeline.tokenizer, job.stop)
        generation = engine.stream(job.prompt_ids, job.params, job.max_tokens, job.num_draft_tokens,
                                   stop=text.stop_index if job.stop else None)
        started = time.perf_counter()
        try:
            for chunk in generation:
                self.metrics.acceptance_length.observe(len(chunk))
                piece = text.push(chunk)
                if piece:
                    job.emit("delta", piece)
                if job.cancelled.is_set():
                    break
        finally:
            generation.close()
        result = generation.result
        if not job.cancelled.is_set():
            rest = text.finish()
            if rest:
                job.emit("delta", rest)
        job.result, job.text = result, text.text
        stats = result.stats
        self.metrics.tokens.inc(stats.new_tokens)
        self.metrics.drafted.inc(stats.drafted)
        self.metrics.accepted.inc(stats.accepted)
        if stats.new_tokens:
            self.metrics.time_per_token.observe((time.perf_counter() - started) / stats.new_tokens)
        job.emit("done", result)
