"""The job queue and the model thread: HTTP threads `submit` validated requests as `Job`s; `Worker.run_jobs` decodes
them together, continuously batched (`speculative.batch.BatchGenerator`: up to `max_batch` requests share each target
forward, each in its own decoding mode; new requests are prefilled chunk by chunk between the batch's steps and join
it; finished ones leave), in the thread that calls it, and hands each job's chunks back through the job's event
queue. A prompt cache across conversations (`prompt_cache.PromptCache`, an LRU bounded in bytes) gives every request
the longest cached prefix of its prompt, so several agents' growing conversations each prefill only their new turn.

The model runs in the thread that calls `run_jobs` (the main thread, for `glimmer serve`): MLX work done in other
threads makes the process abort at exit ("terminate called without an active exception", MLX 0.32)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..cache import CacheRewindError, rewind_cache
from ..prompt_cache import DEFAULT_MAX_ENTRIES, PromptCache
from ..runtime.loop import GenerationChunk, GenerationStats, stop_ids
from ..session import Session
from ..speculative.batch import DEFAULT_MAX_BATCH, BatchGenerator, BatchRequest, Row
from .api import APIError, Request, shutting_down

DEFAULT_PROMPT_CACHE_BYTES = 4 << 30  # the prompt cache's memory budget (`glimmer serve --prompt-cache-gb`)
# prompt-cache entries per batch row (`max_batch`); bytes are bounded by the budget above. A batch full of clients
# cycling through more conversations than there are entries would miss every time (an LRU under a cyclic load):
# 16 entries for 16 rows made every request of 8 clients over 20 conversations prefill its whole prompt
ENTRIES_PER_ROW = 4
# seconds after a step in which a new request is still sized for that step's rows (`Worker._batch_request`): clients
# whose requests finished together come back a moment later, one by one; the first used to be sized for a batch of
# one (at N = 4 in `glimmer bench serve`: it prefilled a cached prompt again for DFlash's state, and carried DFlash,
# which the batch of four it joined a few ms later never drafted with)
RECENT_S = 0.5
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
    row: Row | None = None  # its row in the batch, once admitted
    keys: list | None = None  # its prompt's prompt-cache keys

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


def refuse_waiting(jobs: queue.Queue) -> None:
    """Answer every job still waiting in `jobs` with a 503 (the server is shutting down)."""
    while True:
        try:
            job = jobs.get_nowait()
        except queue.Empty:
            break
        job.events.put(("error", shutting_down()))


def state_key(drafter) -> tuple:
    """Which drafter a state kept with a prompt-cache entry belongs to: its kind and (MTP) depth."""
    return (drafter.kind, getattr(drafter, "depth", None))


class Worker:
    """Runs the jobs on one session's model. `submit` is for any thread; `run_jobs` for the model's thread."""

    def __init__(self, session: Session, *, max_queue: int, max_batch: int = DEFAULT_MAX_BATCH,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES):
        self.session = session
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.stopped = threading.Event()
        self.batch = BatchGenerator(session.model, max_batch=max_batch, prefill_step=session.prefill_step)
        # a fetched entry's drafter states are copies: the entry keeps its own for the next row that continues it
        self.prompts = PromptCache(prompt_cache_bytes, max(DEFAULT_MAX_ENTRIES, ENTRIES_PER_ROW * max_batch),
                                   copy_extra=lambda states: {k: d.copy_state() for k, d in states.items()})
        self.running: list[Job] = []  # jobs in the batch (decoding or being prefilled)
        self.last_step: tuple[int, float] = (0, 0.0)  # (rows, time.monotonic() at its end) of the latest step
        self._admit = threading.Lock()  # a job is either refused or queued before `stop` drains the queue
        self._eos = stop_ids(session.model, session.tokenizer)

    def queued(self) -> int:
        """Jobs waiting for a place in the batch."""
        return self.jobs.qsize()

    def active(self) -> int:
        """Jobs in the batch (decoding, or being prefilled)."""
        return len(self.running)

    def auto_counts(self) -> dict | None:
        """The batch chooser's step counts (`BatchAuto.counts`), None before an `auto` request built it."""
        auto = self.batch.auto
        return None if auto is None else auto.counts()

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
        """Decode the queued jobs in this thread, batched, until `until` is set or the worker stops."""
        try:
            while not self.stopped.is_set() and not (until is not None and until.is_set()):
                self._take_jobs(wait=not self.running)
                if self.running:
                    self._step()
        except BaseException:  # Ctrl-C mid-step: tell the waiting requests before leaving
            self._fail_all(shutting_down())
            raise
        if self.stopped.is_set():
            self._fail_all(shutting_down())

    # -- admission ---------------------------------------------------------------------------------------------------
    def _take_jobs(self, wait: bool) -> None:
        """Move queued jobs into the batch while it has room (waiting up to 50 ms for one when `wait`)."""
        while len(self.running) < self.max_batch:
            try:
                job = self.jobs.get(timeout=0.05) if wait else self.jobs.get_nowait()
            except queue.Empty:
                return
            wait = False
            if job.cancel.is_set():
                continue
            try:
                job.row = self.batch.add(self._batch_request(job))
            except ValueError as e:  # what the request checks could not see (ModeError, ContextLengthError among them)
                job.events.put(("error", APIError(400, str(e))))
                continue
            except Exception as e:  # never let the loop die: report it to this request
                job.events.put(("error", APIError(500, f"generation failed: {type(e).__name__}: {e}",
                                                  type="server_error")))
                continue
            self.running.append(job)

    def expected_rows(self) -> int:
        """The rows a request taken now will decode with: the jobs running and queued, itself included, or as many as
        the latest step had if it ended less than `RECENT_S` ago (its clients' next requests are on their way)."""
        now = len(self.running) + self.jobs.qsize() + 1
        rows, at = self.last_step
        return max(now, rows) if time.monotonic() - at < RECENT_S else now

    def _batch_request(self, job: Job) -> BatchRequest:
        """The job as a batch row: checked (`Session.prepare`), its own drafter state, and the longest prefix of its
        prompt the prompt cache holds. A model drafter (DFlash, MTP) continues on a cached prefix only with the state
        it had there (kept with the cache entry; the row gets a copy, cut back as `Session` cuts a conversation's
        drafter); without one, a fixed-mode row prefills its whole prompt, an `auto` row leaves that drafter out.
        n-gram lookup rebuilds its index from the ids."""
        s = self.session
        stats = GenerationStats()
        p = s.prepare(job.ids, stats=stats, **job.request.generation_kwargs())
        auto = p.mode == "auto"
        if auto and self.batch.auto is None:  # the batch's chooser drafts for it: its own forks of auto's drafters
            self.batch.auto = s.drafters.batch_auto()

        regime = "greedy" if p.sampler.params.greedy else "sampling"
        batch = min(self.max_batch, self.expected_rows())

        def fresh() -> dict:
            if auto:  # sized for the batch it will decode in
                return self.batch.auto.options(regime, batch, p.budget)
            return {} if p.drafter is None else {p.drafter.kind: p.drafter.fork()}

        drafters, cache, reuse, reason = fresh(), None, 0, "fresh: no cached prefix"
        wanted = {state_key(d) for d in drafters.values() if d.taps}  # the states a prefix must come with
        has_wanted = lambda ex: isinstance(ex, dict) and wanted <= set(ex)  # noqa: E731
        usable, look = (has_wanted if wanted else None), True
        if wanted and auto:
            # auto can leave out the model drafters that the longest cached prefix has no state for, unless
            # prefilling what that prefix has beyond the longest one holding every state (none: all of it) pays for
            # their states (`BatchAuto.refill_pays`, asked only about the drafters it lacks: asked about every model
            # drafter, an entry holding DFlash's state but not MTP's was prefilled again for DFlash's)
            longest, extra = self.prompts.reusable(p.keys)
            full, _ = self.prompts.reusable(p.keys, usable=has_wanted)
            kept = set(extra) if isinstance(extra, dict) else set()
            if longest > full:
                if any(self.batch.auto.refill_pays(kind, regime, batch, p.budget, longest - full)
                       for kind, d in drafters.items() if d.taps and state_key(d) not in kept):
                    look = full > 0  # continue the prefix holding every state; none: prefill it all
                    if not look:
                        reason = "fresh: prefilled again for the states of its model drafters"
                else:
                    usable = None  # the longest prefix, without the drafters it has no state for
        hit = self.prompts.fetch(p.keys, usable=usable) if look else None
        if hit:
            drafters, cache, reuse, reason = self._continue(hit, drafters, auto)
            if cache is None:
                drafters = fresh()
        stats.extra.update(cache=reason, cached_tokens=reuse, prefilled_tokens=len(p.ids) - reuse)
        job.keys = p.keys
        return BatchRequest(p.ids, p.sampler, p.budget, self._eos, s.tokenizer, p.stop,
                            drafter=None if auto or not drafters else next(iter(drafters.values())),
                            width=p.drafts, input_embeddings=p.input_embeddings, cache=cache, reuse=reuse,
                            stats=stats, tag=job, auto=auto, options=drafters if auto else None)

    @staticmethod
    def _continue(hit, drafters: dict, auto: bool) -> tuple[dict, list | None, int, str]:
        """Continue `hit` (a prompt-cache hit) with these drafters: each model drafter takes (a copy of) the state the
        entry kept for it (`state_key`) and every state is cut back to a common position (`Drafter.rewind_context`),
        the target's cache to the same. Returns (drafters, cache or None, positions reused, reason)."""
        states = hit.extra if isinstance(hit.extra, dict) else {}
        out = {}
        for kind, d in drafters.items():
            if not d.taps:  # n-gram lookup: no state a prefix could lack
                out[kind] = d
                continue
            st = states.get(state_key(d))  # a copy (`copy_extra`): the entry keeps its own
            if st is not None:
                out[kind] = st
            elif not auto:
                return drafters, None, 0, f"fresh: the {kind} drafter has no state for this conversation"
        k = hit.reused
        try:
            for d in out.values():
                if d.taps:
                    k = min(k, d.context_length())
            while True:  # every drafter agrees on where the target's taps must start again
                ks = [d.rewind_context(k) for d in out.values() if d.taps]
                if not ks or min(ks) == k:
                    break
                k = min(ks)
            if k <= 0:
                return drafters, None, 0, "fresh: nothing in common with a cached conversation"
            rewind_cache(hit.cache, hit.cache[0].offset - k)
        except CacheRewindError as e:
            return drafters, None, 0, f"fresh: {e}"
        return out, hit.cache, k, "reused"

    # -- decoding ----------------------------------------------------------------------------------------------------
    def _step(self) -> None:
        for job in self.running:
            if job.cancel.is_set():
                self.batch.cancel(job.row)
        try:
            events = self.batch.step(keep_cache=True)
        except Exception as e:  # a failed step leaves the batch's caches mid-step: every row in it fails
            self._fail_all(APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
            return
        self.last_step = (len(self.running), time.monotonic())
        for row, chunk in events:
            row.req.tag.events.put(("chunk", chunk))
        for job in list(self.running):
            if job.row.finished:
                self.running.remove(job)
                self._done(job, job.row)

    def _done(self, job: Job, row: Row) -> None:
        if row.final_cache is not None:  # the conversation so far, for the next request that continues it
            n = row.final_cache[0].offset
            keys = (list(job.keys) + row.history[len(row.req.ids):])[:n]
            states = {state_key(d): d for d in row.drafters if d.taps}  # what continues it with these drafters
            # their bytes count in the cache's budget: on Glimmer's shapes DFlash's pending taps alone (5 × 6656 values
            # a position) outweigh the target's K/V (52 layers × 2 × 2 kv heads × 128)
            self.prompts.insert(keys, row.final_cache, extra=states or None,
                                extra_nbytes=sum(d.state_nbytes() for d in states.values()))
            row.final_cache = None
        s = self.session
        s.totals["turns"] += 1
        s.totals["prompt_tokens"] += len(row.req.ids)
        s.totals["prefilled_tokens"] += len(row.req.ids) - row.req.reuse
        s.totals["generated_tokens"] += row.out.n
        if row.cancelled and self.stopped.is_set():  # Ctrl-C cut it short: an error, not a cut answer
            job.events.put(("error", shutting_down()))
        else:
            job.events.put(("done", row.stats))

    def _fail_all(self, error: APIError) -> None:
        for job in self.running:
            job.events.put(("error", error))
        self.running = []
        self.batch = BatchGenerator(self.session.model, max_batch=self.max_batch,
                                    prefill_step=self.session.prefill_step, auto=self.batch.auto)

    def interrupt(self) -> None:
        """Ctrl-C: stop the job loop; the running generations are answered with a 503. Only sets flags (it runs in
        a signal handler)."""
        self.stopped.set()
        for job in list(self.running):
            job.cancel.set()

    def stop(self) -> None:
        """Refuse new jobs and answer the waiting ones with a 503 (instead of leaving them hanging)."""
        with self._admit:
            self.stopped.set()
        refuse_waiting(self.jobs)
