"""`auto`'s drafter: several drafters behind one `protocol.Drafter`, of which per round one proposes (or none: a
plain step), as its `chooser.AutoChooser` decides from the calibrated cost curve (`calibrate`) and what each option
measurably accepts and costs on this machine. `engine.AutoDecoder` drives it."""

from __future__ import annotations

import atexit
import time
import weakref
from pathlib import Path

import mlx.core as mx

from ...cache import CacheRewindError
from ..ngram import OPTION as NGRAM_OPTION
from ..ngram import RUN as NGRAM_RUN
from ..ngram import NGramDrafter
from ..protocol import Drafter
from .calibrate import load_or_calibrate, measure_catch_up, measure_draft_costs
from .chooser import FIRST_CHECK_ROUNDS, MODEL_DECAY, AutoChooser, QuietAsks, alpha_from_tau
from .learned import Memory, drafter_fingerprint, enabled, option_fingerprint

_KINDS = ("dflash", "mtp", "ngram")
# the first draft's acceptance after an n-gram match of each size (greedy, sampling), as measured with n-gram lookup
# drafting every round it could on the embedded set and the trained tiny set (BENCHMARKS.md, issue 20): greedy
# 0.11-0.20 after a 1-gram, 0.26-0.38 after a 2-gram, 0.75-0.99 after a 4-gram; at T = 1 0.02-0.09 and 0.00-0.05 after
# 1- and 2-grams, and longer matches too rare to measure (sampled text seldom repeats): below them by the same ratio.
# The starting estimate for n-gram lookup, as a drafter's eval.json τ is for it; and the acceptance of the drafts after
# an accepted one (a copy that starts right mostly goes on right)
NGRAM_ALPHA = {1: (0.12, 0.04), 2: (0.3, 0.03), 3: (0.6, 0.1)}  # size -> (greedy, sampling); 4 and longer: below
NGRAM_ALPHA_LONG = (0.85, 0.15)
NGRAM_THEN = {"greedy": 0.8, "sampling": 0.3}
# An offer that goes on with a copy the committed tokens already follow (a plain token, or a model drafter's round,
# predicted by the latest offer's drafts) is its own option (`ngram.RUN`, `NGramDrafter.offer`). Measured (`auto`
# forced plain, every greedy offer scored, the first 3 prompts of each category, 96 tokens): its first draft was
# right 0.998 of the time on the trained tiny set (fresh offers 0.18) and 0.52 on the embedded model (fresh 0.13);
# at T = 1 0 of 22 on both. Priced as a fresh 1-gram's, it waited for a 4-gram's estimates: on the tiny set auto
# started every copy 1-3 plain rounds after n-gram lookup alone did
NGRAM_RUN_ALPHA = {"greedy": 0.5, "sampling": 0.05}
# `auto`'s DFlash token trees: verify rows per round, and per regime the share of a depth's chain rejections a tree
# still rejects — the embedded set's DFlash trees of 16 rows (BENCHMARKS.md, "Token trees"): greedy, chain τ 1.50
# (α 0.33 at 15 drafts) → tree τ 2.02 at depth 6 (α 0.50): (1 − 0.50) / (1 − 0.33) ≈ 0.75; at T = 1, chain τ 1.33
# (α 0.25) → tree τ 1.51 (α 0.34): (1 − 0.34) / (1 − 0.25) ≈ 0.88. (The greedy share was used at T = 1 too: a
# prior counting on twice the rescue measured there. On the trained tiny set at T = 1 the change moved nothing
# measurable — auto 1.061x plain with it, 1.063x without, eight sittings: BENCHMARKS.md)
TREE_ROWS = 16
TREE_RESCUE = {"greedy": 0.75, "sampling": 0.88}
# ... and where the cost curve stays flat past the chain's rows (an accelerator: on an NVIDIA H200 under MLX's CUDA
# back-end a verify of 2 to 32 rows costs the same, and 32-row trees of the trained tiny set's block-8 drafter ran
# 1.05-1.16x its chain — BENCHMARKS.md, "Chains vs trees on an NVIDIA H200"), a tree as wide as it stays flat: the
# widest of these whose calibrated verify costs at most FLAT x the widest chain's
TREE_ROWS_FLAT = (32, 16)
FLAT = 1.2


def tree_rows(costs: dict[int, float], chain_rows: int, widest: int) -> int:
    """Verify rows of a DFlash tree on this cost curve ({rows: seconds}), beside its chain of `chain_rows` rows: the
    widest of `TREE_ROWS_FLAT` the curve covers whose verify costs at most `FLAT` x the chain's (a flat curve: the
    extra nodes come nearly free); else `TREE_ROWS`, or `widest` if narrower (the widest round any of auto's
    drafters verifies: a block-8 drafter's tree beside n-gram lookup's 8 drafts is 9 rows)."""
    chain = costs[min(chain_rows, max(costs))]
    for rows in TREE_ROWS_FLAT:
        if rows > chain_rows and rows in costs and costs[rows] <= FLAT * chain:
            return rows
    return min(TREE_ROWS, widest)


def ngram_prior(size: int) -> dict:
    """A measured-τ-like prior (one draft per round) for n-gram lookup after a match of `size` tokens."""
    greedy, sampling = NGRAM_ALPHA.get(size, NGRAM_ALPHA_LONG)
    return {"width": 1, "greedy": 1.0 + greedy, "sampling": 1.0 + sampling}


class AutoDrafter:
    """Several drafters behind one `protocol.Drafter`; per round one proposes (or none: a plain step).

    A drafter is brought up to the committed tokens only when it is asked to draft (or, for n-gram lookup, to say
    what it offers): a plain stretch hands nothing over and computes no taps, unless a model drafter pays by its mean
    estimate (`AutoChooser.paying`), which then stays in step on the taps every forward yields anyway. One that fell
    behind gets its backlog recomputed by the decoder in one forward (`fill`), a cost the chooser weighs
    (`AutoChooser.lags`) before asking it. Keep one AutoDrafter per target for a process: what it learns
    (acceptance, draft costs) carries over between requests, decaying as it goes.

    n-gram lookup is one option per matched n-gram size ("ngram@1" … "ngram@4"): a continuation found after a
    4-gram is far more often right than one found after a single token, and pooling them would hide the good
    matches behind the many poor ones; and an offer that goes on with a copy the committed tokens already follow is
    one more ("ngram@run", `NGramDrafter.offer`)."""

    kind = "auto"
    width_name = "auto drafts"
    measured_tau = None

    @property
    def mode(self) -> str:
        """What a decoder driving it reports: "auto", or the drafter's kind for one model drafter (`width_auto`)."""
        return next(iter(self.drafters)) if len(self.drafters) == 1 and "ngram" not in self.drafters else "auto"

    def __init__(self, target, drafters: list, *, verify_costs: dict[int, float] | None = None,
                 calibration_dir=None, recalibrate: bool = False, log=None, trees: bool = True,
                 remember: bool | None = None):
        if not drafters:
            raise ValueError("auto needs at least one drafter (DFlash, MTP or n-gram)")
        self.target = target
        self.drafters: dict[str, Drafter] = {}
        for d in drafters:
            if d.kind not in _KINDS:
                raise TypeError(f"auto cannot drive a {d.kind!r} drafter")
            if d.kind in self.drafters:
                raise ValueError(f"two {d.kind} drafters given to auto")
            self.drafters[d.kind] = d
        self.taps = tuple(sorted({int(t) for d in self.drafters.values() for t in d.taps}))
        self._tap_idx = {n: [self.taps.index(int(t)) for t in d.taps] for n, d in self.drafters.items()}
        self.max_drafts = max(d.max_drafts for d in self.drafters.values())
        self.calibration = {"cached": None, "source": "given"}
        tree_drafter = self.drafters.get("dflash") if trees else None  # the drafter a tree option drafts with
        if not hasattr(tree_drafter, "propose_tree"):
            tree_drafter = None
        widest = self.max_drafts + 1 if verify_costs is None else max(verify_costs)  # a round's most rows
        if verify_costs is None:  # with a tree-capable drafter, as wide as its trees could go
            rows = max(TREE_ROWS_FLAT) if tree_drafter is not None else 0
            verify_costs, self.calibration = load_or_calibrate(target, self.taps, max(widest, rows),
                                                               directory=calibration_dir, recalibrate=recalibrate,
                                                               log=log)
        wide = self.calibration.get("wide_forward_s")
        # the drafters' costs are timed now, a cached curve on another day: both go to the chooser in the
        # calibration's seconds, the machine's speed now being a plain token checked now over the calibration's (a
        # curve cached while the machine ran 1.56x faster than it does now priced DFlash's and MTP's rounds 1.56x too
        # dear: in two `--quick` sittings where DFlash alone ran 1.13-1.22x plain, auto drafted it in 0 and 11 of ~450
        # rounds); the chooser's speed scale starts there
        speed = self._speed_now()
        self.chooser = AutoChooser(verify_costs, plain_cost=self.calibration.get("plain_token_s"),
                                   wide=(wide["rows"], wide["seconds"]) if wide else None, scale=speed)
        if self.calibration.get("checked_plain_token_s"):  # a scale from a check is checked again soon
            self.chooser.first_check_rounds = FIRST_CHECK_ROUNDS
        # {regime: {drafter: (fixed, per draft)}}: a round at T > 0 samples its drafts and keeps their distributions
        self.draft_costs = {regime: {n: (fixed / speed, per / speed) for n, (fixed, per) in measure_draft_costs(
            target, self.drafters, self.taps, self._tap_idx, temperature=t).items()}
            for regime, t in (("greedy", 0.0), ("sampling", 1.0))}
        # {drafter: (per position, per position² of context)} of its catch-up
        self.catch_up = {n: (per / speed, quad / speed) for n, (per, quad) in
                         measure_catch_up(target, self.drafters, self.taps, self._tap_idx).items()}
        self._kind_of: dict[str, str] = {}  # option name -> drafter kind
        for n, d in self.drafters.items():
            if n == "ngram":
                for m in range(d.index.min_n, d.index.max_n + 1):
                    self.chooser.add(NGRAM_OPTION.format(m), d.max_drafts, "free", measured_tau=ngram_prior(m),
                                     then_alpha=NGRAM_THEN, sporadic=True, shadowed=True)
                    self._kind_of[NGRAM_OPTION.format(m)] = n
                self.chooser.add(NGRAM_RUN, d.max_drafts, "free", then_alpha=NGRAM_THEN, sporadic=True, shadowed=True,
                                 measured_tau={"width": 1, **{r: 1.0 + a for r, a in NGRAM_RUN_ALPHA.items()}})
                self._kind_of[NGRAM_RUN] = n
            else:
                self.chooser.add(n, d.max_drafts, "affine", draft_prior=self.draft_costs["greedy"].get(n),
                                 sampling_draft_prior=self.draft_costs["sampling"].get(n),
                                 measured_tau=d.measured_tau, decay=MODEL_DECAY, **self._catch_up(n))
                self._kind_of[n] = n
        self._trees: dict[str, int] = {}  # token-tree option -> its draft nodes per round
        self._tree_of: dict[str, str] = {}  # drafter kind -> its tree option
        if tree_drafter is not None:
            self._add_trees(tree_drafter, widest)
        self._ngram_options = frozenset(o for o, n in self._kind_of.items() if n == "ngram")
        # what earlier processes learned of these options (`learned`), beside the cost curve's file; not with a cost
        # curve given (synthetic tables, tests) or remember=False (None: unless `learned.ENV` says off)
        self.memory = None
        keep = enabled() if remember is None else remember
        if keep and self.calibration.get("path") and self.calibration.get("model"):
            by_kind = {n: drafter_fingerprint(d) for n, d in self.drafters.items()}
            self.memory = Memory(Path(self.calibration["path"]).parent, self.calibration["model"],
                                 {o: option_fingerprint(by_kind[k], self.chooser.options[o])
                                  for o, k in self._kind_of.items()})
            self.memory.load(self.chooser, log)
            atexit.register(remember_at_exit, weakref.ref(self))
        self._model = [n for n in self.drafters if n != "ngram"]  # the drafters that read the target's taps
        self._model_options = frozenset(self._kind_of) - self._ngram_options  # theirs (`_warm` asks about no other)
        # set by the decoder that drives it: fill(a) recomputes the target's taps over positions [a, now) (rewinding
        # its cache and running those tokens again; None when the cache cannot rewind that far), can_fill(n) says
        # whether n positions could be
        self.fill = None
        self.can_fill = None
        self.needs_taps = False  # whether the latest round's drafter reads taps (the verify forward then yields them)
        self._pending = None
        self._round = None  # (draft + verify seconds, catch-up seconds) of the last speculative round
        # a chain round at T > 0: what its drafts are accepted on average (`verify.expected_acceptance`, set by the
        # decoder between `propose` and `accept`): its option's estimates and ledger learn from that, not its coins
        self.expected: list[tuple[float, float]] | None = None
        self._credit_tokens: float | None = None  # the latest speculative round's tokens for its ledger (`end_round`)
        self._stretch = 0.0  # the running speculative stretch's cost beyond its rounds so far (`lead`)
        # the latest stretch's wake so far, (seconds, excess) per slow plain token after it (`plain_token`); None: none
        self._wake: list | None = None
        self._lead = 0.0  # what the plain token before the coming speculative round cost beyond a pipelined one
        self._option = None  # the option of the latest speculative round (its ledger: `AutoChooser.credit`)
        self._entry = None  # ... and its ledger entry (`AutoChooser.entry`: the phase of the response it ran in)
        self.remaining: int | None = None  # tokens of the request still to generate (the decoder sets it per round)
        self._at = dict.fromkeys(self.drafters, 0)  # target positions each drafter has been handed (`_from`)
        self._how = dict.fromkeys(self.drafters, "start")  # how it gets them next: "start" | "extend" | "accept"
        self._reprefill = 0  # where the target's prefill restarts after `rewind_context`
        self._verdict = None  # the plain verdict a plain stretch keeps (`_hold`)
        self._planned = None  # (state, offers, `pick`'s answer) of the latest speculative `plan`, for `propose`
        self._started = True  # the drafters' state is the current context's (a new one's starts with its first token)
        self.quiet = QuietAsks()  # whether a plain stretch's round asks (`_unasked`), what the asked ones answered
        # (option, drafts) of the speculative rounds this process ran: their shapes' kernels are built (`accept`)
        self.built: set[tuple[str, int]] = set()
        self._reset([], None)

    def _speed_now(self) -> float:
        """A plain token now over the calibration's (`calibrate.cached_problem` checks a cached curve with one;
        a curve measured now or given: 1)."""
        now, cal = self.calibration.get("checked_plain_token_s"), self.calibration.get("plain_token_s")
        return now / cal if now and cal and now > 0 and cal > 0 else 1.0

    def _catch_up(self, kind: str) -> dict:
        """`AutoChooser.add`'s catch-up arguments for an option of drafter `kind` (`measure_catch_up`)."""
        per, quad = self.catch_up.get(kind, (0.0, 0.0))
        return {"catch_up": per, "catch_quad": quad}

    def _add_trees(self, d, widest: int) -> None:
        """A token-tree option beside the DFlash drafter's chain ("dflash+tree"): each round `tree_rows` verify rows,
        the chain and the next likeliest nodes at most `depth` deep (`propose_tree`); its acceptance is the accepted
        path's, learned like a chain's. It starts from the chain's measured τ with each depth's rejections cut by
        `TREE_RESCUE` of its regime — what the embedded set's trees measured (BENCHMARKS.md, "Token trees") — and
        pays only where a verify of its rows costs about what the chain's does (flat cost curves: Apple GPUs, OpenBLAS
        on a CPU).
        d: the DFlash drafter (tree-capable); widest: the most rows a round of any of auto's drafters verifies."""
        rows = tree_rows(self.chooser.costs, d.max_drafts + 1, widest)
        depth = max(2, min(d.max_drafts, (rows - 1) // 2))
        if depth + 1 >= rows:
            return
        prior = None
        if d.measured_tau:
            width, prior = int(d.measured_tau["width"]), {"width": depth, "phases": d.measured_tau.get("phases", ())}
            for key, tau in d.measured_tau.items():
                if key not in ("width", "phases") and tau is not None:
                    a = 1.0 - TREE_RESCUE[key.split("#", 1)[0]] * (1.0 - alpha_from_tau(tau, width))
                    prior[key] = sum(a**i for i in range(depth + 1))
        d.enable_trees()
        name = "dflash+tree"
        self.chooser.add(name, depth, "affine", draft_prior=self.draft_costs["greedy"].get("dflash"),
                         sampling_draft_prior=self.draft_costs["sampling"].get("dflash"), measured_tau=prior,
                         rows=rows, decay=MODEL_DECAY, **self._catch_up("dflash"))
        self._kind_of[name], self._trees[name], self._tree_of["dflash"] = "dflash", rows - 1, name

    # -- the drafters' state, brought up to date only when one will draft ---------------------------------------------
    # Every committed token is kept (`_tokens`, position = index); the target's taps only where a forward produced
    # them anyway (a prefill that asked for them, a verify round of a model drafter: `_chunks`). A plain round hands
    # over nothing, so a plain stretch costs what plain decoding costs. A drafter asked to draft first gets what it
    # missed in one go: its taps from the chunks as far as they cover its backlog without a gap, the rest recomputed
    # by the decoder (`fill`, a forward over those positions that the chooser charges to the option:
    # `AutoChooser.lags`). So a prompt's taps, collected by its prefill, serve a drafter first asked tokens later:
    # only the tokens since are run again.

    def _reset(self, ids: list[int], taps, first: int = 0) -> None:
        """A new context `ids`; `taps` (or None) cover target positions [first, len(ids) − 1)."""
        self.chooser.end_stretch()  # a stretch the last request ended in is over
        self._tokens = list(ids)
        self._chunks: list[tuple[int, list]] = []  # (first position, taps) not yet handed to every model drafter
        self._tail = None  # (start, end) of the gap-free run of chunks the newest one ends (`_covered`'s fast path)
        if taps:
            self._chunks.append((first, list(taps)))
            self._tail = (first, first + taps[0].shape[1])
        self.chooser.clear_lags()
        self._verdict = None
        self._lost: set[str] = set()  # model drafters whose backlog cannot be recomputed in this context
        # (position, k, option, drafts) of the latest n-gram lookup (`_ngram_offer`; drafts [] where nothing matched)
        self._offer = None
        # offers not taken, awaiting the tokens (`_shadow`), with the response's phase and the regime they were made in
        self._shadows: list[tuple[int, str, list[int], int | None, str]] = []
        self._opened = len(ids) - 1  # where the response starts in `_tokens` (its first token's position)

    def _from(self, n: str) -> int:
        """The first target position drafter `n` has not been handed."""
        return 0 if self._how[n] == "start" else self._at[n]

    def _lag(self, n: str) -> int:
        """Target positions drafter `n` is behind."""
        return len(self._tokens) - 1 - self._from(n)

    def _covered(self, a: int) -> int:
        """The end of the chunks' coverage of the positions from `a` on without a gap (`a`: not even a). Asked every
        round a model drafter is offered: inside the newest run of chunks (every round adds one while a drafter is
        kept warm) it is that run's end at once; before it, the chunks up to the first gap."""
        t = self._tail
        if t is not None and t[0] <= a < t[1]:
            return t[1]
        cur = a
        for p0, taps in self._chunks:
            if p0 > cur:
                break
            cur = max(cur, p0 + taps[0].shape[1])
        return cur

    def _gather(self, a: int, pos: int) -> list | None:
        """The taps of positions [a, pos) from the chunks, or None where they do not cover them."""
        parts, cur = [], a
        for p0, taps in self._chunks:
            if cur >= pos:
                break
            end = p0 + taps[0].shape[1]
            if end <= cur:
                continue
            if p0 > cur:
                return None
            hi = min(end, pos)
            parts.append([t[:, cur - p0:hi - p0] for t in taps] if cur > p0 or hi < end else taps)
            cur = hi
        if cur < pos:
            return None
        if len(parts) == 1:
            return parts[0]
        return [mx.concatenate([p[i] for p in parts], axis=1) for i in range(len(parts[0]))]

    def _sync(self, name: str) -> float | None:
        """Bring drafter `name` up to the committed tokens; the seconds spent recomputing taps (`fill`), or None
        when its backlog cannot be recomputed (it sits out the rest of this context)."""
        pos, how = len(self._tokens) - 1, self._how[name]
        a = self._from(name)
        if how == "accept" and a == pos:
            return 0.0
        d, spent = self.drafters[name], 0.0
        if name == "ngram":
            taps = []
        else:
            c = min(self._covered(a), pos)  # the chunks cover [a, c): the rest is recomputed
            if c >= pos:
                taps = self._gather(a, pos)
            else:
                t0 = time.perf_counter()
                rest = self.fill(c) if self.fill is not None else None
                if rest is None:
                    self._lost.add(name)
                    return None
                spent = time.perf_counter() - t0
                head = self._gather(a, c) if c > a else None
                taps = rest if head is None else [mx.concatenate([h, r], axis=1) for h, r in zip(head, rest)]
            taps = [taps[i] for i in self._tap_idx[name]]
        if how == "accept":
            d.accept(taps, self._tokens[a + 1:])
        else:
            (d.start if how == "start" else d.extend)(taps, list(self._tokens))
        self._at[name], self._how[name] = pos, "accept"
        if name != "ngram":
            self._prune()
        return spent

    def _prune(self) -> None:
        """Drop the chunks every model drafter still in play is past."""
        lo = min((self._from(n) for n in self._model if n not in self._lost), default=len(self._tokens))
        self._chunks = [c for c in self._chunks if c[0] + c[1][0].shape[1] > lo]
        if self._tail is not None:
            self._tail = (max(self._tail[0], lo), self._tail[1]) if self._tail[1] > lo else None

    def _missing(self, n: str) -> int | None:
        """The positions of model drafter `n`'s backlog whose taps no chunk holds (run again when it drafts: `fill`),
        or None when it cannot draft now (they cannot be recomputed: it sits out this context)."""
        if n in self._lost:
            return None
        pos = len(self._tokens) - 1
        c = self._covered(self._from(n))
        if c >= pos:
            return 0
        if self.can_fill is None or not self.can_fill(pos - c):
            self._lost.add(n)
            return None
        return pos - c

    def remember(self, force: bool = False) -> bool:
        """Keep what was learned for the next process (`learned.Memory.remember`: at most every few seconds unless
        forced). Whether it wrote."""
        return self.memory is not None and self.memory.remember(self.chooser, force)

    def start(self, taps: list[mx.array] | None, ids: list[int]) -> None:
        self.remember()  # what the requests before this one taught
        self._started = True
        self._at = dict.fromkeys(self.drafters, 0)
        self._how = dict.fromkeys(self.drafters, "start")
        self._reset(ids, taps)
        self._pending = self._round = None
        self._lead = 0.0  # (a stretch's wake goes on into this request: `plain_token`)

    def _available(self, k: int, among=None) -> dict[str, int]:
        """{option: most drafts it can give now}; n-gram lookup only where the context's suffix occurred before, as
        the option of the matched size; a model drafter only where it can catch up (its backlog, in target
        positions, is told to the chooser: `AutoChooser.lags`). among: only these options (a set; None: all)."""
        available = {}
        for n, d in self.drafters.items():
            if n == "ngram":
                if among is not None and among.isdisjoint(self._ngram_options):
                    continue
                offer = self._ngram_offer(k)
                if offer is not None and (among is None or offer[0] in among):
                    available[offer[0]] = offer[1]
                continue
            names = [o for o in (n, self._tree_of.get(n)) if o is not None and (among is None or o in among)]
            missing = self._missing(n) if names else None
            if missing is None:
                continue
            for o in names:
                self.chooser.set_lag(o, self._lag(n), fill=missing, at=len(self._tokens) - 1)
                cap = min(k, self.chooser.options[o].max_k)
                if cap >= 1:
                    available[o] = cap
        return available

    def _ngram_offer(self, k: int) -> tuple[str, int] | None:
        """(option, drafts) n-gram lookup offers now for a round of at most k drafts (the index brought up to the
        committed tokens first), or None where the context's suffix did not occur before. Asked again at the same
        position and k (a fresh `plan` after `_held`, `_shadow` after either), it answers from the first asking."""
        o, p = self._offer, len(self._tokens)
        if o is None or o[0] != p or o[1] != k:
            self._sync("ngram")
            d = self.drafters["ngram"]
            drafts, name = d.offer(min(k, d.max_drafts))
            o = self._offer = (p, k, name, drafts)
        return (o[2], len(o[3])) if o[3] else None

    # n-gram offers not taken are scored anyway (`_shadow`): their drafts are known before the round, and the tokens
    # committed after it say how many a verify would have accepted. At greedy, exactly: those are the tokens it would
    # have compared them with. At T > 0, in distribution: an n-gram draft is a point mass, so a verify accepts draft
    # j (the drafts before it accepted) with probability p_j(d_j), the target's, and plain decoding samples d_j at
    # that position with that same probability — and committed tokens are the target's samples whatever decoded
    # them. Each option's acceptance is then learned from every offer, not only from the rounds that drafted it —
    # which are few and chosen (exploration, or where it already looked good): on the trained tiny set a 1-gram copy
    # explored in a few rounds measured 0.03 where its 63 offers passed over in plain rounds would have accepted 1.1
    # tokens each; at T = 1, learned from its rounds only, each n-gram option (five sizes, three phases) had to be
    # drafted to be known (~10 ms a round on the embedded model), and the embedded model's 2-gram and copy-run offers,
    # priced at 0.03-0.05, measured 0.19-0.34 in the middle of a response once scored this way.

    def _shadow(self, regime: str, taken: str | None, k: int) -> None:
        """This round, at most k drafts, took `taken` (None: a plain step): keep the n-gram offer of this position to
        score (`_resolve`) unless it was the option taken. At greedy the index is asked for it; at T > 0 only an
        offer this round looked up anyway is kept (where an n-gram option could change a plain choice: `relevant`),
        so a plain stretch where none could asks the index nothing."""
        if "ngram" not in self.drafters:
            return
        # not looked up at this position yet (one that matched nothing at some k matches nothing at any k)
        if self._offer is None or self._offer[0] != len(self._tokens):
            if regime != "greedy":
                return
            self._ngram_offer(k)
        p0, _, name, drafts = self._offer
        if drafts and name != taken and (not self._shadows or self._shadows[-1][0] < p0):
            self._shadows.append((p0, name, drafts, self.chooser.phase, regime))

    def _resolve(self) -> None:
        """Score the offers whose drafts the committed tokens now confirm or refute (`AutoChooser.observe_offer`)."""
        toks, keep = self._tokens, []
        for shadow in self._shadows:
            p0, name, drafts, phase, regime = shadow
            n = 0
            while n < len(drafts) and p0 + n < len(toks) and toks[p0 + n] == drafts[n]:
                n += 1
            if n == len(drafts) or p0 + n < len(toks):
                self.chooser.observe_offer(name, len(drafts), n, regime, phase)
            else:
                keep.append(shadow)
        self._shadows = keep

    def plan(self, k: int, regime: str, remaining: int) -> bool:
        """Whether the next round (with `remaining` tokens of the request left) is plain, decided before this round's
        token is known (AutoDecoder queues the next plain forward on it). A plain answer is counted as the round's
        choice. Otherwise the round is speculative and `propose` chooses it afresh, with the token this plan could
        not see: a decision taken on the n-gram index one token behind would draft from a match the latest token
        may already have broken. Inside a plain stretch only the options that could change a plain choice are asked
        what they offer (`AutoChooser.relevant`), and a plain verdict is kept while nothing it rests on changed
        (`_held`): then a plain round asks nothing but the n-gram index, and only where a match could matter — and
        while asking keeps answering plain, only every `QUIET_EVERY`th round of the stretch asks even that
        (`chooser.QUIET_RATE`; a round not asked scores no n-gram offer either)."""
        self._phase()
        if not self._started:
            # the round after the prefill's token, planned before that token is read: every drafter's state, the
            # n-gram index included, is still the previous context's, and a verdict on it is a guess — one that said
            # "speculative" left that round and the next unpipelined (~+1.2 and +2.2 ms a request on the trained tiny
            # set, where the round after it chose plain on the real state). It is plain; a stretch can start at the
            # round after it, chosen on this context
            self.chooser.count_plain()
            self.needs_taps = self._warm(regime, remaining)
            return True
        if self._unasked(regime):
            self.chooser.count_plain()
            self.needs_taps = self._verdict[3]
            return True
        if self._held(k, regime):
            self.quiet.answered(False)
            self.chooser.count_plain()
            self.needs_taps = self._verdict[3]
            self._shadow(regime, None, k)
            return True
        among = self.chooser.relevant(regime, remaining)
        available = self._available(k, among)
        # inside a stretch its option again, where bounds decide it (`AutoChooser.keep`); else every option weighed
        picked = None if among is not None and not available else (
            among is None and self._option is not None and self.chooser.keep(self._option, available, regime, remaining)
            or self.chooser.pick(available, regime, remaining))
        self.quiet.answered(picked is not None and picked[0] is not None)
        if picked is None or picked[0] is None:
            key = (self.chooser.version, regime)  # what it was decided on (counting may age the estimates)
            self.chooser.count_plain()
            self.needs_taps = self._warm(regime, remaining)
            self._hold(key, among, available)
            self._shadow(regime, None, k)
            return True
        self._verdict = None
        # after a speculative round nothing is pending: `propose` will see this very state and takes this answer
        self._planned = ((self.chooser.version, regime, remaining, k, len(self._tokens)), available, picked)
        return False

    def _unasked(self, regime: str) -> bool:
        """Whether this round keeps the plain verdict without asking anything (`chooser.QuietAsks`): the verdict
        still stands on this chooser version and regime, and the quiet rule does not ask this round."""
        v = self._verdict
        return not self.quiet.asks(v is None or v[0] != (self.chooser.version, regime))

    # A plain verdict (`_verdict`): (chooser version, regime), the n-gram options that could change it, the n-gram
    # offers ((option, drafts)) it was taken with, and whether its forwards yield the taps (`_warm`). Within one
    # chooser version (no estimate changed) a plain stretch only makes every option worse — fewer tokens left to
    # spread a switch over or to learn for (a shorter horizon), drafters further behind, fewer drafts left to give —
    # so the verdict stands while the n-gram index offers nothing else (a new context drops it: `_reset`).

    def _hold(self, key: tuple, among, available: dict[str, int]) -> None:
        """Keep the plain verdict just taken on `key` (with `among` from `relevant`; after a speculative round,
        None: the next round asks again)."""
        if among is None:
            self._verdict = None
            return
        if self._chunks and among.isdisjoint(self._model_options) \
                and self.chooser.could_pay_ahead(key[1]).isdisjoint(self._model_options):
            # no model drafter could pay now or in a later phase of the response: the taps kept for one (a long
            # prompt's: 3 taps × its length × the hidden size) are let go; one asked later recomputes what it needs
            # (`fill`)
            self._chunks, self._tail = [], None
        if self._verdict is None or self._verdict[0] != key or self._verdict[3] != self.needs_taps:
            self._verdict = (key, among & self._ngram_options, set(), self.needs_taps)
        self._verdict[2].update(o for o in available.items() if o[0] in self._ngram_options)

    def _held(self, k: int, regime: str) -> bool:
        """Whether the plain verdict still holds for a round that could draft k: same chooser version and regime,
        and the n-gram index offers no draft that the verdict was not taken with."""
        v = self._verdict
        if v is None or v[0] != (self.chooser.version, regime):
            return False
        if not v[1]:
            return True
        offer = self._ngram_offer(k)
        return offer is None or offer[0] not in v[1] or offer in v[2]

    def _warm(self, regime: str, remaining: int | None) -> bool:
        """Whether a forward should yield the model drafters' taps although this round's drafter reads none: while
        one of them pays by its mean estimate (`AutoChooser.paying`) and drafts in this phase of the response
        (`AutoChooser.drafted_lately`), it stays in step on them instead of catching up later; one that is only
        worth exploring, or that the options on offer keep beating here, catches up when it next drafts (its
        catch-up is priced with the forward that recomputes them: `AutoChooser.catch_up_cost`). On a small model
        the taps of every forward cost a few percent: on the trained tiny set, carried for DFlash through every
        n-gram round after the opening (it paid by its prior there and never drafted), an n-gram round took 5-7 %
        longer than one without them."""
        ch = self.chooser
        lately = frozenset(o for o in self._model_options if ch.drafted_lately(o, regime))
        if not lately:
            return False
        pays = {self._kind_of[o] for o in ch.paying(regime, remaining, lately)}
        return any(n in pays for n in self._model if n not in self._lost)

    def _phase(self) -> None:
        """Tell the chooser which phase of the response the coming round is in (`chooser.PHASES`): by the tokens
        generated in this context so far (a new context before its first token: none)."""
        self.chooser.set_phase(0 if self._opened is None else len(self._tokens) - self._opened)

    def wants_taps(self, regime: str) -> bool:
        """Whether a prefill in a new context should yield the model drafters' taps: where one could pay (its
        optimistic scenario beats plain) in some phase of the response (`AutoChooser.could_pay_ahead`). They cost a
        prefill next to nothing (the LM head runs over its last position either way) and they spare a drafter tried
        later in the request a forward over the whole prompt: its catch-up then runs again only the tokens decoded
        since (`_sync`)."""
        self.chooser.new_context()
        self._started = False  # until the prefill's token is read back (`start` / `extend`)
        self._lost.clear()
        self._opened = None  # a new response: its opening phase until it starts (`_reset`)
        self._phase()
        self.chooser.set_horizon(None)
        return not self.chooser.could_pay_ahead(regime).isdisjoint(self._model_options)

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        """`remaining`: the request's tokens still to generate in this round (set by the decoder)."""
        regime = "greedy" if sampler.params.greedy else "sampling"
        self._phase()
        self.expected = None  # (the decoder measures this round's, if sampled)
        planned, self._planned = self._planned, None
        if planned is not None and planned[0] == (self.chooser.version, regime, self.remaining, k, len(self._tokens)):
            available, picked = planned[1], planned[2]  # `plan` asked of this same state (the round after a spec one)
        else:  # chosen afresh: `plan` decided one token behind (the n-gram index without the latest token)
            available, picked = self._available(k), None
        name, kk = self.chooser.choose(available, regime, self.remaining, picked)
        self._shadow(regime, name, k)
        t0 = time.perf_counter()
        lag, spent = 0, 0.0
        kind = None if name is None else self._kind_of[name]
        if kind is not None:
            # a drafter that sat idle catches up on its backlog while drafting: not its steady-state cost
            lag = self._lag(kind)
            spent = self._sync(kind)
        if kind is None or spent is None:
            drafts, q, spent, k_drafted = [], None, 0.0, 0
        elif name in self._trees:  # a token tree (the decoder verifies it as one): kk is its deepest path
            drafts, q = self.drafters[kind].propose_tree(anchor, pos, kk, self._trees[name], sampler, history)
            k_drafted = max(drafts.depths)
        else:
            drafts, q = self.drafters[kind].propose(anchor, pos, kk, sampler, history)
            k_drafted = len(drafts)
        self.needs_taps = (kind is not None and kind != "ngram") or self._warm(regime, self.remaining)
        t1 = time.perf_counter()
        self._pending = (name, k_drafted, regime, t1 - t0 - spent, lag, t1)
        return drafts, q

    def accept(self, taps: list[mx.array] | None, new_tokens: list[int]) -> None:
        now = time.perf_counter()
        if self._pending is not None:
            name, k, regime, t_draft, lag, t1 = self._pending
            # the first round of an option at a width in this process: MLX built kernels for its shapes then (under
            # its CUDA back-end on an H200 the first 16-row DFlash tree round took 20 s, the first 2-row verify 86
            # ms, where each costs ~3-9 ms after): what it accepts counts, its time is not such a round's — neither
            # its option's costs nor its ledger (one such round, capped at `LEDGER_ROUND_CAP` plain tokens, is past
            # the ledger's floor: enough to bar the option)
            building = bool(k) and (name, k) not in self.built
            if building:
                self.built.add((name, k))
            steady = not k or self.chooser.steady(name, lag)
            if not steady:  # a new tenure of its drafter: what its catch-up serves is measured from here
                self.chooser.caught_up(name, regime)
                if not building:  # what it spent beyond a steady round is its own catch-up cost
                    opt = self.chooser.options[name]
                    self.chooser.observe_catch_up(name, lag, t_draft - self.chooser.scale * opt.draft(regime)(k),
                                                  at=len(self._tokens) - 1)
            expected, self.expected = self.expected, None  # (this round's: reset by `propose`)
            self.chooser.update(name if k else None, k, len(new_tokens) - 1, regime,
                                t_draft if steady and not building else None, None if building else now - t1,
                                expected)
            self._round = t_draft + now - t1 if k and not building else None
            self._credit_tokens = None if expected is None else 1.0 + sum(x for _, x in expected)
            if k:
                self._option, self._entry = name, self.chooser.entry(name)
            self._pending = None
        p = len(self._tokens) - 1
        if taps:
            self._chunks.append((p, list(taps)))
            end = p + taps[0].shape[1]
            self._tail = (self._tail[0], end) if self._tail is not None and self._tail[1] == p else (p, end)
        self._tokens += new_tokens
        if self._shadows:
            self._resolve()
        self.needs_taps = False

    def end_round(self, seconds: float, tokens: int) -> bool:
        """The whole round took `seconds` (AutoDecoder: from the previous round's commit to this one's) and committed
        `tokens`: what its draft and verify windows did not cover is overhead every speculative round pays. (What its
        drafter spent catching up is that option's own: `AutoChooser.observe_catch_up`.) Its option's ledger gets
        the round, and the plain token that started its stretch if it did (`AutoChooser.credit`). True if this was
        a speculative round."""
        lead, self._lead = self._lead, 0.0
        if self._round is None:
            return False
        self.chooser.observe_round_overhead(seconds - self._round)
        if self._option is not None:  # (what its drafts commit on average, where measured: `expected`)
            credited = tokens if self._credit_tokens is None else self._credit_tokens
            self.chooser.credit(self._option, credited, seconds + lead, self._entry)
        self._round = None
        return True

    def lead(self, extra: float) -> None:
        """A speculative stretch starts after a plain token that took `extra` seconds more than a pipelined one
        (negative when less: it had no next forward to queue; where queueing it computes it, MLX's CPU backend, a
        whole forward saved). (The prefill's token is never such a token: the round after it is plain, `plan`.)"""
        self._close_wake(undecided=True)
        self._stretch = self._lead = extra

    def restart(self, extra: float) -> None:
        """The stretch ended: the plain token after it took `extra` seconds more than a pipelined one (its forward
        could not be queued behind the previous round's). The pipelined plain tokens after it may still run slow
        (`plain_token`): its whole cost beyond its rounds is known when they no longer do."""
        self._stretch += extra
        if self._option is not None:  # in the stretch's phase: the token after it may be in the next one
            self.chooser.credit(self._option, 0, extra, self._entry)
        self._wake = []
        if not self.chooser.settle_max:
            self._close_wake()

    def plain_token(self, seconds: float) -> None:
        """A pipelined plain token inside a plain stretch took `seconds`. Right after a speculative stretch, the
        tokens slower than the scale's price (`AutoChooser.settled`) are its wake, held back; when a token at the
        price ends the wake, their excess is that stretch's cost, credited to its option, and they never measure the
        speed scale (on a machine whose BLAS threads spin on after a verify, ~0.1 s of tokens). A wake that has not
        ended after `settle_max` tokens is the machine's: they all measure the scale, and nothing is charged. Every
        other token measures the scale (`AutoChooser.observe_plain`). A wake outlives the request it began in: the
        next request's plain tokens go on testing it (a request that ends inside a wake has not told which it was: on
        a VM running slower than the scale knew at the start, the first request's plain tokens after a DFlash tree
        stretch each ran ~2 ms over the price, were all charged to the tree as its wake when the request ended, and
        the ledger barred DFlash's options in the opening phase for the rest of the sitting)."""
        if self._wake is not None:
            extra = self.chooser.settled(seconds)
            if extra is None:
                self._close_wake()
            elif len(self._wake) + 1 < self.chooser.settle_max:
                self._wake.append((seconds, extra))
                return
            else:  # the machine's
                held, self._wake = self._wake, []
                for s, _ in held:
                    self.chooser.observe_plain(s)
                self._close_wake()
        self.chooser.observe_plain(seconds)

    def _close_wake(self, undecided: bool = False) -> None:
        """The latest stretch's wake is over (a plain token at the scale's price, or a new stretch): its tokens'
        excess is charged to the stretch's option and its whole cost beyond its rounds goes to the switch cost.
        undecided (a new stretch began before any token ran at the price): what every held token ran over the price,
        the smallest excess among them, is the machine's — they measure the speed scale — and only what each ran
        beyond it is the stretch's. (Where stretches come every few tokens, n-gram lookup on the trained tiny set, a
        wake rarely ends at the price before the next one starts: when the VM slowed from 2.3 to 3.9 ms a token, the
        held tokens' whole excess was charged to `ngram@4` in the late phase, whose rounds had saved time, and the
        ledger barred it there for the rest of the sitting — auto 0.55-0.70x n-gram alone.)"""
        if self._wake is None:
            return
        floor = min(e for _, e in self._wake) if undecided and self._wake else 0.0
        for s, extra in self._wake:
            if floor > 0.0:
                self.chooser.observe_plain(s)
            self._stretch += extra - floor
            if self._option is not None and extra > floor:
                self.chooser.credit(self._option, 0, extra - floor, self._entry)
        self.chooser.observe_switch(self._stretch, wake=len(self._wake))
        self._stretch, self._wake = 0.0, None

    # -- prompt-cache reuse (session.Session) -------------------------------------------------------------------------
    def context_length(self) -> int:
        """Every committed position but the anchor: a drafter behind them catches up when it is next asked."""
        return len(self._tokens) - 1

    def rewind_context(self, keep: int) -> int:
        """Each model drafter rewinds to its own point (see their `rewind_context`; one that cannot, or has no
        state, starts afresh; one that sat out the whole previous turn rewinds again from the point it was left at).
        The target re-runs from `keep`, or from the point of a drafter that was in step to the end (MTP restarts its
        chain a few positions back): their taps then come with that prefill. A drafter that was behind stays behind,
        and catches up (`fill`) only if it is asked to draft."""
        keep = max(0, min(keep, self.context_length()))
        end = self.context_length()
        lowest = keep
        for n in self._model:
            in_step = self._how[n] == "accept" and self._at[n] == end
            if self._how[n] == "start" or n in self._lost:  # no state, or one that cannot catch up here
                self._how[n] = "start"
                continue
            try:
                point = self.drafters[n].rewind_context(min(keep, self._at[n]))
            except CacheRewindError:
                self._how[n] = "start"
                continue
            self._at[n], self._how[n] = point, "extend"
            if in_step:
                lowest = min(lowest, point)
        if "ngram" in self.drafters:
            self._how["ngram"] = "start"  # its index is rebuilt from the new context
        self._pending = None
        self._reprefill = lowest
        return lowest

    def extend(self, taps: list[mx.array] | None, ids: list[int]) -> None:
        self._started = True
        how, at = self._how, self._at
        self._reset(ids, taps, self._reprefill)
        self._how, self._at = how, at
        self._pending = self._round = None

    def parts(self) -> tuple:
        return (self, *self.drafters.values())

    def stats(self) -> dict:
        return {"auto": {**self.chooser.summary(), "drafters": sorted(self.drafters),
                         "unasked_rounds": self.quiet.unasked, "calibration": self.calibration,
                         "learned": None if self.memory is None else self.memory.stats()}}


def remember_at_exit(ref) -> None:
    """At exit: an AutoDrafter still alive keeps what it learned (`AutoDrafter.remember`)."""
    auto = ref()
    if auto is not None:
        auto.remember(force=True)


def make_auto(target, *, dflash=None, mtp=None, ngram: bool | int = True, calibration_dir=None, log=None,
              **kw) -> AutoDrafter:
    """An AutoDrafter over the given drafters (objects from load_drafter / load_mtp) plus n-gram prompt lookup
    (ngram: True = up to 8 drafts, an int = that many, False = none)."""
    ds = [d for d in (dflash, mtp) if d is not None]
    if ngram:
        ds.append(NGramDrafter(target.args.vocab_size, max_drafts=8 if ngram is True else int(ngram)))
    return AutoDrafter(target, ds, calibration_dir=calibration_dir, log=log, **kw)
