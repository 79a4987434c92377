"""Simulate `auto`'s chooser (`AutoChooser`, the real decision code) against fixed choices on a synthetic drafter:
per-position acceptance drawn at random, the trained tiny set's verify cost curve (OpenBLAS, BENCHMARKS.md), a plain
token 3.2 ms, the first plain token after a speculative round unpipelined (+0.9 of a step), a drafter idle for more
than a block recomputing its taps (C(L)); the chooser's ledger is kept as AutoDecoder keeps it (`credit`,
`elapse`). Noise-free, so decision-rule changes can be compared without a quiet machine; the figures it prints are
tokens per second relative to plain decoding, averaged over seeds.

    python benchmarks/simulate_auto.py --draft-ms 3 [--future-tokens 128] [--requests 10 --tokens 96] [--spread 0.3]
        [--phased 0.85,1.12,0.87]   (acceptance per phase of a response; adds the oracle policy)
        [--warm 10]   (adds `warm`: auto started from what another auto kept after that many requests of its own,
                       other draws, as a new process starts from the last one's file: `speculative.auto.learned`)
        [--age 0.9995]   (the chooser's fade of an idle option's evidence a round; default `AutoChooser`'s 0.998)
        [--fixed-here]   (ρ's weight fixed at HERE_WEIGHT, not measured between requests: `Option.here_weight`)
        [--decay 0.97]   (the drafter's counts' fade a round of its own; default `chooser.MODEL_DECAY`)
        [--cost-noise 0.1]   (each timed draft, verify and plain token × a lognormal factor: the machine's jitter)
        [--context-sd 0.3]   (each round's acceptance × a lognormal factor: contexts differ round to round)
        [--expected]   (auto learns from, and its ledger credits, each round's expected acceptance given its drafts —
                        `verify.expected_acceptance`, exact here — not the coins its round drew)
"""

from __future__ import annotations

import argparse
import random
import statistics

import glimmer_mlx.speculative.auto.chooser as chooser_mod
from glimmer_mlx.speculative.auto import learned
from glimmer_mlx.speculative.auto.chooser import AutoChooser

MS = 1e-3
COSTS = {1: 3.2 * MS, 2: 3.2 * MS, 3: 3.2 * MS, 4: 3.63 * MS, 5: 3.63 * MS, 6: 3.68 * MS, 7: 3.68 * MS,
         8: 3.68 * MS, 9: 3.68 * MS}
PLAIN = 3.2 * MS
# DFlash's conditional acceptance per position on the trained tiny set at T = 1 (issue20-tiny-trained-r0.json)
ALPHAS = [0.508, 0.717, 0.627, 0.676, 0.669, 0.798, 0.46]
AGE = None  # --age: the chooser's fade of idle evidence per round (`AutoChooser` age; None: its default)
NOISE = 0.0  # --cost-noise: each timed draft, verify and plain token × a lognormal factor of this sd (jitter)
DECAY = chooser_mod.MODEL_DECAY  # --decay: the drafter's counts' fade per round of its own (`AcceptanceStats.decay`)
CONTEXT_SD = 0.0  # --context-sd: each round's acceptance × a lognormal factor of this sd (contexts differ)
EXPECTED = False  # --expected: auto learns from (and its ledger credits) a round's expected acceptance, not its coins


def new_chooser(draft: float, prior_tau: float, phased: tuple | None) -> AutoChooser:
    ch = AutoChooser(COSTS, plain_cost=PLAIN, **({} if AGE is None else {"age": AGE}))
    ch.add("dflash", 7, "block", draft_prior=draft, decay=DECAY,
           measured_tau={"width": 7, "greedy": prior_tau, "sampling": prior_tau})
    if phased is None:
        ch.phases = None
    return ch


def warmed(draft: float, *, teach: int, seed: int, prior_tau: float, phased: tuple | None, **kw) -> AutoChooser:
    """A chooser started from what a first one kept after `teach` requests of its own (other draws)."""
    teacher = new_chooser(draft, prior_tau, phased)
    simulate("auto", draft, requests=teach, seed=seed + 2 * 10**6, prior_tau=prior_tau, phased=phased, ch=teacher,
             **kw)
    fps = {"dflash": "sim"}
    student = new_chooser(draft, prior_tau, phased)
    kept = {"format": learned.FORMAT, "options": learned.snapshot(teacher, fps)}
    learned.restore(student, learned.parse(kept, student, fps))
    return student


def simulate(policy: str, draft: float, *, requests: int, tokens: int, seed: int, prior_tau: float = 2.2,
             regime: str = "sampling", spread: float = 0.0, phased: tuple | None = None,
             ch: AutoChooser | None = None) -> tuple[float, int]:
    """(tokens per second, exploration rounds) of `policy` ("plain", "dflash": every round at 7 drafts, "auto",
    "oracle": the drafter in the phases where it pays by its true acceptance, plain in the others).
    spread: each request's acceptance is ALPHAS × (1 − spread) or × (1 + spread), at random (prompts differ).
    phased: (f0, f1, f2): the acceptance × f_p in phase p of a response (`chooser.PHASES`; auto is told them), as
    the trained tiny set's DFlash at T = 1 does (driven alone there: ~0.92x plain in the opening and after 64 tokens,
    ~1.16x between). ch: the chooser auto decides with (default: a fresh one; "warm": `warmed`'s)."""
    rng = random.Random(seed)
    noise = random.Random(seed + 3 * 10**6)
    context = random.Random(seed + 4 * 10**6)

    def jitter() -> float:
        return noise.lognormvariate(-NOISE * NOISE / 2, NOISE) if NOISE > 0 else 1.0

    kinds = random.Random(seed + 10**6)  # the requests' draws, the same for every policy
    if policy == "warm":
        policy = "auto"
    if ch is None:
        ch = new_chooser(draft, prior_tau, phased)
    bounds = chooser_mod.PHASES
    seconds, done = 0.0, 0
    for _ in range(requests):
        left, spec_last, lag = tokens - 1, False, 0
        seconds, done = seconds + PLAIN, done + 1  # the prefill's token
        factor = 1.0 + spread * kinds.choice((-1.0, 1.0))
        ch.new_context()
        while left > 0:
            generated = tokens - left
            phase = chooser_mod.phase_of(generated, bounds)
            f = factor * (phased[phase] if phased is not None else 1.0)
            alphas = [min(a * f, 0.98) for a in ALPHAS]
            k = min(7, left - 1)
            name, kk = None, 0
            if k >= 1 and (policy == "dflash" or policy == "oracle" and pays(alphas, draft)):
                name, kk = "dflash", k
            elif k >= 1 and policy == "auto":
                ch.set_lag("dflash", lag, fill=lag > 8)  # a drafter in step since its last round has its taps
                ch.set_phase(generated if phased is not None else None)
                name, kk = ch.choose({"dflash": k}, regime, left)
            if name is None:
                p = PLAIN * jitter()
                wall = p * (1.9 if spec_last else 1.0)
                seconds += wall
                if policy == "auto":
                    ch.elapse(wall)
                    ch.observe_plain(p)
                    if spec_last:
                        ch.observe_switch(0.9 * PLAIN)
                        ch.credit("dflash", 0, 0.9 * PLAIN)  # the stretch's unpipelined plain token (its ledger)
                left, done, lag, spec_last = left - 1, done + 1, lag + 1, False
                continue
            fill = COSTS[9] if lag > 8 else 0.0
            c = context.lognormvariate(-CONTEXT_SD * CONTEXT_SD / 2, CONTEXT_SD) if CONTEXT_SD > 0 else 1.0
            here = [min(a * c, 0.98) for a in alphas]
            n = 0
            while n < kk and rng.random() < here[min(n, len(here) - 1)]:
                n += 1
            expected, reach = [], 1.0  # (what `verify.expected_acceptance` measures: the coins averaged out)
            for j in range(kk):
                a = here[min(j, len(here) - 1)]
                expected.append((reach, reach * a))
                reach *= a
            d, v = draft * jitter(), COSTS[kk + 1] * jitter()
            wall = d + v + fill
            seconds += wall
            got = min(n + 1, left)
            left, done, lag, spec_last = left - got, done + got, n + 1, True
            if policy == "auto":
                ch.update("dflash", kk, n, regime, d, v, expected if EXPECTED else None)
                ch.elapse(wall)
                ch.credit("dflash", 1 + sum(x for _, x in expected) if EXPECTED and got == n + 1 else got, wall)
    return done / seconds, sum(ch.explored.values())


def pays(alphas: list[float], draft: float) -> bool:
    """Whether a round of 7 drafts at these true acceptances beats plain tokens (the oracle's rule)."""
    return chooser_mod.expected_tokens(alphas) / (draft + COSTS[8]) > 1.0 / PLAIN


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-ms", type=float, default=3.0, help="the drafter's seconds per round, in ms")
    ap.add_argument("--future-tokens", type=int, default=None, help="override chooser.FUTURE_TOKENS")
    ap.add_argument("--prior-tau", type=float, default=2.2, help="the drafter's eval.json τ at 7 drafts")
    ap.add_argument("--prior-weight", type=float, default=None, help="override chooser.PRIOR_WEIGHT")
    ap.add_argument("--loss-budget", type=float, default=None, help="override chooser.LOSS_BUDGET (the ledger's)")
    ap.add_argument("--ledger-floor", type=float, default=None, help="override chooser.LEDGER_FLOOR (plain tokens)")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--spread", type=float, default=0.0, help="requests' acceptance × (1 ± spread), at random")
    ap.add_argument("--fixed-here", action="store_true",
                    help="ρ's weight fixed at HERE_WEIGHT, not measured between requests (as before session 37)")
    ap.add_argument("--here-weight", type=float, default=None, help="override chooser.HERE_WEIGHT")
    ap.add_argument("--phased", default=None, help="f0,f1,f2: acceptance × f_p in phase p of a response")
    ap.add_argument("--age", type=float, default=None, help="override AutoChooser's age (idle evidence's fade a round)")
    ap.add_argument("--decay", type=float, default=None, help="override chooser.MODEL_DECAY (0.97 before session 37)")
    ap.add_argument("--cost-noise", type=float, default=0.0,
                    help="each timed draft, verify and plain token × lognormal(sd): the machine's jitter")
    ap.add_argument("--context-sd", type=float, default=0.0,
                    help="each round's acceptance × lognormal(sd): contexts differ round to round")
    ap.add_argument("--expected", action="store_true",
                    help="auto learns from (and credits) a round's expected acceptance given its drafts, not its coins")
    ap.add_argument("--warm", type=int, default=0, help="add `warm`: auto started from what one kept after N requests")
    a = ap.parse_args()
    global AGE, DECAY, NOISE, CONTEXT_SD, EXPECTED
    AGE = a.age
    NOISE = a.cost_noise
    CONTEXT_SD, EXPECTED = a.context_sd, a.expected
    if a.decay is not None:
        DECAY = a.decay
    if a.future_tokens is not None:
        chooser_mod.FUTURE_TOKENS = a.future_tokens
    if a.prior_weight is not None:
        chooser_mod.PRIOR_WEIGHT = a.prior_weight
    if a.loss_budget is not None:
        chooser_mod.LOSS_BUDGET = a.loss_budget
    if a.here_weight is not None:
        chooser_mod.HERE_WEIGHT = a.here_weight
    if a.fixed_here:
        chooser_mod.HERE_WEIGHT_MIN = chooser_mod.HERE_WEIGHT_MAX = chooser_mod.HERE_WEIGHT
    if a.ledger_floor is not None:
        chooser_mod.LEDGER_FLOOR = a.ledger_floor
    phased = tuple(float(x) for x in a.phased.split(",")) if a.phased else None
    kw = dict(tokens=a.tokens, prior_tau=a.prior_tau, spread=a.spread, phased=phased)
    res = {p: [simulate(p, a.draft_ms * MS, requests=a.requests, seed=s, **kw,
                        ch=warmed(a.draft_ms * MS, teach=a.warm, seed=s, **kw) if p == "warm" else None)
                for s in range(a.seeds)]
           for p in ("plain", "dflash", "auto") + (("oracle",) if phased else ()) + (("warm",) if a.warm else ())}
    base = statistics.mean(r for r, _ in res["plain"])
    rel = {p: round(statistics.mean(r for r, _ in v) / base, 3) for p, v in res.items()}
    print(f"draft {a.draft_ms} ms, prior τ {a.prior_tau}, FUTURE_TOKENS {chooser_mod.FUTURE_TOKENS}, PRIOR_WEIGHT "
          f"{chooser_mod.PRIOR_WEIGHT}, LOSS_BUDGET {chooser_mod.LOSS_BUDGET}, LEDGER_FLOOR "
          f"{chooser_mod.LEDGER_FLOOR}, HERE_WEIGHT {chooser_mod.HERE_WEIGHT}, decay {DECAY}, spread {a.spread}, "
          f"phased {phased}, cost noise {NOISE}: × plain {rel}, auto explored "
          f"{statistics.mean(e for _, e in res['auto']):.1f} rounds a run"
          + (f", warm {statistics.mean(e for _, e in res['warm']):.1f}" if a.warm else ""))


if __name__ == "__main__":
    main()
