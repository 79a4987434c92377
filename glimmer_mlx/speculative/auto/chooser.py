"""`auto`'s cost model and choice: per round, which drafter proposes (DFlash, MTP, n-gram prompt lookup) and how
many drafts — or none, a plain step — to maximise expected committed tokens per second on *this* machine.

Rate of an option (drafter d, k drafts):  E_d(k) / s·(draft_d(k) + v·C(k+1) + o [+ w]),  plain: 1 / (s·P), where
- E_d(k) = 1 + Σ_{i≤k} Π_{j≤i} α_{d,j}: expected tokens per round, α_{d,j} the running (exponentially decayed)
  conditional acceptance of draft position j for drafter d, kept separately for greedy and sampling (`AcceptanceStats`:
  position 0 from a prior or the drafter's measured τ, a rarely reached position like the one before it);
- C(L): seconds of one target forward over L tokens and P: seconds per pipelined plain token, calibrated once per
  machine and model (`load_or_calibrate`, cached as JSON);
- s: how much slower the machine runs now than at calibration, measured by every plain token (context length,
  load); every other time is kept in calibrated units, so comparisons never mix speeds;
- v: what a verify round measurably costs over the bare calibrated forward (sampling, the acceptance test), per regime;
- draft_d(k): the drafter's own measured time per round, fixed + per-draft · k as measured when `auto` starts
  (DFlash drafts a whole block in one forward; MTP runs every depth each round, logits only for the drafted ones;
  n-gram lookup ~0), scaled by what its rounds measure (`DraftCost`);
- o: a speculative round's measured time outside its draft and verify windows; w, charged only to a round that would
  interrupt a plain stretch: what a speculative stretch measurably costs beyond its rounds (the plain tokens either
  side lose their pipelining), spread over the tokens the stretch can run; and for a drafter L positions behind
  (`lags`: it sat out plain rounds or another drafter's), its catch-up, spread alike: the forward that recomputes
  their taps where none were computed (C(L)) and what the drafter itself measurably spends per position of backlog
  (`Option.catch_up`, its own: one drafter's catch-ups never tax another's rounds).
To start a speculative stretch, a drafter must beat plain by `ENTER_GAIN` (5 %): every estimate is noisy and the best
looking option is the one most likely overestimated; to go on with one, by `MIN_GAIN` (leaving and re-entering costs
two switches). n-gram lookup is only an option in a round where the context's suffix
occurred before (its drafts are known in advance: `peek`), one option per matched n-gram size. Because plain is
always one of the options and every option is scored in the same time unit, `auto` decodes plainly whenever no
drafter pays, except for exploration rounds that the rest of the request can pay for (`AutoChooser.explore`: the
expected saving over the remaining tokens if the option's uncertain acceptance turns out better, against what the
round costs; an option whose optimistic acceptance cannot beat plain is never tried, nor one whose offers passed over
are scored: `Option.shadowed`). Inside a plain stretch a round
asks only the options that could change a plain choice (`AutoChooser.relevant`), so a stretch costs what plain
decoding costs.

The estimates can be wrong in ways no estimate shows (a cost the model does not have, a bias shared by every
measurement of an option), so what speculation did is also kept as a ledger, in the manner of a conservative bandit
(Wu, Shariff, Lattimore, Szepesvári, "Conservative Bandits", ICML 2016: keep the cumulative reward above (1 − α) of
the default action's): per option the seconds its rounds saved over plain decoding, measured (tokens × the plain
token's cost now − the round's wall time, the plain tokens that start and end its stretches included). While the
options that lost have together lost more than `LOSS_BUDGET` × the decoding time so far (plus `SURPLUS_SHARE` of
what the options in surplus saved), the largest losers among them are not chosen until what the rest lost fits
(an option never tried may be, once) and plain decoding has earned the budget back: auto then loses at most that
share against plain decoding on the options it still allows, plus what each barred one lost before it was barred,
whatever its estimates.

What a drafter accepts changes along a response, the same way request after request (an answer's opening tokens
are predicted worse, or better, than the rest of it), so the acceptance estimates and the ledger's entries are kept
per phase of the response as well (`PHASES`, `AutoChooser.set_phase`, told by the drafter that multiplexes the
options): a drafter that fails in every opening is barred there and still tried, and kept, after it.

`AutoChooser` is this decision logic, pure (unit-tested against synthetic cost/acceptance tables): it is told what
each round cost and accepted, and it never touches a model.
"""

from __future__ import annotations

import collections
import math
from collections import Counter
from dataclasses import dataclass, field

COST_SHAPES = ("affine", "block", "chain", "free")


def expected_tokens(alphas: list[float]) -> float:
    """Tokens one round commits on average whose drafts are accepted with conditional probabilities `alphas`."""
    e, p = 1.0, 1.0
    for a in alphas:
        p *= a
        e += p
    return e


class AcceptanceStats:
    """Decayed accepted/tried counts per draft position. Position 0 starts from the prior (1 of 2, i.e. α = 0.5,
    unless given); a deeper position j is shrunk toward position j−1's estimate with the prior's weight (decaying
    with the counts), not toward 0.5: a position rarely reached keeps what the earlier ones measured instead of
    leaning on an optimistic constant (n-gram drafts at T = 1 rarely get past the first). then: a prior (accepted,
    tried) for every deeper position as well, for drafters whose later drafts follow their first (an n-gram copy:
    once its first token is right, the rest mostly are); position 1 is then shrunk toward that prior, not toward
    position 0: what a copy does once it started right says nothing of how often it starts right, and pulling it
    toward the first draft's acceptance priced a copy that is rarely right but then runs to the end (n-gram lookup
    after a 1-gram on repetitive text: first draft accepted 1 time in 5, the next seven in 10 of 12 such rounds) as
    worth nothing."""

    def __init__(self, max_k: int, decay: float = 0.97, prior: tuple[float, float] = (1.0, 2.0),
                 then: tuple[float, float] | None = None):
        self.max_k, self.decay, self.prior = max_k, decay, prior
        deep = then or (0.0, 0.0)
        self.base = ([prior[0]] + [deep[0]] * (max_k - 1), [prior[1]] + [deep[1]] * (max_k - 1))  # prior counts
        self.acc, self.tried = list(self.base[0]), list(self.base[1])
        self.shrink = prior[1]  # weight of "like the position before" for positions >= 1
        self.then = None if not then or then[1] <= 0 else then[0] / then[1]  # position 1's anchor, if given
        self._prior_alphas = self._alphas(*self.base, prior[1])  # what the prior alone says (`prior_variance`)
        self._prior_var: dict[int, float] = {}  # k -> `prior_variance(k)` (the prior never changes)

    def __setattr__(self, name: str, value) -> None:
        # counts set from outside (`learned`, a saved state put back) make the kept estimates stale
        object.__setattr__(self, name, value)
        if name in ("acc", "tried", "shrink", "then"):
            object.__setattr__(self, "_kept", None)

    def alphas(self) -> list[float]:
        """The estimates, kept until the counts change (the chooser prices every option's rounds from them many
        times between two observations). The list is shared: read it, never change it."""
        if self._kept is None:
            self._kept = self._alphas(self.acc, self.tried, self.shrink)
        return self._kept

    def _alphas(self, acc: list[float], tried: list[float], shrink: float) -> list[float]:
        out = [acc[0] / tried[0] if tried[0] > 0 else 0.5]
        for j in range(1, self.max_k):
            w = tried[j] + shrink
            anchor = self.then if j == 1 and self.then is not None else out[-1]
            out.append((acc[j] + shrink * anchor) / w if w > 0 else anchor)
        return out

    def prior_variance(self, k: int) -> float:
        """The variance of the tokens one round of k drafts commits (1 + the drafts accepted) by the prior's
        acceptance alone: how much a round's outcome swings by chance for this drafter, whatever was measured."""
        got = self._prior_var.get(k)
        if got is not None:
            return got
        e = e2 = 0.0
        p = 1.0
        for j, a in enumerate([1.0] + self._prior_alphas[:k]):
            p *= a  # P(the round commits more than j tokens)
            e += p
            e2 += (2 * j + 1) * p
        out = self._prior_var[k] = max(0.0, e2 - e * e)
        return out

    def alpha(self, j: int) -> float:
        return self.alphas()[j]

    def set_alphas(self, alphas: list[float], weight: float = 1000.0) -> None:
        """Pin the estimates (synthetic tables, tests): α_j with the weight of `weight` observations."""
        for j in range(self.max_k):
            a = alphas[min(j, len(alphas) - 1)]
            self.acc[j], self.tried[j] = a * weight, weight
        self.shrink = 0.0  # (drops the kept estimates: `__setattr__`)

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.alphas()[:k])

    def update(self, k: int, n_accepted: int, expected: list[tuple[float, float]] | None = None) -> None:
        """A round of k drafts accepted n. expected: instead of what the round's coins decided, what they decide on
        average given its drafts (`verify.expected_acceptance`, at T > 0): per draft j the probability the round
        reaches it and that times the probability it is accepted there — a draft beyond the first rejection counts
        with the weight its earlier drafts give it. Unbiased for the same α's; on the trained tiny set at T = 1 a
        DFlash round's expected tokens swing 0.64 round to round where its committed ones swing 1.6."""
        if k <= 0:
            return
        for j in range(self.max_k):
            self.acc[j] *= self.decay
            self.tried[j] *= self.decay
        self.shrink *= self.decay  # (drops the kept estimates: `__setattr__`)
        if expected is not None:
            for j, (reach, accepted) in enumerate(expected[:min(k, self.max_k)]):
                self.tried[j] += reach
                self.acc[j] += accepted
            return
        for j in range(min(n_accepted + 1, k, self.max_k)):  # positions up to the first rejection were tried
            self.tried[j] += 1
            if j < n_accepted:
                self.acc[j] += 1

    def age(self, factor: float) -> bool:
        """Evidence fades while the option sits idle (the context it was measured in may be gone): every count moves
        toward the prior's by `factor`, so the estimate's uncertainty grows back and exploring it can pay again.
        Whether any moved (counts still at the prior's — an option never observed in this regime — do not)."""
        if self.acc == self.base[0] and self.tried == self.base[1] and self.shrink == self.prior[1]:
            return False
        for j in range(self.max_k):
            self.acc[j] = self.base[0][j] + (self.acc[j] - self.base[0][j]) * factor
            self.tried[j] = self.base[1][j] + (self.tried[j] - self.base[1][j]) * factor
        self.shrink = self.prior[1] + (self.shrink - self.prior[1]) * factor  # (drops the kept estimates)
        return True

    def spread(self) -> float:
        """Standard deviation of the first draft's acceptance under its posterior (the Beta of its decayed counts,
        normal approximation); every position moves with it in the scenarios `AutoChooser` explores over."""
        n = max(self.tried[0], 0.0)
        m = (self.acc[0] + 0.5) / (n + 1.0)
        return math.sqrt(m * (1.0 - m) / (n + 2.0))


# five equally likely values of a normal variable (the midpoints of its quintiles, in standard deviations): the
# scenarios an option's uncertain acceptance is explored over
SCENARIOS = (-1.28, -0.52, 0.0, 0.52, 1.28)
_MEAN_SCENARIO = SCENARIOS.index(0.0)  # the mean estimates' own scenario
# a scenario counts as a saving only if it beats the incumbent by this much: nothing is explored for a gain that
# unmeasured per-round overheads would eat
MIN_GAIN = 0.01
# a speculative stretch is expected to run for the rest of the request, up to this many tokens: the cost of switching
# into it (`AutoChooser.switch_cost`) is spread over them (over a whole round when fewer remain)
SWITCH_HORIZON = 64
# a model drafter's catch-up (`AutoChooser.catch_up_cost`) is spread over the tokens its rounds commit before it has
# to catch up again — its tenure (`Option.tenure`: the tokens of its rounds over its catch-ups, with one prior tenure
# of SWITCH_HORIZON tokens; every count fading by TENURE_DECAY a catch-up) — where that is shorter than the horizon. On
# the trained tiny set MTP's rounds came in the opening of every response, 1-5 a request, before n-gram lookup took
# over for the rest of it: each request's first MTP round caught up on the whole prompt (129-546 positions, 3-20 ms),
# priced over 64 tokens where it served 2-10, and auto ran 0.91-0.98x n-gram lookup alone (without MTP 0.97-1.00x)
TENURE_DECAY = 0.9
# starting a speculative stretch, a drafter must beat plain by this much (going on with one, by MIN_GAIN)
ENTER_GAIN = 0.05
# what is learned now also serves the requests after this one (a session, a server, a benchmark keep one chooser): an
# exploration round's value counts the request's remaining tokens plus as many as this chooser has decoded so far, at
# most this many (a fresh process's first request counts only its own)
FUTURE_TOKENS = 128
# what every option's score shares (the verify factors, the round overhead) moves a little every round: the memoised
# tables are scored again when it has moved by more than this share (of itself; the overhead, of a plain step) since
# they were (`AutoChooser._rescore`) — a round's cost moves by less. Rescored every 8 changes instead, as before, each
# spectator option (a model drafter while n-gram lookup drafts) was scored afresh every ~4 rounds
SHARED_DRIFT = 0.03
# ... and the sets of options that could pay or pay (`could_pay`, `paying`: one option's new estimate may change
# them) every this many changes
RESCORE_EVERY = 8
# a speculative round's overhead sample counts at most this many times the current estimate (`observe_round_overhead`)
OVERHEAD_CLIP = 3.0
# the speed scale is the median of this many latest pipelined plain tokens (`AutoChooser.observe_plain`): the timing
# noise of a shared machine is heavy-tailed (the same round took 2.5–12 ms within one sitting here), and plain
# tokens are rare once speculation pays, so an EMA of them sat wherever the last spikes left it (2.96–3.9 while their
# median said 2.3), pricing every drafter against a plain token that much dearer than it was
SCALE_WINDOW = 9
# ... or of this many if lower: a scale follows a faster machine within half the short window, a slower one only
# within half the long one (a slow moment of 5 of 9 tokens must not set the scale a stretch then runs on, pricing no
# plain token, for up to `STALE_ROUNDS` rounds; too low a scale only makes speculating wait). The batch's plain step
# is priced the same way (`auto.batch.BatchAuto.observe`)
PRICE_WINDOW = 4 * SCALE_WINDOW
# ... and it is kept honest: after this many rounds without a plain token (a speculative stretch that runs on), the
# next rounds are plain until CHECK_SAMPLES fresh plain tokens are measured, and only those make the scale
# (`check_due`).
# A stretch priced on a scale frozen in a slow moment (the machine measured slower than it is now) sees its rounds
# as cheap and its ledger in surplus, and nothing in it would ever sample plain decoding again: on the embedded model
# such a stretch of DFlash rounds ran for ~1 500 rounds at 0.81x plain
STALE_ROUNDS = 256
# a model drafter is kept in step on the taps of other options' rounds while it was chosen by its estimates in this
# phase of the response within this many rounds (`AutoChooser.drafted_lately`): one in use drafts every few rounds;
# on the trained tiny set DFlash, chosen once in a sitting after a response's opening, was carried through every
# n-gram round there for the 256 rounds after it (an n-gram round 5-7 % longer with the taps)
CARRY_ROUNDS = 64
CHECK_SAMPLES = 2
# ... and a scale auto starts with from a plain token checked when it was built (over a cached calibration's:
# `calibrate.check_plain_token`) is checked the same way after this many rounds if none of them measured a plain
# token (`AutoChooser.first_check_rounds`): a stretch that starts at once measures none (the plain round between two
# stretches is the unpipelined first after one). On the trained tiny set at T = 1 a process whose check read 1.95
# (the machine ran at ~1.35) drafted DFlash on that scale through its first six requests, four of them at
# 0.77-0.86x plain decoding, until a plain token measured it; its ledger then barred DFlash in the phase where it
# pays for the rest of the sitting
FIRST_CHECK_ROUNDS = 16
# what a speculative stretch leaves behind (`multiplex.AutoDrafter.plain_token`): after it, pipelined plain tokens
# slower than the scale's price by more than SETTLE_SLACK of it are its wake. A wake that ends — a token at the price
# comes, or the next stretch starts — within SETTLE_MAX tokens was the stretch's doing: its excess is the stretch's
# cost (`switch_cost`, its option's ledger) and its tokens stay out of the speed scale. One that does not end so soon
# is the machine's (it slowed down: another process, a throttle): its tokens measure the scale and nothing is charged.
# On a 2-core VM OpenBLAS's idle worker spun ~0.1 s after a verify's multi-row GEMM and the plain tokens of that time
# ran up to twice as slow (3.0-4.0 ms against 1.7-1.9): charged to the first plain token only, the switch looked
# cheap, and the slow tokens raised the scale every speculative round is priced against. Each token's excess counts
# at most SETTLE_TOKEN_CAP plain tokens (a stall is not the stretch's doing).
SETTLE_SLACK = 0.25
SETTLE_MAX = 32
SETTLE_TOKEN_CAP = 2.0

# the promise kept by measurement, whatever the estimates say (`AutoChooser.credit`): speculation may lose at most this
# share of the decoding time against plain decoding, over a window of about LEDGER_ROUNDS rounds (older rounds fade).
# Where nothing pays, auto spends the whole budget on rounds that lose, again each time plain decoding has earned it
# back: at 2 % the embedded model's long A/B sat at 0.93-0.95x plain (the goal is 0.98), at 0.5 % 0.96-0.985x in the
# same sittings, with the trained tiny set's paying options unharmed (their surplus pays for what exploring costs)
LOSS_BUDGET = 0.005
LEDGER_ROUNDS = 1024
# ... plus this share of what the options in surplus measurably saved (what speculation earned may pay for trying
# the others: on a set where n-gram lookup doubles the speed, a drafter explored for a few rounds is affordable).
# Small: against an option that runs g times plain decoding's speed, losers may cost auto share × (g − 1) of its time
# (at 0.25 an MTP that its estimates kept choosing between n-gram rounds on the trained tiny set lost 0.45 s of a 1.5 s
# sitting, auto 0.85x n-gram lookup alone); at 0.01 (g = 3.4-3.8 there) DFlash's and MTP's few explorations, each
# with its catch-up over the whole context, cost auto 2.0-3.5 % of its time (auto over n-gram lookup alone: 0.2-0.3 %),
# which is most of what kept it from 0.97x n-gram lookup alone; at 0.0025 1.0-1.2 %
SURPLUS_SHARE = 0.0025
# ... and one round (or one stretch's plain tokens) is charged at most this many plain tokens' time: a stall of the
# machine (another process, a first-call build) during a speculative round must not bar speculation for minutes
LEDGER_ROUND_CAP = 16
# ... and together they may always lose this many plain tokens' time: early in a process 0.5 % of the short decoding
# time so far is less than one losing round, so the first round a paying drafter lost (its catch-up, an unlucky
# acceptance) barred it for hundreds of rounds. Later the budget is the larger (the decoding time fades with the
# ledger: 0.5 % of ~1024 rounds is ~5 plain tokens), so the floor does not raise the share auto may lose.
# `benchmarks/simulate_auto.py` (64 seeds of ten 96-token requests): a drafter paying 1.66x, auto 1.40x without the
# floor (1.51x at the former 2 % budget), 1.63x with it; one paying 1.17x: 1.05x / 1.08x / 1.09x; one losing 19 %:
# 0.993x / 0.984x / 0.992x plain
LEDGER_FLOOR = 4
# ... and more than this many standard deviations of what their rounds' savings sum to by chance: "slower than plain
# by more than noise", tested. A round's share of that variance is the variance of the tokens it commits by its
# drafter's prior acceptance (`AcceptanceStats.prior_variance`, × a plain token squared; faded as the ledger is): a
# DFlash round swings by about one and a half tokens either way by chance alone, and four rounds that all happened to
# be rejected show no spread among themselves. (Not the measured savings' own spread: one round's loss, however
# large, would then never exceed its own deviation.) With the floor alone a drafter paying 35 % was barred after its
# first four or five unlucky rounds in 5 of `benchmarks/simulate_auto.py`'s 24 seeds (fifteen 32-token requests),
# for the rest of the process (auto 0.72-0.86x the drafter alone there); one that loses on every round is still
# barred within a few of them. At 2 deviations a drafter losing 27 % kept auto at 0.982x plain (0.990 with the floor
# alone), at 1.5 0.984x, with the paying one at 1.117x (1.100)
LEDGER_Z = 1.5


# offers scored without a round (`observe_offer`) between two refreshes of the memo
SHADOW_BATCH = 16

# a choice that keeps coming out plain is asked only every QUIET_EVERY rounds (a batch's steps: `batch.BatchAuto.asks`;
# a lone request's rounds inside a plain stretch: `multiplex.AutoDrafter.plan`): while fewer than QUIET_RATE of its
# asks (an EMA over asks, weight QUIET_EMA, from 1) found a speculative round worth taking, and not right after one
# that did. Asking is the n-gram offers (the index brought up to the latest token and looked up, the offers passed
# over scored), the phases and measures, the bounds and widths scored: at 8 rows of the embedded model ~150 µs of an
# ~11 ms step here, for a step that speculated in 1 of ~400 (auto rows ran ~3.5 % behind plain rows at 1-8 rows in
# three sittings; at 8 rows, asked nothing, ~1-2 %; `benchmarks/batch_rows_ab.py`); in a lone greedy request ~20-30
# µs of a ~3.4 ms plain token, where n-gram lookup took 1 round in ~150 (the embedded model on a 2-core CPU, where the
# host's work is not hidden behind the forward as it is behind a GPU's; asking every 4th round: +0.9 ± 0.6 % over 14
# sittings of `benchmarks/auto_vs_plain_ab.py 0 12 32 ar,ar2,auto,noquiet`, +2.9 ± 0.6 % over 5 at T = 1). An
# opportunity (a copy n-gram lookup can follow) waits at most QUIET_EVERY − 1 rounds; one that pays is asked about
# every round again
QUIET_RATE = 0.05
QUIET_EVERY = 4
QUIET_EMA = 1 / 32


class QuietAsks:
    """`QUIET_RATE`'s rule for one decider (a batch's choice, `batch.BatchAuto`; a lone request's plain stretch,
    `multiplex.AutoDrafter`): whether a round asks, and what each asked round answered. most: the most rounds
    between two asks — quiet, the gap starts at `QUIET_EVERY` and doubles with every plain answer up to it, and
    goes back to QUIET_EVERY with a speculative one."""

    def __init__(self, most: int = QUIET_EVERY):
        self.hits = 1.0  # the share of the latest answers that found a speculative round, EMA (from 1)
        self.since = 0  # rounds since the latest ask, while quiet
        self.unasked = 0  # rounds not asked
        self.most = max(QUIET_EVERY, most)
        self.every = QUIET_EVERY  # rounds between two asks while quiet

    def asks(self, must: bool = False) -> bool:
        """Whether this round asks: always where `must` (right after a speculative round; a plain verdict no longer
        standing) or while at least QUIET_RATE of the latest answers found a speculative round; else every
        `every`th round."""
        if must or self.hits >= QUIET_RATE or self.since + 1 >= self.every:
            self.since = 0
            return True
        self.since += 1
        self.unasked += 1
        return False

    def answered(self, hit: bool) -> None:
        """An asked round's answer; hit: it found a speculative round worth taking."""
        self.hits += QUIET_EMA * (float(hit) - self.hits)
        if hit:
            self.every = QUIET_EVERY
        elif self.hits < QUIET_RATE:
            self.every = min(self.most, 2 * self.every)


# a response's phases, by the tokens it has generated: [0, 16), [16, 64), 64 on. A drafter's acceptance is not the
# same throughout a response, and it moves the same way request after request; each phase keeps its own estimates and
# ledger entries (`AutoChooser.set_phase`). Measured (fixed modes drafting every round, 96 tokens, accepted drafts
# per round in each phase): on the trained tiny set at T = 0, DFlash 0.41 / 3.63 / 3.48 and n-gram lookup
# 0.90 / 7.79 / 7.17 — every answer opens with tokens no drafter predicts, then settles into what they copy; on the
# embedded model the other way, DFlash 2.34 / 1.76 / 0.95 and MTP 0.70 / 0.64 / 0.58. Pooled, a fresh auto on the
# tiny set tried DFlash in the first rounds of a request, saw it fail, and its ledger barred it for the rest of the
# run (1.0x plain where DFlash alone ran 1.7-1.9x); on the embedded model a drafter that pays in the opening only is
# averaged away by the rest
PHASES = (16, 64)


_KEYS: dict[tuple[str, int], str] = {}  # (regime, phase) -> its estimates' key (`AutoChooser._key`)


def phase_of(generated: int, bounds=PHASES) -> int:
    """The phase of a response that has generated `generated` tokens: how many of the phases' `bounds` it reached."""
    return sum(generated >= b for b in bounds)


PRIOR_WEIGHT = 4.0  # a drafter's own measured τ (its eval.json) counts as this many observed rounds

# a model drafter's (DFlash, MTP: `multiplex.AutoDrafter`) acceptance counts fade by this with each round of its own
# (`AcceptanceStats.decay`; n-gram options, scored at every offer of the context at hand, by the default 0.97): its
# rounds come from explorations spread over many requests, and at 0.97 its evidence never exceeded ~33 rounds, so
# its optimistic scenario kept beating plain decoding and auto explored it again and again (a request's own
# acceptance is ρ's business, an idle option's fade `AutoChooser.age`'s). `benchmarks/simulate_auto.py` (--decay),
# × plain at 0.97 → 0.99: a drafter paying 15 %, 60 requests of 32 tokens 1.074 → 1.095 (explorations 69 → 40 a
# run), 10 of 96 1.126 → 1.133 (43 → 24), with requests differing ±30 % 1.174 → 1.206; a losing one 0.988-0.995
# either way (fewer explorations)
MODEL_DECAY = 0.99

# what a model drafter accepts differs from request to request far more than its estimates, carried across requests,
# can follow (the embedded model's DFlash drafter takes 0.75x plain decoding's time on its code, JSON and maths
# prompts, 1.15-1.2x on its chat and quoting ones; a request's few rounds barely move estimates that a session's
# hundreds of rounds made): a round is priced with its option's estimates scaled by how this request's rounds did
# against them, ρ = (drafts accepted + HERE_WEIGHT) / (drafts the estimates expected accepted + HERE_WEIGHT) over the
# drafts they tried (`Option.here`, afresh with each request: `AutoChooser.new_context`). n-gram options learn from
# every offer (`Option.shadowed`): their estimates follow the request by themselves. `benchmarks/simulate_auto.py`
# (ten 96-token requests, a drafter paying 18 %, 32 seeds): where every request accepts alike, auto 1.115x plain
# without it, 1.084 / 1.098 / 1.104 at a weight of 8 / 16 / 32; where half the requests accept 30 % more and half
# 30 % less (`--spread 0.3`), 1.166 without, 1.241 / 1.222 / 1.215
HERE_WEIGHT = 16.0
# ... and that weight is measured, per option and regime (`Option.here_weight`): a Bayesian ρ weighs its prior
# by q / σ², σ² the variance of a request's acceptance ratio between requests and q the sampling variance per
# expected draft (Σ α(1 − α) / Σ α, ~1 − α). σ² is what a request's two interleaved halves share — the mean over
# finished requests of (accepted / expected − 1) of its odd rounds times the same of its even rounds, each weighed by
# its share of what it measured (`Option.close_here`): chance moves the halves apart, only what the request carries
# throughout moves them together. (Measured as the request's whole ratio squared less its sampling part, as before
# the fiftieth session, σ² was biased up by auto itself: a request whose opening rounds accepted little went plain
# and ended its measure there, its ratio kept at a low swing. Simulated — α as estimated, each request stopped once
# its own ρ falls below 0.95 — the former measure settled at W 31-36 (256 with no request stopped), this one at
# 93-206; on the trained tiny set at T = 1 a request's first half of DFlash rounds predicted nothing of its second,
# correlation −0.003 over 140 requests.)
# Where requests accept alike σ² falls and ρ stays near 1; where they differ (prompts a drafter copies well against
# ones it does not) ρ follows the request within a round or two. (`benchmarks/here_weight_replay.py`: on the
# embedded model's 20 shipped prompts DFlash's requests differ little beyond chance, W stays 16-32.) From
# HERE_WEIGHT (as q / σ² of HERE_PRIOR_REQUESTS requests) within [HERE_WEIGHT_MIN, HERE_WEIGHT_MAX]; the latest
# HERE_REQUESTS requests' worth count
HERE_PRIOR_REQUESTS = 4.0
HERE_REQUESTS = 32.0
HERE_WEIGHT_MIN, HERE_WEIGHT_MAX = 2.0, 256.0
HERE_Q = 0.4


def prior_between(weight: float = HERE_WEIGHT) -> tuple[float, float, float]:
    """(requests counted, σ², q) that an option's measure of how far requests differ starts from (`Option.between`):
    ρ's weight `weight`, counted as HERE_PRIOR_REQUESTS requests."""
    return HERE_PRIOR_REQUESTS, HERE_Q / weight, HERE_Q


def scaled_alphas(alphas: list[float], rho: float | None) -> list[float]:
    """Acceptance estimates as a request's rounds measure them (`Option.rho`, None: not measured): each × ρ, at most
    0.99 where that raises it."""
    return alphas if rho is None else [min(x * rho, max(x, 0.99)) for x in alphas]


def alpha_from_tau(tau: float, width: int) -> float:
    """The per-position acceptance α with 1 + α + … + α^width = τ (τ measured at `width` drafts per round)."""
    tau = min(max(float(tau), 1.0), width + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(width + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def wake_excess(seconds: float, price: float) -> float | None:
    """A plain token (or a batch's plain step) soon after a speculative stretch took `seconds` where one costs
    `price`: None if it runs at the price (within SETTLE_SLACK: the wake is over), else its excess in seconds (at most
    SETTLE_TOKEN_CAP prices)."""
    extra = seconds - price
    if extra <= SETTLE_SLACK * price:
        return None
    return min(extra, SETTLE_TOKEN_CAP * price)


def lag_bucket(n: int) -> int:
    """n positions rounded up to one of 8 steps per power of two (at most 1/8 above; exact up to 16): how a
    drafter's backlog is priced (`AutoChooser.catch_up_cost`). Rounded up to a power of two, as before, a prompt of
    554 positions that the drafter had yet to start on was priced as 1 024 of them: on the trained tiny set the
    rounds after a response's opening were then priced out for the longest prompts."""
    if n <= 16:
        return n
    s = (n - 1).bit_length() - 4
    return (((n - 1) >> s) + 1) << s


def tenure_bucket(tokens: float) -> int:
    """A tenure (`AutoChooser.tenure`) in whole tokens within [1, SWITCH_HORIZON], rounded as a backlog is
    (`lag_bucket`): what its rates are priced by."""
    return min(SWITCH_HORIZON, lag_bucket(max(1, int(tokens))))


def _median(xs: list[float]) -> float:
    """statistics.median of a short list, without its overhead (it runs after every plain token)."""
    xs.sort()
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def plain_price(xs: list[float], recent: int = SCALE_WINDOW) -> float:
    """The lower of the median of the latest `recent` of `xs` (oldest first) and the median of them all
    (`PRICE_WINDOW`'s rule: the solo speed scale, the batch's plain step)."""
    return min(_median(xs[-recent:]), _median(list(xs)))


def robust_ema(old: float | None, x: float, w: float, clip: float = 3.0) -> float:
    """EMA step with the new sample clipped to [old/clip, old·clip]: a timing spike (another process taking the
    CPU/GPU for a moment) moves the estimate by at most a factor (1 + w·(clip − 1)), while a lasting change still
    comes through within a few rounds."""
    if old is None or old <= 0:
        return x
    return (1 - w) * old + w * min(max(x, old / clip), old * clip)


class DraftCost:
    """A drafter's measured seconds per round as a function of k: fixed + per_draft · k, times one learned factor.

    The shape comes from the drafter itself, measured when `auto` starts (`calibrate.measure_draft_costs` times a
    round at one draft and at the most: "affine", prior = (fixed, per_draft)); every round's sample then moves one
    factor on it (an EMA), whatever its k, so the shape never follows one width's jitter. Shorthands for synthetic
    tables: "block" (one forward whatever k: prior = seconds per round), "chain" (prior = seconds per draft).
    "free" (n-gram lookup, ~0): no shape, the EMA of the seconds per round itself. MTP was once priced as a chain
    (its cost ∝ k): but every depth's layer runs every round (each keeps its cache in step), only the logits of the
    drafted depths depend on k — the chooser took its one-draft rounds for half what they cost."""

    def __init__(self, shape: str, prior, ema: float = 0.2):
        if shape not in COST_SHAPES:
            raise ValueError(f"cost shape must be one of {COST_SHAPES}, got {shape!r}")
        if shape == "affine":
            fixed, per_draft = (float(x) for x in prior)
        else:
            fixed, per_draft = {"block": (prior, 0.0), "chain": (0.0, prior), "free": (0.0, 0.0)}[shape]
        self.shape, self.ema = shape, ema
        self.fixed, self.per_draft = max(0.0, float(fixed)), max(0.0, float(per_draft))
        self.prior = float(prior) if shape == "free" else 0.0  # the additive estimate's start ("free")
        self.unit: float | None = None  # learned: the factor on the shape, or seconds per round ("free"); None: prior

    def _shaped(self) -> bool:
        return self.fixed + self.per_draft > 0

    def __call__(self, k: int) -> float:
        if not self._shaped():
            return self.prior if self.unit is None else self.unit
        return (1.0 if self.unit is None else self.unit) * (self.fixed + self.per_draft * k)

    def observe(self, k: int, seconds: float) -> None:
        """EMA starting from the current estimate (the prior at first): one slow first sample (another process took
        the machine) cannot lock an option out, a truly costly drafter is learned within a few rounds."""
        if not self._shaped():
            old = self.prior if self.unit is None else self.unit
            self.unit = robust_ema(old if old > 0 else None, seconds, self.ema)
        else:
            self.unit = robust_ema(1.0 if self.unit is None else self.unit,
                                   seconds / (self.fixed + self.per_draft * k), self.ema)


@dataclass
class Option:
    name: str
    max_k: int
    cost: DraftCost  # a round's draft at greedy (`draft`)
    stats: dict = field(default_factory=dict)  # "greedy" | "sampling" -> AcceptanceStats
    decay: float = 0.97
    prior_alpha: dict = field(default_factory=dict)  # regime -> α from the drafter's measured τ (else 0.5)
    then_alpha: dict = field(default_factory=dict)  # regime -> α of the drafts after an accepted one (else shrunk)
    touched: dict = field(default_factory=dict)  # regime -> the chooser's round of its latest observation
    # calibrated seconds per target position of backlog a round of it processes beyond a steady round's (`steady`):
    # a drafter that sat out rounds of another one catches up on their tokens while it drafts (EMA, from what
    # `calibrate.measure_catch_up` timed when auto started)
    catch_up: float = 0.0
    # ... and calibrated seconds per position² of the context its backlog attends over: a backlog of L positions
    # ending at position P costs catch_up · L + catch_quad · (P² − (P − L)²) (an MTP layer's forward over it
    # attends over every position before; `calibrate.measure_catch_up`)
    catch_quad: float = 0.0
    # only available in some rounds (n-gram lookup: where the context's suffix occurred before): a stretch of it
    # lasts as long as its matches do, and `stretch` measures that; a drafter that can always draft (DFlash, MTP) can
    # run to the horizon (its stretches end when the chooser leaves them: their length says nothing of the next)
    sporadic: bool = False
    # regime -> tokens a speculative stretch it started has committed, EMA (absent: none seen yet, the horizon)
    stretch: dict = field(default_factory=dict)
    # regime -> [tokens its rounds committed, catch-ups its rounds ran], each fading by TENURE_DECAY a catch-up:
    # how many tokens it serves per catch-up (`AutoChooser.tenure`; absent: none seen yet, the horizon)
    tenure: dict = field(default_factory=dict)
    # regime -> its verify rounds' measured time over the calibrated forward, EMA (absent: the chooser's shared one):
    # what a verify does beyond the forward depends on the drafter (n-gram's one-hot q at T > 0, taps or none)
    verify_factor: dict = field(default_factory=dict)
    # a token-tree option: every round verifies this many rows (the root and up to rows − 1 draft nodes, paths at
    # most k deep) whatever its depth k; None: a chain, k + 1 rows
    rows: int | None = None
    # its offers that no round took are scored (`AutoChooser.observe_offer`; n-gram lookup, whose drafts are known
    # before the round): a plain round learns what a round of it would, so it is never explored — a round drafted
    # only to learn it would pay for what passing it over learns for free — and is chosen where its estimate pays
    shadowed: bool = False
    # regime -> [drafts accepted, drafts its estimates expected accepted, their variance Σ α(1 − α)] in this
    # request's rounds (`HERE_WEIGHT`)
    here: dict = field(default_factory=dict)
    # a round's draft at T > 0, where it was measured apart (None: as at greedy): sampled drafts and their
    # distributions cost more than greedy ones (the embedded DFlash 2's 7-draft round ~2 ms more, half a plain token)
    sampling_cost: DraftCost | None = None
    # regime -> (requests counted, σ², q): how a request's acceptance varies around the estimates (`here_weight`)
    between: dict = field(default_factory=dict)
    # key ("greedy#1": regime and phase) -> the chooser's round of its latest round chosen by its estimates (not to
    # explore it): `AutoChooser.drafted_lately`
    picked: dict = field(default_factory=dict)
    # key -> (its estimates' list, ρ, those scaled by ρ): `alphas`
    _scaled: dict = field(default_factory=dict, repr=False, compare=False)

    def draft(self, regime: str) -> DraftCost:
        """What a round's draft costs in `regime` ("greedy" | "sampling"): each learns from its own rounds."""
        return self.sampling_cost if regime == "sampling" and self.sampling_cost is not None else self.cost

    def alphas(self, key: str) -> list[float]:
        """The acceptance estimates of `key` (`acceptance`) as this request's rounds measure them (`here`): each
        scaled by ρ (`scaled_alphas`); kept while the estimates and ρ are what they were (shared: read only)."""
        base, rho = self.acceptance(key).alphas(), self.rho(key.split("#", 1)[0])
        kept = self._scaled.get(key)
        if kept is None or kept[0] is not base or kept[1] != rho:
            kept = self._scaled[key] = (base, rho, scaled_alphas(base, rho))
        return kept[2]

    def rho(self, regime: str, here: dict | None = None) -> float | None:
        """How this request's rounds of `regime` did against its estimates (`HERE_WEIGHT`; None: no round yet);
        here: a batch row's measure instead of the option's own."""
        h = (self.here if here is None else here).get(regime)
        if h is None:
            return None
        w = self.here_weight(regime)
        return (h[0] + w) / (h[1] + w)

    def note_here(self, key: str, k: int, n_accepted: int, here: dict | None = None) -> None:
        """A round of k drafts, n accepted, in this request (before its estimates of `key` learn from it); here: a
        batch row's measure (`rho`) instead of the option's own."""
        # [accepted, expected, their sampling variance; accepted and expected of the odd rounds; rounds]
        h = (self.here if here is None else here).setdefault(key.split("#", 1)[0], [0.0] * 6)
        alphas = self.acceptance(key).alphas()
        tried = min(n_accepted + 1, k, self.max_k)
        accepted, expected = min(n_accepted, tried), sum(alphas[:tried])
        h[0] += accepted
        h[1] += expected
        h[2] += sum(a * (1.0 - a) for a in alphas[:tried])
        if h[5] % 2 == 0:  # one of the request's two interleaved halves (`close_here`)
            h[3] += accepted
            h[4] += expected
        h[5] += 1

    def _between(self, regime: str) -> tuple[float, float, float]:
        return self.between.get(regime) or prior_between()

    def here_weight(self, regime: str) -> float:
        """ρ's weight in `regime`: q / σ² (`HERE_WEIGHT`), the expected drafts a request's rounds must have tried to
        weigh as much as the estimates."""
        _, s2, q = self._between(regime)
        return min(max(q / s2, HERE_WEIGHT_MIN), HERE_WEIGHT_MAX) if s2 > 0.0 else HERE_WEIGHT_MAX

    def close_here(self, here: dict | None = None) -> None:
        """A request ended: what its rounds measured (`here`; a batch row's measure where given) joins the spread
        between requests (`here_weight`: what its odd and even rounds' ratios share), weighed by the share of its
        ratio that was not its prior's; the option's own measure starts afresh."""
        for regime, h in (self.here if here is None else here).items():
            odd, even = h[4], h[1] - h[4]
            if odd <= 0.0 or even <= 0.0:  # (a request of one round tells nothing of how far requests differ)
                continue
            # weighed as its halves' expected drafts multiply while few (the share of each half's ratio that was
            # not its prior's, multiplied): the product of their surpluses has mean 0 by chance however early a
            # request ended — its ratios' product, or its whole ratio squared, weighed as its drafts add up, had
            # not: a request that ended early ended on a low run, both halves in it
            half = 0.5 * self.here_weight(regime)
            u = odd * even / ((odd + half) * (even + half))
            n, s2, q = self._between(regime)
            n = min(n + u, HERE_REQUESTS)
            s2 += u * ((h[3] - odd) * (h[0] - h[3] - even) / (odd * even) - s2) / n
            q += u * (h[2] / h[1] - q) / n
            self.between[regime] = (n, s2, q)
        if here is None:
            self.here = {}

    def verify_rows(self, k: int) -> int:
        """Rows one round at k drafts (a tree: k deep) feeds the target's verify forward."""
        return k + 1 if self.rows is None else max(k + 1, self.rows)

    @property
    def steady(self) -> int:
        """The backlog a round in a run of its own rounds has: the previous round's tokens (anchor + drafts)."""
        return self.max_k + 1

    def acceptance(self, regime: str) -> AcceptanceStats:
        """The acceptance estimates of `regime` — "greedy" or "sampling", or one of them with a phase of the response
        ("greedy#0": `AutoChooser.set_phase`); every phase starts from its own prior where the drafter's τ was
        measured per phase (`AutoChooser.add`), else from the regime's."""
        if regime not in self.stats:
            base = regime.split("#", 1)[0]
            a, t = self.prior_alpha.get(regime, self.prior_alpha.get(base)), self.then_alpha.get(base)
            prior = (1.0, 2.0) if a is None else (a * PRIOR_WEIGHT, PRIOR_WEIGHT)
            then = None if t is None else (t * PRIOR_WEIGHT / 2, PRIOR_WEIGHT / 2)
            self.stats[regime] = AcceptanceStats(self.max_k, self.decay, prior=prior, then=then)
        return self.stats[regime]


class AutoChooser:
    """Per round: the (option, k) with the highest expected tokens per second, or (None, 0) for a plain step —
    or, when the rest of the request can pay for it, a round that explores an option whose acceptance is uncertain.

    verify_costs: {L: seconds of a target forward over L tokens} for L = 1..max_k+1 (the calibrated curve);
    plain_cost: calibrated seconds per pipelined plain token (default: the single forward, verify_costs[1]);
    scale: the machine's speed when the chooser starts, a plain token timed now over plain_cost (`scale` below;
    default 1: as at calibration).

    Every time is kept in calibrated units: one running `scale` (how much slower the machine runs now than at
    calibration: the median of the latest `SCALE_WINDOW` pipelined plain tokens over the calibrated one) converts
    each measurement when it comes in. A slowdown seen while
    decoding plainly (another process, a longer context) then raises the drafters' costs too, and every comparison
    stays between figures measured at the same speed. A verify round does more than the calibrated forward
    (sampling the target's distributions, the acceptance test, rewinding): `verify_factor` (per regime, and per option
    once it has verify rounds of its own: `Option.verify_factor`) is its
    measured time over the calibrated forward's.

    Exploration (`explore`): an option's first-draft acceptance is uncertain (its decayed counts, the drafter's
    measured τ as the prior); over five equally likely scenarios of it (`SCENARIOS`, every position shifted alike)
    the expected saving per token over the incumbent (the best choice by the mean estimates) is EI. One round of the
    option resolves a share of that uncertainty, n_new / (n + n_new) with n the counts so far and n_new the positions
    it tries; over the H tokens that will use the answer that is worth H · EI · share, H = the request's remaining
    tokens plus what this chooser has decoded so far, at most `FUTURE_TOKENS` (what it learns serves the requests of
    the same session or server too), times the share of tokens the option could serve (`_servable`). It is explored
    only when that exceeds what the round costs against the
    incumbent by the mean estimates. So an option whose optimistic scenario cannot beat plain is never tried (EI = 0),
    a fresh process's short request pays for no exploration that cannot pay back, and a long one tries a promising
    option until its estimate settles (`benchmarks/simulate_auto.py`, 64 seeds of ten
    96-token requests on the trained tiny set's cost curve: a drafter paying 17 % at T = 1, auto 0.93× the drafter
    alone without the future tokens, 0.95× with 128 of them; one losing 19 %, auto 0.99× plain without, 0.98× with). Counts of an option left
    idle fade toward its prior (`age`), so the question comes back when the context may have changed."""

    def __init__(self, verify_costs: dict[int, float], scale_ema: float = 0.1,
                 plain_cost: float | None = None, age_every: int = 64, age: float = 0.998,
                 wide: tuple[int, float] | None = None, scale: float = 1.0):
        if 1 not in verify_costs:
            raise ValueError("verify_costs needs L = 1 (a plain step)")
        self.costs = {int(L): float(c) for L, c in verify_costs.items()}
        # (rows, calibrated seconds) of one forward far wider than the curve (the calibration's prefill-sized one):
        # what a forward over a drafter's backlog of that many positions costs (`forward_cost`)
        self.wide = None if not wide or int(wide[0]) <= max(self.costs) else (int(wide[0]), float(wide[1]))
        self.plain_cal = float(plain_cost) if plain_cost else self.costs[1]
        self.options: dict[str, Option] = {}
        self.scale_ema = scale_ema
        self._spec_last = False  # the latest choice was a drafter
        self.scale = scale  # measured / calibrated time of a pipelined plain token, the median of the latest few
        self._speeds: collections.deque = collections.deque(maxlen=PRICE_WINDOW)  # (round, measured / calibrated)
        self._sampled_at: int | None = None  # the round of the latest plain token measured (`check_due`)
        self._check_from: int | None = None  # the round a running check of the scale began at
        self.stale_rounds = STALE_ROUNDS
        # rounds after which a check is due if no plain token was measured yet (`check_due`): `FIRST_CHECK_ROUNDS`
        # where the starting scale was checked when auto was built, None where it is the calibration's own
        self.first_check_rounds: int | None = None
        self.settle_max = SETTLE_MAX  # see SETTLE_SLACK (0: the first plain token after a stretch only)
        self.wake_tokens = 0  # slow plain tokens after stretches counted into their switch cost so far
        self.checks = 0  # checks of the scale begun (`check_due`)
        # option -> [wall seconds, calibrated seconds charged] its ledger was credited since the latest plain token
        # measured: priced again, if the machine measures faster then (`_confirm`)
        self._unconfirmed: dict[str, list[float]] = {}
        self.verify_factor: dict[str, float] = {}  # regime -> measured verify round / calibrated forward, EMA
        # calibrated seconds a speculative round spends outside its measured draft and verify windows (choosing,
        # committing, the drafters' bookkeeping), EMA
        self.round_overhead = 0.0
        # calibrated seconds a speculative stretch costs beyond its rounds, EMA over stretches: what the plain tokens
        # on either side of it lost to the interrupted pipeline; charged to the round that would start a stretch
        self.switch_cost = 0.0
        self.round = 0  # rounds chosen so far
        self.decoded = 0  # tokens committed under this chooser so far (`FUTURE_TOKENS`)
        self._stretch_from: tuple | None = None  # (option, regime) that started the running speculative stretch
        self._stretch_tokens = 0  # tokens that stretch has committed so far
        self.horizon = SWITCH_HORIZON  # see `set_horizon`
        self.age_every, self.age = age_every, age  # idle evidence fades by age ** age_every every age_every rounds
        # per (regime, after a drafter?, option) its best width for each cap (`_leaders`), its exploration terms
        # (`_explore_terms`), and per regime the options that could beat plain at all (`relevant`), kept until an
        # estimate changes: inside a plain stretch only the machine's speed moves, which scales every rate alike, so
        # a plain round does not pay for scoring every option and width again (on a small model that Python work is
        # a measurable share of a step). Kept per option (None: what every option's estimates feed), so that one
        # option's new estimate drops its own tables at once (`_forget`), whatever the others hold
        self._memo: dict[str | None, dict] = {}
        self._changes = 0  # estimate changes so far (`_rescore`)
        self._shared: tuple = (0.0, {})  # (round overhead, verify factors) the memo was scored with
        # bumped whenever the memo is refreshed (`_forget`): a decision taken on the memoised tables holds as long as
        # this does (`multiplex.AutoDrafter.plan` keeps a plain verdict across the tokens of a plain stretch)
        self.version = 0
        # option -> (target positions its drafter is behind, how many of them must have their taps recomputed, the
        # target position its backlog ends at) (set per round by the drafter that multiplexes them): a round of it
        # first catches up on them (`catch_up_cost`), a one-time cost spread over the horizon like the switch cost
        self._contexts = False  # told when requests begin (`new_context`)
        self.lags: dict[str, tuple[int, int, int]] = {}  # set through `set_lag` / `clear_lags` (they keep `_lag_sig`)
        self._catch: dict[str, tuple] = {}  # name -> (what its catch-up was priced from, that price): `catch_up_cost`
        self._lag_keys: dict[str, tuple] = {}  # name -> its backlog's buckets (`_lag_key`)
        self._lag_sig: tuple = ()  # the lags' buckets (`lag_bucket`), part of the memo keys
        self.chosen: Counter = Counter()  # (name or "plain", k) -> rounds
        self.explored: Counter = Counter()  # name -> rounds chosen to explore it
        # the ledger (`credit`, `elapse`), in calibrated seconds, fading by 1 − 1/LEDGER_ROUNDS a round: the decoding
        # time, each option's saving over plain (negative: a loss), the options it bars and the decoding time at
        # which the first of them may be reconsidered
        self.elapsed = 0.0
        self.saved: dict[str, float] = {}
        self.spread_sq: dict[str, float] = {}  # per entry, the variance of its credits by chance (`LEDGER_Z`)
        self._round_var: dict[str, float] = {}  # entry -> its latest round's prior variance, until credited
        self.barred: frozenset = frozenset()
        self._reopen = math.inf
        self.loss_budget = LOSS_BUDGET
        self.ledger_z = LEDGER_Z
        self.surplus_share = SURPLUS_SHARE
        # the phase of the response the rounds are in (`set_phase`: None — the chooser is not told — one set of
        # estimates and ledger entries per regime and option, as the batch's rows use them)
        self.phase: int | None = None
        self.phases = PHASES
        self.shadowed = 0  # offers scored without a round (`observe_offer`)
        self._shadowed_options: set[str] = set()  # the options those of the running batch scored (`observe_offer`)
        # option (None: plain) -> tokens its rounds committed, fading as the ledger does (`_servable`)
        self.served: dict[str | None, float] = {}

    def add(self, name: str, max_k: int, shape: str, draft_prior=None, decay: float = 0.97,
            measured_tau: dict | None = None, then_alpha: dict | None = None, sporadic: bool = False,
            rows: int | None = None, shadowed: bool = False, catch_up: float = 0.0, catch_quad: float = 0.0,
            sampling_draft_prior=None) -> Option:
        """measured_tau: {"width", "greedy", "sampling"} τ measured for this drafter (`read_measured_tau`): the
        acceptance estimates start from it instead of α = 0.5, so a weak drafter is not tried blindly first; each
        phase of a response from its own τ where it was measured per phase with this chooser's bounds ("greedy#0",
        …, "phases").
        then_alpha: {regime: α} of the drafts after an accepted one (`AcceptanceStats` then). sporadic: available
        in some rounds only (`Option.sporadic`). rows: a token-tree option's verify rows per round (`Option.rows`;
        its acceptance is the accepted path's, per depth). shadowed: its offers no round took are scored
        (`observe_offer`, `Option.shadowed`): it is never explored. catch_up: calibrated seconds per position of
        backlog its drafter takes in while drafting (`Option.catch_up`'s start: `calibrate.measure_catch_up`);
        catch_quad: ... and per position² of the context it attends over (`Option.catch_quad`).
        sampling_draft_prior: draft_prior for rounds at T > 0, where it was measured apart (`Option.sampling_cost`)."""
        max_k = min(max_k, max(self.costs) - 1)
        if max_k < 1:
            raise ValueError(f"option {name!r}: the verify cost curve must cover at least L = 2")
        if rows is not None and not max_k + 1 <= rows <= max(self.costs):
            raise ValueError(f"option {name!r}: {rows} tree rows outside the verify cost curve's "
                             f"[{max_k + 1}, {max(self.costs)}]")
        prior = draft_prior
        if prior is None:  # a guess: 0.3 plain steps per round
            guess = 0.0 if shape == "free" else 0.3 * self.costs[1]
            prior = (guess, 0.0) if shape == "affine" else guess
        alphas = {} if not measured_tau else {
            key: alpha_from_tau(tau, int(measured_tau["width"])) for key, tau in measured_tau.items()
            if tau is not None and (key in ("greedy", "sampling") or key.split("#", 1)[0] in ("greedy", "sampling")
                                    and tuple(measured_tau.get("phases", ())) == tuple(self.phases))}
        opt = Option(name, max_k, DraftCost(shape, prior), decay=decay, prior_alpha=alphas,
                     then_alpha=dict(then_alpha or {}), sporadic=sporadic, rows=rows,
                     shadowed=shadowed, catch_up=max(0.0, float(catch_up)), catch_quad=max(0.0, float(catch_quad)),
                     sampling_cost=None if sampling_draft_prior is None else DraftCost(shape, sampling_draft_prior))
        self.options[name] = opt
        self._forget()
        return opt

    def catch_up_cost(self, name: str) -> float:
        """Calibrated seconds that bring option `name`'s drafter up to date (`lags`), for L positions behind (L and
        the positions to run again rounded up to `lag_bucket`s, so the memoised tables stay few): the forward that
        recomputes the taps of those of them no forward kept (`forward_cost`), plus what the drafter itself
        measurably spends per position beyond a steady round's backlog (`Option.catch_up`)."""
        lags = self.lags.get(name)
        if lags is None or lags[0] <= 0:
            return 0.0
        opt = self.options.get(name)
        # kept while what it is computed from is what it was: asked of every option at every memo lookup (`_where`)
        key = (lags, self.wide) if opt is None else (lags, self.wide, opt.catch_up, opt.catch_quad)
        kept = self._catch.get(name)
        if kept is not None and kept[0] == key:
            return kept[1]
        lag, rows, at = lags
        out = self.backlog_cost(name, lag, at) + (self.forward_cost(lag_bucket(rows)) if rows > 0 else 0.0)
        self._catch[name] = (key, out)
        return out

    def backlog_cost(self, name: str, lag: int, at: int) -> float:
        """Calibrated seconds option `name`'s drafter spends taking in a backlog of `lag` positions ending at target
        position `at` beyond what a steady round's backlog costs (`Option.catch_up`, `Option.catch_quad`), the
        positions rounded up to a `lag_bucket`; a batch row's drafter prices its backlog so too
        (`auto.batch.BatchAuto.backlog_cost`)."""
        opt = self.options.get(name)
        if opt is None or lag <= 0:
            return 0.0
        L = lag_bucket(lag)
        return opt.catch_up * max(0, L - opt.steady) + self._quad(opt, L, lag_bucket(at))

    @staticmethod
    def _quad(opt: Option, lag: int, at: int) -> float:
        """What option `opt`'s catch-up on `lag` positions ending at position `at` costs for the context it attends
        over (`Option.catch_quad`), beyond a steady round's backlog (its latest `steady` positions)."""
        lag = min(lag, at)
        if not opt.catch_quad or lag <= opt.steady:
            return 0.0
        return opt.catch_quad * ((at - opt.steady) ** 2 - (at - lag) ** 2)

    def forward_cost(self, L: int) -> float:
        """Calibrated seconds of one target forward over L positions: the verify curve's C(L); past its end, toward
        the calibration's wide forward (`wide`) and in proportion to it beyond (a forward that wide is compute-bound);
        without one, the curve extended linearly. A flat curve (a verify of 9 rows costs what one row does) says
        nothing of a forward over hundreds of positions: extended, it priced the tiny set's catch-up over a 256-token
        prompt at a third of what it measures."""
        if L in self.costs:
            return self.costs[L]
        top = max(self.costs)
        if L < top:
            return self.costs[min(c for c in self.costs if c >= L)]
        if self.wide is not None:
            rows, seconds = self.wide
            seconds = max(seconds, self.costs[top])
            if L >= rows:
                return seconds * L / rows
            return self.costs[top] + (seconds - self.costs[top]) * (L - top) / (rows - top)
        mid = max(1, top // 2)
        slope = max(0.0, (self.costs[top] - self.costs.get(mid, self.costs[1])) / max(1, top - mid))
        return self.costs[top] + (L - top) * slope

    def set_lag(self, name: str, lag: int, fill: bool | int = True, at: int | None = None) -> None:
        """Option `name`'s drafter is `lag` target positions behind (0: in step); fill: how many of them (the
        latest) must be run again for their taps (a plain stretch computed none); True: all of them, False: none.
        at: the target position the backlog ends at (the context's length; None: as if it began at position 0)."""
        rows = (lag if fill else 0) if isinstance(fill, bool) else min(int(fill), lag)
        new = (lag, max(0, rows), lag if at is None else max(lag, int(at)))
        if self.lags.get(name) == new:
            return
        old = self._lag_key(name)
        self.lags[name] = new
        key = self._lag_keys[name] = self._bucketed(name)
        if key != old:
            self._lag_sig = tuple(sorted((n, self._lag_key(n)) for n in self.lags if self.lags[n][0] > 0))

    def new_context(self) -> None:
        """A new request: no drafter is behind (`clear_lags`), and what its rounds measure starts afresh
        (`Option.here`; a chooser never told of requests keeps no such measure)."""
        self._contexts = True
        self.clear_lags()
        if any(o.here for o in self.options.values()):
            for o in self.options.values():
                o.close_here()
            self._forget()

    def clear_lags(self) -> None:
        """A new context: no drafter is behind."""
        self.lags.clear()
        self._lag_keys.clear()
        self._lag_sig = ()
        self.version += 1  # a drafter's catch-up no longer weighs on it: a decision taken behind does not hold

    def _lag_key(self, name: str) -> tuple:
        """Option `name`'s backlog as its memo keys hold it (`_bucketed`, worked out when `set_lag` is told)."""
        return self._lag_keys.get(name, (0, 0))

    def _bucketed(self, name: str) -> tuple:
        lag, rows, at = self.lags.get(name, (0, 0, 0))
        if lag <= 0:
            return (0, 0)  # (in step: what `_bounded_by` and `_where` test for)
        opt = self.options.get(name)
        return (lag_bucket(lag), rows and lag_bucket(rows), lag_bucket(at) if opt is not None and opt.catch_quad else 0)

    def steady(self, name: str, lag: int) -> bool:
        """Whether a round of option `name` with its drafter `lag` positions behind costs what its rounds cost in a
        run of their own (else the excess is a catch-up: `observe_catch_up`)."""
        return lag <= self.options[name].steady

    def observe_catch_up(self, name: str, lag: int, seconds: float, ema: float = 0.25, at: int | None = None) -> None:
        """A round of option `name` whose drafter was `lag` positions behind (ending at target position `at`; None:
        from position 0) spent `seconds` beyond its estimated draft cost: the per-position catch-up it is charged from
        now on (only the positions beyond `steady`), what the context it attended over cost (`Option.catch_quad`,
        as measured when auto started) taken out first."""
        opt = self.options[name]
        extra = lag - opt.steady
        if extra <= 0:
            return
        x = max(0.0, seconds / self.scale - self._quad(opt, lag, lag if at is None else max(lag, at))) / extra
        opt.catch_up = (1 - ema) * opt.catch_up + ema * min(x, 2.0 * self.plain_cal)
        self._rescore(name)

    def tenure(self, name: str, regime: str = "greedy") -> float:
        """Tokens option `name`'s rounds commit per catch-up of its drafter in `regime`, as measured (`caught_up`,
        `Option.tenure`) with one prior tenure of `SWITCH_HORIZON` tokens: what its catch-up is spread over (`rates`).
        A drafter that drafts on once caught up serves the horizon or more; one that other options keep interrupting
        (n-gram lookup taking over where the output copies) serves a round or two per catch-up."""
        t = self.options[name].tenure.get(regime)
        return SWITCH_HORIZON if t is None else (t[0] + SWITCH_HORIZON) / (t[1] + 1.0)

    def caught_up(self, name: str, regime: str = "greedy") -> None:
        """A round of option `name` in `regime` caught its drafter up on a backlog (`steady` says it was behind): a
        new tenure begins (`tenure`)."""
        opt = self.options[name]
        t = opt.tenure.get(regime)
        opt.tenure[regime] = [0.0, 1.0] if t is None else [TENURE_DECAY * t[0], TENURE_DECAY * t[1] + 1.0]
        self._forget(name)  # (its tokens come with `update`, which scores its tables again as any estimate does)

    @property
    def plain_cost(self) -> float:
        """Seconds per pipelined plain token now."""
        return self.scale * self.plain_cal

    def rate(self, name: str | None, k: int, regime: str = "greedy") -> float:
        """Expected committed tokens per second of `k` drafts from option `name` (None or k = 0: a plain step) if
        chosen now: after a plain round a drafter's round also carries the cost of switching to it."""
        if name is None or k == 0:
            return 1.0 / self.plain_cost
        return self.rates(name, k, regime)[k - 1]

    def rates(self, name: str, cap: int, regime: str = "greedy", shift: float = 0.0,
              phase: int | None | str = "now", free: bool = False) -> list[float]:
        """[rate(name, k) for k = 1..min(cap, max_k)] in one pass; shift: every position's acceptance moved by it
        (a scenario of `explore`). After a plain round a drafter's round also carries the cost of switching to it,
        spread over the tokens the stretch can run: the horizon, or as many as its stretches measurably last
        (`Option.stretch`), if fewer; and a drafter that is behind its catch-up, spread over as many tokens as its
        catch-ups measurably serve (`tenure`), if fewer still. phase: whose acceptance estimates (`set_phase`; "now":
        the current one).
        free: as if its round paid no switch and no catch-up (its drafter in step, inside a stretch): a bound on
        every rate it can have with the same estimates, whatever came last, its backlog and the horizon
        (`_bounded_by`)."""
        return self._rate_rows(name, cap, regime, (shift,), phase, free)[0]

    def _rate_rows(self, name: str, cap: int, regime: str, shifts, phase: int | None | str = "now",
                   free: bool = False) -> list[list[float]]:
        """`rates` at each of `shifts`, what they share (the switch, the catch-up and what it is spread over, the
        rounds' costs) looked up once: `_scenarios` scores five."""
        opt = self.options[name]
        key = self._key(regime, phase)
        switch = 0.0 if free or self._spec_last else max(0.0, self.switch_cost)
        catch = 0.0 if free else self.catch_up_cost(name)
        span = self.horizon
        if regime in opt.stretch and not self._spec_last:
            span = max(1.0, min(span, opt.stretch[regime]))
        held = min(span, tenure_bucket(self.tenure(name, regime))) if catch else span  # what its catch-up serves
        alphas, costs, scale = opt.alphas(key)[:min(cap, opt.max_k)], self._round_costs(name, regime), self.scale
        rows = []
        for shift in shifts:
            out, e, p = [], 1.0, 1.0
            for a, base in zip(alphas, costs):
                a += shift
                p *= 1.0 if a >= 1.0 else (a if a > 0.0 else 0.0)
                e += p
                out.append(e / (scale * (base + (switch if e >= span else switch * e / span)
                                         + (catch if e >= held else catch * e / held))))
            rows.append(out)
        return rows

    def _round_costs(self, name: str, regime: str) -> list[float]:
        """[calibrated seconds of a round of option `name` at k drafts, without a switch or catch-up, for k = 1..max_k]:
        its draft, its verify (× the verify factor) and the round overhead; kept while those are what they were."""
        opt = self.options[name]
        fixed = max(0.0, self.round_overhead)
        vf = opt.verify_factor.get(regime, self.verify_factor.get(regime, 1.0))
        memo = self._memo_of(name)
        got = memo.get(("round costs", regime))
        if got is None or got[0] != vf:  # [verify factor, draft + verify, the overhead added to them, their sums]
            draft = opt.draft(regime)
            got = memo[("round costs", regime)] = [
                vf, [draft(k) + vf * self.costs[opt.verify_rows(k)] for k in range(1, opt.max_k + 1)], None, None]
        if got[2] != fixed:  # (the overhead moves after every speculative round, the rest when an estimate does)
            got[2], got[3] = fixed, [c + fixed for c in got[1]]
        return got[3]

    def _switch(self, name: str) -> float:
        """Calibrated seconds a round of option `name` pays once, beyond its own work: the switch into a
        speculative stretch (after a plain round) and its drafter's catch-up."""
        return (0.0 if self._spec_last else max(0.0, self.switch_cost)) + self.catch_up_cost(name)

    def set_horizon(self, remaining: int | None) -> None:
        """The tokens a stretch started now can run: the request's remaining tokens, at most `SWITCH_HORIZON` (None:
        unknown, the most), rounded down to a power of two (so the memoised tables stay few)."""
        h = SWITCH_HORIZON if remaining is None else max(1, min(int(remaining), SWITCH_HORIZON))
        self.horizon = 1 << (h.bit_length() - 1)

    def set_phase(self, generated: int | None) -> None:
        """The rounds to come are in the phase of a response that has generated `generated` tokens so far (None: the
        phases are not told): the number of `phases` boundaries it has reached. Each phase has its own acceptance
        estimates and ledger entries (`_key`, `entry`). The memoised tables are keyed by phase too: the next
        response's opening finds its own tables from the last one's, unless an estimate changed since; only a
        decision taken in another phase no longer holds (`version`)."""
        phase = None if generated is None or self.phases is None else phase_of(generated, self.phases)
        if phase != self.phase:
            self.phase = phase
            self.version += 1

    def _key(self, regime: str, phase: int | None | str = "now") -> str:
        """The acceptance estimates' key of `regime` in `phase` (the current one by default)."""
        phase = self.phase if phase == "now" else phase
        if phase is None:
            return regime
        key = _KEYS.get((regime, phase))
        if key is None:
            key = _KEYS[(regime, phase)] = f"{regime}#{phase}"
        return key

    def entry(self, name: str, phase: int | None | str = "now") -> str:
        """Option `name`'s ledger entry in `phase` (the current one by default), keyed as the estimates are: a
        drafter that loses in a response's opening tokens and pays after them is barred from the opening only."""
        return self._key(name, phase)

    def _memo_of(self, name: str | None) -> dict:
        """The memoised tables of option `name` (None: those every option's estimates feed)."""
        memo = self._memo.get(name)
        if memo is None:
            memo = self._memo[name] = {}
        return memo

    def _leaders(self, name: str, regime: str, free: bool = False) -> list[tuple[int, float]]:
        """[(best k, its rate × scale) among k = 1..cap for cap = 1..max_k] of option `name` (free: without a
        switch or catch-up, `rates`), kept until an estimate changes. In units of the speed scale, so a plain token
        moving the scale leaves it valid (every rate, plain's included, scales alike)."""
        memo = self._memo_of(name)
        key = ("lead", regime, self.phase) + (("free",) if free else self._where(name))
        out = memo.get(key)
        if out is None:
            out, bk, br = [], 0, 0.0
            for k, r in enumerate(self.rates(name, self.options[name].max_k, regime, free=free), start=1):
                if r * self.scale > br * (1 + 1e-9):
                    bk, br = k, r * self.scale
                out.append((bk, br))
            memo[key] = out
        return out

    def _where(self, name: str) -> tuple:
        """What option `name`'s rates depend on beyond its estimates (`rates`), as a memo key: what came last, the
        horizon and its backlog — or ("free",) when its round would pay neither a switch nor a catch-up, its rates
        then those of its free tables whatever the horizon (inside a stretch, its drafter in step)."""
        if self._switch(name) <= 0.0:
            return ("free",)
        return (self._spec_last, self.horizon, self._lag_key(name))

    def _bounded_by(self, name: str, bound: float, rate) -> bool:
        """Whether option `name` cannot beat `bound` even free of a switch and a catch-up: `rate(free)` is the rate
        × scale to compare, and both only add to a round's cost, so every rate it has now is at most `rate(True)`.
        Its tables with them — one per horizon, what came last and backlog bucket, the last moving every round or
        two while another option drafts — are then not scored at all; the free one is kept until an estimate
        changes. Inside a stretch, with its drafter in step, it pays neither: its own tables are the free ones."""
        if self._spec_last and self._lag_key(name) == (0, 0):
            return False
        return rate(True) <= bound

    def best(self, available: dict[str, int], regime: str = "greedy") -> tuple[str | None, int, float]:
        """The best (name, k, rate) over the options in `available` ({name: most drafts it can give now}) by the mean
        estimates. To start a stretch (after a plain round) a drafter must beat plain by `ENTER_GAIN`, inside one by
        `MIN_GAIN`: a plain round in between would cost the stretch's switch twice, and a 10 % margin both ways made
        an option that pays ~12 % flap between rounds and plain steps (or never start)."""
        plain = 1.0 / self.plain_cal  # × scale, as `_leaders`
        best_name, best_k, best_rate = None, 0, plain
        bar = plain * (1 + 1e-9 + (MIN_GAIN if self._spec_last else ENTER_GAIN))
        for name, cap in available.items():
            if name not in self.options:
                raise KeyError(f"unknown option {name!r}")
            if cap < 1:
                continue
            top = max(bar, best_rate * (1 + 1e-9))
            if self._bounded_by(name, top, lambda free: self._leaders(name, regime, free)[
                    min(cap, self.options[name].max_k) - 1][1]):
                continue
            leaders = self._leaders(name, regime)
            k, r = leaders[min(cap, len(leaders)) - 1]
            if r > bar and r > best_rate * (1 + 1e-9):
                best_name, best_k, best_rate = name, k, r
        return best_name, best_k, best_rate / self.scale

    def _explore_terms(self, name: str, cap: int, regime: str, incumbent: tuple) -> tuple[float, float, int]:
        """(EI × share, loss, k) of exploring option `name` (at most `cap` drafts) against `incumbent` = (name or
        None, its rate × scale): see the class docstring. Scale-free, kept until an estimate changes; what does not
        depend on the incumbent (`_scenarios`) is kept apart, the incumbent moving every round or two."""
        memo = self._memo_of(name)
        key = ("explore", regime, self.phase, cap, incumbent) + self._where(name)
        out = memo.get(key)
        if out is None:
            tops, k_e, mean, e_mean, share = self._scenarios(name, cap, regime)
            t_inc = 1.0 / incumbent[1]  # calibrated seconds per token of the incumbent
            ei = 0.0
            for top in tops:
                if top > incumbent[1] * (1 + MIN_GAIN):
                    ei += (t_inc - 1.0 / top) / len(SCENARIOS)
            # calibrated seconds this round loses on the incumbent by the mean estimate, its switch and catch-up
            # spread as its rate spreads them. (Charging them whole — a round that ends its stretch — explored less
            # and found less: `benchmarks/simulate_auto.py`, a drafter paying 1.17x, auto 1.063x against 1.093x.)
            loss = max(0.0, e_mean * (1.0 / mean - t_inc))
            out = memo[key] = (ei * share, loss, k_e)
        return out

    def _scenarios(self, name: str, cap: int, regime: str) -> tuple[list[float], int, float, float, float]:
        """Option `name` explored at most `cap` drafts, whatever the incumbent: (its best rate × scale in each of
        `SCENARIOS`, the width k its optimistic one drafts at — the one to try —, its mean rate × scale at k, the
        tokens a round at k commits by the mean estimates, the share of its uncertainty one round resolves),
        kept until an estimate changes."""
        memo = self._memo_of(name)
        key = ("scenarios", regime, self.phase, cap) + self._where(name)
        out = memo.get(key)
        if out is None:
            stats = self.options[name].acceptance(self._key(regime))
            sd = stats.spread()
            rows = self._rate_rows(name, cap, regime, [z * sd for z in SCENARIOS])
            tops = []
            for row in rows:
                rs = [r * self.scale for r in row]
                tops.append(max(rs))
            k_e = 1 + rs.index(tops[-1])  # (the optimistic scenario's, the last)
            mean = rows[_MEAN_SCENARIO][k_e - 1] * self.scale  # (its rate at k_e: the first k_e of the row)
            e_mean = expected_tokens(self.options[name].alphas(self._key(regime))[:k_e])
            n_new = min(e_mean, k_e)  # positions one round tries, about
            share = n_new / (max(stats.tried[0], 0.0) + n_new)
            out = memo[key] = (tops, k_e, mean, e_mean, share)
        return out

    def _optimistic(self, name: str, cap: int, regime: str, free: bool = False,
                    phase: int | None | str = "now") -> float:
        """Option `name`'s best rate × scale (at most `cap` drafts) in its optimistic scenario (`SCENARIOS[-1]`):
        the bound that decides whether exploring it can gain at all, kept until an estimate changes (unlike the
        exploration terms it does not depend on the incumbent, whose rate moves every round of a stretch). free:
        without a switch or catch-up (`rates`); phase: whose estimates ("now": the current one)."""
        phase = self.phase if phase == "now" else phase
        memo = self._memo_of(name)
        key = ("optimistic", regime, phase, cap) + (("free",) if free else self._where(name))
        out = memo.get(key)
        if out is None:
            sd = self.options[name].acceptance(self._key(regime, phase)).spread()
            out = memo[key] = max(self.rates(name, cap, regime, shift=SCENARIOS[-1] * sd, phase=phase,
                                             free=free)) * self.scale
        return out

    def explore(self, available: dict[str, int], regime: str, incumbent: tuple, remaining: int):
        """(name, k) of the option worth exploring now, or None: remaining · (the share of it that option could
        serve: `_servable`) · EI · share must exceed the round's loss against the incumbent ((name or None,
        rate × scale)); the largest surplus wins."""
        best, surplus = None, 0.0
        # the incumbent's rate to 1 % (its estimate moves a little every round: the tables need not)
        incumbent = (incumbent[0], math.exp(round(100 * math.log(incumbent[1])) / 100))
        for name, cap in available.items():
            if cap < 1 or name == incumbent[0]:
                continue
            if self.options[name].shadowed:
                continue
            cap = min(cap, self.options[name].max_k)
            bar = incumbent[1] * (1 + MIN_GAIN)
            if self._bounded_by(name, bar, lambda free: self._optimistic(name, cap, regime, free)):
                continue
            top = self._optimistic(name, cap, regime)
            if top <= bar:
                continue  # not even its optimistic scenario beats the incumbent: EI = 0 (and no scoring pass)
            value, loss, k = self._explore_terms(name, cap, regime, incumbent)
            gain = remaining * self._servable(name, top, regime) * value - loss
            if gain > surplus:
                best, surplus = (name, k), gain
        return best

    def _servable(self, name: str, top: float, regime: str) -> float:
        """The share of the tokens decoded lately (`served`) that option `name` could have served had it been as
        good as its optimistic rate `top` (× scale): those of plain rounds, its own, and those of options whose best
        rate by the mean estimates is below it. What is learned about it serves only such tokens: where n-gram
        lookup commits most of the tokens at five times plain speed, a DFlash drafter's answer serves the rest alone
        (on the trained tiny set a fresh auto explored DFlash, its trees and MTP there again and again). An option
        whose free tables are below `top` is below it whatever its backlog (`_bounded_by`): a drafter far behind is
        not scored with it here, at each new backlog bucket of a plain stretch (an option in step has its tables
        scored anyway; those of an n-gram option's offers are scored again only every `SHADOW_BATCH` of them, so its
        free ones may be older than the rest)."""
        total = sum(self.served.values())
        if total <= 0.0:
            return 1.0
        under = math.nextafter(top, 0.0)  # below `top`: at most this
        ok = 0
        for y, v in self.served.items():
            if y is None or y == name:
                ok += v
            elif y in self.options and (
                    self._lag_key(y) != (0, 0)
                    and self._bounded_by(y, under, lambda free, y=y: self._leaders(y, regime, True)[-1][1] * (1 + 1e-9))
                    or self._leaders(y, regime)[-1][1] < top):
                ok += v
        return ok / total

    def pick(self, available: dict[str, int], regime: str = "greedy",
             remaining: int | None = None) -> tuple[str | None, int, bool]:
        """What `choose` would choose now, without counting it: (name or None, k, whether it explores). remaining:
        the request's tokens still to generate (None: unknown, no exploration)."""
        self.set_horizon(remaining)
        if self.check_due():
            return None, 0, False
        if self.barred:
            available = {n: c for n, c in available.items() if self.entry(n) not in self.barred}
        name, k, rate = self.best(available, regime)
        if remaining is not None and remaining > 1:
            horizon = remaining + min(self.decoded, FUTURE_TOKENS)
            e = self.explore(available, regime, (name, rate * self.scale), horizon)
            if e is not None:
                return e[0], e[1], True
        return name, k, False

    def keep(self, name: str, available: dict[str, int], regime: str = "greedy",
             remaining: int | None = None) -> tuple[str, int, bool] | None:
        """`pick`'s answer when bounds alone decide it for option `name` (the running stretch's), else None (ask
        `pick`): `name` at its best width by the mean estimates beats plain's bar and every other option in
        `available` free of a switch and a catch-up — their best rate by the mean estimates (`best` then picks
        `name`) and their optimistic scenario's (`explore` then tries none: it compares them with the incumbent
        rounded to 1 %, beaten by more than that here). Their rates with a switch or a catch-up are at most those
        (`_bounded_by`), and their free tables are kept until their own estimates change: inside a stretch of one
        option this is one table lookup per other option where `pick` weighs each of them twice."""
        cap = available.get(name, 0)
        if cap < 1:
            return None
        self.set_horizon(remaining)
        if self.check_due() or self.entry(name) in self.barred:
            return None  # (`pick` says plain on a due check; `check_due` asked again answers the same)
        leaders = self._leaders(name, regime)
        k, r = leaders[min(cap, len(leaders)) - 1]
        if r <= (1 + 1e-9 + (MIN_GAIN if self._spec_last else ENTER_GAIN)) / self.plain_cal:
            return None
        explores = remaining is not None and remaining > 1
        for other, c in available.items():
            if other == name or c < 1 or self.entry(other) in self.barred:
                continue
            if self._leaders(other, regime, True)[-1][1] * (1 + 1e-9) >= r:
                return None
            if explores and not self.options[other].shadowed \
                    and self._optimistic(other, self.options[other].max_k, regime, True) >= r:
                return None
        return name, k, False

    def choose(self, available: dict[str, int], regime: str = "greedy", remaining: int | None = None,
               picked: tuple | None = None) -> tuple[str | None, int]:
        """The option for this round (`pick`), counted. picked: what `pick` said of this very state (same estimates,
        offers and budget), when it was already asked."""
        name, k, explores = picked if picked is not None else self.pick(available, regime, remaining)
        self._tick()
        if explores:
            self.explored[name] += 1
        elif name is not None:
            self.options[name].picked[self._key(regime)] = self.round
        self.chosen[(name or "plain", k)] += 1
        self.served[name] = self.served.get(name, 0.0) + 1.0  # its first token; the accepted drafts: `update`
        if name is None:
            self.end_stretch()
        elif not self._spec_last and self.options[name].sporadic:
            self._stretch_from, self._stretch_tokens = (name, regime), 0
        self._spec_last = name is not None
        return name, k

    def relevant(self, regime: str = "greedy", remaining: int | None = None) -> frozenset | None:
        """After a plain round, the options that could make this round anything but plain: those whose optimistic
        scenario beats plain by `MIN_GAIN` at some width (a scoring pass memoised until an estimate changes). None after a
        speculative round (every option counts). `choose` over the available ones among these chooses exactly as
        over all; when none is available the round is plain (`count_plain`) without asking the drafters.

        In a plain stretch this is what a round costs instead of every drafter's offer and a scoring pass: where the
        host's bookkeeping competes with the model for the cores (the 2-core CPU runs of this repository) each µs of
        it per token is a measurable share of a small model's step."""
        return None if self._spec_last else self.could_pay(regime, remaining)

    def paying(self, regime: str = "greedy", remaining: int | None = None, among: frozenset | None = None
               ) -> frozenset:
        """The options (of `among`; None: all) whose mean estimate beats plain by `ENTER_GAIN` at some width after a
        plain round — those a plain stretch would be left for (`best`'s bar there). Only their drafters are kept in
        step on the taps of plain forwards: one that pays less would never be entered, and its taps would cost every
        plain token."""
        self.set_horizon(remaining)
        memo = self._memo_of(None)
        key = ("paying", regime, self.phase, self.horizon, self._lag_sig, among)
        out = memo.get(key)
        if out is None:
            spec_last, self._spec_last = self._spec_last, False
            try:
                bar = (1 + ENTER_GAIN) / self.plain_cal
                out = memo[key] = frozenset(
                    n for n in self.options if (among is None or n in among) and self.entry(n) not in self.barred
                    and not self._bounded_by(n, bar, lambda free: self._leaders(n, regime, free)[-1][1])
                    and self._leaders(n, regime)[-1][1] > bar)
            finally:
                self._spec_last = spec_last
        return out

    def drafted_lately(self, name: str, regime: str = "greedy") -> bool:
        """Whether option `name` was chosen by its estimates (not to explore it) in the current phase of the
        response (`set_phase`) within the latest `CARRY_ROUNDS` rounds: a drafter worth keeping in step on other
        rounds' forwards (`AutoDrafter._warm`). One that pays by its estimates but is not chosen here is one the
        options on offer keep beating (on the trained tiny set DFlash, by its prior, after a response's opening,
        where n-gram lookup offers every round): the taps kept for it would serve no catch-up."""
        r = self.options[name].picked.get(self._key(regime))
        return r is not None and self.round - r <= CARRY_ROUNDS

    def could_pay(self, regime: str = "greedy", remaining: int | None = None) -> frozenset:
        """The options whose optimistic scenario beats plain by `MIN_GAIN` at some width, whatever came last."""
        self.set_horizon(remaining)
        return self._could_pay_in(regime, self.phase)

    def could_pay_ahead(self, regime: str = "greedy") -> frozenset:
        """The options that could pay (`could_pay`) in the current phase of the response or in any phase after it:
        those whose drafters' taps are worth keeping now (a drafter that loses in the opening tokens and pays after
        them still wants the prompt's)."""
        if self.phase is None or self.phases is None:
            return self._could_pay_in(regime, self.phase)
        return frozenset().union(*(self._could_pay_in(regime, p) for p in range(self.phase, len(self.phases) + 1)))

    def _could_pay_in(self, regime: str, phase: int | None) -> frozenset:
        """`could_pay` by the estimates and ledger entries of `phase`, at the current horizon (memoised)."""
        memo = self._memo_of(None)
        key = ("pays", regime, phase, self.horizon, self._lag_sig)
        rel = memo.get(key)
        if rel is None:
            bar = (1 + MIN_GAIN) / self.plain_cal

            def top(n: str, free: bool = False) -> float:
                return self._optimistic(n, self.options[n].max_k, regime, free, phase)

            # those that could pay even free of a switch and a catch-up (`_bounded_by`): one set per phase until an
            # estimate changes, where the set with them is scored again whenever a backlog's bucket moves (every
            # token or two of a plain stretch)
            free = memo.get(("pays free", regime, phase))
            if free is None:
                free = memo[("pays free", regime, phase)] = frozenset(
                    n for n in self.options if self.entry(n, phase) not in self.barred and top(n, True) > bar)
            rel = memo[key] = frozenset(n for n in free if top(n) > bar)
        return rel

    def count_plain(self) -> None:
        """A plain round chosen without `choose` (nothing `relevant` was available, or `pick` said plain): counted as
        `choose` counts it."""
        self._tick()
        self.chosen[("plain", 0)] += 1
        self.served[None] = self.served.get(None, 0.0) + 1.0
        self.end_stretch()
        self._spec_last = False

    def end_stretch(self, ema: float = 0.25) -> None:
        """The running speculative stretch (if any) ended (a plain round, or a new context): the tokens it committed
        go to the `Option.stretch` of the option that started it."""
        started, self._stretch_from = self._stretch_from, None
        if started is None or started[0] not in self.options:
            return
        name, regime = started
        opt, x = self.options[name], float(self._stretch_tokens)
        opt.stretch[regime] = x if regime not in opt.stretch else (1 - ema) * opt.stretch[regime] + ema * x
        self._rescore(name)

    def _tick(self) -> None:
        """A round is chosen; every `age_every` rounds the evidence of the options idle since the last time fades."""
        self.round += 1
        self.decoded += 1  # every round commits a token; a speculative round's accepted drafts come with `update`
        if self.round % self.age_every:
            return
        fade = (1.0 - 1.0 / LEDGER_ROUNDS) ** self.age_every  # both sides of every bar alike: none moves
        self.elapsed *= fade
        self._reopen *= fade
        self.saved = {n: v * fade for n, v in self.saved.items()}
        self.spread_sq = {n: v * fade * fade for n, v in self.spread_sq.items()}
        self.served = {n: v * fade for n, v in self.served.items()}
        for u in self._unconfirmed.values():
            u[0] *= fade
            u[1] *= fade
        if self.barred:
            self._bar()  # the losses faded under the floor (`LEDGER_FLOOR`): the bar may lift
        factor = self.age ** self.age_every
        aged = set()
        for opt in self.options.values():
            for regime, stats in opt.stats.items():
                if opt.touched.get(regime, -1) <= self.round - self.age_every and stats.age(factor):
                    aged.add(opt.name)
        self._forget_options(aged)  # (an estimate at its prior does not move: the tables scored on it stand)

    def update(self, name: str | None, k: int, n_accepted: int, regime: str = "greedy",
               draft_time: float | None = None, verify_time: float | None = None,
               expected: list[tuple[float, float]] | None = None) -> None:
        """After a round: k drafts of `name` proposed, n accepted; measured draft and verify seconds; expected: what
        its drafts were accepted on average (`AcceptanceStats.update`; None: what its coins decided)."""
        self._observe_round(name, k, n_accepted, regime, draft_time, verify_time, expected)
        self._rescore(name if name is not None and k > 0 else None)

    def _observe_round(self, name: str | None, k: int, n_accepted: int, regime: str, draft_time: float | None,
                       verify_time: float | None, expected: list[tuple[float, float]] | None = None) -> None:
        if name is not None and k > 0:
            self.decoded += n_accepted
            self.served[name] = self.served.get(name, 0.0) + n_accepted
            if self._stretch_from is not None:
                self._stretch_tokens += n_accepted + 1
            opt = self.options[name]
            t = opt.tenure.get(regime)
            if t is not None:
                t[0] += n_accepted + 1
            key = self._key(regime)
            stats = opt.acceptance(key)
            if self._contexts and not opt.shadowed:
                opt.note_here(key, k, n_accepted)
            stats.update(k, n_accepted, expected)
            opt.touched[key] = self.round
            self._round_var[self.entry(name)] = stats.prior_variance(k)
            if draft_time is not None:
                opt.draft(regime).observe(k, draft_time / self.scale)
        if verify_time is None:
            return
        if name is None or k == 0:
            # a plain step through the speculative engine: unpipelined, not what a plain token costs (on a machine
            # where the host and the model share the cores the two drift apart from what calibration measured)
            return
        opt = self.options.get(name)
        L = k + 1 if opt is None else opt.verify_rows(k)
        if self.costs.get(L, 0.0) > 0:
            x = verify_time / (self.scale * self.costs[L])
            shared = self.verify_factor.get(regime, 1.0)
            if opt is None or opt.rows is None:  # a tree's verify (its mask, the path's compaction) is its own
                self.verify_factor[regime] = robust_ema(shared, x, self.scale_ema)
            if opt is not None:
                opt.verify_factor[regime] = robust_ema(opt.verify_factor.get(regime, shared), x, self.scale_ema)

    def observe_offer(self, name: str, k: int, n_accepted: int, regime: str = "greedy",
                      phase: int | None | str = "now") -> None:
        """An offer of option `name` that no round took: k drafts of which a verify would have accepted n (known
        after the fact, exactly or in distribution: n-gram lookup, `AutoDrafter._shadow`). Its acceptance learns
        from it as from a round (that of `phase`, the response's phase the offer was made in; "now": the current
        one); their tables are scored again every `SHADOW_BATCH` of them, not after each (a plain stretch would
        otherwise be scored afresh every token), and only theirs (`_forget_options`)."""
        opt = self.options[name]
        key = self._key(regime, phase)
        opt.acceptance(key).update(k, n_accepted)
        opt.touched[key] = self.round
        self.shadowed += 1
        self._shadowed_options.add(name)
        if self.shadowed % SHADOW_BATCH == 0:
            self._forget_options({name})

    def elapse(self, seconds: float) -> None:
        """A round took `seconds` (commit to commit), whatever it was: the decoding time the ledger's budget grows
        with (`credit`)."""
        self.elapsed += seconds / self.scale
        if self.elapsed > self._reopen:
            self._bar()

    def credit(self, name: str, tokens: float, seconds: float, entry: str | None = None) -> None:
        """Option `name`'s ledger: a round of it committed `tokens` in `seconds` of wall time — or, tokens = 0,
        `seconds` its stretch cost beyond pipelined plain tokens (the plain tokens that start and end it). Its
        saving over plain decoding, tokens × a plain token now − seconds, is added (in calibrated seconds; a loss
        of at most `LEDGER_ROUND_CAP` plain tokens). While the options that lost, together, lost more than
        `LOSS_BUDGET` × the decoding time plus `SURPLUS_SHARE` of what the others saved (and more than noise:
        `LEDGER_Z`), those that lost most are barred from being chosen, the largest loss first, until what the
        others lost fits (one that saves goes on: another's loss does not stop it; one never tried may be tried
        once, which puts it on the ledger; one that lost a round's worth beside one that lost hundreds is not
        barred with it), until `elapse` has brought the budget back (module docstring). entry: the ledger entry
        (`entry`) of the phase its rounds ran in, if not the current one (the plain token that ends a stretch may
        fall in the next phase of the response). At T > 0 a chain round's tokens are what its drafts commit on average
        (`verify.expected_acceptance`, `multiplex.AutoDrafter.end_round`): its swing by chance is then less than the
        coins' variance `LEDGER_Z` counts, which only makes a bar slower to come (a true loss barred later, a chance one
        less often)."""
        gain = max(tokens * self.plain_cal - seconds / self.scale, -LEDGER_ROUND_CAP * self.plain_cal)
        name = entry if entry is not None else self.entry(name)
        self.saved[name] = self.saved.get(name, 0.0) + gain
        if tokens > 0:  # a round: how much its saving swings by chance (`LEDGER_Z`)
            by_chance = self._round_var.pop(name, 0.0) * self.plain_cal ** 2
            self.spread_sq[name] = self.spread_sq.get(name, 0.0) + by_chance
        if gain > -LEDGER_ROUND_CAP * self.plain_cal:  # a capped loss is charged in full however plain is priced
            u = self._unconfirmed.setdefault(name, [0.0, 0.0])
            u[0] += seconds
            u[1] += seconds / self.scale
        self._bar()

    def _bar(self) -> None:
        """Bar the options that lost, the largest loss first, until what the others lost fits what they may lose
        (`credit`); reconsider the last one barred when the decoding time has earned its loss back (`_reopen`)."""
        losers = sorted((v, n) for n, v in self.saved.items() if v < 0.0)
        short = -sum(v for v, _ in losers) - self.surplus_share * sum(v for v in self.saved.values() if v > 0.0)
        var = sum(self.spread_sq.get(n, 0.0) for _, n in losers)
        floor = max(self.loss_budget * self.elapsed, LEDGER_FLOOR * self.plain_cal)
        barred, self._reopen = [], math.inf
        for v, n in losers:
            if short <= max(floor, self.ledger_z * math.sqrt(max(var, 0.0))):
                break
            barred.append(n)
            short += v
            var -= self.spread_sq.get(n, 0.0)
            self._reopen = (short - v) / self.loss_budget
        if frozenset(barred) != self.barred:
            self.barred = frozenset(barred)
            self._forget()

    def observe_round_overhead(self, seconds: float) -> None:
        """Measured wall time of a speculative round (from the previous round's commit to its own) minus its
        measured draft and verify time. An EMA from 0, each sample capped at two plain steps (one stall — another
        process, a first-call kernel build — cannot lock the drafters out) and at `OVERHEAD_CLIP` × the estimate
        (at least a quarter of a plain step, so that it grows from 0): the samples' tail is the machine's (on the
        trained tiny set: median 0.41 ms, nine in ten below 0.65, and the odd 5-10 ms stall of a shared CPU, which
        the plain tokens suffer alike), and capped at two plain steps alone, one such spike in the few speculative
        rounds of a plain-heavy sitting left the estimate at 1.0-1.2 ms — 0.15 of a plain token more on every round
        of DFlash, a drafter paying 5-8 % there. A lasting overhead still comes through within ~30 rounds."""
        cap = min(2.0 * self.plain_cal, max(OVERHEAD_CLIP * self.round_overhead, 0.25 * self.plain_cal))
        x = min(max(seconds / self.scale, 0.0), cap)
        self.round_overhead = (1 - self.scale_ema) * self.round_overhead + self.scale_ema * x
        self._rescore(None)

    def settled(self, seconds: float) -> float | None:
        """A pipelined plain token right after a speculative stretch took `seconds`: its excess over the scale's price
        while the stretch's wake goes on, None once it is over (`wake_excess`)."""
        return wake_excess(seconds, self.plain_cost)

    def observe_switch(self, seconds: float, ema: float = 0.25, wake: int = 0) -> None:
        """What one speculative stretch cost beyond its rounds (`switch_cost`). Samples may be negative (the plain
        token before a stretch had no next forward to wait for); each is clipped to ±8 plain steps, plus the cap of
        each of the `wake` slow plain tokens after it counted in (`settled`)."""
        cap = (8.0 + SETTLE_TOKEN_CAP * wake) * self.plain_cal
        self.wake_tokens += wake
        self.switch_cost = (1 - ema) * self.switch_cost + ema * min(max(seconds / self.scale, -cap), cap)
        self._forget_switched()

    def rescore(self) -> None:
        """Score every option afresh (after estimates were set from outside)."""
        self._forget()

    def _rescore(self, name: str | None) -> None:
        """An estimate changed: option `name`'s own tables are scored again at once; every table once what every
        round shares (verify factors, round overhead) has moved by `SHARED_DRIFT` since it was scored; the sets of
        options that could pay every `RESCORE_EVERY` changes. Scoring every option, width and scenario after every
        round was ~10 % of a small model's speculative round."""
        self._changes += 1
        if name is not None:
            self._forget(name)
        overhead, factors = self._shared
        if abs(self.round_overhead - overhead) > SHARED_DRIFT * self.plain_cal or factors.keys() != \
                self.verify_factor.keys() or any(abs(v - factors[r]) > SHARED_DRIFT * factors[r]
                                                 for r, v in self.verify_factor.items()):
            self._forget()
        elif self._changes % RESCORE_EVERY == 0:
            self._forget(None, sets=True)

    def _forget(self, name: str | None = None, sets: bool = False) -> None:
        """Drop what the memo keeps (of option `name` only, if given; sets: only the sets every option feeds): an
        estimate it was computed from changed."""
        if name is not None or sets:
            self._memo.pop(name, None)
        else:
            self._memo.clear()
            self._shared = (self.round_overhead, dict(self.verify_factor))
        self.version += 1

    def _forget_switched(self) -> None:
        """The switch cost changed: drop the tables that price one (the free ones and the round costs stand: the
        next stretch's first round need not score every option, width and scenario afresh), and the sets."""
        for name, memo in self._memo.items():
            if name is None:
                memo.clear()
                continue
            for key in [k for k in memo if k[-1] != "free" and k[0] != "round costs"]:
                del memo[key]
        self.version += 1

    def _forget_options(self, names: set[str]) -> None:
        """The estimates of options `names` changed (none else): their own tables, those of the options whose offers
        were scored since the last batch (`observe_offer`: their tables are refreshed whenever any are), and the
        sets every option feeds are scored again; the others' tables stand."""
        if not names:
            return
        for name in names | self._shadowed_options:
            self._forget(name)
        self._shadowed_options = set()
        self._forget(None, sets=True)

    def observe_plain(self, seconds: float) -> None:
        """Measured seconds of one pipelined plain token: how fast the machine runs now (`SCALE_WINDOW`, never above
        `PRICE_WINDOW`'s; a check of the scale keeps only its own tokens: `check_due`). What the ledger was credited
        since the previous one is priced again at the scale a check measures where that is lower (`_confirm`)."""
        self._speeds.append((self.round, seconds / self.plain_cal))
        self._sampled_at = self.round
        if self._check_from is None:
            self.scale = plain_price([x for _, x in self._speeds])
            if self._unconfirmed:
                self._unconfirmed.clear()  # priced on a scale measured in the latest `STALE_ROUNDS` rounds
            return
        fresh = [(r, x) for r, x in self._speeds if r >= self._check_from]
        if len(fresh) < CHECK_SAMPLES:
            return
        self._speeds = collections.deque(fresh, maxlen=PRICE_WINDOW)
        self._check_from = None
        self.scale = _median([x for _, x in fresh])
        self._forget()  # a plain verdict held for the check does not hold past it
        self._confirm()

    def check_due(self) -> bool:
        """Whether this round must be plain to measure the scale again: no plain token was measured in the latest
        `STALE_ROUNDS` rounds — or, before the first, in the first `first_check_rounds` (the scale then being one
        checked when auto was built; None: never before the first, the scale being the calibration's own) — or a
        check began and has not yet its `CHECK_SAMPLES` tokens. Every time auto compares
        — each option's measured costs and the ledger's plain price — goes through the scale, so a stretch must not
        run on one measured long ago: the machine may have sped up since (a stretch entered on a slow moment then
        looks cheap, its ledger in surplus) or slowed down."""
        if self._check_from is not None:
            return True
        if self._sampled_at is None:
            if self.first_check_rounds is None or self.round < self.first_check_rounds:
                return False
        elif self.round - self._sampled_at <= self.stale_rounds:
            return False
        self._check_from = self.round
        self.checks += 1
        self._forget()
        return True

    def _confirm(self) -> None:
        """The ledger's credits since the latest measured plain token before a check, at the scale the check
        measured if that is lower (plain decoding cheaper than they were priced against: they saved less, or lost
        more); a higher one changes nothing (the ledger never rises on a re-pricing)."""
        changed = False
        for name, (wall, charged) in self._unconfirmed.items():
            extra = wall / self.scale - charged
            if extra > 0.0 and name in self.saved:
                self.saved[name] -= extra
                changed = True
        self._unconfirmed.clear()
        if changed:
            self._bar()

    def summary(self) -> dict:
        return {
            "plain_token_ms_now": round(1000 * self.plain_cost, 3),
            "plain_token_ms_calibrated": round(1000 * self.plain_cal, 3),
            "verify_cost_ms": {L: round(1000 * c, 3) for L, c in sorted(self.costs.items())},
            "verify_cost_ratio": {L - 1: round(c / self.costs[1], 3) for L, c in sorted(self.costs.items())},
            "speed_scale_now": round(self.scale, 3),
            "scale_checks": self.checks, "offers_scored": self.shadowed,
            "verify_factor": {r: round(v, 3) for r, v in sorted(self.verify_factor.items())},
            "round_overhead_ms": round(1000 * self.scale * self.round_overhead, 3),
            "switch_cost_ms": round(1000 * self.scale * self.switch_cost, 3),
            "wake_tokens": self.wake_tokens,
            "chosen": {f"{n}:{k}": c for (n, k), c in sorted(self.chosen.items(), key=lambda x: (x[0][0], x[0][1]))},
            "explored": dict(sorted(self.explored.items())),
            "ledger_saved_ms": {n: round(1000 * self.scale * v, 3) for n, v in sorted(self.saved.items())},
            "ledger_elapsed_ms": round(1000 * self.scale * self.elapsed, 3),
            "barred": sorted(self.barred),
            "stretch_tokens": {n: {r: round(v, 1) for r, v in sorted(o.stretch.items())}
                               for n, o in self.options.items() if o.stretch},
            "verify_factor_by_option": {n: {r: round(v, 3) for r, v in sorted(o.verify_factor.items())}
                                        for n, o in self.options.items() if o.verify_factor},
            "acceptance": {n: {reg: [round(a, 3) for a in s.alphas()] for reg, s in o.stats.items()}
                           for n, o in self.options.items()},
            "this_request": {n: {reg: round(o.rho(reg), 3) for reg in o.here}
                             for n, o in self.options.items() if o.here},
            "here_weight": {n: {reg: round(o.here_weight(reg), 1) for reg in sorted(o.between)}
                            for n, o in self.options.items() if o.between},
            "draft_cost_ms": {n: {f"k={k}": round(1000 * self.scale * o.cost(k), 3) for k in sorted({1, o.max_k})}
                              for n, o in self.options.items() if o.cost.unit is not None},
        }
