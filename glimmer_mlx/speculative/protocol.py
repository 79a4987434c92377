"""The drafter protocol: what the speculative engine, `auto` and the session's prompt-cache reuse rely on.

A drafter only proposes; `verify` accepts. Per round the engine asks for k drafts (`propose`), runs one target
forward over [anchor, d_1..d_k] with the drafter's `taps`, verifies, and hands back the taps of the committed
positions with the committed tokens (`accept`). `start` follows a fresh prefill; `context_length` /
`rewind_context` / `extend` continue a drafter's state on a new prompt that shares a prefix with the old one
(`session.Session`), so that it drafts exactly what a freshly started drafter would.

A drafter that can decode inside a batch (`batch.BatchGenerator`: each row needs its own state) also has `fork()`:
the same drafter (shared weights, the same width) with its own, empty state. DFlash, DFlash 2, MTP and n-gram have
it; `auto` does not (in a batch the choice is made for all rows together). A model drafter (one with taps) there
also tells its `backlog`: the target positions its next round takes in (what the batch's choice prices a row's round
by beyond a steady one's, `auto.batch.BatchAuto.backlog_cost`).

Implemented by `dflash.DFlashDrafter`, `mtp.MTPDrafter`, `ngram.NGramDrafter` and `auto.multiplex.AutoDrafter`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, TypedDict, runtime_checkable

import mlx.core as mx


class MeasuredTau(TypedDict):
    """τ as measured when the drafter was trained (`read_measured_tau`); where measured per phase of a response
    too, also "greedy#P" / "sampling#P" (phase P) and "phases" (the phases' bounds, tokens generated)."""
    width: int  # drafts per round the figures were measured at
    greedy: float
    sampling: float


@runtime_checkable
class Drafter(Protocol):
    kind: str  # "dflash" | "mtp" | "ngram" | "auto"
    width_name: str  # what the width is called in messages ("block_size - 1", "MTP depth", …)
    taps: tuple[int, ...]  # target layers whose residual-stream outputs the drafter reads
    measured_tau: MeasuredTau | None  # τ measured when the drafter was trained (its eval.json), or None

    @property
    def max_drafts(self) -> int:
        """Most drafts one round can propose."""

    def start(self, taps: list[mx.array], ids: list[int]) -> None:
        """After a fresh prefill: `taps` cover every prompt position; `ids` = prompt + the first generated token."""

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]) -> tuple[list[int], mx.array | None]:
        """Up to k drafts for positions pos+1.. (the anchor, the last committed token, sits at `pos`), and the
        processed log-probabilities [k, V] they were sampled from (None at greedy)."""

    def accept(self, taps: list[mx.array], new_tokens: list[int]) -> None:
        """The target's taps of the positions just verified (anchor + accepted drafts) and the tokens committed."""

    def context_length(self) -> int:
        """Target positions the drafter's state covers."""

    def rewind_context(self, keep: int) -> int:
        """Forget the state at positions >= keep; return p <= keep from which the target's taps must be handed over
        again with `extend`. Raises `cache.CacheRewindError` (changing nothing) when it cannot."""

    def extend(self, taps: list[mx.array], ids: list[int]) -> None:
        """After `rewind_context`: the taps from the rewind point to the new prompt's end; ids = the whole new prompt
        + its first generated token."""

    def parts(self) -> tuple:
        """The drafter objects whose state this one changes (itself, and what an `auto` drafter drives)."""

    def stats(self) -> dict:
        """What the drafter adds to a generation's statistics."""


def read_measured_tau(folder, kind: str) -> MeasuredTau | None:
    """τ after training from a drafter checkpoint's eval.json (on its validation prompts, as `glimmer train` writes
    it: "width" there is the block size for DFlash, the depth for MTP), or None when there is none or it cannot be
    read. Where eval.json has τ per phase of a response too ("phases": their bounds, "tau_greedy_by_phase" /
    "tau_t1_by_phase"), they come as "greedy#0", "sampling#1", … with "phases" (bounds that are not the reader's
    are not used: `AutoChooser.add`)."""
    try:
        ev = json.loads((Path(folder) / "eval.json").read_text())
        after = ev["after"]
        drafts = int(ev["width"]) - (1 if kind == "dflash" else 0)
        out = {"width": drafts, "greedy": float(after["tau_greedy"]), "sampling": float(after["tau_t1"])}
        if after.get("phases") is not None:
            phased = {f"{regime}#{p}": float(tau) for regime, key in (("greedy", "tau_greedy_by_phase"),
                                                                     ("sampling", "tau_t1_by_phase"))
                      for p, tau in enumerate(after.get(key) or []) if tau is not None}
            if phased:
                out.update(phased, phases=tuple(int(b) for b in after["phases"]))
        return out
    except (OSError, ValueError, KeyError, TypeError):
        return None
