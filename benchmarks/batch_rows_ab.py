"""The batch's per-row choice, A/B in one process (issue 24): N rows of the embedded model (the shipped prompts under
the chat template, 64 tokens, temperature T, per-row seeds), RUNS runs, the modes' order reversed from run to run;
ms per token and each run's ar ÷ mode, as medians and means over the runs, the steps each mode's chooser ran, and per batch size what a plain
step cost by the chooser's price where it chose to speculate (not to explore) against what its priced plain steps
took.
Every auto mode has its own `AutoDrafter` (`ab_setup.second_auto`: estimates, costs and ledger its own).

Modes: ar (plain rows); auto (the batch's chooser as it is); before (the chooser before the twenty-sixth session: each
row's model drafters priced by the estimates pooled over rows and requests alone, no `BatchAuto.rho`; every row with an
option drafting at the step's width whatever its drafting costs; a plain step priced by an EMA of the plain steps, not
their latest `SCALE_WINDOW`'s median; speculative shapes priced as today, in plain steps); ema (auto with only the last
of those: the EMA plain price); ar2 (plain rows again: an A/A control); plainauto (auto rows whose every step is plain:
what the rows' bookkeeping and the choice cost); nochoice (auto rows the batch never asks anything: their
bookkeeping alone, the n-gram index kept); eager (auto asking its choice every step, as before the thirtieth
session, however seldom it speculates: `BatchAuto.asks`); quietplain (auto whose every answer is plain, asked as
seldom as such a batch asks: what asking costs it); ngauto (auto rows carrying n-gram lookup only, no model drafter:
`BatchAuto.carries` always no); plainngauto (both); plaincarry (auto rows whose every step is plain, carrying
every model drafter: what carrying costs); stale (auto as before the twenty-eighth session: a check after
`STALE_ROUNDS` steps whatever the margin a stretch was chosen by, `BatchAuto.stale_after`, and no credit re-priced by a
check, `BatchAuto._confirm`); warm (auto started from what another auto learned over AB_LEARN runs, default 16, of
the same rows before the A/B — as a process does from what the last one kept, `speculative.auto.learned`); warmfull
(the same at the whole weight of what the teacher measured, not half); uncapped (auto whose plain step of B rows is
priced by B rows' own steps alone, as before the fifty-second session, not at most a larger row count's price:
`BatchAuto.plain_price`). Every other
auto starts cold (`ab_setup`).
With AB_SET=DIR the trained tiny set (`bench_tiny_set.py`: its target, DFlash drafter and MTP layers; the prompts
byte-encoded as `glimmer bench` does, no EOS: every row runs its 64 tokens) instead of the embedded model.

    python benchmarks/batch_rows_ab.py N RUNS MODES [T]        e.g. 2 30 ar,auto,before,ema
"""
import os
import statistics
import sys

from ab_setup import batch_prompts, second_auto, taught, timed_steps, tiny_set, warm

from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.session import load_session
from glimmer_mlx.speculative.auto import batch as auto_batch
from glimmer_mlx.speculative.batch import BatchGenerator, BatchRequest

N, RUNS, MODES = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
T = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
TINY = os.environ.get("AB_SET")
if TINY:
    s, encoded = tiny_set(TINY)
    m, tok, EOS = s.model, None, set()
    ids = [encoded[c][0] for c in encoded] + [encoded[c][1 % len(encoded[c])] for c in encoded]
else:
    s = load_session(None)
    m, tok = s.model, s.tokenizer
    EOS = set(tok.eos_token_ids)
    ids = batch_prompts(tok)


def every_row_drafts(self, k, shift=None):
    """`StepChoice.at` before the twenty-sixth session: each row its option with the most expected tokens."""
    plan, tokens, drafting, L = [], self.fixed_tokens, 0.0, self.fixed_width
    for col, count in zip(self._picks(shift), self.counts):
        pick, e = col[k]
        tokens += count * e
        plan.append((None, 0) if pick is None else pick)
        if pick is not None:
            drafting += count * self.draft_cost(pick)
            L = max(L, pick[1] + 1)
    return (0.0, plan) if L == self.fixed_width else (tokens / (self.step_cost(L) + drafting), plan)


def ema_observe(self, n, seconds, spec, rows=None):
    """`BatchAuto.observe` before the twenty-sixth session: every shape's price an EMA of its steps."""
    if seconds <= 0:
        return
    self.measured[n] = auto_batch.robust_ema(self.measured.get(n), seconds, auto_batch.EMA)
    if rows and (spec or n != rows):  # (a speculative shape in plain steps of its rows, as `observe` keeps it)
        rel = self.relative.setdefault(rows, {})
        rel[n // rows] = auto_batch.robust_ema(rel.get(n // rows), seconds / self.step_cost(rows, rows=rows),
                                               auto_batch.EMA)
    elif rows:
        self.plain_by_rows[rows] = auto_batch.robust_ema(self.plain_by_rows.get(rows), seconds, auto_batch.EMA)
    self.ratio = auto_batch.robust_ema(self.ratio, seconds / self.calibrated(n), auto_batch.EMA)
    if not spec:
        self._priced_at = self.stepped
        self._check = max(0, self._check - 1)


at, rhos, observe = auto_batch.StepChoice.at, auto_batch.BatchAuto.rhos, auto_batch.BatchAuto.observe
auto_batch.StepChoice.at = lambda self, k, shift=None: (
    every_row_drafts if getattr(self.auto, "variant", None) == "before" else at)(self, k, shift)
auto_batch.BatchAuto.rhos = lambda self, here, regime: (
    () if getattr(self, "variant", None) == "before" else rhos(self, here, regime))
auto_batch.BatchAuto.observe = lambda self, *a, **k: (
    ema_observe if getattr(self, "variant", None) in ("before", "ema") else observe)(self, *a, **k)
priced, took = {}, {}  # variant -> plain step prices at its speculative choices / its priced plain steps' seconds
choose, observe_now = auto_batch.BatchAuto.choose, auto_batch.BatchAuto.observe


def noted_choose(self, rows, fixed_rows, *a):
    k, plan = choose(self, rows, fixed_rows, *a)
    if k > 0 and self.exploring is None:
        B = len(rows) + fixed_rows
        priced.setdefault((self.variant, B), []).append(self.step_cost(B, rows=B))
    return k, plan


def noted_observe(self, n, seconds, spec, rows=None):
    if not spec and rows and n == rows and seconds > 0:
        took.setdefault((self.variant, rows), []).append(seconds)
    observe_now(self, n, seconds, spec, rows)


def variant_choose(self, rows, *a):
    if self.variant in ("plainauto", "plainngauto", "plaincarry"):
        self.exploring = None
        return 0, [(None, 0)] * len(rows)
    return noted_choose(self, rows, *a)


carries = auto_batch.BatchAuto.carries
stale_after, confirm = auto_batch.BatchAuto.stale_after, auto_batch.BatchAuto._confirm
auto_batch.BatchAuto.stale_after = property(lambda self: (
    auto_batch.STALE_ROUNDS if self.variant == "stale" else stale_after.fget(self)))
auto_batch.BatchAuto._confirm = lambda self, *a: None if self.variant == "stale" else confirm(self, *a)
auto_batch.BatchAuto.choose, auto_batch.BatchAuto.observe = variant_choose, noted_observe
auto_batch.BatchAuto.carries = lambda self, *a, **k: (
    False if self.variant in ("ngauto", "plainngauto") else True if self.variant == "plaincarry"
    else carries(self, *a, **k))
asks, pick = auto_batch.BatchAuto.asks, auto_batch.BatchAuto._pick
plain_price = auto_batch.BatchAuto.plain_price
auto_batch.BatchAuto.plain_price = lambda self, rows: (
    self.plain_by_rows.get(rows) if self.variant == "uncapped" else plain_price(self, rows))
auto_batch.BatchAuto._pick = lambda self, rows, *a: (
    (0, [(None, 0)] * len(rows)) if self.variant == "quietplain" else pick(self, rows, *a))
auto_batch.BatchAuto.asks = lambda self: True if self.variant == "eager" else asks(self)
engine_choose = BatchGenerator._choose
BatchGenerator._choose = lambda self, rows: (
    {} if getattr(self.auto, "variant", None) == "nochoice" else engine_choose(self, rows))
PLAIN = ("ar", "ar2")
chooser = {}
for mode in MODES:
    if mode not in PLAIN:
        chooser[mode] = auto_batch.BatchAuto(second_auto(s))
        chooser[mode].variant = mode


def run(mode, r):
    g = BatchGenerator(m, auto=chooser.get(mode))
    for j in range(N):
        g.add(BatchRequest(ids[(r + j) % len(ids)], Sampler(SamplingParams(temperature=T), 100 * r + j), 64,
                           EOS, tok, auto=mode not in PLAIN))
    return timed_steps(g)


if {"warm", "warmfull"} & set(MODES):  # a teacher learns over AB_LEARN runs; they start from what it kept
    LEARN = int(os.environ.get("AB_LEARN", "16"))
    chooser["teacher"] = auto_batch.BatchAuto(second_auto(s))
    chooser["teacher"].variant = "teacher"
    kept = taught(chooser["teacher"].auto,  # other seeds and row orders than the A/B's
                  lambda: [run("teacher", RUNS + r) for r in range(LEARN)])
    del chooser["teacher"]
    for mode, weight in (("warm", None), ("warmfull", 1.0)):
        if mode in chooser:
            print(f"{mode}: {warm(chooser[mode].auto, kept, weight)} estimates restored from a teacher's {LEARN} "
                  "runs", flush=True)
res = {mode: [] for mode in MODES}
for r in range(RUNS):
    for mode in MODES if r % 2 == 0 else MODES[::-1]:
        res[mode].append(run(mode, r))
for mode, v in res.items():
    ratios = [a / b for a, b in zip(res["ar"], v)] if "ar" in res else [1.0]
    c = chooser.get(mode)
    print(f"N={N} T={T} {mode}: ms/token median {statistics.median(v):.3f} mean {statistics.mean(v):.3f}; ar ÷ it "
          f"median {statistics.median(ratios):.3f} mean {statistics.mean(ratios):.3f}"
          + ("" if c is None else f"; steps {c.steps} explored {c.explored}")
          + "".join(f"; {B} rows: a plain step priced {1e3 * statistics.mean(v):.2f} ms at its {len(v)} speculative "
                    f"choices, its priced plain steps {1e3 * statistics.mean(took.get((mode, B), [0.0])):.2f}"
                    for (name, B), v in sorted(priced.items()) if name == mode), flush=True)
