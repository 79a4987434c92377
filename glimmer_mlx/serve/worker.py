"""The job queue and the model thread: HTTP threads `submit` validated requests as `Job`s; `Worker.run_jobs` runs
their generations one at a time, in arrival order, in the thread that calls it, and hands each job's chunks back
through the job's event queue.

The model runs in the thread that calls `run_jobs` (the main thread, for `glimmer serve`): MLX work done in other
threads makes the process abort at exit ("terminate called without an active exception", MLX 0.32)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..runtime.loop import GenerationChunk, GenerationStats
from ..session import Session
from .api import APIError, Request, shutting_down


POLL = 0.1  # seconds between checks that a waiting client is still connected


class ClientGone(ConnectionResetError):
    """The client of a job closed its connection while waiting: the job is cancelled."""


@dataclass
class Job:
    """One queued generation. `events` carries ("chunk", GenerationChunk) …, then ("done", GenerationStats) or
    ("error", APIError); setting `cancel` (the client is done or gone) stops the generation at its next chunk, or
    skips it if it has not started."""
    request: Request
    events: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def ids(self) -> list[int]:
        return self.request.ids

    def results(self, gone: Callable[[], bool] | None = None
                ) -> Iterator[tuple[str, GenerationChunk | GenerationStats]]:
        """The job's ("chunk", …) events, then ("done", stats); an error event is raised. `gone` (polled every
        `POLL` seconds): has the client left? Then the job is cancelled (skipped if still
        queued, stopped at its next token if running) and `ClientGone` raised."""
        checked = time.monotonic()
        while True:
            try:
                kind, val = self.events.get(timeout=POLL if gone is not None else None)
            except queue.Empty:
                kind = None
            if gone is not None and (kind is None or time.monotonic() - checked >= POLL):
                checked = time.monotonic()
                if gone():
                    self.cancel.set()
                    raise ClientGone("the client closed the connection")
            if kind is None:
                continue
            if kind == "error":
                raise val
            yield kind, val
            if kind == "done":
                return


class Worker:
    """Runs the jobs on one session. `submit` is for any thread; `run_jobs` for the model's thread."""

    def __init__(self, session: Session, *, max_queue: int):
        self.session = session
        self.max_queue = max_queue
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.stopped = threading.Event()
        self.current: Job | None = None  # the job whose generation is running
        self._admit = threading.Lock()  # a job is either refused or queued before `stop` drains the queue

    def queued(self) -> int:
        return self.jobs.qsize()

    def submit(self, request: Request) -> Job:
        """Queue a generation; a 503 when shutting down or when `max_queue` jobs are waiting."""
        with self._admit:
            if self.stopped.is_set():
                raise shutting_down()
            if self.jobs.qsize() >= self.max_queue:
                raise APIError(503, f"the server is busy: {self.max_queue} requests are waiting", type="server_error")
            job = Job(request)
            self.jobs.put(job)
        return job

    def run_jobs(self, until: threading.Event | None = None) -> None:
        """Run queued generations in this thread, in arrival order, until `until` is set or the worker stops."""
        while not self.stopped.is_set() and not (until is not None and until.is_set()):
            try:
                job = self.jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            if job.cancel.is_set():
                continue
            self.current = job
            try:
                self.run(job)
            except BaseException:  # Ctrl-C mid-generation: tell the waiting request before leaving
                job.events.put(("error", shutting_down()))
                raise
            finally:
                self.current = None

    def run(self, job: Job) -> None:
        """One generation, its chunks and its end put on `job.events`; never raises for a failed generation."""
        stats = GenerationStats()
        it = None
        try:
            it = self.session.stream(job.ids, stats=stats, **job.request.generation_kwargs())
            for chunk in it:
                job.events.put(("chunk", chunk))
                if job.cancel.is_set():
                    break
        except ValueError as e:  # what the request checks could not see (ModeError, ContextLengthError among them)
            job.events.put(("error", APIError(400, str(e))))
            return
        except Exception as e:  # never let the loop die: report it to this request
            job.events.put(("error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                              type="server_error")))
            return
        finally:
            if it is not None:
                it.close()
        if job.cancel.is_set() and self.stopped.is_set():  # Ctrl-C cut it short: an error, not a cut answer
            job.events.put(("error", shutting_down()))
            return
        job.events.put(("done", stats))

    def interrupt(self) -> None:
        """Ctrl-C: stop the job loop and cancel the running generation at its next token. Only sets flags (it runs
        in a signal handler)."""
        self.stopped.set()
        job = self.current
        if job is not None:
            job.cancel.set()

    def stop(self) -> None:
        """Refuse new jobs and answer the waiting ones with a 503 (instead of leaving them hanging)."""
        with self._admit:
            self.stopped.set()
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            job.events.put(("error", shutting_down()))
