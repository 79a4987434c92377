"""`auto` inside a batch (`speculative.batch.BatchGenerator`): each step one draft width for every auto row — 0, a
plain step — and for each row the option it drafts with, chosen to maximise the batch's expected committed tokens
per second:

    rate(k) = Σ_rows E_r(k) / (T(n) + Σ_rows draft_r(k))

- E_r(k): the row's expected tokens per round with its best option at width ≤ k (`AcceptanceStats` of the option,
  learned across rows and requests, shared with the solo `auto` of the same process — a model drafter's scaled by
  how the row's own rounds of it did against them, its ρ, as the solo chooser scales a request's: `rho`); a row
  whose option gives fewer drafts (n-gram lookup: only where its context's suffix occurred before) counts what it
  gives; a row in a fixed mode counts its own width's expectation; a plain row 1. A row whose drafting would add
  fewer tokens than the step's rate commits in the seconds it costs steps plainly in that step (`StepChoice.at`).
- T(n): seconds of one batched step feeding n = B·L positions (B rows, padded to the widest block L), measured (without
  the rows' drafting): a plain step of B rows is priced by the median of its latest steps, and every speculative step's
  time updates an EMA per shape (B, L) in plain steps of B rows, priced at the plain price now (`BatchAuto.relative`) —
  and per n in seconds, what a shape with no plain step measured yet is priced by; an n not measured yet is the solo
  calibration's forward cost C(n) (the cost curve `auto` measured for this machine and model, up to its widest verify,
  then toward the calibration's forward over 128 positions) times the measured/calibrated ratio of the steps seen. The
  first step of each shape a process runs is not measured (MLX builds its kernels then: `BatchAuto.first_of`), and no
  sample moves an estimate by more than a factor 1.4 (`chooser.robust_ema`).
  At a small batch verification is nearly free and drafting pays; as B·L grows the step becomes compute-bound, T
  grows with n, and plain steps win — then `auto` chooses them.
- draft_r(k): the option's measured seconds per round (`DraftCost`, calibrated units × the measured scale).

To speculate, the best width must beat plain by `ENTER_GAIN`. A model drafter whose mean estimate does not pay may
still be explored (`BatchAuto.explore`, the solo chooser's rule over the batch's rate): when the seconds its
optimistic scenarios would save over the tokens still to come, times the share of its uncertainty one step resolves,
exceed what the step loses by its mean. Without it a drafter's estimate never moved off its prior: on the embedded
server DFlash stayed at α 0.55 (τ ≈ 2.2) while DFlash rows there committed ~4 tokens a round, and a lone auto
request decoded plainly at 0.98x where DFlash rows ran 1.30x. Outputs are lossless whatever is chosen (every drafted
row is verified by `verify`); the choice only changes speed.

As the solo chooser does (`chooser.AutoChooser.credit`), the batch keeps a ledger of what its speculative steps
measurably saved over plain steps of as many rows, stretch by stretch (`speculative.batch.Span`: the plain step
read back just before it, its steps and the plain steps after it until `SPAN_AFTER` of them ran; a speculative
step counts its committed tokens × a plain step's time per row − its wall time, a plain step its price − its
time): while it is below −`LOSS_BUDGET` × the batch's decoding time (and below −`LEDGER_FLOOR` plain steps: early
in a server's life 0.5 % of its decoding time is less than one unlucky step), every step is plain, until plain
steps have earned the budget back.
"""

from __future__ import annotations

import bisect
import collections

from .chooser import (CHECK_SAMPLES, ENTER_GAIN, FUTURE_TOKENS, LEDGER_FLOOR, LEDGER_ROUND_CAP, LEDGER_ROUNDS,
                      LOSS_BUDGET, MIN_GAIN, PRICE_WINDOW, SCALE_WINDOW, SCENARIOS, SETTLE_TOKEN_CAP, STALE_ROUNDS,
                      AcceptanceStats, QuietAsks, phase_of, plain_price, robust_ema, scaled_alphas, tenure_bucket)
from .multiplex import AutoDrafter

EMA = 0.2  # weight of a new step time in its n's estimate (each sample at most 3x the estimate: `chooser.robust_ema`)
EXPLORE_EVERY = 8  # steps an answer of `BatchAuto.explore` holds while nothing it depends on but the step costs moved
# speculative steps of B rows with no plain step of B rows ever priced (their plain price a guess: `_unpriced_plain`)
# after which a check prices one (`BatchAuto.observe`)
UNPRICED_STEPS = 8
TABLE_MEMO = 512  # expected-tokens tables kept (`BatchAuto.table`; all dropped when full)
# steps an answer of `BatchAuto.carries` holds while nothing it depends on but the step costs moved: rows join a
# batch of 2 every ~32 steps (64-token requests), so a hold of `EXPLORE_EVERY` steps never reached the next join and
# each auto row's join scored every model drafter's phases again (~0.4 ms of a 0.73 ms join here, ar's 0.21 ms)
CARRIES_HOLD = 64
CARRIED_MEMO = 256  # answers of `BatchAuto.carries` kept (all dropped when full: they hold for a few steps only)
# plain steps after a speculative stretch that are still its cost (`speculative.batch.Span`): the first one after it
# (where queueing a step runs most of its forward, it carries the next one's as well) and those a stretch leaves slow
# (on this repository's 2-core CPU with OpenBLAS, plain steps after a DFlash stretch ran ~1.25x for ~6 steps). Every
# step of the window adds its own noise to the stretch's ledger credit: a longer one charges longer wakes and is
# noisier (24 one-row runs of the embedded model: the stretches' spans lost 321 / 392 / 407 ms over 4 / 8 / 32 steps)
SPAN_AFTER = 8
# a quiet batch (`asks`) asks every QUIET_EVERY steps at first, then at most every QUIET_MOST: at 8 rows of the
# embedded model an ask (the rows' n-gram offers, phases and measures, the bounds) was ~150-180 us of a ~10 ms step
# here — every 4th step ~0.4 % of every step, in batches that speculated in 1 step of ~700 — where a lone request's
# ask is ~25 us of a 3.4 ms token and its plain stretches stay at QUIET_EVERY (an opportunity waits at most
# QUIET_MOST − 1 steps there; a speculative answer brings the gap back to QUIET_EVERY, its stretch asked every step)
QUIET_MOST = 16
# a stretch chosen by a thin margin over the plain step's price re-prices plain steps sooner (`BatchAuto.stale_after`):
# STALE_ROUNDS steps after the latest priced one at a margin of 1 + THIN_MARGIN or more, down to STALE_ROUNDS //
# THIN_DIVISOR at no margin. A price set at a slow moment (a fresh process's first steps, another process) makes a
# step that loses look like it wins by 10-30 %, and a stretch prices no plain step: on the embedded model's lone auto
# rows DFlash ran on a 1-row plain price of 5.7 ms for five requests where plain steps took 3.7 (0.84-0.93x ar in
# them), and on 9.4 ms against 6.4 in another sitting (auto 0.91x ar over 16 runs). An option that wins by more than
# the price's own error runs on as before: a check ends its stretch for a wake and CHECK_SAMPLES priced steps
THIN_MARGIN = 0.5
THIN_DIVISOR = 8


def nearest(rows: int, counts: list[int]) -> int:
    """The row count of `counts` nearest `rows` (the smaller on a tie): whose measures price a row count with none of
    its own (`BatchAuto._unpriced_plain`, `BatchAuto._relative_prior`)."""
    return min(counts, key=lambda b: (abs(b - rows), b))


class BatchAuto:
    """The batch-level chooser over an `AutoDrafter`'s options and cost curve (the solo `auto` of the process)."""

    def __init__(self, auto: AutoDrafter):
        self.auto = auto
        self.chooser = auto.chooser
        self.curve = dict(sorted(auto.chooser.costs.items()))  # L -> calibrated seconds of a forward over L tokens
        wide = (auto.calibration or {}).get("wide_forward_s")  # the calibration's compute-bound point
        if wide and wide["rows"] > max(self.curve):
            self.curve[int(wide["rows"])] = max(float(wide["seconds"]), self.curve[max(self.curve)])
        self.measured: dict[int, float] = {}  # n positions -> EMA seconds of a step
        # B rows -> the price of a plain step of B rows (`observe`), and `relative` below: what a step of each shape
        # costs. n = B·L alone conflates shapes: on the embedded server a plain step of 8 rows took 19.8 ms
        # and a 1-row verify of 8 positions ~9; priced by n, a server that had ever batched 8 requests priced a lone
        # request's verify at the 8-row step and never drafted for it again (DFlash rows alone ran 1.29x plain there,
        # auto 0.91x)
        self.plain_by_rows: dict[int, float] = {}
        # B rows -> {L positions per row > 1 -> EMA of a step's seconds in plain steps of B rows, priced when it ran}:
        # what a speculative step costs is priced at the plain step's price now (`step_cost`). In seconds, a slow
        # moment raised the plain price (the median of its latest steps) and left the speculative shapes' EMAs at the
        # fast moment they were measured in: every speculative step looked cheap beside plain ones exactly while the
        # machine was slow, and the stretch it started prices no plain step (on the embedded model's lone auto rows
        # the plain step was priced 5.5-9.4 ms at the batch's speculative choices, 4.1-6.4 on average)
        self.relative: dict[int, dict[int, float]] = {}
        # B rows -> the latest `PRICE_WINDOW` plain steps' seconds: a plain step's price is the lower median of the
        # latest `SCALE_WINDOW` (a check's own, while fewer) and of them all (`observe`)
        self._plain: dict[int, collections.deque] = {}
        self._fresh: dict[int, int] = {}  # B rows -> how many of the latest plain steps make the short window
        self._checked: set[int] = set()  # the row counts a running check has priced (`check_due`)
        self.ratio: float | None = None  # measured / calibrated step time, EMA over every step
        self.steps = {"plain": 0, "spec": 0}
        self.draft_factor: dict[str, float] = {}  # option -> measured / calibrated draft time, EMA
        # the ledger (`credit`): seconds of decoding and seconds speculation saved over plain steps (negative: lost),
        # both fading by 1 − 1/LEDGER_ROUNDS a step
        self.elapsed = 0.0
        self.saved = 0.0
        self.plain_step = 0.0  # seconds of a plain step of the batch, as the latest credit priced it (the floor's)
        self.decoded = 0  # tokens the batch committed so far (`explore`: what is learned serves later requests too)
        self.explored: dict[str, int] = {}  # option -> steps that explored it (counted by the batch that ran them)
        self.exploring: str | None = None  # the option the latest `choose` explores, if any
        self.prefill_s: float | None = None  # seconds per position of a prefill chunk, EMA (`prefill_cost`)
        self._explore_memo: tuple | None = None  # (what `explore` was asked on, steps it still holds, its answer)
        self._carried: dict = {}  # what `carries` was asked -> (`stepped` when answered, its answer)
        self._tables: dict = {}  # an option's estimates, scenario and ρ -> its expected-tokens table (`table`)
        self._shapes: set[tuple[int, int]] = set()  # (rows, positions per row) of the steps seen (`first_of`)
        self.span_after = SPAN_AFTER  # plain steps after a speculative stretch that are still its cost
        self._priced_at: int | None = None  # `stepped` when a plain step was last priced (`observe`; `check_due`)
        self._check = 0  # plain steps a check still has to price
        self._unpriced: dict[int, int] = {}  # rows -> speculative steps of them with no plain step of them priced
        self.checks = 0  # checks run
        self.margin: float | None = None  # rate ÷ plain rate of the latest step chosen by the mean estimates
        # rows -> [Σ tokens × the plain price they were credited at, Σ tokens] credited since a plain step of that
        # many rows was last priced (`book`): a check re-prices them (`observe`)
        self._unconfirmed: dict[int, list[float]] = {}
        # whether a step asks `choose` (`asks`), the answers' share of speculative steps
        self.quiet = QuietAsks(most=QUIET_MOST)
        self._spec_last = False  # whether the latest ask took a speculative step

    def key(self, regime: str, generated: int) -> str:
        """The acceptance estimates a row of `regime` that has generated `generated` tokens drafts by: the regime's in
        the phase of the response it is in (`chooser.PHASES`, the solo chooser's phases and estimates): the
        embedded drafters accept far more in a response's opening than after it, and pooled, the estimates that
        exploration taught in the openings priced the later steps' drafts ~15 % too high."""
        phases = self.chooser.phases
        return regime if phases is None else f"{regime}#{phase_of(generated, phases)}"

    def keys(self, regime: str, generated: int, budget: int) -> list[str]:
        """The estimates' keys of the phases a row reaches from `generated` tokens on with `budget` more."""
        out = []
        for n in [generated] + [b for b in self.chooser.phases or () if generated < b < generated + budget]:
            k = self.key(regime, n)
            if k not in out:
                out.append(k)
        return out

    def options(self, regime: str, batch: int = 1, budget: int | None = None) -> dict:
        """A new auto row's own drafters: forks of the auto's (shared weights, empty state) — n-gram lookup always
        (it costs nothing to keep in step), a model drafter only if the batch's choice could take it for this row
        (`carries`, in a batch of `batch` rows, `budget` tokens to generate: None, `FUTURE_TOKENS`): every drafter
        of a row follows each of its steps (the taps of every committed position, its own bookkeeping), so one the
        choice would never take would only slow the row down. A row with one token to generate takes every model
        drafter: it ends at its prefill's token, follows no step, and its prompt-cache entry keeps their states for
        the conversation's next turn (without them, a request that only warmed the cache — `glimmer bench serve`'s
        warm-up sends one per prompt — left entries that every later auto request on them had to prefill again for
        its drafters, or go without them)."""
        budget = FUTURE_TOKENS if budget is None else budget
        return {kind: d.fork() for kind, d in self.auto.drafters.items()
                if kind == "ngram" or budget <= 1 or self.carries(kind, regime, batch, budget)}

    def carries(self, name: str, regime: str, batch: int, budget: int, generated: int = 0,
                rho: float | None = None) -> bool:
        """Whether a row of `regime` that has generated `generated` tokens and may generate `budget` more, in a
        batch of `batch` rows, should carry model drafter `name`: in a phase it reaches (`keys`) the batch's choice
        could take it — it pays by its mean estimate (`could_pay`), or exploring it would (`explore`, in a batch of
        such rows all carrying it only, against plain steps); rho: how the row's own rounds of it did (`rho`).

        An answer holds for `CARRIES_HOLD` steps while nothing it depends on but the step costs moved (the drafter's
        estimates in those phases, the batch's size, the row's budget and ρ), as `explore`'s in a step does
        (`_explored`): asked once per model drafter at every row's join, it was ~0.3 ms a drafter (the phases'
        exploration scenarios width by width), ~0.6 % of every step of a batch of 8 rows of 64 tokens here, and the
        rows of a burst join on the same question."""
        keys = self.keys(regime, generated, budget)
        memo = (name, tuple(keys), batch, budget, rho,
                tuple((tuple(a.acc), tuple(a.tried), a.shrink) for a in (self.acceptance(name, k) for k in keys)))
        got = self._carried.get(memo)
        if got is not None and self.stepped - got[0] < CARRIES_HOLD:
            return got[1]
        out = self._carries(name, keys, batch, budget, rho)
        if len(self._carried) >= CARRIED_MEMO:
            self._carried.clear()
        self._carried[memo] = (self.stepped, out)
        return out

    def _carries(self, name: str, keys: list[str], batch: int, budget: int, rho: float | None) -> bool:
        rhos = () if rho is None else ((name, rho),)
        for key in keys:
            if self.could_pay(name, key, batch, budget, rho):
                return True
            rows = [(key, budget, {name: self.chooser.options[name].max_k}, rhos)] * batch
            step = StepChoice(self, rows, 0, 1, 0.0, self.chooser.options[name].max_k)
            if self.explore(step, step.plain_rate) is not None:
                return True
        return False

    def could_pay(self, name: str, regime: str, batch: int, budget: int | None = None,
                  rho: float | None = None) -> bool:
        """Whether `name` beats plain decoding by the margin `choose` wants to start speculating (`ENTER_GAIN`) at
        some width, by its mean estimate, in a batch of `batch` rows all drafting with it (the most favourable
        case: every row pays the widest block anyway): at 1.00–1.05x plain the batch's choice never takes it. A row
        with `budget` tokens to generate drafts at most budget − 1 a round (as `choose` lets it); rho: the rows'
        own measure of it (`rho`)."""
        plain = (1.0 + ENTER_GAIN) / self.step_cost(batch, rows=batch)
        top = self.chooser.options[name].max_k if budget is None else min(self.chooser.options[name].max_k, budget - 1)
        if top < 1:
            return False
        # a bound first (exact: the most expected tokens, at its widest, over the cheapest speculative step and its
        # cheapest drafting; a step costs no less at more positions): a drafter that cannot pay at a batch's size —
        # the usual answer for a row joining a batch of 8 here — is not priced width by width (~0.3 ms a row's join)
        expected = self.table(name, regime, rho=rho)[1:top + 1]  # expected tokens of a round at 1..top drafts
        drafting = [self.draft_cost(name, k) for k in range(1, top + 1)]
        if expected[-1] / (self.step_cost(batch * 2, rows=batch) + batch * min(drafting)) <= plain:
            return False
        return any(e / (self.step_cost(batch * (k + 1), rows=batch) + batch * d) > plain
                   for k, (e, d) in enumerate(zip(expected, drafting), 1))

    def refill_pays(self, name: str, regime: str, batch: int, budget: int, positions: int) -> bool:
        """Whether a new row of `regime` with `budget` tokens to generate, in a batch of `batch` rows, should prefill
        `positions` prompt positions a prompt cache holds again, to give model drafter `name` the state the cache
        lacks (without it, the row leaves the drafter out: a conversation that once went without it, or a prompt
        first served plainly, would never draft with it again, nor teach the batch what it accepts): what the
        drafter is worth to the row must exceed what that prefill costs (`prefill_cost`). Its worth, phase by phase
        of the response (`keys`): its mean saving over plain steps on that phase's tokens in a batch of such rows,
        or, if more, what exploring it there is worth (`explore`)."""
        if positions <= 0 or not self.carries(name, regime, batch, budget):
            return False
        cap = self.chooser.options[name].max_k
        bounds = [0] + [b for b in self.chooser.phases or () if b < budget] + [budget]
        worth = 0.0
        for lo, hi in zip(bounds, bounds[1:]):
            rows = [(self.key(regime, lo), hi - lo, {name: cap})] * batch
            step = StepChoice(self, rows, 0, 1, 0.0, cap)
            _, rate, _ = step.best()
            found = self.explore(step, step.plain_rate)
            worth += max((hi - lo) * (1.0 / step.plain_rate - 1.0 / rate), found[3] if found is not None else 0.0)
        return worth > self.prefill_cost(positions)

    def prefill_cost(self, positions: int) -> float:
        """Seconds of prefilling `positions` prompt positions, drafters' start included: as the prefills measured
        (`observe_prefill`), or before any, the calibrated forward over them (x the measured step ratio)."""
        if self.prefill_s is not None:
            return positions * self.prefill_s
        return self.calibrated(positions) * (self.ratio if self.ratio is not None else 1.0)

    def observe_prefill(self, positions: int, seconds: float) -> None:
        """A prefill chunk of `positions` positions took `seconds` (its row's drafters' start included)."""
        if positions > 0 and seconds > 0:
            self.prefill_s = robust_ema(self.prefill_s, seconds / positions, EMA)

    @property
    def taps(self) -> tuple:
        return self.auto.taps

    # -- the cost model ------------------------------------------------------------------------------------------
    def calibrated(self, n: int) -> float:
        """C(n): the calibration's forward cost over n positions, extended linearly past its longest block."""
        c = self.curve
        if n in c:
            return c[n]
        keys = sorted(c)
        if n < keys[0]:
            return c[keys[0]]
        i = bisect.bisect_right(keys, n)  # keys[i - 1] <= n < keys[i]
        lo, hi = keys[i - 1], keys[i] if i < len(keys) else None
        if hi is None:  # beyond the calibrated widths: the slope of the last two points
            a, b = keys[-2] if len(keys) > 1 else keys[-1], keys[-1]
            slope = (c[b] - c[a]) / (b - a) if b > a else c[b] / b
            return c[b] + max(slope, 0.0) * (n - b)
        return c[lo] + (c[hi] - c[lo]) * (n - lo) / (hi - lo)

    def step_cost(self, n: int, rows: int | None = None) -> float:
        """Seconds of a step feeding n positions: the measured EMA at n; between two measured counts, linear
        between them; past the largest, its time plus the steeper of the measured slope (its last two counts) and
        the calibrated one; below the smallest, the smallest scaled down along the calibrated curve; nothing
        measured yet, the calibrated curve (x the measured ratio) — and never less than a smaller count measured
        (the times are noisy; the cost is not decreasing in positions). rows: a step of that many rows (n / rows
        positions each), from the steps measured with as many rows (`plain_by_rows`) once a plain one is among them."""
        m = self.measured
        if rows:
            price = self.plain_price(rows)
            if price is not None:
                if n == rows:  # a plain step of rows already priced: its price (what the rest gives, at a fraction of
                    return price  # the work; asked every step of a batch, `speculative.batch._observe`)
                rel = {**self._relative_prior(rows), **self.relative.get(rows, {})}  # its own widths over the prior's
                m = {rows * L: r * price for L, r in rel.items()}
                m[rows] = price
            elif n == rows and m and n not in m:  # (no step of n positions measured either)
                return self._unpriced_plain(rows)
        floor = max((t for k, t in m.items() if k < n), default=0.0)  # more positions never cost less
        return max(floor, self._interpolated(n, m, plain=rows if rows and price is not None else None))

    def plain_price(self, rows: int) -> float | None:
        """The price of a plain step of `rows` rows (`observe`; None: none priced yet), at most that of any larger row
        count's: a step of fewer rows never costs more. A row count's first plain steps may be slow ones — the step
        after a row left the batch, a stretch's wake — and its price, the median of the few it has, stays there while
        a stretch prices no plain step: on the embedded model at N = 2 the 1-row plain step was priced 7.0 ms (the
        2-row one 5.9) where 1-row plain steps took ~4.4, and the lone row drafted DFlash at a loss on that price
        (`benchmarks/batch_rows_ab.py`, `uncapped`)."""
        own = self.plain_by_rows.get(rows)
        if own is None:
            return None
        return min([own] + [p for b, p in self.plain_by_rows.items() if b > rows])

    def _relative_prior(self, rows: int) -> dict[int, float]:
        """{L: a speculative shape's cost in plain steps} measured at the nearest other row count, for the widths
        `rows` rows have not run yet: what a row count's first speculative steps are priced by, in place of the
        solo calibration's curve — which knows neither what a batch's verify costs beyond a solo forward over as many
        positions (~1.8 plain steps here where the curve says 1.36) nor the wake a stretch leaves (folded into the
        measured shapes: `charge`). A server's first steps at 2 rows, after a level at 1, drafted lone n-gram steps
        at 4-9 a level, each ~20 ms with its wake, on the curve's price, until each width had learned its own."""
        others = [b for b, rel in self.relative.items() if rel and b != rows]
        return self.relative[nearest(rows, others)] if others else {}

    def _unpriced_plain(self, rows: int) -> float:
        """A plain step of `rows` rows before any was priced: the priced plain step of the nearest row count, along the
        calibrated curve; with none, the calibrated curve at the machine's speed now by plain steps only (the solo
        chooser's scale, a plain token checked when auto started over the calibration's). Never from the speculative
        steps' times scaled down the curve: a fresh server's first requests drafted from their first step, and their
        1-row plain step, priced from their DFlash steps (which cost 1.8 plain steps here where the solo calibration
        says 1.36), rose from 4.4 to 9.4 ms while the plain steps it stood for took ~4.5 — every DFlash step looked
        like a win, and with no plain step ever priced no check came (`check_due`)."""
        if self.plain_by_rows:
            b = nearest(rows, list(self.plain_by_rows))
            return self.plain_price(b) * self.calibrated(rows) / self.calibrated(b)
        return self.calibrated(rows) * self.chooser.scale

    def _interpolated(self, n: int, m: dict[int, float], plain: int | None = None) -> float:
        """`step_cost`'s estimate at n from the measured steps `m` ({positions: seconds}); plain: the key of m that is
        a plain step (its rows' price), if one is."""
        if n in m:
            return m[n]
        ratio = self.ratio if self.ratio is not None else 1.0
        if not m:
            return self.calibrated(n) * ratio
        below = max((k for k in m if k < n), default=None)
        above = min((k for k in m if k > n), default=None)
        if below is not None and above is not None:
            return m[below] + (m[above] - m[below]) * (n - below) / (above - below)
        if below is None:
            return m[above] * self.calibrated(n) / self.calibrated(above)
        slope = ratio * (self.calibrated(n) - self.calibrated(below)) / (n - below)
        # the measured slope between two speculative widths, never from the plain step up: a speculative shape's price
        # holds what a stretch costs beyond its steps (its wake, charged to every shape: `charge`), which does not grow
        # with the positions — taken as a slope from the plain step, one 1-row step of 2 positions priced at 1.6 plain
        # steps priced a 9-position one at 6 (the calibration says 1.4), and a fresh server's lone auto rows never
        # carried a model drafter again
        lower = [k for k in m if k < below and k != plain]
        if lower:
            k2 = max(lower)
            slope = max(slope, (m[below] - m[k2]) / (below - k2))
        # ... and at least the largest measured step scaled along the calibrated curve: the ratio that matters is the
        # one measured there (a batch's step over B rows costs more per position than a solo forward over as many:
        # each row attends over its own keys), not the EMA over every step, which the cheap small steps pull down
        # (measured on the embedded server: 8 rows x 6 positions cost 1.5x the additive estimate)
        proportional = m[below] * self.calibrated(n) / self.calibrated(below)
        return max(m[below] + max(slope, 0.0) * (n - below), proportional)

    def observe(self, n: int, seconds: float, spec: bool, rows: int | None = None) -> None:
        """A step over n positions (of `rows` rows, if told) took `seconds` (its drafting excluded). Each estimate moves
        by at most a factor 1 + EMA·2 a sample (`chooser.robust_ema`: a stall of the machine, another process taking
        it for a moment, is not what such a step costs; a lasting change comes through within a few steps) — but a
        plain step of `rows` rows is priced as the solo chooser prices a plain token (`AutoChooser.observe_plain`):
        the median of the latest `SCALE_WINDOW` (a check's own only, once it has them: `check_due`). The plain price
        is what every speculative step is weighed against, and an EMA of it sat wherever the latest slow steps left
        it: on the embedded server's 2 rows the batch's DFlash steps were chosen on a plain step priced 8.3 ms on
        average, its plain steps taking 5.7 (the choice falls where the price is high, and a stretch, which measures
        no plain step, keeps it there), where those steps' own predictions were close (7.3 tokens in 22.9 ms
        predicted, 6.7 in 20.7 taken).

        ... and never above the median of the latest `PRICE_WINDOW`: a price follows a faster machine within half
        the short window, a slower one only within half the long one. A slow moment of a few steps (5 of 9 at
        1.5x, another process) priced the 2-row plain step at 9.4 ms where they took 6.5-7, the batch took DFlash
        on it, and the stretch, which prices no plain step, kept that price for its ~130 steps until the next check
        (`STALE_ROUNDS`): its ledger in surplus, its steps 3.5 ms a token against plain's 3.4. Too low a price only
        makes speculating wait; too high, it speculates at a loss."""
        if seconds <= 0:
            return
        self.measured[n] = robust_ema(self.measured.get(n), seconds, EMA)
        if rows:
            if spec or n != rows:
                if rows in self.plain_by_rows:  # in plain steps of these rows: what `step_cost` multiplies them by
                    rel = self.relative.setdefault(rows, {})
                    rel[n // rows] = robust_ema(rel.get(n // rows), seconds / self.plain_price(rows), EMA)
                # (before one is priced, a step measured against the stand-in price, `_unpriced_plain` — the
                # calibration at the solo chooser's scale, 0.55-0.7 of what a fresh server's first plain steps then
                # took — went on being read against the real price once one came: a 1-row 2-position step costing
                # 1.06 plain steps kept 1.5-1.6)
                if spec and rows not in self.plain_by_rows and not self._check:
                    # speculating on a plain price never measured for these rows (`_unpriced_plain`): a check after a
                    # few such steps (`UNPRICED_STEPS`), not `STALE_ROUNDS` — with no plain step ever priced, none was
                    # ever due
                    self._unpriced[rows] = self._unpriced.get(rows, 0) + 1
                    if self._unpriced[rows] >= UNPRICED_STEPS:
                        self._unpriced[rows] = 0
                        self._start_check()
            else:
                window = self._plain.setdefault(rows, collections.deque(maxlen=PRICE_WINDOW))
                if self._check and rows not in self._checked:  # a check's own steps make the short window ...
                    self._checked.add(rows)
                    self._fresh[rows] = 0
                window.append(seconds)
                fresh = self._fresh[rows] = min(self._fresh.get(rows, 0) + 1, SCALE_WINDOW)
                # ... and the long one still bounds it: a check's steps come right after a stretch's span, and where
                # the stretch's wake outlasts the span they run slow (a check priced 2-row plain steps at 7.5 ms
                # where they took ~6.0 and the batch went on drafting DFlash at 3.3 ms a token against plain's 3.0)
                self.plain_by_rows[rows] = plain_price(list(window), fresh)
                self._confirm(rows, fresh)
        self.ratio = robust_ema(self.ratio, seconds / self.calibrated(n), EMA)
        if not spec:
            self._priced_at = self.stepped
            self._check = max(0, self._check - 1)

    def _confirm(self, rows: int, fresh: int) -> None:
        """A plain step of `rows` rows was priced (`observe`): what the ledger was credited since the previous one, at
        the price a check measures where that is lower (plain steps cheaper than the credits counted: they saved less,
        or lost more), the solo chooser's rule (`AutoChooser._confirm`); a higher one changes nothing. A stretch prices
        no plain step, and one run on a price from a slow moment credits the ledger for steps that lost (on the
        embedded model's lone auto rows a DFlash stretch on a 1-row price of 8.3 ms, plain steps taking ~5, was ~100 ms
        in surplus), which then pays for more losing steps."""
        u = self._unconfirmed.get(rows)
        if u is None:
            return
        if not self._check:  # priced within the latest `stale_after` steps: the credits stand
            del self._unconfirmed[rows]
        elif fresh >= CHECK_SAMPLES:
            del self._unconfirmed[rows]
            extra = u[0] - u[1] * self.plain_price(rows)
            if extra > 0.0:
                self.saved -= extra

    @property
    def stepped(self) -> int:
        """Steps timed so far (`elapse`)."""
        return self.steps["plain"] + self.steps["spec"]

    @property
    def check_due(self) -> bool:
        """Whether this step must be plain to price plain steps again: none was priced in the latest `STALE_ROUNDS`
        steps (a check then runs until `CHECK_SAMPLES` are), the solo chooser's rule (`AutoChooser.check_due`). A
        stretch's plain steps price nothing (`speculative.batch.Span`): where stretches follow one another, the
        plain step's price would otherwise stay what it was before them — a moment's price, the machine faster or
        slower since — and every step of theirs be weighed and charged against it."""
        if not self._check and self._priced_at is not None and self.stepped - self._priced_at > self.stale_after:
            self._start_check()
        return self._check > 0

    @property
    def stale_after(self) -> int:
        """Steps after the latest priced plain step that a check is due at: `STALE_ROUNDS`, fewer the thinner the
        margin (`margin`) by which the latest speculative step beat the plain step's price (`THIN_MARGIN`): the price's
        own error decides such a stretch, and it measures no plain step."""
        if self.margin is None:
            return STALE_ROUNDS
        share = min(1.0, max(0.0, self.margin - 1.0) / THIN_MARGIN)
        return max(STALE_ROUNDS // THIN_DIVISOR, round(STALE_ROUNDS * share))

    def _start_check(self) -> None:
        """Every step plain until `CHECK_SAMPLES` plain steps are priced, each row count's on its own steps."""
        self._check = CHECK_SAMPLES
        self._checked = set()
        self.checks += 1

    def first_of(self, rows: int, L: int) -> bool:
        """Whether a step of `rows` rows feeding `L` positions each is the first of that shape this process runs (and
        note it). MLX builds kernels on a shape's first use — its CUDA back-end compiles them, Metal builds pipeline
        states, our own kernels one per template — and such a step measures that build, not the step: on an NVIDIA
        H200 the batch's first 1 × 16 verify took 4.3 s where one costs ~10 ms (its first plain steps 3-10x the later
        ones). Priced and charged to the ledger, that one step barred speculation for the rest of the process (445 ms
        in the red, the 1 × 16 verify priced at 4.3 s) where DFlash rows alone ran 1.40x plain: a lone auto request
        decoded plainly at 0.91x. `BatchGenerator._observe` neither prices nor charges it."""
        if (rows, L) in self._shapes:
            return False
        self._shapes.add((rows, L))
        return True

    def elapse(self, seconds: float, spec: bool = False) -> None:
        """A step (speculative: `spec`) took `seconds`: the decoding time the ledger's budget grows with."""
        self.steps["spec" if spec else "plain"] += 1
        fade = 1.0 - 1.0 / LEDGER_ROUNDS
        self.elapsed = fade * self.elapsed + max(0.0, seconds)
        self.saved *= fade
        for u in self._unconfirmed.values():
            u[0] *= fade
            u[1] *= fade

    def credit(self, seconds: float, plain_step: float) -> None:
        """Speculation saved `seconds` over plain steps (negative: lost) in one step of a stretch's span (`book`): a
        speculative step's committed tokens at a plain step's time per row less its wall time, a plain step's price
        less its time; a loss of at most `LEDGER_ROUND_CAP` plain steps (`plain_step` seconds each: a stall must not
        bar speculation for long)."""
        self.saved += max(seconds, -LEDGER_ROUND_CAP * plain_step)
        self.plain_step = plain_step

    @property
    def barred(self) -> bool:
        """Whether speculation lost more than `LOSS_BUDGET` of the decoding time and more than `LEDGER_FLOOR` plain
        steps (every step is plain until not)."""
        return self.saved + max(LOSS_BUDGET * self.elapsed, LEDGER_FLOOR * self.plain_step) < 0.0

    def book(self, steps: list, n: int, rows: int, credited: bool) -> None:
        """A speculative stretch's span measured (`speculative.batch.Span`: steps as (seconds, plain step's price,
        committed in plain steps of its rows or None, plain)): its plain steps' time beyond their price (each at most
        `SETTLE_TOKEN_CAP` prices: a stall is not the stretch's) is the cost of its latest speculative step, over n
        positions of `rows` rows (`charge`); where an auto row drafted in it (`credited`), each step goes to the
        ledger (`credit`)."""
        excess = sum(min(s - p, SETTLE_TOKEN_CAP * p) for s, p, _, plain in steps if plain)
        if n and excess > 0:
            self.charge(n, excess, rows)
        if credited:
            u = self._unconfirmed.setdefault(rows, [0.0, 0.0])
            for s, p, worth, _ in steps:
                if worth is not None:
                    self.credit(worth * p - s, p)
                    u[0] += worth * p
                    u[1] += worth

    def charge(self, n: int, seconds: float, rows: int | None = None) -> None:
        """What a speculative step over n positions cost beyond its own time (the plain steps of its stretch's span
        beyond their price: `book`), added to n's estimate (EMA-weighted) — and, with `rows`, to the estimate of
        every speculative shape of as many rows: the wake a stretch leaves is the cost of having speculated, whatever
        the width of its last step (at 2 rows here ~3.5 plain steps of wake after a lone 9-position step; the
        n-gram steps there, whose widths vary step to step, each taught only its own width, which had rarely run:
        stretches of one step went on being chosen at a loss of ~20 ms each, auto 0.80x ar at N = 2 in one sitting
        with 20 of them)."""
        if seconds <= 0:
            return
        if n in self.measured:  # (by positions alone: every row count's, this step's only)
            self.measured[n] += EMA * seconds
        shaped = self.relative.get(rows) if rows else None
        if shaped:
            unit = self.step_cost(rows, rows=rows)
            for L in shaped:
                shaped[L] += EMA * seconds / unit

    def draft_cost(self, name: str, k: int) -> float:
        """Seconds of one round of `name` at k drafts: its calibrated shape (`DraftCost`) times what its rounds in
        batches measure (EMA of measured / shape; before any, the solo chooser's machine scale)."""
        return self.draft_factor.get(name, self.chooser.scale) * self.chooser.options[name].cost(k)

    def backlog_cost(self, name: str, lag: int, at: int) -> float:
        """Seconds a row's drafter of option `name` spends beyond a steady round taking in a backlog of `lag` positions
        ending at target position `at` (`AutoChooser.backlog_cost`, at the speed its rounds in batches measure, as
        `draft_cost`). A row that joins on a prompt-cache entry whose DFlash state never drafted takes in the whole
        prompt at its first draft (63–192 positions in a served sitting at 2 rows here, 1–15 at the later ones): one
        price per option priced that round as a steady one, and learned every catch-up into the steady price."""
        return self.draft_factor.get(name, self.chooser.scale) * self.chooser.backlog_cost(name, lag, at)

    def observe_draft(self, name: str, k: int, seconds: float) -> None:
        shape = self.chooser.options[name].cost(k)
        if shape <= 0 or seconds <= 0:
            return
        self.draft_factor[name] = robust_ema(self.draft_factor.get(name), seconds / shape, EMA)

    def acceptance(self, name: str, regime: str) -> AcceptanceStats:
        return self.chooser.options[name].acceptance(regime)

    def table(self, name: str, regime: str, z: float = 0.0, rho: float | None = None) -> list[float]:
        """[expected tokens of a round of `name` at 0..max_k drafts] by its `regime` estimates moved by z of their
        spread and scaled by ρ (`StepChoice.table`), kept while those estimates stand: every step of an open batch
        bounds its rows' offers by them, and building them afresh each step (~30 µs at 8 rows here) was a third of
        its choice."""
        acc = self.acceptance(name, regime)
        key = (name, regime, z, rho, tuple(acc.acc), tuple(acc.tried), acc.shrink)
        t = self._tables.get(key)
        if t is None:
            lift = z * acc.spread() if z else 0.0
            t, p = [1.0], 1.0
            for a in scaled_alphas(acc.alphas(), rho):
                p *= min(1.0, max(0.0, a + lift))
                t.append(t[-1] + p)
            if len(self._tables) >= TABLE_MEMO:
                self._tables.clear()
            self._tables[key] = t
        return t

    # -- the choice ----------------------------------------------------------------------------------------------
    def closed(self, fixed_width: int) -> bool:
        """Whether this step is plain for every auto row whatever they offer: the ledger bars speculation (`barred`),
        or a check prices plain steps again (`check_due`; only where no fixed row feeds a block — then no step is
        plain anyway). `speculative.batch.BatchGenerator` asks it before asking the rows what they offer: at 8 rows
        their n-gram offers, phase keys and measures were ~60 µs of a barred batch's every step here, for a choice
        they could not change."""
        return self.barred or (fixed_width == 1 and self.check_due)

    def asks(self) -> bool:
        """Whether this step asks `choose` (`speculative.batch.BatchGenerator` asks it before asking the rows what
        they offer; not asked, every auto row steps plainly): always while at least `QUIET_RATE` of the latest asks
        took a speculative step (`chooser.QuietAsks`), or right after one that did; else every `QUIET_EVERY`th step,
        the gap doubling with every plain answer up to `QUIET_MOST`."""
        return self.quiet.asks(self._spec_last)

    def choose(self, rows, fixed_rows: int, fixed_width: int, fixed_tokens: float, k_max: int) -> tuple[int, list]:
        """rows: the auto rows, each as (regime, budget, {option: most drafts it gives now}[, ((option, ρ), ...): its
        own measure of its model drafters, `rhos`]); fixed_rows: the other
        rows, fixed_width: the widest block they feed (1: none wider than a token), fixed_tokens: their expected
        tokens this step. Returns (k, [(option or None, drafts) per auto row]) — k 0: every auto row steps plainly;
        the best width by the mean estimates, or a step that explores a model drafter where that is worth it
        (`explore`); plain while the ledger bars speculation (`barred`) or a check prices plain steps again
        (`check_due`). Each answer is counted for `asks`."""
        k, plan = self._pick(rows, fixed_rows, fixed_width, fixed_tokens, k_max)
        self._spec_last = k > 0
        self.quiet.answered(k > 0)
        return k, plan

    def _pick(self, rows, fixed_rows: int, fixed_width: int, fixed_tokens: float, k_max: int) -> tuple[int, list]:
        """`choose`'s answer."""
        self.exploring = None
        plain = [(None, 0)] * len(rows)
        if self.closed(fixed_width):
            return 0, plain
        k_top = min(k_max, max((cap for row in rows for cap in row[2].values()), default=0))
        if k_top < 1:
            return 0, plain
        step = StepChoice(self, rows, fixed_rows, fixed_width, fixed_tokens, k_top)
        best = step.plain_rate
        # a bound first (exact: it never changes the answer): every row at its most expected tokens, the step at its
        # cheapest speculative width and no drafting cost; when even that cannot start speculating, no width is
        # scored (a plain batch asks every step: at 8 rows that scoring was ~3 % of a step here)
        best_k, best_plan = 0, None
        if step.bound() > best * (1 + ENTER_GAIN):
            for k in range(1, k_top + 1):  # no width beyond what some row can draft
                if step.bound_at(k) <= best * (1 + ENTER_GAIN if best_k == 0 else 1.0):
                    continue  # (exact, as the bound above: not even every row's most at this width could)
                rate, plan = step.at(k)
                if rate > best * (1 + ENTER_GAIN if best_k == 0 else 1.0):
                    best, best_k, best_plan = rate, k, plan
        found = self._explored(step, best, best_plan)
        if found is not None:
            self.exploring = found[0]
            return found[1], step.expand(found[2])
        if best_k:
            self.margin = best / step.plain_rate
        return best_k, plain if best_plan is None else step.expand(best_plan)

    def _explored(self, step: "StepChoice", incumbent: float, plan: list | None) -> tuple | None:
        """`explore`, asked again only when what it depends on changed beyond the steps' costs and the rows' n-gram
        offers — the rows' model drafters and budgets, the fixed rows, what the plan drafts with, an estimate — or
        after `EXPLORE_EVERY` steps (scoring every scenario of every model drafter each step cost a batch of 8 rows
        ~1 ms a step here; its answer moves with the step costs' EMA only slowly). A step that explores is asked
        afresh next time. The n-gram offers (their sizes move nearly every step: keyed on them, a lone auto request
        asked it afresh in 81 of 90 choices, 45 once they left the key) reach its answer through the incumbent's
        plan, which is in the key."""
        used = frozenset(c[0] for c in plan or () if c[0] is not None)
        options = self.chooser.options
        names = sorted({n for _, _, avail in step.groups for n in avail if n not in used and not options[n].shadowed})
        if not names:
            return None
        seen = tuple((n, r, self.acceptance(n, r).tried[0]) for n in names for r in {g[0] for g in step.groups})
        models = [(regime, budget, tuple((n, c) for n, c in avail.items() if not options[n].shadowed), rho)
                  for (regime, budget, avail), rho in zip(step.groups, step.rhos)]
        key = (tuple(models[g] for g in step.of), step.B, step.fixed_width, step.fixed_tokens, step.k_top, used, seen)
        memo = self._explore_memo
        if memo is not None and memo[0] == key and memo[1] > 0:
            self._explore_memo = (key, memo[1] - 1, memo[2])
            return memo[2]
        found = self.explore(step, incumbent, plan, names)
        self._explore_memo = (key, 0 if found is not None else EXPLORE_EVERY - 1, found)
        return found

    def explore(self, step: "StepChoice", incumbent: float, plan: list | None = None,
                names: list | None = None) -> tuple | None:
        """(option, k, plan per row group, surplus seconds) of a step that explores a model drafter, or None — the solo
        chooser's rule (`chooser.AutoChooser.explore`) over the batch's rate: for each model drafter some row carries
        and the step's plan (`plan`, at `incumbent` tokens per second) does not use (`names`: those, when known), the
        batch's best rate with that drafter's acceptance in each of `SCENARIOS` (its spread, every position alike); the
        expected saving EI = the mean over them of the seconds per token saved on the incumbent (beyond `MIN_GAIN`),
        times the tokens it can serve (the rows' budgets and what the batch decoded, at most `FUTURE_TOKENS`), times the
        share of its uncertainty the step resolves (the rows that try its first draft against the first drafts counted),
        must exceed what the step loses by the mean estimates: its seconds over its tokens at the incumbent's rate (less
        `ENTER_GAIN` when the incumbent is plain steps). The most surplus wins; the step is the optimistic scenario's
        best plan. Model drafters only: an n-gram option's drafts are free."""
        used = {c[0] for c in plan or () if c[0] is not None}
        if names is None:
            names = sorted({n for _, _, avail in step.groups for n in avail
                            if n not in used and not self.chooser.options[n].shadowed})
        if not names:
            return None
        bar = incumbent * (1 + MIN_GAIN)
        t_inc = 1.0 / incumbent
        # the step's loss counts the margin `choose` wants to leave plain steps (`ENTER_GAIN`: what a speculative
        # step costs beyond its price, its wake), when the incumbent is plain
        margin = 1.0 + ENTER_GAIN if not used else 1.0
        horizon = sum(row[1] for row in step.rows) + min(self.decoded, FUTURE_TOKENS)
        found, surplus = None, 0.0
        for name in names:
            top = (name, SCENARIOS[-1])
            if step.bound(top) <= bar:
                continue  # not even its optimistic scenario's bound beats the incumbent: EI = 0
            ei, k_e, plan_e = 0.0, 0, None
            for z in reversed(SCENARIOS):  # best first: the rate falls with the scenario
                k, rate, p = step.best((name, z))
                if plan_e is None:
                    k_e, plan_e = k, p
                if rate <= bar:
                    break
                ei += (t_inc - 1.0 / rate) / len(SCENARIOS)
            if ei <= 0.0:
                continue
            tokens, seconds = step.cost(plan_e)
            loss = max(0.0, seconds - tokens * t_inc / margin)
            # the share of its uncertainty the step resolves: its spread is its first draft's (`spread`), which each
            # row drafting with it tries once (counting the drafts each tries, ~4 a row at 2 rows, the batch kept
            # exploring DFlash at 5-8 % under plain steps there, its estimate never narrowing enough)
            tried = {}
            for (key, _, _), count, (n, _) in zip(step.groups, step.counts, plan_e):
                if n == name:
                    tried[key] = tried.get(key, 0) + count
            new = sum(tried.values())
            if new <= 0:  # its best plan in that scenario drafts with other options only: nothing learned of it
                continue
            known = sum(max(self.acceptance(name, key).tried[0], 0.0) for key in tried)
            gain = horizon * ei * new / (known + new) - loss
            if gain > surplus:
                found, surplus = (name, k_e, plan_e, gain), gain
        return found

    def update(self, name: str, regime: str, k: int, accepted: int, here: dict | None = None,
               expected: list[tuple[float, float]] | None = None) -> None:
        """A round of `name` at k drafts accepted `accepted` of them; here: the row's own measure of its model
        drafters' rounds (`rho`; `speculative.batch.Row.here`), noted first (before the estimates learn from it);
        expected: what its drafts are accepted on average at T > 0 (`chooser.AcceptanceStats.update`)."""
        opt = self.chooser.options[name]
        if here is not None and not opt.shadowed:
            opt.note_here(regime, k, accepted, here.setdefault(name, {}))
        self.acceptance(name, regime).update(k, accepted, expected)

    def close_row(self, here: dict) -> None:
        """A row finished: how its rounds of each model drafter did against the estimates (`update`) joins the
        measure of how far requests differ (`chooser.Option.close_here`), as a lone request's does."""
        for name, h in here.items():
            opt = self.chooser.options.get(name)
            if opt is not None:
                opt.close_here(h)

    def rho(self, name: str, regime: str, here: dict) -> float | None:
        """How a row's own rounds of model drafter `name` did against the estimates they were drafted on (the solo
        chooser's ρ, `chooser.HERE_WEIGHT`: a drafter accepts far more on some requests than on others, which the
        estimates pooled over every row and request cannot follow), to 0.01; None: no round of it in the row yet.
        here: the row's measures (`update`)."""
        h = here.get(name)
        rho = None if h is None else self.chooser.options[name].rho(regime.split("#", 1)[0], h)
        return None if rho is None else round(rho, 2)

    def rhos(self, here: dict, regime: str) -> tuple:
        """((option, ρ), ...) of a row's measured model drafters (`rho`), for a row of `choose`."""
        return tuple(sorted((n, r) for n in here if (r := self.rho(n, regime, here)) is not None))

    def counts(self) -> dict:
        """The batch's steps so far, plain and speculative, those that explored each option, and those a quiet batch
        did not ask its choice (`asks`) (copies: safe to read from another thread while the batch steps); and where
        the process's auto started from (`AutoDrafter.memory`: the estimates it restored, None with no file kept)."""
        memory = self.auto.memory
        return {"auto_steps": dict(self.steps), "explored_steps": dict(self.explored),
                "unasked_steps": self.quiet.unasked,
                "learned_restored": None if memory is None else memory.restored}

    def stats(self) -> dict:
        return {**self.counts(),
                "ledger_saved_s": round(self.saved, 6), "ledger_elapsed_s": round(self.elapsed, 6),
                "barred": self.barred, "price_checks": self.checks,
                "step_seconds": {int(n): round(s, 6) for n, s in sorted(self.measured.items())},
                "step_seconds_by_rows": {int(b): {int(L): round(self.step_cost(b * L, rows=b), 6)
                                                  for L in sorted({1, *self.relative.get(b, {})})}
                                         for b in sorted(set(self.plain_by_rows) | set(self.relative))}}


class StepChoice:
    """One step's choice for `BatchAuto.choose`: the auto rows ((regime, budget, {option: most drafts it gives}[,
    ((option, ρ), ...)[, ((option, seconds), ...)]]) — the last: what its model drafters' backlogs cost it to take in
    beyond a steady round, `BatchAuto.backlog_cost`), the fixed rows (their count, widest block, expected tokens) and
    the widest block to consider. Rows alike for the choice (the same regime, offers and backlogs, budgets past the
    widest block) are scored once, as a group (`groups`, with
    their `counts`; a plan is one (option or None, drafts) per group: `expand` makes it one per row). Each option's
    expected tokens per round (`expected`), optionally in a scenario of its acceptance (`shift`: (option, z) — its
    every position moved by z of its spread), and the batch's rate of the best plan at a width (`at`)."""

    def __init__(self, auto: BatchAuto, rows, fixed_rows: int, fixed_width: int, fixed_tokens: float, k_top: int):
        self.auto, self.rows, self.k_top = auto, rows, k_top
        self.B = len(rows) + fixed_rows
        self.fixed_width, self.fixed_tokens = fixed_width, fixed_tokens
        self.tables: dict = {}  # (option, regime, z) -> expected tokens at 0..max_k drafts
        self.picks: dict = {}  # shift -> `_picks`
        self.costs: dict = {}  # L -> seconds of the step at L positions a row
        self.drafts: dict = {}  # (option, drafts) -> seconds of its round
        index: dict = {}
        self.groups, self.counts, self.of = [], [], []  # group g: (regime, budget, offers), its rows; row -> group
        self.rhos = []  # group g: ((option, ρ), ...) of its rows (`BatchAuto.rhos`)
        self.backlogs = []  # group g: {option: seconds its rows' drafter takes beyond a steady round} (its backlog)
        for row in rows:
            regime, budget, avail = row[:3]
            rho = row[3] if len(row) > 3 else ()
            behind = row[4] if len(row) > 4 else ()
            key = (regime, min(budget, k_top + 1), tuple(avail.items()), rho, behind)
            g = index.get(key)
            if g is None:
                g = index[key] = len(self.groups)
                self.groups.append((regime, key[1], avail))
                self.rhos.append(rho)
                self.backlogs.append(dict(behind))
                self.counts.append(0)
            self.counts[g] += 1
            self.of.append(g)
        self.plain_rate = (len(rows) + fixed_tokens) / self.step_cost(fixed_width)

    def expand(self, plan: list) -> list:
        """A plan per group as one per row."""
        return [plan[g] for g in self.of]

    def table(self, name: str, regime: str, z: float = 0.0, rho: float | None = None) -> list[float]:
        """[expected tokens of a round of `name` at 0..max_k drafts] in scenario z (its acceptance + z × spread), its
        estimates scaled by a row's ρ (`BatchAuto.rho`; None: as they are)."""
        t = self.tables.get((name, regime, z, rho))
        if t is None:
            t = self.tables[(name, regime, z, rho)] = self.auto.table(name, regime, z, rho)
        return t

    def expected(self, name: str, regime: str, k: int, z: float = 0.0, rho: float | None = None) -> float:
        t = self.table(name, regime, z, rho)
        return t[min(k, len(t) - 1)]

    def rho(self, g: int, name: str) -> float | None:
        """Group g's ρ of option `name` (None: not measured)."""
        for n, r in self.rhos[g]:
            if n == name:
                return r
        return None

    def _picks(self, shift: tuple | None) -> list[list[tuple]]:
        """Per group, per width k = 0..k_top: (its pick (option, drafts) or None, its expected tokens) — the option
        with the most expected tokens at min(k, its offer, budget − 1) drafts."""
        got = self.picks.get(shift)
        if got is not None:
            return got
        out = []
        for g, (regime, budget, avail) in enumerate(self.groups):
            lim = min(self.k_top, budget - 1)
            opts = []
            for n, cap in avail.items():
                c = min(cap, lim)
                if c >= 1:
                    t = self.table(n, regime, shift[1] if shift is not None and shift[0] == n else 0.0, self.rho(g, n))
                    opts.append((t, min(c, len(t) - 1), n))
            col = [(None, 1.0)]
            for k in range(1, self.k_top + 1):
                pick, e_pick = None, 1.0
                for t, c, n in opts:
                    kk = k if k < c else c
                    if t[kk] > e_pick:
                        pick, e_pick = (n, kk), t[kk]
                col.append((pick, e_pick))
            out.append(col)
        self.picks[shift] = out
        return out

    def step_cost(self, L: int) -> float:
        """Seconds of the step with every row fed L positions (`BatchAuto.step_cost`), once per step."""
        got = self.costs.get(L)
        if got is None:
            got = self.costs[L] = self.auto.step_cost(self.B * L, rows=self.B)
        return got

    def draft_cost(self, pick: tuple) -> float:
        got = self.drafts.get(pick)
        if got is None:
            got = self.drafts[pick] = self.auto.draft_cost(*pick)
        return got

    def behind(self, g: int, name: str, e: float) -> float:
        """Group g's rows' backlog price for a round of option `name` that commits `e` tokens: spread, as the solo
        chooser spreads a catch-up (`AutoChooser.rates`), over the tokens a catch-up of it measurably serves
        (`AutoChooser.tenure`) — a drafter caught up drafts on at its steady price; charged whole to one round, a
        row behind would never catch up."""
        seconds = self.backlogs[g].get(name, 0.0)
        if seconds <= 0.0:
            return 0.0
        held = tenure_bucket(self.auto.chooser.tenure(name, self.groups[g][0].split("#", 1)[0]))
        return seconds * min(1.0, e / held)

    def bound(self, shift: tuple | None = None) -> float:
        """A bound on every width's rate: each row at its most expected tokens, the step at its cheapest
        speculative width and no drafting."""
        most = self.fixed_tokens
        for g, ((regime, budget, avail), count) in enumerate(zip(self.groups, self.counts)):
            lim, e = min(self.k_top, budget - 1), 1.0
            for n, cap in avail.items():
                if min(cap, lim) >= 1:  # expected tokens grow with the drafts: its most is at its widest
                    t = self.table(n, regime, shift[1] if shift is not None and shift[0] == n else 0.0, self.rho(g, n))
                    e = max(e, t[min(cap, lim, len(t) - 1)])
            most += count * e
        return most / self.step_cost(self.fixed_width + 1)

    def bound_at(self, k: int) -> float:
        """A bound on the rate at width k (`at`): every row at its pick's expected tokens at that width, the step at its
        cheapest speculative width and no drafting. Narrow widths are bounded by what their drafts can commit: at
        8 rows, where one row's copy could pay only at its widest, the narrow widths need not be scored."""
        most = self.fixed_tokens
        for col, count in zip(self._picks(None), self.counts):
            most += count * col[k][1]
        return most / self.step_cost(self.fixed_width + 1)

    def at(self, k: int, shift: tuple | None = None) -> tuple[float, list]:
        """(the batch's rate, [(option or None, drafts) per group]) at width k: each row its option with the most
        expected tokens — unless what drafting costs it is worth fewer tokens than the step's rate would commit in
        that time: its extra tokens over its drafting seconds below the rate, it steps plainly (its block is padded
        into the step's anyway, so drafting is all it adds; a row whose own rounds accept little, `BatchAuto.rho`,
        need not hold back the others, nor draft for nothing beside them). 0 where no row drafts at this width: the
        same as plain."""
        plan, tokens, drafting = [], self.fixed_tokens, 0.0
        worth = []  # (extra tokens per drafting second, group) of the groups that draft
        for g, (col, count) in enumerate(zip(self._picks(shift), self.counts)):
            pick, e = col[k]
            tokens += count * e
            plan.append((None, 0) if pick is None else pick)
            if pick is not None:
                d = self.draft_cost(pick) + self.behind(g, pick[0], e)
                drafting += count * d
                worth.append(((e - 1.0) / d if d > 0 else float("inf"), g, e, d))
        worth.sort()
        while worth:
            L = max([self.fixed_width] + [plan[g][1] + 1 for _, g, _, _ in worth])
            if L == self.fixed_width:  # no block wider than the fixed rows': as plain
                break
            rate = tokens / (self.step_cost(L) + drafting)
            if worth[0][0] >= rate:
                return rate, plan
            _, g, e, d = worth.pop(0)  # the least worth: stepping plainly raises the rate
            tokens -= self.counts[g] * (e - 1.0)
            drafting -= self.counts[g] * d
            plan[g] = (None, 0)
        return 0.0, plan

    def best(self, shift: tuple | None = None) -> tuple[int, float, list]:
        """(k, rate, plan per group) of the best width (k 0: plain), with no margin."""
        out = (0, self.plain_rate, [(None, 0)] * len(self.groups))
        for k in range(1, self.k_top + 1):
            rate, plan = self.at(k, shift)
            if rate > out[1]:
                out = (k, rate, plan)
        return out

    def cost(self, plan: list) -> tuple[float, float]:
        """(expected tokens, seconds) of a step on `plan` (per group) by the mean estimates."""
        tokens, drafting, L = self.fixed_tokens, 0.0, self.fixed_width
        for g, ((regime, _, _), count, (name, k)) in enumerate(zip(self.groups, self.counts, plan)):
            if name is None:
                tokens += count
                continue
            e = self.expected(name, regime, k, rho=self.rho(g, name))
            tokens += count * e
            drafting += count * (self.draft_cost((name, k)) + self.behind(g, name, e))
            L = max(L, k + 1)
        return tokens, self.step_cost(L) + drafting
