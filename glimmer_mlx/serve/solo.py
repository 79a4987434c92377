"""A worker that decodes one request at a time through `Session.stream` (`glimmer serve --distributed`): the same job
queue, bounded (503 when `max_queue` jobs wait), cancellation at the next chunk and shutdown answers as `worker.Worker`,
without batching. Under `--distributed` the session is a `follower.LeaderSession`: each request is sent to the other
ranks, which decode it in lockstep; a batch's steps depend on when requests arrive, which only rank 0 sees, so the
ranks decode requests one by one. The prompt cache is the session's own (the latest conversation: a request that
continues it prefills only its new tokens)."""

from __future__ import annotations

import queue
import threading

from ..runtime.loop import GenerationStats
from .api import APIError, Request, shutting_down
from .worker import Job, refuse_waiting


class SessionPromptCache:
    """/health's view of a session's own prompt cache (one conversation)."""

    def __init__(self, session):
        self.session = session

    def stats_dict(self) -> dict:
        return {"kind": "session (the latest conversation)", "entries": int(self.session.cached_tokens > 0),
                "cached_tokens": self.session.cached_tokens}


class SoloWorker:
    """Runs the jobs one at a time on `session` (`submit` from any thread, `run_jobs` in the model's thread)."""

    max_batch = 1

    def __init__(self, session, *, max_queue: int):
        self.session, self.max_queue = session, max_queue
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.stopped = threading.Event()
        self.prompts = SessionPromptCache(session)
        self.current: Job | None = None
        self._admit = threading.Lock()

    def queued(self) -> int:
        return self.jobs.qsize()

    def active(self) -> int:
        return int(self.current is not None)

    def auto_counts(self) -> None:
        """No batch, no batch chooser (/health's `batch_auto`)."""
        return None

    def submit(self, request: Request) -> Job:
        """Queue a generation; a 503 when shutting down or when `max_queue` jobs are waiting."""
        with self._admit:
            if self.stopped.is_set():
                raise shutting_down()
            if self.jobs.qsize() >= self.max_queue:
                raise APIError(503, f"the server is busy: {self.max_queue} requests are waiting (--distributed: one "
                               f"request decoded at a time)", type="server_error")
            job = Job(request)
            self.jobs.put(job)
        return job

    def run_jobs(self, until: threading.Event | None = None) -> None:
        while not self.stopped.is_set() and not (until is not None and until.is_set()):
            try:
                job = self.jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            if job.cancel.is_set():
                continue
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None
        if self.stopped.is_set():
            self.stop()

    def _run(self, job: Job) -> None:
        stats = GenerationStats()
        it = None
        try:
            it = self.session.stream(job.ids, stats=stats, **job.request.generation_kwargs())
            for chunk in it:
                job.events.put(("chunk", chunk))
                if job.cancel.is_set() or self.stopped.is_set():
                    break
        except ValueError as e:  # what the request checks could not see (ModeError, ContextLengthError among them)
            job.events.put(("error", APIError(400, str(e))))
            return
        except Exception as e:
            job.events.put(("error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                              type="server_error")))
            return
        finally:
            if it is not None:
                it.close()
        job.events.put(("error", shutting_down()) if self.stopped.is_set() else ("done", stats))

    def interrupt(self) -> None:
        """Ctrl-C: stop the loop; the running generation stops at its next chunk (answered with a 503)."""
        self.stopped.set()
        if self.current is not None:
            self.current.cancel.set()

    def stop(self) -> None:
        """Refuse new jobs and answer the waiting ones with a 503."""
        with self._admit:
            self.stopped.set()
        refuse_waiting(self.jobs)
