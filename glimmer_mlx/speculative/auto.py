"""`auto`: per round, choose which drafter proposes (DFlash, MTP, n-gram prompt lookup) and how many drafts — or none,
a plain step — to maximise expected committed tokens per second on *this* machine.

Rate of an option (drafter d, k drafts):  E_d(k) / s·(draft_d(k) + v·C(k+1) + o [+ w]),  plain: 1 / (s·P), where
- E_d(k) = 1 + Σ_{i≤k} Π_{j≤i} α_{d,j}: expected tokens per round, α_{d,j} the running (exponentially decayed)
  conditional acceptance of draft position j for drafter d, kept separately for greedy and sampling (`AcceptanceStats`:
  position 0 from a prior or the drafter's measured τ, a rarely reached position like the one before it);
- C(L): seconds of one target forward over L tokens and P: seconds per pipelined plain token, calibrated once per
  machine and model (`load_or_calibrate`, cached as JSON);
- s: how much slower the machine runs now than at calibration, measured by every plain token (context length,
  load); every other time is kept in calibrated units, so comparisons never mix speeds;
- v: what a verify round measurably costs over the bare calibrated forward (sampling, the acceptance test), per regime;
- draft_d(k): the drafter's own measured time per round (constant in k for DFlash, which drafts a whole block in
  one forward; linear for MTP's chain; ~0 for n-gram lookup);
- o: a speculative round's measured time outside its draft and verify windows; w, charged only to a round that would
  interrupt a plain stretch: what a speculative stretch measurably costs beyond its rounds (the plain tokens either
  side lose their pipelining; a drafter that sat idle catches up on the tokens since it last drafted).
A drafter must also beat plain by `switch_margin` (10 %): every estimate is noisy and the best looking option is
the one most likely overestimated. n-gram lookup is only an option in a round where the context's suffix occurred
before (its drafts are known in advance: `peek`), one option per matched n-gram size. Because plain is always one of
the options and every option is scored in the same time unit, `auto` decodes plainly whenever no drafter pays (up
to the cost of occasional probes: an option idle for its probe interval is tried once in a round that would
otherwise be plain, so that its acceptance estimate can recover; its interval doubles, 16 → 1024 rounds, while its
probes keep losing; one clock per regime, as the estimate is). Inside a plain stretch a round asks only the options
that could change a plain choice (`AutoChooser.relevant`), so a stretch costs what plain decoding costs.

`AutoChooser` is the pure decision logic (unit-tested against synthetic cost/acceptance tables); `AutoDrafter` is the
engine-facing drafter holding several drafters in sync (all see every committed token and the union of their taps).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from weakref import WeakKeyDictionary

import mlx.core as mx

CACHE_ENV = "GLIMMER_MLX_CACHE_DIR"
CALIBRATION_CONTEXT = 128  # prompt tokens in the cache while the verify cost curve is measured
COST_SHAPES = ("block", "chain", "free")


# -------------------------------------------------------------------------------------------------------------
# pure decision logic


class AcceptanceStats:
    """Decayed accepted/tried counts per draft position. Position 0 starts from the prior (1 of 2, i.e. α = 0.5,
    unless given); a deeper position j is shrunk toward position j−1's estimate with the prior's weight (decaying
    with the counts), not toward 0.5: a position rarely reached keeps what the earlier ones measured instead of
    leaning on an optimistic constant (n-gram drafts at T = 1 rarely get past the first)."""

    def __init__(self, max_k: int, decay: float = 0.97, prior: tuple[float, float] = (1.0, 2.0)):
        self.max_k, self.decay, self.prior = max_k, decay, prior
        self.acc = [prior[0]] + [0.0] * (max_k - 1)
        self.tried = [prior[1]] + [0.0] * (max_k - 1)
        self.shrink = prior[1]  # weight of "like the position before" for positions >= 1

    def alphas(self) -> list[float]:
        out = [self.acc[0] / self.tried[0] if self.tried[0] > 0 else 0.5]
        for j in range(1, self.max_k):
            w = self.tried[j] + self.shrink
            out.append((self.acc[j] + self.shrink * out[-1]) / w if w > 0 else out[-1])
        return out

    def alpha(self, j: int) -> float:
        return self.alphas()[j]

    def set_alphas(self, alphas: list[float], weight: float = 1000.0) -> None:
        """Pin the estimates (synthetic tables, tests): α_j with the weight of `weight` observations."""
        for j in range(self.max_k):
            a = alphas[min(j, len(alphas) - 1)]
            self.acc[j], self.tried[j] = a * weight, weight
        self.shrink = 0.0

    def expected_tokens(self, k: int) -> float:
        e, p = 1.0, 1.0
        for a in self.alphas()[:k]:
            p *= a
            e += p
        return e

    def update(self, k: int, n_accepted: int) -> None:
        if k <= 0:
            return
        for j in range(self.max_k):
            self.acc[j] *= self.decay
            self.tried[j] *= self.decay
        self.shrink *= self.decay
        for j in range(min(n_accepted + 1, k, self.max_k)):  # positions up to the first rejection were tried
            self.tried[j] += 1
            if j < n_accepted:
                self.acc[j] += 1


PRIOR_WEIGHT = 4.0  # a drafter's own measured τ (its eval.json) counts as this many observed rounds


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


def read_measured_tau(folder, kind: str) -> dict | None:
    """{"width": drafts per round, "greedy", "sampling"} from a trained drafter's eval.json (τ after training, on its
    validation prompts, as `glimmer train` writes it: "width" there is the block size for DFlash, the depth for
    MTP), or None when there is none or it cannot be read."""
    try:
        ev = json.loads((Path(folder) / "eval.json").read_text())
        after = ev["after"]
        drafts = int(ev["width"]) - (1 if kind == "dflash" else 0)
        return {"width": drafts, "greedy": float(after["tau_greedy"]), "sampling": float(after["tau_t1"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def robust_ema(old: float | None, x: float, w: float, clip: float = 3.0) -> float:
    """EMA step with the new sample clipped to [old/clip, old·clip]: a timing spike (another process taking the
    CPU/GPU for a moment) moves the estimate by at most a factor (1 + w·(clip − 1)), while a lasting change still
    comes through within a few rounds."""
    if old is None or old <= 0:
        return x
    return (1 - w) * old + w * min(max(x, old / clip), old * clip)


class DraftCost:
    """A drafter's measured seconds per round as a function of k (EMA per k).

    shape "block": one forward whatever k (DFlash) — unmeasured k borrow the mean of measured ones; "chain": one
    forward per draft (MTP) — unmeasured k scale the nearest measured k linearly; "free": ~0 (n-gram lookup)."""

    def __init__(self, shape: str, prior: float, ema: float = 0.2):
        if shape not in COST_SHAPES:
            raise ValueError(f"cost shape must be one of {COST_SHAPES}, got {shape!r}")
        self.shape, self.prior, self.ema = shape, prior, ema
        self.by_k: dict[int, float] = {}

    def __call__(self, k: int) -> float:
        if k in self.by_k:
            return self.by_k[k]
        if not self.by_k:
            return self.prior * (k if self.shape == "chain" else 1)
        if self.shape == "chain":
            near = min(self.by_k, key=lambda m: (abs(m - k), m))
            return self.by_k[near] * k / near
        return sum(self.by_k.values()) / len(self.by_k)

    def observe(self, k: int, seconds: float) -> None:
        """EMA per k, starting from the current estimate (the prior at first): one slow first sample (another
        process took the machine) cannot lock an option out, a truly costly drafter is learned within a few rounds."""
        self.by_k[k] = robust_ema(self(k) if self(k) > 0 else None, seconds, self.ema)


@dataclass
class ProbeClock:
    """When an option last drafted (the chooser's round) and how many idle rounds it waits for a probe; one per
    regime, as the acceptance estimate a probe refreshes is."""

    last: int
    interval: int


@dataclass
class Option:
    name: str
    max_k: int
    cost: DraftCost
    stats: dict = field(default_factory=dict)  # "greedy" | "sampling" -> AcceptanceStats
    decay: float = 0.97
    prior_alpha: dict = field(default_factory=dict)  # regime -> α from the drafter's measured τ (else 0.5)
    clocks: dict = field(default_factory=dict)  # regime -> ProbeClock (the chooser starts it on first use)

    def acceptance(self, regime: str) -> AcceptanceStats:
        if regime not in self.stats:
            a = self.prior_alpha.get(regime)
            prior = (1.0, 2.0) if a is None else (a * PRIOR_WEIGHT, PRIOR_WEIGHT)
            self.stats[regime] = AcceptanceStats(self.max_k, self.decay, prior=prior)
        return self.stats[regime]


class AutoChooser:
    """Per round: the (option, k) with the highest expected tokens per second, or (None, 0) for a plain step.

    verify_costs: {L: seconds of a target forward over L tokens} for L = 1..max_k+1 (the calibrated curve);
    plain_cost: calibrated seconds per pipelined plain token (default: the single forward, verify_costs[1]).

    Every time is kept in calibrated units: one running `scale` (how much slower the machine runs now than at
    calibration, measured by every plain token) converts each measurement when it comes in. A slowdown seen while
    decoding plainly (another process, a longer context) then raises the drafters' costs too, and every comparison
    stays between figures measured at the same speed. A verify round does more than the calibrated forward
    (sampling the target's distributions, the acceptance test, rewinding): `verify_factor` (per regime) is its
    measured time over the calibrated forward's."""

    def __init__(self, verify_costs: dict[int, float], probe_every: int = 16, scale_ema: float = 0.1,
                 switch_margin: float = 0.1, plain_cost: float | None = None):
        if 1 not in verify_costs:
            raise ValueError("verify_costs needs L = 1 (a plain step)")
        self.costs = {int(L): float(c) for L, c in verify_costs.items()}
        self.plain_cal = float(plain_cost) if plain_cost else self.costs[1]
        self.options: dict[str, Option] = {}
        self.probe_every, self.scale_ema = probe_every, scale_ema
        # a drafter must promise this much more than plain decoding: every estimate is noisy, and the option that
        # looks best is the one most likely overestimated
        self.switch_margin = switch_margin
        self._spec_last = False  # the latest choice was a drafter
        self.scale = 1.0  # measured / calibrated time of a plain token, EMA
        self.verify_factor: dict[str, float] = {}  # regime -> measured verify round / calibrated forward, EMA
        # calibrated seconds a speculative round spends outside its measured draft and verify windows (choosing,
        # committing, the drafters' bookkeeping), EMA
        self.round_overhead = 0.0
        # calibrated seconds a speculative stretch costs beyond its rounds, EMA over stretches: what the plain tokens
        # on either side of it lost to the interrupted pipeline and what the drafter spent catching up on the tokens
        # it had not drafted from; charged to the round that would start a stretch
        self.switch_cost = 0.0
        self.max_probe_every = 64 * probe_every  # each option's probe interval doubles up to this
        self._probing = False
        self.round = 0  # rounds chosen so far: the probe clock
        self._next_probe: dict = {}  # regime -> the first round in which some option's probe falls due
        # per (regime, after a drafter?, option) its best width for each cap (`_leaders`), and per regime the options
        # that can beat plain at all (`relevant`), kept until an estimate changes: inside a plain stretch only the
        # machine's speed moves, which scales every rate alike, so a plain round does not pay for scoring every
        # option and width again (on a small model that Python work is a measurable share of a step)
        self._memo: dict = {}
        self.chosen: Counter = Counter()  # (name or "plain", k) -> rounds

    def add(self, name: str, max_k: int, shape: str, draft_prior: float | None = None, decay: float = 0.97,
            measured_tau: dict | None = None) -> Option:
        """measured_tau: {"width", "greedy", "sampling"} τ measured for this drafter (`read_measured_tau`): the
        acceptance estimates start from it instead of α = 0.5, so a weak drafter is not tried blindly first."""
        max_k = min(max_k, max(self.costs) - 1)
        if max_k < 1:
            raise ValueError(f"option {name!r}: the verify cost curve must cover at least L = 2")
        prior = draft_prior if draft_prior is not None else (0.0 if shape == "free" else 0.3 * self.costs[1])
        alphas = {} if not measured_tau else {
            regime: alpha_from_tau(measured_tau[regime], int(measured_tau["width"]))
            for regime in ("greedy", "sampling") if measured_tau.get(regime) is not None}
        opt = Option(name, max_k, DraftCost(shape, prior), decay=decay, prior_alpha=alphas)
        self.options[name] = opt
        self._memo.clear()
        self._next_probe.clear()
        return opt

    def clock(self, name: str, regime: str) -> ProbeClock:
        """Option `name`'s probe clock for `regime`, started (idle from now, the base interval) on first use."""
        clocks = self.options[name].clocks
        c = clocks.get(regime)
        if c is None:
            c = clocks[regime] = ProbeClock(self.round, self.probe_every)
        return c

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

    def rates(self, name: str, cap: int, regime: str = "greedy") -> list[float]:
        """[rate(name, k) for k = 1..min(cap, max_k)] in one pass."""
        opt = self.options[name]
        stats = opt.acceptance(regime)
        fixed = max(0.0, self.round_overhead) + (0.0 if self._spec_last else max(0.0, self.switch_cost))
        vf = self.verify_factor.get(regime, 1.0)
        out, e, p = [], 1.0, 1.0
        alphas = stats.alphas()
        for k in range(1, min(cap, opt.max_k) + 1):
            p *= alphas[k - 1]
            e += p
            out.append(e / (self.scale * (opt.cost(k) + vf * self.costs[k + 1] + fixed)))
        return out

    def _leaders(self, name: str, regime: str) -> list[tuple[int, float]]:
        """[(best k, its rate × scale) among k = 1..cap for cap = 1..max_k] of option `name`, kept until an estimate
        changes. In units of the speed scale, so a plain token moving the scale leaves it valid (every rate, plain's
        included, scales alike)."""
        key = (regime, self._spec_last, name)
        out = self._memo.get(key)
        if out is None:
            out, bk, br = [], 0, 0.0
            for k, r in enumerate(self.rates(name, self.options[name].max_k, regime), start=1):
                if r * self.scale > br * (1 + 1e-9):
                    bk, br = k, r * self.scale
                out.append((bk, br))
            self._memo[key] = out
        return out

    def best(self, available: dict[str, int], regime: str = "greedy") -> tuple[str | None, int, float]:
        """The best (name, k, rate) over the options in `available` ({name: most drafts it can give now}); a drafter
        has to beat plain decoding by `switch_margin`."""
        plain = 1.0 / self.plain_cal  # × scale, as `_leaders`
        best_name, best_k, best_rate = None, 0, plain
        bar = plain * (1 + 1e-9 + self.switch_margin)
        for name, cap in available.items():
            if name not in self.options:
                raise KeyError(f"unknown option {name!r}")
            if cap < 1:
                continue
            leaders = self._leaders(name, regime)
            k, r = leaders[min(cap, len(leaders)) - 1]
            if r > bar and r > best_rate * (1 + 1e-9):
                best_name, best_k, best_rate = name, k, r
        return best_name, best_k, best_rate / self.scale

    def pick(self, available: dict[str, int], regime: str = "greedy") -> tuple[str | None, int, bool]:
        """What `choose` would choose now, without counting it: (name or None, k, whether it is a probe). When the
        best option is a plain step, an option idle for its probe interval (in this regime) is tried once instead (the
        best-scoring one of those due) so that its acceptance estimate can recover."""
        name, k, _ = self.best(available, regime)
        if name is None:
            due = [(self._leaders(n, regime)[min(c, self.options[n].max_k) - 1][1], n, c)
                   for n, c in available.items() if c >= 1 and self._due(n, regime)]
            if due:
                _, name, cap = max(due)
                return name, min(cap, self.options[name].max_k, 4), True
        return name, k, False

    def choose(self, available: dict[str, int], regime: str = "greedy") -> tuple[str | None, int]:
        """The option for this round (`pick`), counted: the probe clock advances, the option's idle time restarts."""
        name, k, self._probing = self.pick(available, regime)
        self.round += 1
        if name is not None:
            clock = self.clock(name, regime)
            if not self._probing and not self._spec_last:
                # it wins on its own against plain (margin and switch cost included): probed at the base rate again
                # (a win inside a stretch is not that)
                clock.interval = self.probe_every
            clock.last = self.round
            self._next_probe.pop(regime, None)
        self.chosen[(name or "plain", k)] += 1
        self._spec_last = name is not None
        return name, k

    def relevant(self, regime: str = "greedy") -> frozenset | None:
        """After a plain round, the options that could make this round anything but plain: those that beat plain at
        some width (a scoring pass memoised until an estimate changes) and those whose probe falls due. None after a
        speculative round (every option counts). `choose` over the available ones among these chooses exactly as
        over all; when none is available the round is plain (`count_plain`) without asking the drafters.

        In a plain stretch this is what a round costs instead of every drafter's offer and a scoring pass: where the
        host's bookkeeping competes with the model for the cores (the 2-core CPU runs of this repository) each µs of
        it per token is a measurable share of a small model's step."""
        if self._spec_last:
            return None
        rel = self._memo.get(regime)
        if rel is None:
            rel = self._memo[regime] = frozenset(n for n, o in self.options.items()
                                                 if self.best({n: o.max_k}, regime)[0] is not None)
        due = self._next_probe.get(regime)
        if due is None:
            due = self._next_probe[regime] = min((c.last + c.interval for c in
                                                  (self.clock(n, regime) for n in self.options)), default=1 << 62)
        if self.round + 1 >= due:
            rel = rel | {n for n in self.options if self._due(n, regime)}
        return rel

    def _due(self, name: str, regime: str) -> bool:
        """Option `name` has sat idle for its probe interval by the coming round."""
        clock = self.clock(name, regime)
        return self.round + 1 - clock.last >= clock.interval

    def count_plain(self) -> None:
        """A plain round chosen without `choose` (nothing `relevant` was available, or `pick` said plain): counted as
        `choose` counts it."""
        self.round += 1
        self.chosen[("plain", 0)] += 1
        self._spec_last = self._probing = False

    def update(self, name: str | None, k: int, n_accepted: int, regime: str = "greedy",
               draft_time: float | None = None, verify_time: float | None = None) -> None:
        """After a round: k drafts of `name` proposed, n accepted; measured draft and verify seconds."""
        self._memo.clear()
        if name is not None and k > 0:
            opt = self.options[name]
            opt.acceptance(regime).update(k, n_accepted)
            if draft_time is not None:
                opt.cost.observe(k, draft_time / self.scale)
            if self._probing:  # a probe that still loses to plain: probe it half as often
                wins = self.best({name: opt.max_k}, regime)[0] is not None
                clock = self.clock(name, regime)
                clock.interval = self.probe_every if wins else min(2 * clock.interval, self.max_probe_every)
                self._next_probe.pop(regime, None)
        self._probing = False
        if verify_time is None:
            return
        if name is None or k == 0:  # a plain step through the speculative engine (not pipelined)
            self.scale = robust_ema(self.scale, verify_time / self.costs[1], self.scale_ema)
        elif k + 1 in self.costs and self.costs[k + 1] > 0:
            x = verify_time / (self.scale * self.costs[k + 1])
            self.verify_factor[regime] = robust_ema(self.verify_factor.get(regime, 1.0), x, self.scale_ema)

    def observe_round_overhead(self, seconds: float) -> None:
        """Measured wall time of a speculative round (from the previous round's commit to its own) minus its
        measured draft and verify time. An EMA from 0, each sample capped at two plain steps: one stall (another
        process, a first-call kernel build) cannot lock the drafters out, a lasting overhead comes through within
        ~20 speculative rounds."""
        x = min(max(seconds / self.scale, 0.0), 2.0 * self.plain_cal)
        self.round_overhead = (1 - self.scale_ema) * self.round_overhead + self.scale_ema * x
        self._memo.clear()

    def observe_switch(self, seconds: float, ema: float = 0.25) -> None:
        """What one speculative stretch cost beyond its rounds (`switch_cost`). Samples may be negative (the plain
        token before a stretch had no next forward to wait for); each is clipped to ±8 plain steps."""
        cap = 8.0 * self.plain_cal
        self.switch_cost = (1 - ema) * self.switch_cost + ema * min(max(seconds / self.scale, -cap), cap)
        self._memo.clear()

    def observe_plain(self, seconds: float) -> None:
        """Measured seconds of one pipelined plain token: how fast the machine runs now."""
        self.scale = robust_ema(self.scale, seconds / self.plain_cal, self.scale_ema)

    def summary(self) -> dict:
        return {
            "plain_token_ms_now": round(1000 * self.plain_cost, 3),
            "plain_token_ms_calibrated": round(1000 * self.plain_cal, 3),
            "verify_cost_ms": {L: round(1000 * c, 3) for L, c in sorted(self.costs.items())},
            "verify_cost_ratio": {L - 1: round(c / self.costs[1], 3) for L, c in sorted(self.costs.items())},
            "speed_scale_now": round(self.scale, 3),
            "verify_factor": {r: round(v, 3) for r, v in sorted(self.verify_factor.items())},
            "round_overhead_ms": round(1000 * self.scale * self.round_overhead, 3),
            "switch_cost_ms": round(1000 * self.scale * self.switch_cost, 3),
            "chosen": {f"{n}:{k}": c for (n, k), c in sorted(self.chosen.items(), key=lambda x: (x[0][0], x[0][1]))},
            "acceptance": {n: {reg: [round(a, 3) for a in s.alphas()] for reg, s in o.stats.items()}
                           for n, o in self.options.items()},
            "draft_cost_ms": {n: {k: round(1000 * self.scale * v, 3) for k, v in sorted(o.cost.by_k.items())}
                              for n, o in self.options.items()},
        }


# -------------------------------------------------------------------------------------------------------------
# calibration: the verify cost curve, measured once per machine and model


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "glimmer-mlx"


def machine_fingerprint() -> str:
    """Short hash of what makes timings differ between machines: OS, CPU/chip, cores, RAM, MLX device and version,
    the BLAS in use."""
    from importlib.metadata import version

    from ..bench import apple_chip, blas_in_use, cpu_model, total_memory

    cpu = cpu_model() or apple_chip() or platform.processor()
    mem = total_memory() or 0
    parts = [platform.system(), platform.machine(), cpu, str(os.cpu_count()), str(mem // 2**30),
             str(mx.default_device()), version("mlx"), blas_in_use()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def model_fingerprint(model) -> str:
    """Short hash of the target: its config and weight files (name, size), or its architecture when not from disk."""
    h = hashlib.sha256()
    path = getattr(model, "path", None)
    if path is not None and (Path(path) / "config.json").exists():
        p = Path(path)
        h.update((p / "config.json").read_bytes())
        for f in sorted(p.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    else:
        h.update(repr(sorted(vars(model.args).items(), key=lambda kv: kv[0])).encode())
    h.update(str(model.model.norm.weight.dtype).encode())
    return h.hexdigest()[:12]


def measure_verify_costs(model, cache, taps, max_k: int, repeats: int = 3) -> dict[int, float]:
    """Seconds for a target forward over L = 1..max_k+1 tokens at the cache's current length (rewound after)."""
    from ..cache import rewind_cache

    costs = {}
    for L in range(1, max_k + 2):
        x = mx.zeros((1, L), dtype=mx.int32)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            logits, tapped = model(x, cache, taps=taps)
            mx.eval(logits, tapped)
            best = min(best, time.perf_counter() - t0)
            rewind_cache(cache, L)
        costs[L] = best
    return costs


def pipelined_step_cost(model, cache, taps, n: int = 16) -> float:
    """Seconds per token of plain decoding at the cache's current length, each step queued (async) before the
    previous token is read back, as `PlainDecoder` and auto's plain stretches run (the cache is rewound after)."""
    from ..cache import rewind_cache

    y = mx.zeros((1,), dtype=mx.int32)
    times = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        logits, tapped = model(y.reshape(1, 1), cache, taps=taps)
        nxt = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
        mx.async_eval(nxt, *tapped)
        int(y.item())
        y = nxt
        times.append(time.perf_counter() - t0)
    mx.eval(y)
    rewind_cache(cache, n + 1)
    return sorted(times[1:])[n // 2]  # the median: the first step had nothing to overlap with


def calibrate(model, taps, max_len: int, context: int = CALIBRATION_CONTEXT,
              repeats: int = 5) -> tuple[dict[int, float], float]:
    """({L: seconds of a target forward over L tokens (with `taps`)}, seconds per pipelined plain token), both
    after `context` cached tokens."""
    from ..generate import prefill

    cache = model.make_cache(max_rewind=max(64, max_len, 17))
    ids = [int(x) for x in (mx.arange(context) % max(2, model.args.vocab_size - 2) + 2).tolist()]
    logits, tapped = prefill(model, cache, ids, taps=tuple(taps))
    mx.eval(logits, tapped)
    measure_verify_costs(model, cache, tuple(taps), max_len - 1, repeats=1)  # warm-up (first calls build kernels)
    # passes over every L, min per L: a burst of load from another process hits one pass of every L rather than
    # every repeat of one L (which would bend the curve's shape)
    passes = [measure_verify_costs(model, cache, tuple(taps), max_len - 1, repeats=1) for _ in range(repeats)]
    raw = {L: min(p[L] for p in passes) for L in passes[0]}
    # a forward over more tokens never costs less: a dip is timing noise, and keeping the running max errs toward
    # plain decoding (drafting is charged at least what the shorter forward cost)
    costs, top = {}, 0.0
    for L in sorted(raw):
        top = max(top, raw[L])
        costs[L] = top
    plain = min(pipelined_step_cost(model, cache, tuple(taps)) for _ in range(2))
    return costs, min(plain, costs[1])


def load_or_calibrate(model, taps, max_len: int, *, directory=None, recalibrate: bool = False,
                      log=None) -> tuple[dict[int, float], dict]:
    """The verify cost curve for this machine and model, from the cache file or measured now (then cached).

    Returns ({L: seconds}, info) with info = {"path", "cached", "machine", "model", "context", "plain_token_s"}
    (plain_token_s: seconds per token of pipelined plain decoding, measured with the curve)."""
    d = Path(directory) if directory is not None else cache_dir()
    machine, mod = machine_fingerprint(), model_fingerprint(model)
    taps = sorted(int(t) for t in taps)
    path = d / f"costs-{machine}-{mod}-taps{'_'.join(map(str, taps)) or 'none'}.json"
    info = {"path": str(path), "machine": machine, "model": mod, "context": CALIBRATION_CONTEXT}
    if path.exists() and not recalibrate:
        try:
            raw = json.loads(path.read_text())
            costs = {int(L): float(c) for L, c in raw["costs_s"].items()}
            if all(L in costs for L in range(1, max_len + 1)):
                return costs, {**info, "cached": True, "plain_token_s": float(raw["plain_token_s"])}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or too short: measure again
    if log:
        log(f"calibrating the verify cost curve (L = 1..{max_len}) for this machine and model → {path}")
    costs, plain = calibrate(model, taps, max_len)
    d.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"machine": machine, "model": mod, "taps": taps, "context": CALIBRATION_CONTEXT,
                               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "costs_s": {str(L): c for L, c in costs.items()}, "plain_token_s": plain},
                              indent=2))
    tmp.replace(path)
    return costs, {**info, "cached": False, "plain_token_s": plain}


# -------------------------------------------------------------------------------------------------------------
# the engine-facing drafter


_SHAPES = {"dflash": "block", "mtp": "chain", "ngram": "free"}


class AutoDrafter:
    """Several drafters behind the engine's drafter protocol; per round one proposes (or none: a plain step).

    Every sub-drafter sees every committed token (`accept`) with its own taps out of the union, so any of them can
    propose in any round. Keep one AutoDrafter per target for a process: what it learns (acceptance, draft costs)
    carries over between requests, decaying as it goes.

    n-gram lookup is one option per matched n-gram size ("ngram@1" … "ngram@4"): a continuation found after a
    4-gram is far more often right than one found after a single token, and pooling them would hide the good
    matches behind the many poor ones."""

    kind = "auto"
    width_name = "auto drafts"

    @property
    def mode(self) -> str:
        """What a decoder driving it reports: "auto", or the drafter's kind for one model drafter (`width_auto`)."""
        return next(iter(self.drafters)) if len(self.drafters) == 1 and "ngram" not in self.drafters else "auto"

    def __init__(self, target, drafters: list, *, verify_costs: dict[int, float] | None = None,
                 calibration_dir=None, recalibrate: bool = False, probe_every: int = 16, log=None):
        if not drafters:
            raise ValueError("auto needs at least one drafter (DFlash, MTP or n-gram)")
        self.target = target
        self.drafters: dict[str, object] = {}
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
        self.chooser = AutoChooser(verify_costs, probe_every=probe_every,
                                   plain_cost=self.calibration.get("plain_token_s"))
        self._kind_of: dict[str, str] = {}  # option name -> drafter kind
        for n, d in self.drafters.items():
            names = [n] if n != "ngram" else [f"ngram@{m}" for m in range(d.index.min_n, d.index.max_n + 1)]
            for name in names:
                self.chooser.add(name, d.max_drafts, _SHAPES[n], measured_tau=getattr(d, "measured_tau", None))
                self._kind_of[name] = n
        self._ngram_options = frozenset(o for o, n in self._kind_of.items() if n == "ngram")
        self._pending = None
        self._round = None  # (draft + verify seconds, catch-up seconds) of the last speculative round
        self._stretch = 0.0  # the running speculative stretch's cost beyond its rounds (`lead`, catch-ups)
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

    def plan(self, k: int, regime: str) -> bool:
        """Whether the next round is plain, decided before this round's token is known (AutoDecoder queues the next
        plain forward on it). A plain answer is counted as the round's choice. Otherwise the round is speculative
        and `propose` chooses it afresh, with the token this plan could not see: a decision taken on the n-gram
        index one token behind would draft from a match the latest token may already have broken. Inside a plain
        stretch only the options that could change a plain choice are asked what they offer
        (`AutoChooser.relevant`)."""
        among = self.chooser.relevant(regime)
        available = self._available(k, among)
        if (among is not None and not available) or self.chooser.pick(available, regime)[0] is None:
            self.chooser.count_plain()
            return True
        return False

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        regime = "greedy" if sampler.params.greedy else "sampling"
        name, kk = self.chooser.choose(self._available(k), regime)
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
        from ..cache import CacheRewindError

        for d in self.drafters.values():
            if not hasattr(d, "rewind_context"):
                raise CacheRewindError(f"the {d.kind} drafter cannot extend its state")
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

    def stats(self) -> dict:
        return {"auto": {**self.chooser.summary(), "drafters": sorted(self.drafters),
                         "calibration": self.calibration}}


def make_auto(target, *, dflash=None, mtp=None, ngram: bool | int = True, calibration_dir=None, log=None,
              **kw) -> AutoDrafter:
    """An AutoDrafter over the given drafters (objects from load_drafter / load_mtp) plus n-gram prompt lookup
    (ngram: True = up to 8 drafts, an int = that many, False = none)."""
    from .ngram import NGramDrafter

    ds = [d for d in (dflash, mtp) if d is not None]
    if ngram:
        ds.append(NGramDrafter(target.args.vocab_size, max_drafts=8 if ngram is True else int(ngram)))
    return AutoDrafter(target, ds, calibration_dir=calibration_dir, log=log, **kw)


_WIDTH_AUTO: WeakKeyDictionary = WeakKeyDictionary()  # drafter -> its width_auto AutoDrafter


def width_auto(target, drafter) -> AutoDrafter:
    """`block_size="auto"` for one DFlash or MTP drafter: auto's per-round choice between a plain step and that
    drafter at its best width (no n-gram lookup), with all of auto's cost accounting and pipelined plain stretches.
    One per drafter for the process (rebuilt if its most drafts per round changed), so what it learns carries over
    between requests; it drives `drafter` itself, whose state it changes."""
    a = _WIDTH_AUTO.get(drafter)
    if a is None or a.max_drafts != drafter.max_drafts or a.target is not target:
        a = _WIDTH_AUTO[drafter] = AutoDrafter(target, [drafter])
    return a


def _engine():
    from . import engine

    return engine


class AutoDecoder(_engine().SpeculativeDecoder):
    """The speculative engine for `auto`, with plain rounds pipelined as in `PlainDecoder`: while the chooser picks
    plain steps, the next token's forward is queued (async) before the current token is read back, so a stretch of
    plain rounds runs at plain decoding's speed. Whether the next round is plain is decided one token early inside a
    stretch (`AutoDrafter.plan`, the n-gram index one token behind); a speculative round is then chosen afresh when
    it starts. The target's taps of every plain token still reach every drafter."""

    def __init__(self, model, drafter, sampler, width=None, prefill_step: int = 512, cache=None):
        if getattr(drafter, "kind", None) != "auto":
            raise TypeError("AutoDecoder drives an AutoDrafter")
        super().__init__(model, drafter, sampler, None, prefill_step, cache)
        self.mode = drafter.mode
        self._queued = None
        self.plain_rounds = 0
        self._t_commit = None  # when the previous round's tokens were committed (None before the first)
        self._after = None  # what that round was: "plain", "spec" (a measured speculative round) or None
        self._spec_next = False  # `plan` said the next round is speculative (no plain forward queued for it)

    def _regime(self) -> str:
        return "greedy" if self.sampler.params.greedy else "sampling"

    def _forward(self, tok):
        """Queue the target forward of `tok` (an int already in history, or a lazy sampled token): (y, taps)."""
        p = self.sampler.params
        hist = None
        if isinstance(tok, int):
            x = mx.array([[tok]], dtype=mx.int32)
            hist = self._hist()
        else:
            x = tok.reshape(1, 1)  # the sampler's uint32 id, as plain decoding feeds it
            if p.repetition_penalty != 1.0:
                h = mx.array(self.history[-p.repetition_context_size:], dtype=mx.int32)
                hist = mx.concatenate([h, x.reshape(-1).astype(mx.int32)])[-p.repetition_context_size:]
        logits, taps = self.model(x, self.cache, taps=self.taps)
        y = self.sampler(logits[:, -1], hist)
        mx.async_eval(y, *taps)
        return y, taps

    def step(self, budget: int) -> list[int]:
        """One round. Timing is commit to commit (everything between two rounds' results, the consumer's work
        included): a plain token inside a plain stretch is what plain decoding costs now; a speculative round is
        charged what its draft and verify windows missed; a speculative stretch, what the plain tokens on either
        side of it cost beyond pipelined ones and what its drafters spent catching up (`AutoChooser.switch_cost`)."""
        auto, t_prev = self.drafter, self._t_commit
        if self._first is not None and budget > 1:  # the prefill's token
            t, self._first = self._first, None
            self.history.append(t)
            self._spec_next = budget > 2 and not auto.plan(min(self.max_k, budget - 2), self._regime())
            if not self._spec_next:  # a plain round follows: queue its forward now, as plain decoding does, while
                self._queued = self._forward(t)  # the caller handles this token
            self._t_commit = time.perf_counter()
            return [t]
        if self._queued is None:
            if (budget <= 1 or self._spec_next  # (the prefill's token is only still pending with budget 1)
                    or not auto.plan(min(self.max_k, budget - 1), self._regime())):
                self._spec_next = False
                out = super().step(budget)  # a speculative round (propose chooses it)
                now = time.perf_counter()
                spec = t_prev is not None and auto.end_round(now - t_prev)
                self._after, self._t_commit = ("spec" if spec else None), now
                return out
            self._queued = self._forward(self.history[-1])
        t0 = time.perf_counter()
        y, taps = self._queued
        self._queued = None
        left = budget - 1  # after this token
        if left == 1 or (left > 1 and auto.plan(min(self.max_k, left - 1), self._regime())):
            self._queued = self._forward(y)  # the next round is plain too: queue it before reading y
        else:
            self._spec_next = left > 1
        t = int(y.item())
        auto.accept(taps, [t])
        now = time.perf_counter()
        if t_prev is not None:
            excess = now - t_prev - auto.chooser.plain_cost
            if self._after == "spec":  # the first plain token after a speculative stretch
                auto.restart(excess)
            elif self._after == "plain" and self._queued is not None:  # inside a plain stretch
                auto.chooser.observe_plain(now - t_prev)
            elif self._after == "plain":  # the last plain token before a speculative round
                auto.lead(excess)
        self._after, self._t_commit = "plain", now
        self.t_verify += now - t0
        self.plain_rounds += 1
        return self._commit([t])

    def stats(self) -> dict:
        d = super().stats()
        d["plain_rounds"] = self.plain_rounds
        return d


def load_auto(target, *, dflash=None, mtp=None, embedded: bool = False, ngram: bool | int = True,
              calibration_dir=None, log=None) -> AutoDrafter:
    """An AutoDrafter from checkpoints: `dflash` a DFlash drafter folder, `mtp` a folder with MTP layers (default:
    the target's own, if it has them); `embedded`: fall back to the embedded model set's drafters for what is not
    given. At least n-gram lookup is always there."""
    from ..embedded import embedded_path
    from .drafter import load_drafter
    from .mtp import load_mtp

    def part(name):
        try:
            return embedded_path(name)
        except FileNotFoundError:
            return None

    if dflash is None and embedded:
        dflash = part("dflash")
    d = None
    if dflash is not None:
        d = load_drafter(dflash, target)
        if d.kind != "dflash":  # a folder with MTP layers given as the drafter: use it as such
            d, mtp = None, mtp if mtp is not None else dflash
    m = None
    if mtp is not None:
        m = load_mtp(mtp, target)
    elif getattr(target, "mtp_weights", None) is not None and len(target.mtp_weights):
        m = load_mtp(None, target)
    elif embedded and part("mtp") is not None:
        m = load_mtp(part("mtp"), target)
    if m is not None and m.depth < 2:
        m.set_depth(2)  # auto limits the drafts per round itself; depth 2 reuses the last layer once
    return make_auto(target, dflash=d, mtp=m, ngram=ngram, calibration_dir=calibration_dir, log=log)
