"""How a generation decodes: a `DecodeSpec` (mode + width) and the one place that turns it into a decoder.

Modes: `ar` (plain decoding), `dflash` (the DFlash drafter), `mtp` (MTP layers), `ngram` (prompt lookup), `auto`
(per round the fastest of those and a plain step, `speculative.auto`). Width: DFlash's block size (drafts + 1), MTP's
depth (drafts; past the trained layers the last one is reused), n-gram's most drafts per round; `"auto"`: per
round, a plain step or the drafter at its best width (`auto` over that one drafter); None: as trained. Every mode
gives the same greedy output and the same sampling distribution.

`load_drafters` loads the drafter models a target can decode with (with the embedded model set's as fallback);
`Drafters.resolve` validates a spec against them and prepares the drafter; `build_decoder` makes the decoder;
`make_decoder` is the same for a drafter object and a block size (the Python API's `generate(drafter=...)`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from .embedded import DEFAULT_DFLASH, embedded_path, resolve_model
from .loading import CheckpointError
from .runtime.plain import PlainDecoder
from .runtime.prefill import DEFAULT_PREFILL_STEP
from .sampling import Sampler, is_int
from .speculative.auto import AutoDrafter, make_auto
from .speculative.auto.batch import BatchAuto
from .speculative.engine import AutoDecoder, SpeculativeDecoder, TreeDecoder
from .speculative.loader import load_drafter
from .speculative.mtp import MAX_DEPTH, load_mtp
from .speculative.ngram import NGramDrafter
from .speculative.protocol import Drafter

MODES = ("ar", "dflash", "mtp", "ngram", "auto")
NGRAM_DRAFTS = 8  # n-gram lookup's most drafts per round by default
MAX_NGRAM_DRAFTS = 64
# auto's MTP option chains as deep as the trained layers (at least this): every depth's layer runs every round
# whatever the round drafts (each keeps its cache in step), so a deeper chain costs every round more — at depth 2
# the embedded model's one-layer MTP, which pays at depth 1 with OpenBLAS, never did inside auto
MIN_AUTO_MTP_DEPTH = 1


class ModeError(ValueError):
    """A decoding mode or width that cannot run (no drafter loaded for it, a width out of range)."""


@dataclass(frozen=True)
class DecodeSpec:
    mode: str = "ar"
    width: int | str | None = None
    tree: int | None = None  # token-tree verification with this many draft nodes per round (`make_tree_decoder`)

    @classmethod
    def parse(cls, mode: str | None, width=None, *, default: str = "ar", what: str = "block_size") -> "DecodeSpec":
        """From command-line or request values: mode None = `default`; width an int, a numeric string, "auto" or
        None (`what`: its name in the error). Raises ModeError for an unknown mode or a width that is neither."""
        mode = default if mode is None else mode
        if mode not in MODES:
            raise ModeError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        if isinstance(width, str) and width != "auto":
            try:
                width = int(width)
            except ValueError:
                raise ModeError(f"{what} must be an integer or 'auto', got {width!r}") from None
        if width is not None and width != "auto" and not is_int(width):
            raise ModeError(f"{what} must be an integer or 'auto', got {width!r}")
        return cls(mode, width)


def check_width(kind: str, width, drafter=None) -> None:
    """ModeError unless `width` suits a drafter of `kind` (`drafter`: the loaded one, for its trained sizes)."""
    if width is None:
        return
    if kind == "ar":
        raise ModeError("block_size is for the speculative modes (dflash, mtp, ngram, auto), not ar")
    if kind == "auto":
        raise ModeError("block_size does not apply to mode 'auto': it chooses the width itself; give block_size only "
                        "with dflash, mtp or ngram")
    if width == "auto":
        if kind == "ngram":
            raise ModeError("n-gram lookup drafts what it finds; its block_size is an integer, not 'auto'")
        return
    if not is_int(width):
        name = {"mtp": "MTP depth (block_size)", "ngram": "n-gram drafts (block_size)"}.get(kind, "block_size")
        raise ModeError(f"{name} must be an integer or 'auto', got {width!r}")
    if kind == "dflash":
        top = drafter.block_size if drafter is not None else None
        if width < 2 or (top is not None and width > top):
            raise ModeError(f"block_size must be in [2, {top}] (the DFlash drafter's trained block size) or 'auto', "
                            f"got {width}")
    elif kind == "mtp":
        if not 1 <= width <= MAX_DEPTH:
            raise ModeError(f"MTP depth (block_size) must be in [1, {MAX_DEPTH}] or 'auto', got {width}")
    elif kind == "ngram":
        top = drafter.max_drafts if drafter is not None else MAX_NGRAM_DRAFTS
        if not 1 <= width <= top:
            raise ModeError(f"n-gram drafts (block_size) must be in [1, {top}], got {width}")


_WIDTH_AUTO: WeakKeyDictionary = WeakKeyDictionary()  # drafter -> its width-auto AutoDrafter


def width_auto(target, drafter: Drafter) -> AutoDrafter:
    """`block_size="auto"` for one DFlash or MTP drafter: auto's per-round choice between a plain step and that
    drafter at its best width (no n-gram lookup). One per drafter for the process (rebuilt if its most drafts per
    round changed), so what it learns carries over between requests; it drives `drafter` itself."""
    a = _WIDTH_AUTO.get(drafter)
    if a is None or a.max_drafts != drafter.max_drafts or a.target is not target:
        a = _WIDTH_AUTO[drafter] = AutoDrafter(target, [drafter])
    return a


def prepare(target, drafter: Drafter, block_size) -> tuple[Drafter, int | None]:
    """A drafter object and a block size (DFlash block, MTP depth, n-gram drafts, "auto", None) → (the drafter a
    decoder drives, drafts per round or None for "all it gives"). An int MTP depth is set on the drafter."""
    kind = drafter.kind
    check_width(kind, block_size, drafter)
    if block_size == "auto":
        return width_auto(target, drafter), None
    if block_size is None:
        return drafter, None
    if kind == "mtp":
        drafter.set_depth(block_size)  # depth is the drafter's state (its caches are per depth)
        return drafter, block_size
    return drafter, block_size - 1 if kind == "dflash" else block_size


def build_decoder(model, drafter: Drafter | None, sampler: Sampler, *, drafts: int | None = None,
                  prefill_step: int = DEFAULT_PREFILL_STEP, cache=None, tree: int | None = None):
    """The decoder for a prepared drafter (`prepare`, `Drafters.resolve`): None → plain decoding; an auto drafter →
    `AutoDecoder`; else the speculative engine at `drafts` per round — token trees of `tree` nodes (`check_tree`),
    paths at most `drafts` deep, when given."""
    if drafter is None:
        return PlainDecoder(model, sampler, prefill_step, cache=cache)
    if drafter.kind == "auto":
        return AutoDecoder(model, drafter, sampler, None, prefill_step, cache)
    if tree is not None:
        check_tree(drafter.kind, tree)
        return TreeDecoder(model, drafter, sampler, tree, drafts, prefill_step, cache)
    return SpeculativeDecoder(model, drafter, sampler, drafts, prefill_step, cache)


def check_tree(mode: str, nodes, block_size=None) -> None:
    """ModeError unless token trees of `nodes` draft nodes, paths at most `block_size` deep, can run in `mode`."""
    if mode not in ("ngram", "mtp", "dflash"):
        what = "auto (it chooses its own DFlash trees)" if mode == "auto" else repr(mode)
        raise ModeError(f"token trees (tree nodes) are for modes dflash, mtp and ngram, not {what}")
    if not is_int(nodes) or not 1 <= nodes <= MAX_NGRAM_DRAFTS:
        raise ModeError(f"tree nodes must be an integer in [1, {MAX_NGRAM_DRAFTS}], got {nodes!r}")
    if block_size == "auto":
        raise ModeError("with a tree, block_size is the most drafts per path: an integer, not 'auto'")


def make_decoder(model, drafter: Drafter | None, sampler: Sampler, *, block_size=None,
                 prefill_step: int = DEFAULT_PREFILL_STEP, cache=None):
    """A decoder for `drafter` (None: plain) at `block_size` (see `prepare`)."""
    if drafter is None:
        if block_size is not None:
            raise ModeError("block_size needs a drafter")
        return build_decoder(model, None, sampler, prefill_step=prefill_step, cache=cache)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"unsupported drafter {type(drafter).__name__}")
    d, drafts = prepare(model, drafter, block_size)
    return build_decoder(model, d, sampler, drafts=drafts, prefill_step=prefill_step, cache=cache)


def make_tree_decoder(model, drafter: Drafter, sampler: Sampler, *, nodes: int, block_size=None,
                      prefill_step: int = DEFAULT_PREFILL_STEP, cache=None):
    """Token-tree verification (`speculative.engine.TreeDecoder`): up to `nodes` draft nodes per round, each path at
    most `block_size` drafts deep (None: the drafter's most; for MTP, its depth). For n-gram lookup, MTP and DFlash
    (v1 and v2); `auto` chooses its own trees (a clean ModeError here)."""
    if drafter is None:
        raise ModeError("token trees (tree nodes) are for modes dflash, mtp and ngram, got no drafter")
    check_tree(drafter.kind, nodes, block_size)
    drafter, block_size = prepare(model, drafter, block_size)  # an MTP depth is set on the drafter
    return TreeDecoder(model, drafter, sampler, nodes, block_size, prefill_step, cache)


class Drafters:
    """The drafters one resident target decodes with: its DFlash drafter and MTP layers (either may be absent),
    n-gram lookup (always), and `auto` over them (built on first use: it calibrates the verify cost curve once per
    machine and model). The same objects serve every request, so what they learn and the state the session's
    prompt-cache reuse continues persist."""

    def __init__(self, target, dflash: Drafter | None = None, mtp: Drafter | None = None, *, log=None):
        for name, d, kind in (("dflash", dflash, "dflash"), ("mtp", mtp, "mtp")):
            if d is not None and d.kind != kind:
                raise ModeError(f"{name}: expected a {kind} drafter, got a {d.kind} one")
        self.target, self.dflash, self.mtp = target, dflash, mtp
        self.log = log  # where `auto` says that it calibrates (once per machine and model)
        self._ngram: dict[int, NGramDrafter] = {}  # most drafts per round -> its drafter
        self._auto: AutoDrafter | None = None
        self._batch_auto: BatchAuto | None = None

    def available_modes(self) -> list[str]:
        return ["ar"] + [m for m in ("dflash", "mtp") if getattr(self, m) is not None] + ["ngram", "auto"]

    def default_mode(self) -> str:
        """The mode a command uses when none is asked for: `auto` when a drafter model is loaded (it decodes plainly
        wherever no drafter pays, BENCHMARKS.md), else plain decoding."""
        return "auto" if self.dflash is not None or self.mtp is not None else "ar"

    def ngram(self, drafts: int = NGRAM_DRAFTS) -> NGramDrafter:
        d = self._ngram.get(drafts)
        if d is None:
            d = self._ngram[drafts] = NGramDrafter(self.target.args.vocab_size, max_drafts=drafts)
        return d

    def auto(self, *, calibration_dir=None, recalibrate: bool = False, log=None) -> AutoDrafter:
        """`auto` over copies of the model drafters (their own state, shared weights) and n-gram lookup."""
        if self._auto is None:
            dflash = copy.copy(self.dflash) if self.dflash is not None else None
            mtp = None
            if self.mtp is not None:
                mtp = copy.copy(self.mtp)
                mtp.set_depth(max(MIN_AUTO_MTP_DEPTH, mtp.head.num_layers))
            self._auto = make_auto(self.target, dflash=dflash, mtp=mtp, ngram=NGRAM_DRAFTS,
                                   calibration_dir=calibration_dir, recalibrate=recalibrate, log=log or self.log)
        return self._auto

    def batch_auto(self) -> BatchAuto:
        """`auto` for batches (`speculative.auto.batch.BatchAuto`) over this process's `auto` (its options, their
        acceptance and the cost curve are shared)."""
        if self._batch_auto is None:
            self._batch_auto = BatchAuto(self.auto())
        return self._batch_auto

    def _model_drafter(self, mode: str) -> Drafter:
        d = getattr(self, mode)
        if d is None:
            what = ("no DFlash drafter loaded (give --draft-model DFLASH_DRAFTER)" if mode == "dflash" else
                    "no MTP layers loaded (the target is without MTP layers of its own: give --mtp-model or "
                    "--draft-model MTP_FOLDER)")
            raise ModeError(f"mode {mode!r} is not available: {what}; available: {', '.join(self.available_modes())}")
        return d

    def check(self, spec: DecodeSpec) -> None:
        """ModeError if `spec` cannot run here; changes nothing (safe from any thread)."""
        if spec.mode not in MODES:
            raise ModeError(f"unknown mode {spec.mode!r}; one of {', '.join(MODES)}")
        d = self._model_drafter(spec.mode) if spec.mode in ("dflash", "mtp") else None
        check_width(spec.mode, spec.width, d)

    def select(self, spec: DecodeSpec) -> tuple[Drafter | None, int | str | None]:
        """(the drafter object `spec` decodes with, its block size) — (None, None) for plain decoding; checked.
        Without an integer width the MTP drafter goes back to its trained depth; `auto` is built on first use."""
        self.check(spec)
        if spec.mode == "ar":
            return None, None
        if spec.mode == "auto":
            return self.auto(), None
        if spec.mode == "ngram":
            return self.ngram(spec.width or NGRAM_DRAFTS), None
        d = self._model_drafter(spec.mode)
        if spec.mode == "mtp" and not is_int(spec.width):
            d.set_depth(d.head.num_layers)
        return d, spec.width

    def resolve(self, spec: DecodeSpec) -> tuple[Drafter | None, int | None]:
        """(the drafter a decoder for `spec` drives, drafts per round) — `select`, then `prepare`."""
        d, block_size = self.select(spec)
        return (None, None) if d is None else prepare(self.target, d, block_size)


def _embedded(part: str, log=None) -> str | None:
    """The embedded set's `part` (announced once per process through `log`), or None when it is missing."""
    try:
        embedded_path(part)
    except FileNotFoundError:
        return None
    return resolve_model(None, part, announce=log)


def load_drafters(target, *, dflash=None, mtp=None, embedded: bool = False, want=("dflash", "mtp"),
                  log=None) -> Drafters:
    """The drafter models for `target`.

    dflash: a DFlash drafter folder / Hub id (a folder with MTP layers given here is used as the MTP drafter).
    mtp: a folder with MTP layers; without one, the target's own `mtp.*` layers when its checkpoint has them.
    "none" disables either. embedded: fall back to the embedded model set's drafter for what is not given.
    want: which of the two to load at all (a command that needs none skips the loading). log: where the embedded
    parts are announced (once per process) and `auto` says that it calibrates."""
    d = m = None
    if "dflash" in want and dflash != "none":
        path = dflash if dflash is not None else (_embedded(DEFAULT_DFLASH, log) if embedded else None)
        if path is not None:
            d = load_drafter(path, target)
            if d.kind != "dflash":  # MTP layers given as the drafter: use them as such
                if mtp is not None and mtp != "none":
                    raise CheckpointError(f"{path}: holds MTP layers, not a DFlash drafter, and MTP layers were "
                                          f"given separately ({mtp})")
                d, m = None, d if "mtp" in want else None
    if "mtp" in want and m is None and mtp != "none":
        if mtp is not None:
            m = load_drafter(mtp, target)
            if m.kind != "mtp":
                raise CheckpointError(f"{mtp}: MTP needs a checkpoint with MTP layers (num_mtp_layers and mtp.* "
                                      "weights); this one is a DFlash drafter")
        elif getattr(target, "mtp_weights", None) is not None and len(target.mtp_weights):
            m = load_mtp(None, target)
        elif embedded and (path := _embedded("mtp", log)) is not None:
            m = load_mtp(path, target)
    return Drafters(target, dflash=d, mtp=m, log=log)
