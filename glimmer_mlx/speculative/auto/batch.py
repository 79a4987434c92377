"""`auto` inside a batch (`speculative.batch.BatchGenerator`): each step one draft width for every auto row — 0, a
plain step — and for each row the option it drafts with, chosen to maximise the batch's expected committed tokens
per second:

    rate(k) = Σ_rows E_r(k) / (T(n) + Σ_rows draft_r(k))

- E_r(k): the row's expected tokens per round with its best option at width ≤ k (`AcceptanceStats` of the option,
  learned across rows and requests, shared with the solo `auto` of the same process); a row whose option gives
  fewer drafts (n-gram lookup: only where its context's suffix occurred before) counts what it gives; a row in a
  fixed mode counts its own width's expectation; a plain row 1.
- T(n): seconds of one batched step feeding n = B·L positions (B rows, padded to the widest block L), measured
  (without the rows' drafting): every step's time updates an EMA per shape (B, L) — and per n, what a shape with no
  plain step measured yet is priced by; an n not measured yet is the solo calibration's forward cost C(n) (the
  cost curve `auto` measured for this machine and model, up to its widest verify, then toward the calibration's
  forward over 128 positions) times the measured/calibrated ratio of the steps seen.
  At a small batch verification is nearly free and drafting pays; as B·L grows the step becomes compute-bound, T
  grows with n, and plain steps win — then `auto` chooses them.
- draft_r(k): the option's measured seconds per round (`DraftCost`, calibrated units × the measured scale).

To speculate, the best width must beat plain by `ENTER_GAIN`. Outputs are lossless whatever is chosen (every
drafted row is verified by `verify`); the choice only changes speed.

As the solo chooser does (`chooser.AutoChooser.credit`), the batch keeps a ledger of what its speculative steps
measurably saved over plain steps of as many rows (the step's committed tokens × a plain step's time per row − its
wall time, the unpipelined plain step after it included): while it is below −`LOSS_BUDGET` × the batch's decoding
time (and below −`LEDGER_FLOOR` plain steps: early in a server's life 0.5 % of its decoding time is less than one
unlucky step), every step is plain, until plain steps have earned the budget back.
"""

from __future__ import annotations

from .chooser import (ENTER_GAIN, LEDGER_FLOOR, LEDGER_ROUND_CAP, LEDGER_ROUNDS, LOSS_BUDGET, AcceptanceStats,
                      wake_excess)
from .multiplex import AutoDrafter

EMA = 0.2  # weight of a new step time in its n's estimate


def ema(old: float | None, x: float) -> float:
    """`x` folded into the estimate `old` with weight `EMA` (None: no estimate yet, `x` itself)."""
    return x if old is None else (1 - EMA) * old + EMA * x


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
        # B rows -> {L positions per row -> EMA seconds of a step}: what a step of that shape costs. n = B·L alone
        # conflates shapes: on the embedded server a plain step of 8 rows took 19.8 ms and a 1-row verify of 8
        # positions ~9; priced by n, a server that had ever batched 8 requests priced a lone request's verify at the
        # 8-row step and never drafted for it again (DFlash rows alone ran 1.29x plain there, auto 0.91x)
        self.by_rows: dict[int, dict[int, float]] = {}
        self.ratio: float | None = None  # measured / calibrated step time, EMA over every step
        self.steps = {"plain": 0, "spec": 0}
        self.draft_factor: dict[str, float] = {}  # option -> measured / calibrated draft time, EMA
        # the ledger (`credit`): seconds of decoding and seconds speculation saved over plain steps (negative: lost),
        # both fading by 1 − 1/LEDGER_ROUNDS a step
        self.elapsed = 0.0
        self.saved = 0.0
        self.plain_step = 0.0  # seconds of a plain step of the batch, as the latest credit priced it (the floor's)

    def options(self, regime: str, batch: int = 1) -> dict:
        """A new auto row's own drafters: forks of the auto's (shared weights, empty state) — n-gram lookup always
        (it costs nothing to keep in step), a model drafter only if it could pay in a batch of `batch` rows by its
        mean estimate (`could_pay`): every drafter of a row follows each of its steps (the taps of every committed
        position, its own bookkeeping), and the batch's choice (`choose`) goes by the mean estimates, so one that
        pays only in its optimistic scenario would never draft and only slow the row down."""
        return {kind: d.fork() for kind, d in self.auto.drafters.items()
                if kind == "ngram" or self.could_pay(kind, regime, batch, optimistic=False)}

    def could_pay(self, name: str, regime: str, batch: int, optimistic: bool = True) -> bool:
        """Whether `name` beats plain decoding at some width in a batch of `batch` rows all drafting with it (the
        most favourable case: every row pays the widest block anyway), with its acceptance at the optimistic end of
        what is known (mean + 1.28 sd of the first draft's, every position moved alike) or, not `optimistic`, at
        its mean and by the margin `choose` wants to start speculating (`ENTER_GAIN`): a drafter a row carries for
        that (`options`, the batch's prune) is one the batch's choice could take — at 1.00–1.05x plain it never
        would, and the row would pay its taps and bookkeeping every step for nothing."""
        acc = self.acceptance(name, regime)
        lift = 1.28 * acc.spread() if optimistic else 0.0
        plain = (1.0 if optimistic else 1.0 + ENTER_GAIN) / self.step_cost(batch, rows=batch)
        alphas = acc.alphas()
        for k in range(1, self.chooser.options[name].max_k + 1):
            e, p = 1.0, 1.0
            for a in alphas[:k]:
                p *= min(1.0, a + lift)
                e += p
            if e / (self.step_cost(batch * (k + 1), rows=batch) + batch * self.draft_cost(name, k)) > plain:
                return True
        return False

    @property
    def taps(self) -> tuple:
        return self.auto.taps

    # -- the cost model ------------------------------------------------------------------------------------------
    def calibrated(self, n: int) -> float:
        """C(n): the calibration's forward cost over n positions, extended linearly past its longest block."""
        c = self.curve
        if n in c:
            return c[n]
        keys = list(c)
        if n < keys[0]:
            return c[keys[0]]
        lo = max(k for k in keys if k <= n)
        hi = min((k for k in keys if k > n), default=None)
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
        positions each), from the steps measured with as many rows (`by_rows`) once a plain one is among them."""
        m = self.measured
        if rows:
            shaped = self.by_rows.get(rows)
            if shaped and 1 in shaped:
                m = {rows * L: t for L, t in shaped.items()}
        floor = max((t for k, t in m.items() if k < n), default=0.0)  # more positions never cost less
        return max(floor, self._interpolated(n, m))

    def _interpolated(self, n: int, m: dict[int, float]) -> float:
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
        lower = [k for k in m if k < below]
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
        """A step over n positions (of `rows` rows, if told) took `seconds` (its drafting excluded)."""
        if seconds <= 0:
            return
        self.measured[n] = ema(self.measured.get(n), seconds)
        if rows:
            shaped = self.by_rows.setdefault(rows, {})
            shaped[n // rows] = ema(shaped.get(n // rows), seconds)
        self.ratio = ema(self.ratio, seconds / self.calibrated(n))
        self.steps["spec" if spec else "plain"] += 1

    def elapse(self, seconds: float) -> None:
        """A step took `seconds`: the decoding time the ledger's budget grows with."""
        fade = 1.0 - 1.0 / LEDGER_ROUNDS
        self.elapsed = fade * self.elapsed + max(0.0, seconds)
        self.saved *= fade

    def credit(self, seconds: float, plain_step: float) -> None:
        """Speculation saved `seconds` over plain steps (negative: lost): a speculative step's committed tokens at a
        plain step's time per row less its wall time, or the plain step after it less a pipelined one; a loss of at
        most `LEDGER_ROUND_CAP` plain steps (`plain_step` seconds each: a stall must not bar speculation for long)."""
        self.saved += max(seconds, -LEDGER_ROUND_CAP * plain_step)
        self.plain_step = plain_step

    @property
    def barred(self) -> bool:
        """Whether speculation lost more than `LOSS_BUDGET` of the decoding time and more than `LEDGER_FLOOR` plain
        steps (every step is plain until not)."""
        return self.saved + max(LOSS_BUDGET * self.elapsed, LEDGER_FLOOR * self.plain_step) < 0.0

    def charge(self, n: int, seconds: float, rows: int | None = None) -> None:
        """What a speculative step over n positions cost beyond its own time (the plain step after it, which could
        not be queued before the speculative step was read: its time over a pipelined plain step's), added to n's
        estimate (EMA-weighted)."""
        if n in self.measured and seconds > 0:
            self.measured[n] += EMA * seconds
        shaped = self.by_rows.get(rows) if rows else None
        if shaped is not None and n // rows in shaped and seconds > 0:
            shaped[n // rows] += EMA * seconds

    @staticmethod
    def settled(seconds: float, plain_step: float) -> float | None:
        """A pipelined plain step soon after a speculative one took `seconds` where a plain step costs `plain_step`:
        its excess while that speculative step's wake goes on, None once it is over (`chooser.wake_excess`;
        `BatchGenerator._observe`; the solo chooser's, per token: `multiplex.AutoDrafter.plain_token`)."""
        return wake_excess(seconds, plain_step)

    def charge_wake(self, n: int, wake: list, credited: bool, rows: int | None = None) -> None:
        """A speculative step over n positions left a wake that ended: each of its plain steps' excess
        ((rows, seconds, plain step seconds, excess) per step) is that step's cost (`charge`; the ledger's too where
        it was `credited`)."""
        for _, _, plain_step, extra in wake:
            self.charge(n, extra, rows)
            if credited:
                self.credit(-extra, plain_step)

    @property
    def settle_max(self) -> int:
        """The most plain steps a wake counts (the solo chooser's: `chooser.SETTLE_MAX`)."""
        return self.chooser.settle_max

    def draft_cost(self, name: str, k: int) -> float:
        """Seconds of one round of `name` at k drafts: its calibrated shape (`DraftCost`) times what its rounds in
        batches measure (EMA of measured / shape; before any, the solo chooser's machine scale)."""
        return self.draft_factor.get(name, self.chooser.scale) * self.chooser.options[name].cost(k)

    def observe_draft(self, name: str, k: int, seconds: float) -> None:
        shape = self.chooser.options[name].cost(k)
        if shape <= 0 or seconds <= 0:
            return
        f = seconds / shape
        self.draft_factor[name] = ema(self.draft_factor.get(name), f)

    def acceptance(self, name: str, regime: str) -> AcceptanceStats:
        return self.chooser.options[name].acceptance(regime)

    # -- the choice ----------------------------------------------------------------------------------------------
    def choose(self, rows, fixed_rows: int, fixed_width: int, fixed_tokens: float, k_max: int) -> tuple[int, list]:
        """rows: the auto rows, each as (regime, budget, {option: most drafts it gives now}); fixed_rows: the other
        rows, fixed_width: the widest block they feed (1: none wider than a token), fixed_tokens: their expected
        tokens this step. Returns (k, [(option or None, drafts) per auto row]) — k 0: every auto row steps plainly."""
        B = len(rows) + fixed_rows
        plain = [(None, 0)] * len(rows)
        tables: dict = {}  # (option, regime) -> expected tokens at 0..max_k drafts, this step's estimates

        def expected(name: str, regime: str, k: int) -> float:
            t = tables.get((name, regime))
            if t is None:
                t, p = [1.0], 1.0
                for a in self.acceptance(name, regime).alphas():
                    p *= a
                    t.append(t[-1] + p)
                tables[(name, regime)] = t
            return t[min(k, len(t) - 1)]

        best_k, best_plan = 0, plain
        if self.barred:
            return best_k, best_plan
        best = (len(rows) + fixed_tokens) / self.step_cost(B * fixed_width, rows=B)
        k_top = min(k_max, max((cap for _, _, avail in rows for cap in avail.values()), default=0))
        if k_top < 1:
            return best_k, best_plan
        # a bound first (exact: it never changes the answer): every row at its most expected tokens, the step at its
        # cheapest speculative width and no drafting cost; when even that cannot start speculating, the step is plain
        # without scoring each width (a plain batch asks every step: at 8 rows that scoring was ~3 % of a step here)
        most = fixed_tokens + sum(max([1.0] + [expected(name, regime, min(k_top, cap, budget - 1))
                                               for name, cap in avail.items() if min(k_top, cap, budget - 1) >= 1])
                                  for regime, budget, avail in rows)
        if most / self.step_cost(B * (fixed_width + 1), rows=B) <= best * (1 + ENTER_GAIN):
            return best_k, best_plan
        for k in range(1, k_top + 1):  # no width beyond what some row can draft
            plan, tokens, drafting, L = [], fixed_tokens, 0.0, fixed_width
            for regime, budget, avail in rows:
                pick, e_pick = (None, 0), 1.0
                for name, cap in avail.items():
                    kk = min(k, cap, budget - 1)
                    if kk < 1:
                        continue
                    e = expected(name, regime, kk)
                    if e > e_pick:
                        pick, e_pick = (name, kk), e
                plan.append(pick)
                tokens += e_pick
                if pick[0] is not None:
                    drafting += self.draft_cost(pick[0], pick[1])
                    L = max(L, pick[1] + 1)
            if L == fixed_width:
                continue  # no row drafts at this width: the same as plain
            rate = tokens / (self.step_cost(B * L, rows=B) + drafting)
            if rate > best * (1 + ENTER_GAIN if best_k == 0 else 1.0):
                best, best_k, best_plan = rate, k, plan
        return best_k, best_plan

    def update(self, name: str, regime: str, k: int, accepted: int) -> None:
        self.acceptance(name, regime).update(k, accepted)

    def stats(self) -> dict:
        return {"auto_steps": dict(self.steps), "ledger_saved_s": round(self.saved, 6),
                "ledger_elapsed_s": round(self.elapsed, 6), "barred": self.barred,
                "step_seconds": {int(n): round(s, 6) for n, s in sorted(self.measured.items())},
                "step_seconds_by_rows": {int(b): {int(L): round(s, 6) for L, s in sorted(t.items())}
                                         for b, t in sorted(self.by_rows.items())}}
