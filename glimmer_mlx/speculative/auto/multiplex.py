"""`auto`'s drafter: several drafters behind one `protocol.Drafter`, of which per round one proposes (or none: a
plain step), as its `chooser.AutoChooser` decides from the calibrated cost curve (`calibrate`) and what each option
measurably accepts and costs on this machine. `engine.AutoDecoder` drives it."""

from __future__ import annotations

import time

import mlx.core as mx

from ..ngram import NGramDrafter
from ..protocol import Drafter
from .calibrate import load_or_calibrate, measure_draft_costs
from .chooser import AutoChooser


_SHAPES = {"dflash": "block", "mtp": "chain", "ngram": "free"}
# the first draft's acceptance after an n-gram match of each size, as measured on the embedded set and the trained
# tiny set (BENCHMARKS.md): auto's starting estimate for n-gram lookup, as a drafter's eval.json τ is for it; and
# the acceptance of the drafts after an accepted one (a copy that starts right mostly goes on right)
NGRAM_ALPHA = {1: (0.08, 0.08), 2: (0.2, 0.1), 3: (0.6, 0.3)}  # size -> (greedy, sampling); 4 and longer: below
NGRAM_ALPHA_LONG = (0.75, 0.4)
NGRAM_THEN = {"greedy": 0.8, "sampling": 0.5}


def ngram_prior(size: int) -> dict:
    """A measured-τ-like prior (one draft per round) for n-gram lookup after a match of `size` tokens."""
    greedy, sampling = NGRAM_ALPHA.get(size, NGRAM_ALPHA_LONG)
    return {"width": 1, "greedy": 1.0 + greedy, "sampling": 1.0 + sampling}


class AutoDrafter:
    """Several drafters behind one `protocol.Drafter`; per round one proposes (or none: a plain step).

    Every sub-drafter sees every committed token (`accept`) with its own taps out of the union, so any of them can
    propose in any round. Keep one AutoDrafter per target for a process: what it learns (acceptance, draft costs)
    carries over between requests, decaying as it goes.

    n-gram lookup is one option per matched n-gram size ("ngram@1" … "ngram@4"): a continuation found after a
    4-gram is far more often right than one found after a single token, and pooling them would hide the good
    matches behind the many poor ones."""

    kind = "auto"
    width_name = "auto drafts"
    measured_tau = None

    @property
    def mode(self) -> str:
        """What a decoder driving it reports: "auto", or the drafter's kind for one model drafter (`width_auto`)."""
        return next(iter(self.drafters)) if len(self.drafters) == 1 and "ngram" not in self.drafters else "auto"

    def __init__(self, target, drafters: list, *, verify_costs: dict[int, float] | None = None,
                 calibration_dir=None, recalibrate: bool = False, log=None):
        if not drafters:
            raise ValueError("auto needs at least one drafter (DFlash, MTP or n-gram)")
        self.target = target
        self.drafters: dict[str, Drafter] = {}
        for d in drafters:
            if d.kind not in _SHAPES:
                raise TypeError(f"auto cannot drive a {d.kind!r} drafter")
            if d.kind in self.drafters:
                raise ValueError(f"two {d.kind} drafters given to auto")
            self.drafters[d.kind] = d
        self.taps = tuple(sorted({int(t) for d in self.drafters.values() for t in d.taps}))
        self._tap_idx = {n: [self.taps.index(int(t)) for t in d.taps] for n, d in self.drafters.items()}
        self.max_drafts = max(d.max_drafts for d in self.drafters.values())
        self.calibration = {"cached": None, "source": "given"}
        if verify_costs is None:
            verify_costs, self.calibration = load_or_calibrate(target, self.taps, self.max_drafts + 1,
                                                               directory=calibration_dir, recalibrate=recalibrate,
                                                               log=log)
        self.chooser = AutoChooser(verify_costs, plain_cost=self.calibration.get("plain_token_s"))
        self.draft_costs = measure_draft_costs(target, self.drafters, self.taps, self._tap_idx)
        self._kind_of: dict[str, str] = {}  # option name -> drafter kind
        for n, d in self.drafters.items():
            cost = self.draft_costs.get(n)
            if cost is not None and _SHAPES[n] == "chain":
                cost /= d.max_drafts  # one forward per draft
            if n == "ngram":
                for m in range(d.index.min_n, d.index.max_n + 1):
                    self.chooser.add(f"ngram@{m}", d.max_drafts, "free", measured_tau=ngram_prior(m),
                                     then_alpha=NGRAM_THEN)
                    self._kind_of[f"ngram@{m}"] = n
            else:
                self.chooser.add(n, d.max_drafts, _SHAPES[n], draft_prior=cost, measured_tau=d.measured_tau)
                self._kind_of[n] = n
        self._ngram_options = frozenset(o for o, n in self._kind_of.items() if n == "ngram")
        self._pending = None
        self._round = None  # (draft + verify seconds, catch-up seconds) of the last speculative round
        self._stretch = 0.0  # the running speculative stretch's cost beyond its rounds (`lead`, catch-ups)
        self._rewound: dict[str, int] = {}  # each drafter's rewind point (`rewind_context`, then `extend`)
        self.remaining: int | None = None  # tokens of the request still to generate (the decoder sets it per round)
        self._reset_log()

    def _reset_log(self) -> None:
        # every committed round's (taps, tokens), kept until each drafter has been handed it: a drafter gets what it
        # missed in one batch when it is next asked (`_sync`), so a plain token costs one append, not per-drafter
        # bookkeeping (n-gram lookup included: it is brought up to date only when its offer is asked for)
        self._log: list[tuple[list, list[int]]] = []
        self._fed = {n: 0 for n in self.drafters}  # entries of the log each drafter has been handed

    def start(self, taps: list[mx.array], ids: list[int]) -> None:
        for n, d in self.drafters.items():
            d.start([taps[i] for i in self._tap_idx[n]], ids)
        self._pending = self._round = None
        self._stretch = 0.0
        self._reset_log()

    def _sync(self, name: str | None = None) -> None:
        """Hand drafter `name` (None: every drafter) the committed rounds it has not seen, in one `accept`."""
        log = self._log
        for n in [name] if name is not None else list(self.drafters):
            new = log[self._fed[n]:]
            if not new:
                continue
            idx = self._tap_idx[n]
            if len(new) == 1:
                taps, toks = [new[0][0][i] for i in idx], new[0][1]
            else:
                taps = [mx.concatenate([e[0][i] for e in new], axis=1) for i in idx]
                toks = [t for e in new for t in e[1]]
            self.drafters[n].accept(taps, toks)
            self._fed[n] = len(log)
        if min(self._fed.values()) == len(log):  # every drafter has it all: start the log afresh
            log.clear()
            self._fed = dict.fromkeys(self._fed, 0)

    def _backlog(self, name: str) -> int:
        """Tokens committed since drafter `name` was last handed any."""
        return sum(len(e[1]) for e in self._log[self._fed[name]:])

    def _available(self, k: int, among=None) -> dict[str, int]:
        """{option: most drafts it can give now}; n-gram lookup only where the context's suffix occurred before, as
        the option of the matched size. among: only these options (a set; None: all)."""
        available = {}
        for n, d in self.drafters.items():
            if n == "ngram":
                if among is not None and among.isdisjoint(self._ngram_options):
                    continue
                self._sync(n)
                drafts, m = d.peek(min(k, d.max_drafts))
                cap, n = len(drafts), f"ngram@{m}"
            else:
                cap = min(k, d.max_drafts)
            if cap >= 1 and (among is None or n in among):
                available[n] = cap
        return available

    def plan(self, k: int, regime: str, remaining: int) -> bool:
        """Whether the next round (with `remaining` tokens of the request left) is plain, decided before this round's
        token is known (AutoDecoder queues the next plain forward on it). A plain answer is counted as the round's
        choice. Otherwise the round is speculative and `propose` chooses it afresh, with the token this plan could
        not see: a decision taken on the n-gram index one token behind would draft from a match the latest token
        may already have broken. Inside a plain stretch only the options that could change a plain choice are asked
        what they offer (`AutoChooser.relevant`)."""
        among = self.chooser.relevant(regime, remaining)
        available = self._available(k, among)
        if (among is not None and not available) or self.chooser.pick(available, regime, remaining)[0] is None:
            self.chooser.count_plain()
            return True
        return False

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        """`remaining`: the request's tokens still to generate in this round (set by the decoder)."""
        regime = "greedy" if sampler.params.greedy else "sampling"
        name, kk = self.chooser.choose(self._available(k), regime, self.remaining)
        t0 = time.perf_counter()
        steady = True
        if name is None:
            drafts, q = [], None
        else:
            # a drafter that sat idle catches up on its backlog while drafting: not its steady-state cost
            kind = self._kind_of[name]
            steady = self._backlog(kind) <= self.drafters[kind].max_drafts + 1
            self._sync(kind)
            drafts, q = self.drafters[kind].propose(anchor, pos, kk, sampler, history)
        t1 = time.perf_counter()
        self._pending = (name, len(drafts), regime, t1 - t0, steady, t1)
        return drafts, q

    def accept(self, taps: list[mx.array], new_tokens: list[int]) -> None:
        now = time.perf_counter()
        if self._pending is not None:
            name, k, regime, t_draft, steady, t1 = self._pending
            self.chooser.update(name if k else None, k, len(new_tokens) - 1, regime, t_draft if steady else None,
                                now - t1)
            catch_up = 0.0 if steady or not k else t_draft - self.chooser.scale * self.chooser.options[name].cost(k)
            self._round = (t_draft + now - t1, catch_up) if k else None
            self._pending = None
        self._log.append((taps, list(new_tokens)))

    def end_round(self, seconds: float) -> bool:
        """The whole round took `seconds` (AutoDecoder: from the previous round's commit to this one's): what its
        draft and verify windows did not cover is overhead every speculative round pays; what its drafter spent
        catching up goes to the stretch. True if this was a speculative round."""
        if self._round is None:
            return False
        measured, catch_up = self._round
        self.chooser.observe_round_overhead(seconds - measured)
        self._stretch += catch_up
        self._round = None
        return True

    def lead(self, extra: float) -> None:
        """A speculative stretch starts after a plain token that took `extra` seconds more than a pipelined one
        (negative when less: it had no next forward to queue)."""
        self._stretch = extra

    def restart(self, extra: float) -> None:
        """The stretch ended: the plain token after it took `extra` seconds more than a pipelined one (its forward
        could not be queued behind the previous round's). Its whole cost beyond its rounds is then known."""
        self.chooser.observe_switch(self._stretch + extra)
        self._stretch = 0.0

    # -- prompt-cache reuse (session.Session) -------------------------------------------------------------------------
    def context_length(self) -> int:
        self._sync()
        return min(d.context_length() for d in self.drafters.values())

    def rewind_context(self, keep: int) -> int:
        """Each sub-drafter rewinds to its own point (see their `rewind_context`); the target re-runs from the lowest,
        and `extend` gives each sub-drafter the taps from its own point on."""
        self._sync()
        self._rewound = {n: d.rewind_context(keep) for n, d in self.drafters.items()}
        self._pending = None
        return min(self._rewound.values())

    def extend(self, taps: list[mx.array], ids: list[int]) -> None:
        p = min(self._rewound.values())
        for n, d in self.drafters.items():
            off = self._rewound[n] - p
            d.extend([taps[i][:, off:] for i in self._tap_idx[n]], ids)
        self._pending = None
        self._reset_log()

    def parts(self) -> tuple:
        return (self, *self.drafters.values())

    def stats(self) -> dict:
        return {"auto": {**self.chooser.summary(), "drafters": sorted(self.drafters),
                         "calibration": self.calibration}}


def make_auto(target, *, dflash=None, mtp=None, ngram: bool | int = True, calibration_dir=None, log=None,
              **kw) -> AutoDrafter:
    """An AutoDrafter over the given drafters (objects from load_drafter / load_mtp) plus n-gram prompt lookup
    (ngram: True = up to 8 drafts, an int = that many, False = none)."""
    ds = [d for d in (dflash, mtp) if d is not None]
    if ngram:
        ds.append(NGramDrafter(target.args.vocab_size, max_drafts=8 if ngram is True else int(ngram)))
    return AutoDrafter(target, ds, calibration_dir=calibration_dir, log=log, **kw)
