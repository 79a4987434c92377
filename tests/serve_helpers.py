"""What the server tests share: a tiny target (tokenizer, DFlash drafter, one MTP layer) served on an ephemeral
port, running the clients in a thread while the main thread runs the generations, and scripting a generation's
tokens where the batch engine samples."""

from __future__ import annotations

import threading

import pytest

import glimmer_mlx
from glimmer_mlx.serve import GlimmerServer
from glimmer_mlx.session import Session


def serve_tiny(tiny_checkpoint, tmp_path_factory, seed: int):
    """Yields (server, base_url, model, tokenizer, path) — for a module-scoped fixture: the server shut down, the
    calibration cache's environment restored after it."""
    from hf_fixtures import build_hf_drafter, build_hf_mtp, save_mtp_weights
    from glimmer_mlx.speculative import load_drafter

    mp = pytest.MonkeyPatch()  # auto's calibration cache: in tmp
    mp.setenv("GLIMMER_MLX_CACHE_DIR", str(tmp_path_factory.mktemp("calibration")))
    path, hf = tiny_checkpoint(seed=seed, tokenizer=True, num_mtp_layers=1, mtp_layer_types=["sliding_attention"])
    save_mtp_weights(build_hf_mtp(hf, 1, seed=3), path)
    model, tok = glimmer_mlx.load(path)
    d = tmp_path_factory.mktemp("srv_drafter")
    build_hf_drafter().save_pretrained(d)
    session = Session(model, tok, drafters={"dflash": load_drafter(d, model), "mtp": load_drafter(path, model)},
                      max_context=1024)
    session.path = path
    server = GlimmerServer(session, port=0, quiet=True, mode="ar", default_max_tokens=16)
    server.start_http()
    try:
        yield server, f"http://127.0.0.1:{server.port}", model, tok, path
    finally:
        server.shutdown()
        mp.undo()


def over_http(server, fn):
    """Run `fn()` (the HTTP client side: no MLX work) in a thread while this (main) thread runs the server's
    generations, as `glimmer serve` does; re-raise what `fn` raised."""
    done, box = threading.Event(), {}

    def client():
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised in the main thread
            box["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=client)
    t.start()
    server.run_jobs(until=done)
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


class ScriptedSampler:
    """A greedy sampler that emits `tokens` in order (then `end`), calling `each(i)` before token i: the output of a
    generation scripted where the batch engine samples (the prefill's token included), so the HTTP, queue,
    batching, parsing and formatting paths around it are the real ones. Its params carry a (for it, no-op)
    repetition penalty so the batch always asks it: greedy plain rows without one get their tokens from one shared
    argmax, which would bypass the script."""

    def __init__(self, tokens, end, each=None):
        from glimmer_mlx.sampling import SamplingParams

        self.params = SamplingParams(repetition_penalty=1.01)
        self.tokens, self.end, self.each, self.i = list(tokens), end, each, 0

    def __call__(self, logits, history=None):
        import mlx.core as mx

        if self.each is not None:
            self.each(self.i)
        t = self.tokens[self.i] if self.i < len(self.tokens) else self.end
        self.i += 1
        return mx.array([t], dtype=mx.int32)


def script(monkeypatch, server, pick):
    """Requests whose Prepared `pick(prepared)` returns a sampler get it instead of their own."""
    real = server.session.prepare

    def prepare(prompt, **kw):
        p = real(prompt, **kw)
        sampler = pick(p)
        if sampler is not None:
            p.sampler = sampler
        return p

    monkeypatch.setattr(server.session, "prepare", prepare)


def script_slow(monkeypatch, server, tok, budget: int, each) -> None:
    """Requests asking for exactly `budget` tokens generate the filler token "x" `budget` times, calling `each(i)`
    before token i (a slow, long generation to cancel or to fill the queue with); the others are untouched."""
    filler = tok.encode_text("x", add_special_tokens=False)[0]
    script(monkeypatch, server,
           lambda p: ScriptedSampler([filler] * budget, filler, each) if p.budget == budget else None)
