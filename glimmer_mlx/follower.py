"""One resident model across the ranks of `mlx.launch`: rank 0 leads a `session.Session`, the other ranks follow it.

`glimmer chat|serve|agent --distributed tp|pp` load the target split over the ranks (`distributed.load_agreed`) into a
`Session` on every rank. Only rank 0 talks to the terminal, the HTTP clients or the tools: its session is wrapped in
a `LeaderSession`, which hands every operation that runs the model to the other ranks before running it itself. The
other ranks run `follow`: receive an operation, run the same one on their own session, in lockstep, until rank 0
says `exit`.

The wire (`send` / `receive`): one JSON message per operation, broadcast from rank 0 as bytes (`broadcast_bytes`: an
int32 `all_sum` of the length, a uint8 `all_sum` of the bytes — exact, every other rank adds zeros). Operations:

- `stream`: token ids (rank 0 tokenizes: the ranks' tokenizers are not compared) and `Session.stream`'s keyword
  arguments — mode, width, max_tokens, sampling parameters, stop strings, and the seed (rank 0 draws one when the
  request has none: seeded sampling must draw the same keys on every rank). Every rank then runs `Session.stream`
  on the same request: its prompt-cache reuse, prefill, drafting, verification and acceptance are the same
  functions of the same inputs, and the logits they act on are gathered (bitwise the same on every rank,
  `distributed`'s docstring), so every rank decides the same tokens and issues the same collectives. After each
  chunk rank 0 sends one int (an `all_sum`): continue, or stop here (the client left, Ctrl-C, a server shutting
  down) — a stream closed early must leave every rank's cache at the same position, or the next request's prefill
  would differ. A request error (an unknown mode, a prompt beyond the context) is raised on every rank at the same
  point, before any model work; rank 0 reports it, the followers drop the request.
- `reset` (chat's /clear), `calibrate` (chat's plain-rate calibration: model forwards on a scratch cache), `exit`.

Lockstep is checked as for `glimmer generate` (`distributed.lockstep`: a hash of the committed tokens compared every
16 chunks and at the end, a `Watchdog` over the whole stream, the control waits included).

Failures: rank 0's process ending without `exit` (killed, crashed) closes its sockets, and a follower's next
collective raises — one line, exit code 1 (`follow`); `mlx.launch` stops the remaining ranks with SIGTERM when a rank
exits with an error, which a follower turns into one line too (`trap_termination`). A rank 0 that hangs in a
generation is caught by the watchdog; between requests a follower waits without a bound (rank 0 waiting for its
user or its clients looks the same). A second Ctrl-C that aborts rank 0 in the middle of a step leaves the ranks at
different points of the step: rank 0 then exits (one line) instead of resynchronising.

`auto` is refused (it chooses rounds from per-rank wall-clock timings): `LeaderSession` lists the modes without it
and defaults to plain decoding where a single process would default to auto.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from typing import Iterator

import mlx.core as mx
import numpy as np

from .distributed import (DEFAULT_TIMEOUT, DistributedError, check_mode, expose_taps, load_agreed, lockstep)
from .embedded import resolve_model
from .runtime.loop import GenerationChunk, GenerationStats, collect
from .runtime.request import encode_prompt
from .session import Session
from .strategy import ModeError, load_drafters

__all__ = ["LeaderSession", "follow", "load_distributed_session", "broadcast_bytes", "send", "receive",
           "trap_termination"]

CONTINUE, STOP = 1, 2
STREAM_KEYS = ("mode", "block_size", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "seed", "stop", "tree")


def lost(e: RuntimeError, group) -> RuntimeError:
    """A collective's RuntimeError (a lost peer: the backend's message) as the one-line DistributedError naming this
    rank; any other error unchanged."""
    if isinstance(e, DistributedError) or not any(tag in str(e) for tag in ("[ring]", "[mpi]", "[jaccl]")):
        return e
    peer = "rank 0" if group.rank() else "another rank"
    return DistributedError(f"rank {group.rank()}: lost contact with {peer} ({e}); exiting")


# -- the wire --------------------------------------------------------------------------------------------------------

def broadcast_bytes(data: bytes | None, group) -> bytes:
    """Rank 0's `data` on every rank (the others pass None): the length, then the bytes, each an exact all_sum."""
    mine = data if group.rank() == 0 else b""
    n = int(mx.distributed.all_sum(mx.array(len(mine), dtype=mx.int32), group=group).item())
    if n == 0:
        return b""
    buf = mx.array(np.frombuffer(mine, dtype=np.uint8)) if group.rank() == 0 else mx.zeros((n,), dtype=mx.uint8)
    return np.array(mx.distributed.all_sum(buf, group=group)).tobytes()


def send(group, message: dict) -> None:
    """Rank 0: broadcast one operation."""
    broadcast_bytes(json.dumps(message).encode(), group)


def receive(group) -> dict:
    """A follower: the next operation rank 0 sends."""
    return json.loads(broadcast_bytes(None, group).decode())


def control(group, value: int | None = None) -> int:
    """Rank 0's CONTINUE / STOP after a chunk, on every rank (one int32 all_sum)."""
    mine = value if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group).item())


# -- rank 0 ----------------------------------------------------------------------------------------------------------

class LeaderSession:
    """Rank 0's `Session`, shared with the followers: `stream`, `generate`, `reset` and `calibrate_plain_rate` are
    sent to them first; everything else (the tokenizer, the drafters, the limits, the totals, `encode_messages`) is
    the wrapped session's. `close` (also at exit) tells the followers to exit. Use it from one thread (the model's),
    as a `Session`."""

    def __init__(self, session: Session, group, *, timeout: float = DEFAULT_TIMEOUT, strategy: str = "tp"):
        if group.rank() != 0:
            raise DistributedError(f"rank {group.rank()}: only rank 0 leads; the other ranks run `follow`")
        self.session, self.group, self.timeout, self.strategy = session, group, timeout, strategy
        self.closed = False
        atexit.register(self.close)

    def __getattr__(self, name):  # what the wrapped session has and this class does not override
        return getattr(self.session, name)

    # -- modes: no auto ------------------------------------------------------------------------------------------------
    def available_modes(self) -> list[str]:
        return [m for m in self.session.available_modes() if m != "auto"]

    def default_mode(self) -> str:
        mode = self.session.default_mode()
        return "ar" if mode == "auto" else mode

    def check_mode(self, mode: str, block_size=None) -> None:
        try:
            check_mode(mode, block_size)
        except ValueError as e:
            raise ModeError(str(e)) from None
        self.session.check_mode(mode, block_size)

    # -- operations the followers run too ------------------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        if self.closed:
            raise DistributedError("rank 0: the distributed session is closed")
        try:
            send(self.group, message)
        except RuntimeError as e:
            raise lost(e, self.group) from None

    def reset(self) -> None:
        self._send({"op": "reset"})
        self.session.reset()

    def calibrate_plain_rate(self, tokens: int = 32):
        self._send({"op": "calibrate", "tokens": int(tokens)})
        return self.session.calibrate_plain_rate(tokens)

    def stream(self, prompt, *, stats: GenerationStats | None = None, images=None, **kw) -> Iterator[GenerationChunk]:
        """`Session.stream` on every rank (keyword arguments: `STREAM_KEYS`); images are refused."""
        if images:
            raise ValueError("--distributed: images are not supported with --distributed yet")
        unknown = set(kw) - set(STREAM_KEYS)
        if unknown:
            raise TypeError(f"stream() got unexpected keyword arguments {sorted(unknown)}")
        ids = encode_prompt(prompt, self.session.tokenizer)
        self.check_mode(kw.get("mode", "ar"), kw.get("block_size"))
        if kw.get("seed") is None:
            kw["seed"] = int.from_bytes(os.urandom(3), "little")
        return self._lead(ids, kw, stats)

    def _lead(self, ids, kw, stats) -> Iterator[GenerationChunk]:
        # sent at the first next(): a stream never started (or closed before it started) sends nothing
        self._send({"op": "stream", "ids": ids, "kw": kw})
        gen = lockstep(self.session.stream(ids, stats=stats, **kw), self.group, timeout=self.timeout)
        try:
            while True:
                try:
                    chunk = next(gen)
                except StopIteration:
                    return
                except KeyboardInterrupt:
                    abort(self.group)
                except RuntimeError as e:
                    raise lost(e, self.group) from None
                try:
                    yield chunk
                except BaseException:  # closed early (GeneratorExit) or an exception thrown in: stop every rank here
                    control(self.group, STOP)
                    raise
                control(self.group, CONTINUE)
        finally:
            gen.close()

    def generate(self, prompt, **kw):
        """Non-streaming `stream`: (tokens, text, finish_reason, stats)."""
        stats = kw.pop("stats", None) or GenerationStats()
        r = collect(self.stream(prompt, stats=stats, **kw), stats, with_text=True)
        return r.tokens, r.text, r.finish_reason, stats

    def close(self) -> None:
        """Tell the followers to exit (once; also run at interpreter exit)."""
        if self.closed:
            return
        try:
            send(self.group, {"op": "exit"})
        except RuntimeError:
            pass  # a follower is already gone: nothing to tell
        self.closed = True


def abort(group) -> None:
    """Rank 0 interrupted in the middle of a step: the ranks cannot be brought back in step; exit in one line."""
    sys.stderr.write(f"error: rank {group.rank()}: interrupted in the middle of a distributed step; the ranks cannot "
                     f"resynchronise, exiting (Ctrl-C once stops an answer cleanly)\n")
    sys.stderr.flush()
    os._exit(130)


# -- the other ranks -------------------------------------------------------------------------------------------------

def follow(session: Session, group, *, timeout: float = DEFAULT_TIMEOUT, log=None) -> int:
    """Run rank 0's operations on `session` until it says `exit` (returns 0); a lost rank 0 → one line on stderr,
    returns 1. `log(msg)`: where a dropped request is mentioned (default: nowhere)."""
    rank = group.rank()
    try:
        while True:
            msg = receive(group)
            op = msg.get("op")
            if op == "exit":
                return 0
            if op == "reset":
                session.reset()
            elif op == "calibrate":
                session.calibrate_plain_rate(int(msg["tokens"]))
            elif op == "stream":
                follow_stream(session, group, msg["ids"], msg["kw"], timeout)
            else:
                raise DistributedError(f"rank {rank}: unknown operation {op!r} from rank 0 (ranks running different "
                                       f"glimmer versions?)")
    except RuntimeError as e:
        err = lost(e, group)
        if not isinstance(err, DistributedError):
            raise
        sys.stderr.write(f"error: {err}\n")
        sys.stderr.flush()
        return 1


def follow_stream(session: Session, group, ids: list[int], kw: dict, timeout: float) -> None:
    gen = lockstep(session.stream(ids, stats=GenerationStats(), **kw), group, timeout=timeout)
    try:
        for _chunk in gen:
            if control(group) == STOP:
                break
    except ValueError:  # the request's own error: raised on rank 0 at the same point, reported there
        pass
    finally:
        gen.close()


def trap_termination(rank: int, grace: float = 2.0) -> None:
    """SIGTERM (how `mlx.launch` stops the other ranks when one exits with an error) → one line and exit code 1,
    even while the main thread is blocked inside a collective (the signal's wakeup byte is read by a thread). The
    main thread gets `grace` seconds to report a lost rank 0 itself first. Call from the main thread."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread below acts on it

    def watch():
        while os.read(r, 1) != bytes([signal.SIGTERM]):
            pass
        time.sleep(grace)
        sys.stderr.write(f"error: rank {rank}: stopped by the launcher (another rank exited with an error: rank 0 "
                         f"died?); exiting\n")
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name="glimmer-sigterm", daemon=True).start()


# -- loading ---------------------------------------------------------------------------------------------------------

def load_distributed_session(model: str | None, group, strategy: str, *, microbatch: int = 1,
                             draft_model: str | None = None,
                             mtp_model: str | None = None, dtype: str | None = None, max_context: int | None = None,
                             announce=None, **options) -> Session:
    """This rank's part of the target (`distributed.load_agreed`: every rank must name the same checkpoint and pass
    the same `options`), the drafters whole, the taps they read exposed across pipeline stages, in a `Session`.
    microbatch: pipeline forwards in micro-batches (`distributed.pipeline_model`)."""
    path = resolve_model(model, announce=announce)
    m, tok = load_agreed(path, group, dtype, strategy, microbatch, draft_model=draft_model, mtp_model=mtp_model,
                         max_context=max_context, weights_dtype=dtype, **options)
    drafters = load_drafters(m, dflash=draft_model, mtp=mtp_model, embedded=model is None, log=announce)
    expose_taps(m, [t for d in (drafters.dflash, drafters.mtp) if d is not None for t in d.taps])
    s = Session(m, tok, drafters=drafters, max_context=max_context)
    s.path = path
    return s
