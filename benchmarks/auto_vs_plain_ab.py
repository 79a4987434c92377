"""auto vs plain decoding, interleaved, long (issue 20): the embedded model, the first prompt of each shipped category
under the chat template, MAX_TOKENS tokens, REPS repeats, the modes' order rotated and reversed from run to run
(`glimmer_mlx.bench.runner.task_order`: each mode follows each other mode equally often); the generation
seconds of each mode summed over all its runs, as × plain, and auto's choices. Greedy outputs are checked identical
to plain's.

Modes: ar; ar2 (plain again: an A/A control, how far two identical modes drift apart in the sitting); auto; forced
(auto whose verify cost curve is linear, so that no drafter can ever pay: every round plain — what auto's own
bookkeeping costs); notree (auto without its DFlash token-tree option, built as auto: over copies of the drafters);
notreeshared (the same over the session's own drafter objects, which the fixed dflash/mtp modes also drive: notree
as the script built it before the fiftieth session); noledger (auto whose ledger never bars an
option: what its estimates alone do); auto2 (a second auto built as the first: an A/A control for auto); emascale (auto
with the speed scale of the sixth session: an EMA of plain tokens and unpipelined plain steps, not the median of the
former); nocheck (auto whose speculative stretches never stop to measure plain tokens again, as in the seventh
session); budget2 (auto whose ledger lets speculation lose 2 % of the decoding time, as before the eighth session,
not 0.5 %); before (both: the seventh session's auto); servable (an exploration's value counts every future token,
not only those the option could serve, as before the ninth session); shrunk (n-gram's second draft shrunk toward the
first, as before the ninth session); nowide (a drafter's catch-up forward priced by the verify curve extended
linearly, as before the ninth session); surplus25 (losers may lose a quarter of what the others saved, as before the
ninth session, not 1 %); surplus1 (losers may lose 1 % of what the others saved, as before the fourteenth
session, not 0.25 %); meantaps (a prefill yields the drafters' taps only where one pays by its mean estimate, as
before the ninth session); noshadow (greedy n-gram offers passed over are not scored, as before the ninth session);
eighth (all six: the eighth session's rules; its catch-ups still run only what the chunks miss); nophase (one set of
acceptance estimates and ledger entries for a whole response, as before the tenth session, not one per phase:
`chooser.PHASES`); dfauto, dfauto_nophase (auto over the DFlash drafter alone: plain, its chains or its trees per
round; and the same without phases); dfforced (auto over the DFlash drafter alone, made to draft every round it can:
what auto's own machinery costs against DFlash alone); ngauto (auto over n-gram lookup alone: plain or n-gram per
round); ngdf, ngdf_never (auto over n-gram lookup and the DFlash drafter; and the same with the drafter's ledger
entries barred throughout: what carrying it costs where it never drafts); never (auto whose model
drafters' entries are all barred throughout); nowarm (auto whose plain forwards never yield the model drafters'
taps); norun, ngnorun (auto, and auto over n-gram lookup alone, whose n-gram offers are named by matched size
only: no "ngram@run", as before the twelfth session); nowake,
ngnowake (auto, and auto over n-gram lookup alone, charging a stretch the first plain token after it only, the slow
ones after that measuring the speed scale, as before the thirteenth session: `chooser.SETTLE_SLACK`); noz (auto whose
ledger bars on its floor and budget alone, as before the seventeenth session: `chooser.LEDGER_Z`); nohere (auto whose
rounds are priced by the estimates carried across requests alone, as before the seventeenth session:
`chooser.HERE_WEIGHT`); pooled (auto whose ledger bars every option that lost once the losses exceed the budget, as
before the seventeenth session, not the largest losers until the rest fits); emaoverhead (auto whose round overhead
is an EMA of samples capped at two plain steps only, as before the eighteenth session: `chooser.OVERHEAD_CLIP`);
nomtp (auto without the MTP drafter:
DFlash and n-gram lookup); linearcatch (auto whose drafters' catch-ups are priced per position of backlog alone, as
before the thirty-eighth session, not also by the context it attends over: `Option.catch_quad`); notenure (auto whose
drafters' catch-ups are spread over the horizon, as before the thirty-ninth session, not over the tokens a catch-up
measurably serves: `AutoChooser.tenure`); dflash, ngram, mtp (fixed, dflash at block 8); warm (auto started from what a teacher auto learned over AB_LEARN
repeats of the prompts, default 2, other seeds, before the A/B: as a new process starts from what the last one kept,
`speculative.auto.learned`; every other auto starts cold, `ab_setup`); warmfull (the same at the whole weight of
what the teacher measured); noquiet (auto whose plain stretches ask every round, as before the thirty-fourth session:
`chooser.QUIET_RATE`); nocatchup (auto whose drafters' first catch-ups are priced at nothing, as before the
thirty-fifth session: `calibrate.measure_catch_up`); bare (auto reduced to the engine's plain path, no plan and no
bookkeeping: a bound for what its plain stretches could cost); forcednoshadow (forced without scoring the n-gram offers passed over); noexplore (auto
that never explores: an option is drafted only where its mean estimate pays — what exploring costs and finds);
trainprior (auto whose DFlash and MTP start from what training measured, eval.json's "training_eval", as before the
thirty-sixth session; embedded model only); oldwake (auto whose stretch's wake is charged whole when the request
ends or the next stretch begins, as before the thirty-sixth session); onedraft (auto whose rounds' drafts are priced
alike at T = 0 and T > 0, from the greedy calibration, as before the thirty-sixth session); before36 (all three);
before37 (auto whose ρ weighs its prior by `chooser.HERE_WEIGHT` always, not by how far the requests measured
differ, as before the thirty-seventh session); decay97 (auto whose model drafters' estimates fade by 0.97 a round
of their own, as before the thirty-seventh session, not `chooser.MODEL_DECAY`); coins (auto whose estimates and ledger
learn from what each round's uniforms decided, as before the forty-eighth session, not from what its drafts are
accepted on average: `verify.expected_acceptance`); wholeratio (auto whose ρ's weight is measured from each finished
request's whole acceptance ratio squared less its sampling part, as before the fiftieth session, not from what its
odd and even rounds share: `chooser.Option.close_here`); here64 (auto whose ρ starts from a weight of 64 expected
drafts before how far requests differ is measured, not `chooser.HERE_WEIGHT`'s 16); widest (auto whose DFlash
chain rounds draft all the block offers whenever it chooses that chain, not the width the cost curve makes best);
straight (auto whose cached cost curve is straightened to C(1) + b · (L − 1), b its least-squares slope); readfirst
(auto whose sampled chain rounds read what their drafts are accepted on average before the verify, as before the
fifty-first session: `engine.AutoDecoder.sampled`); medcost (auto whose verify and drafting factors are the medians
of their latest 16 rounds' measures, not EMAs); warmfree (auto whose plain forwards keep a model drafter's taps
while its rate in step beats plain, not its rate with the catch-up it has now: `AutoChooser.paying`; tried in the
fifty-second session, level).

    python benchmarks/auto_vs_plain_ab.py T REPS [MAX_TOKENS [MODES]]     e.g. 1 20 96 ar,ar2,forced,auto
    AB_OUT=FILE ...   also appends the sitting to FILE as one JSON line (every run, each auto's summary)
    AB_SETTLE=SECONDS ...   idle this long before each run (default 0)
    AB_PROMPT_TOKENS=N ...   every prompt lengthened to N tokens (its category's prompts repeated before it)
    AB_SET=DIR python benchmarks/auto_vs_plain_ab.py ...   the trained tiny set (benchmarks/bench_tiny_set.py DIR):
        its target, DFlash drafter and MTP layers; the prompts byte-encoded as `glimmer bench` does
"""
import copy
import math
import os
import statistics
import sys
import time

import glimmer_mlx
import ab_setup
from ab_setup import args, never_models, session_and_prompts
from glimmer_mlx.bench.runner import task_order
from glimmer_mlx.speculative.auto import make_auto
from glimmer_mlx.speculative.auto.chooser import ENTER_GAIN, HERE_WEIGHT, LEDGER_FLOOR, SWITCH_HORIZON
from glimmer_mlx.speculative.engine import AutoDecoder
from glimmer_mlx.speculative.verify import expected_acceptance

T, reps, maxt = args()
modes = sys.argv[4].split(",") if len(sys.argv) > 4 else ["ar", "auto"]
SETTLE = float(os.environ.get("AB_SETTLE", "0"))  # seconds idle before each run (what the run before left running
# settles: OpenBLAS's idle threads spin ~0.1 s after a multi-row GEMM)
s, ids, SET = session_and_prompts()
cats = list(ids)
m = s.model
d = s.drafters
# every run decodes MAX_TOKENS tokens, as `glimmer bench` does: at T = 1 an EOS ends each mode's runs at its own
# length (auto's first speculative round changes what the rest samples), and runs of 10 and 96 tokens weigh alike in
# the mean of seconds per token (the tiny set's runs at T = 1 averaged ~59 tokens, 1 770 in 30 runs)
m.eos_token_ids = set()


def second_auto(**options):
    """An auto built exactly as the session's (`strategy.Drafters.auto`), but its own (`ab_setup.second_auto`)."""
    return ab_setup.second_auto(s, **options)


def unguarded(auto):
    auto.chooser._bar = lambda: None
    return auto


def budget(auto, share):
    """auto whose ledger lets speculation lose `share` of the decoding time (`AutoChooser.loss_budget`)."""
    auto.chooser.loss_budget = share
    return auto


def no_z(auto):
    """auto as before the seventeenth session: its ledger bars on the floor and the budget alone, not also beyond
    what its rounds swing by chance (`AutoChooser.ledger_z`)."""
    auto.chooser.ledger_z = 0.0
    return auto


def no_here(auto):
    """auto as before the seventeenth session: every round priced by its option's estimates carried across requests,
    not scaled by how this request's rounds did against them (`chooser.HERE_WEIGHT`)."""
    auto.chooser.new_context = auto.chooser.clear_lags
    return auto


def pooled_bar(auto):
    """auto as before the seventeenth session: once the losers' losses exceed what they may lose, every option that
    lost is barred, not only the largest losers until the rest fits (`AutoChooser._bar`)."""
    ch = auto.chooser

    def bar():
        losers = {n for n, v in ch.saved.items() if v < 0.0}
        short = -sum(ch.saved[n] for n in losers) - ch.surplus_share * sum(v for v in ch.saved.values() if v > 0.0)
        noise = ch.ledger_z * math.sqrt(sum(ch.spread_sq.get(n, 0.0) for n in losers))
        if short > max(ch.loss_budget * ch.elapsed, LEDGER_FLOOR * ch.plain_cal, noise):
            barred, ch._reopen = frozenset(n for n, v in ch.saved.items() if v <= 0.0), short / ch.loss_budget
        else:
            barred, ch._reopen = frozenset(), math.inf
        if barred != ch.barred:
            ch.barred = barred
            ch.rescore()

    ch._bar = bar
    return auto


def no_check(auto):
    """auto as before the eighth session: a speculative stretch never stops to measure plain tokens again, however
    old the scale it is priced on (`AutoChooser.check_due`)."""
    auto.chooser.stale_rounds = 10**9
    return auto


def ema_scale(auto):
    """The speed scale as it was before the seventh session: an EMA (clipped 3x a sample) of the pipelined plain
    tokens and of the unpipelined plain steps through the speculative engine, instead of the median of the former."""
    from glimmer_mlx.speculative.auto.chooser import AutoChooser, robust_ema

    ch = auto.chooser
    ch.stale_rounds = 10**9  # as it was then: a stretch never checks the scale (nor could: the EMA keeps no rounds)

    def observe_plain(seconds):
        ch.scale = robust_ema(ch.scale, seconds / ch.plain_cal, ch.scale_ema)

    def update(name, k, n_accepted, regime="greedy", draft_time=None, verify_time=None, expected=None):
        AutoChooser.update(ch, name, k, n_accepted, regime, draft_time, verify_time, expected)
        if verify_time is not None and (name is None or k == 0):
            ch.scale = robust_ema(ch.scale, verify_time / ch.costs[1], ch.scale_ema)

    ch.observe_plain, ch.update = observe_plain, update
    return auto


def all_servable(auto):
    """auto as before the ninth session: an exploration's value counts every future token, not only the share the
    option could serve (`AutoChooser._servable`)."""
    auto.chooser._servable = lambda name, top, regime: 1.0
    return auto


def shrunk(auto):
    """auto as before the ninth session: n-gram lookup's second draft shrunk toward the first's acceptance, not
    toward its `then` prior (`AcceptanceStats.then`)."""
    for name, opt in auto.chooser.options.items():
        if name.startswith("ngram@"):
            for regime in ("greedy", "sampling"):
                opt.acceptance(regime).then = None
    return auto


def no_shadow(auto):
    """auto as before the ninth session: n-gram offers passed over are not scored (`AutoDrafter._shadow`)."""
    auto._shadow = lambda regime, taken, k: None
    return auto


def mean_taps(auto):
    """auto as before the ninth session: a prefill yields the drafters' taps only where one pays by its mean
    estimate, not where one could pay (`AutoDrafter.wants_taps`)."""
    def wants_taps(regime):
        auto.chooser.clear_lags()
        auto._lost.clear()
        return auto._warm(regime, None)

    auto.wants_taps = wants_taps
    return auto


def surplus(auto, share):
    """auto whose losers may lose `share` of what the options in surplus saved (`AutoChooser.surplus_share`)."""
    auto.chooser.surplus_share = share
    return auto


def no_phase(auto):
    """auto as before the tenth session: one set of acceptance estimates and ledger entries per regime for a whole
    response, not one per phase of it (`AutoChooser.set_phase`)."""
    auto.chooser.phases = None
    return auto


def forced_dflash(auto):
    """auto over the DFlash drafter alone that drafts with its chain every round it can (never plain, never a tree,
    no check of the speed scale): its own bookkeeping and measures run as ever."""
    ch = auto.chooser

    def pick(available, regime="greedy", remaining=None):
        ch.set_horizon(remaining)
        cap = available.get("dflash", 0)
        return ("dflash", min(cap, ch.options["dflash"].max_k), False) if cap >= 1 else (None, 0, False)

    ch.pick = pick
    ch.keep = lambda name, available, regime="greedy", remaining=None: pick(available, regime, remaining)
    ch.relevant = lambda regime="greedy", remaining=None: None
    ch.check_due = lambda: False
    return auto


def no_warm(auto):
    """auto whose plain forwards never yield the model drafters' taps (`AutoDrafter._warm` always False): a drafter
    it tries catches up on its backlog then."""
    auto._warm = lambda regime, remaining: False
    return auto


def no_run(auto):
    """auto whose n-gram offers are named by their matched size only, as before the twelfth session: an offer that
    goes on with a copy the committed tokens confirmed is not its own option (`NGramDrafter.offer`)."""
    auto.drafters["ngram"]._runs = lambda p, first: False
    return auto


def no_wake(auto):
    """auto as before the thirteenth session: a stretch is charged the first plain token after it only; the slow
    pipelined plain tokens after that measure the speed scale (`AutoDrafter.plain_token`)."""
    auto.chooser.settle_max = 0
    return auto


def no_wide(auto):
    """auto as before the ninth session: a forward over a drafter's backlog priced by the verify curve extended
    linearly, not toward the calibration's wide forward (`AutoChooser.forward_cost`)."""
    auto.chooser.wide = None
    auto.chooser._forget()
    return auto


def ema_overhead(auto):
    """auto as before the eighteenth session: its round overhead an EMA of samples capped at two plain steps only,
    not also at `chooser.OVERHEAD_CLIP` × the estimate (`AutoChooser.observe_round_overhead`)."""
    ch = auto.chooser

    def observe_round_overhead(seconds):
        x = min(max(seconds / ch.scale, 0.0), 2.0 * ch.plain_cal)
        ch.round_overhead = (1 - ch.scale_ema) * ch.round_overhead + ch.scale_ema * x
        ch._rescore(None)
    ch.observe_round_overhead = observe_round_overhead
    return auto


def linear_catch_up(auto):
    """auto as before the thirty-eighth session: a drafter's catch-up priced per position of its backlog alone, as
    measured over 128 positions after 32 (`calibrate.measure_catch_up`: per + quad · 192), not also by the context
    that backlog attends over (`Option.catch_quad`)."""
    for opt in auto.chooser.options.values():
        if opt.catch_quad:
            opt.catch_up, opt.catch_quad = opt.catch_up + opt.catch_quad * 192, 0.0
    auto.chooser.rescore()
    return auto


def no_tenure(auto):
    """auto as before the thirty-ninth session: a drafter's catch-up spread over the horizon, not over the tokens its
    catch-ups measurably serve (`AutoChooser.tenure`)."""
    auto.chooser.tenure = lambda name, regime="greedy": SWITCH_HORIZON
    return auto


def no_explore(auto):
    """auto that never explores (`AutoChooser.explore` finds nothing): it drafts only where an option pays by its mean
    estimate."""
    auto.chooser.explore = lambda *args, **kwargs: None
    return auto


def before37(auto):
    """auto as before the thirty-seventh session: ρ's weight fixed at `chooser.HERE_WEIGHT`, not measured between
    requests (`Option.here_weight`)."""
    for opt in auto.chooser.options.values():
        opt.here_weight = lambda regime: HERE_WEIGHT
    return auto


def decay(auto, factor):
    """auto whose model drafters' acceptance estimates fade by `factor` with each round of their own
    (`chooser.MODEL_DECAY`)."""
    for opt in auto.chooser.options.values():
        if opt.shadowed:
            continue  # n-gram lookup's
        opt.decay = factor
        for st in opt.stats.values():
            st.decay = factor
    return auto


def no_quiet(auto):
    """auto whose plain stretches ask every round, as before the thirty-fourth session (`chooser.QUIET_RATE`)."""
    auto._unasked = lambda regime: False
    return auto


def no_catch_up(auto):
    """auto whose drafters' catch-ups are priced at nothing until one is measured, as before the thirty-fifth session
    (`calibrate.measure_catch_up`)."""
    for opt in auto.chooser.options.values():
        opt.catch_up = 0.0
    auto.chooser.rescore()
    return auto


def bare(auto):
    """auto reduced to the engine's plain path: every round plain, no plan, no bookkeeping (an upper bound for what
    auto's plain stretches could cost)."""
    def plan(k, regime, remaining):
        auto.needs_taps = False
        return True

    def accept(taps, new_tokens):
        auto._tokens += new_tokens

    auto.plan, auto.accept = plan, accept
    auto.plain_token = lambda seconds: None
    auto.chooser.elapse = lambda seconds: None
    return auto


def whole_ratio(auto):
    """auto whose options measure how far requests differ as before the fiftieth session (`Option.close_here`): each
    finished request's (accepted / expected − 1)² less its sampling part, weighed by the share of its ratio that was
    its own rounds'."""
    from glimmer_mlx.speculative.auto.chooser import HERE_REQUESTS, prior_between

    def close_here(opt):
        def close(here=None):
            for regime, h in (opt.here if here is None else here).items():
                if h[1] <= 0.0:
                    continue
                w = h[1] / (h[1] + opt.here_weight(regime))
                n, s2, q = opt.between.get(regime) or prior_between()
                n = min(n + w, HERE_REQUESTS)
                s2 += w * ((h[0] / h[1] - 1.0) ** 2 - h[2] / h[1] ** 2 - s2) / n
                q += w * (h[2] / h[1] - q) / n
                opt.between[regime] = (n, s2, q)
            if here is None:
                opt.here = {}
        return close

    for opt in auto.chooser.options.values():
        opt.close_here = close_here(opt)
    return auto


def here_prior(auto, weight):
    """auto whose model drafters' ρ starts from a weight of `weight` expected drafts (how far requests differ, before
    any is measured: `chooser.HERE_WEIGHT`, 16), counted as `chooser.HERE_PRIOR_REQUESTS` requests."""
    from glimmer_mlx.speculative.auto.chooser import prior_between

    for opt in auto.chooser.options.values():
        if not opt.shadowed:
            opt.between = {r: prior_between(weight) for r in ("greedy", "sampling")}
    auto.chooser.rescore()
    return auto


def widest(auto):
    """auto whose DFlash chain rounds draft as many as the drafter offers (k = block size − 1) whenever it chooses
    DFlash's chain, whatever width the cost curve made best (a DFlash draft costs the same at any k)."""
    ch = auto.chooser
    choose = ch.choose

    def choose_widest(available, regime="greedy", remaining=None, picked=None):
        name, k = choose(available, regime, remaining, picked)
        if name == "dflash":
            k = min(available.get(name, k), ch.options[name].max_k)
        return name, k

    ch.choose = choose_widest
    return auto


def straight_curve(auto):
    """auto whose verify cost curve is its cached one straightened: C(L) = C(1) + b · (L − 1), b the least-squares
    slope through every measured width (the curve's shape between widths without its steps; level, plain token and
    the tree option's shape as measured)."""
    ch = auto.chooser
    c1 = ch.costs[1]
    xs = [L - 1 for L in ch.costs if L > 1]
    b = sum(x * (ch.costs[x + 1] - c1) for x in xs) / sum(x * x for x in xs)
    for L in ch.costs:
        ch.costs[L] = c1 + max(0.0, b) * (L - 1)
    ch.rescore()
    return auto


def coins(auto):
    """auto whose estimates and ledger learn from what each round's coins decided, as before the forty-eighth session,
    not from what its drafts are accepted on average (`verify.expected_acceptance`)."""
    accept = auto.accept

    def accept_coins(taps, new_tokens):
        auto.expected = None
        return accept(taps, new_tokens)

    auto.accept = accept_coins
    return auto


def median_costs(auto, window: int = 16):
    """auto whose verify factors and drafting factors are the medians of their latest `window` rounds' measures (the
    value they started from counting as one until the window is full), not EMAs: a few rounds in a slow moment of
    the machine no longer move them, as the speed scale (a median of plain tokens) is not moved by a few slow
    plain tokens."""
    from collections import deque
    ch = auto.chooser
    wins = {}

    def med(key, start, x):
        st, w = wins.setdefault(key, (start, deque(maxlen=window)))
        w.append(x)
        return statistics.median(list(w) + ([st] if len(w) < window else []))

    observe_round = ch._observe_round

    def observe(name, k, n_accepted, regime, draft_time, verify_time, expected=None):
        opt = ch.options.get(name) if name is not None else None
        shared = ch.verify_factor.get(regime, 1.0)
        own = None if opt is None else opt.verify_factor.get(regime, shared)
        observe_round(name, k, n_accepted, regime, draft_time, verify_time, expected)
        if verify_time is None or name is None or k == 0:
            return
        L = k + 1 if opt is None else opt.verify_rows(k)
        if ch.costs.get(L, 0.0) <= 0:
            return
        x = verify_time / (ch.scale * ch.costs[L])
        if opt is None or opt.rows is None:
            ch.verify_factor[regime] = med(("shared", regime), shared, x)
        if opt is not None:
            opt.verify_factor[regime] = med((name, regime), own, x)

    ch._observe_round = observe
    for name, opt in ch.options.items():
        for which, dc in (("greedy", opt.cost), ("sampling", opt.sampling_cost)):
            if dc is None or not dc._shaped():
                continue

            def draft_observe(k, seconds, dc=dc, key=(name, which, "draft")):
                dc.unit = med(key, 1.0 if dc.unit is None else dc.unit, seconds / (dc.fixed + dc.per_draft * k))

            dc.observe = draft_observe
    return auto


def warm_free(auto):
    """auto whose plain forwards keep a model drafter's taps while its rate in step (no switch, no catch-up) beats
    plain by `chooser.ENTER_GAIN`, not its rate with the catch-up it has now (`AutoChooser.paying`)."""
    ch = auto.chooser

    def paying(regime="greedy", remaining=None, among=None):
        ch.set_horizon(remaining)
        bar = (1 + ENTER_GAIN) / ch.plain_cal
        return frozenset(n for n in ch.options if (among is None or n in among) and ch.entry(n) not in ch.barred
                         and ch._leaders(n, regime, True)[-1][1] > bar)

    ch.paying = paying
    return auto


def read_first(auto):
    """auto whose sampled chain rounds read what their drafts are accepted on average before the verify, as before the
    fifty-first session (p's evaluation a wait of its own), not after it from p and q evaluated with it
    (`engine.AutoDecoder.sampled`)."""
    auto.read_first = True
    return auto


_sampled = AutoDecoder.sampled


def sampled(self, p, q, drafts):
    if getattr(self.drafter, "read_first", False):
        self.drafter.expected = expected_acceptance(p, q, drafts)
    else:
        _sampled(self, p, q, drafts)


AutoDecoder.sampled = sampled


make = {
    "coins": lambda: coins(second_auto()),
    "readfirst": lambda: read_first(second_auto()),
    "medcost": lambda: median_costs(second_auto()),
    "warmfree": lambda: warm_free(second_auto()),
    "wholeratio": lambda: whole_ratio(second_auto()),
    "here64": lambda: here_prior(second_auto(), 64.0),
    "widest": lambda: widest(second_auto()),
    "straight": lambda: straight_curve(second_auto()),
    "bare": lambda: bare(second_auto()),
    "noquiet": lambda: no_quiet(second_auto()),
    "nocatchup": lambda: no_catch_up(second_auto()),
    "forcednoshadow": lambda: no_shadow(make_auto(m, dflash=d.dflash, mtp=d.mtp, ngram=8,
                                                  verify_costs={L: 0.005 * L for L in range(1, 17)})),
    "noexplore": lambda: no_explore(second_auto()),
    "ar": lambda: None, "ar2": lambda: None, "auto": d.auto,
    "forced": lambda: make_auto(m, dflash=d.dflash, mtp=d.mtp, ngram=8,
                                verify_costs={L: 0.005 * L for L in range(1, 17)}),
    "notree": lambda: second_auto(trees=False),
    "notreeshared": lambda: make_auto(m, dflash=d.dflash, mtp=d.mtp, ngram=8, trees=False),
    "nomtp": lambda: make_auto(m, dflash=d.dflash, ngram=8),
    "linearcatch": lambda: linear_catch_up(second_auto()),
    "notenure": lambda: no_tenure(second_auto()),
    "noledger": lambda: unguarded(second_auto()),
    "auto2": second_auto,
    "emascale": lambda: ema_scale(second_auto()),
    "budget2": lambda: budget(second_auto(), 0.02),
    "nocheck": lambda: no_check(second_auto()),
    "noz": lambda: no_z(second_auto()),
    "nohere": lambda: no_here(second_auto()),
    "before37": lambda: before37(second_auto()),
    "decay97": lambda: decay(second_auto(), 0.97),
    "pooled": lambda: pooled_bar(second_auto()),
    "emaoverhead": lambda: ema_overhead(second_auto()),
    "before": lambda: budget(no_check(second_auto()), 0.02),
    "servable": lambda: all_servable(second_auto()), "shrunk": lambda: shrunk(second_auto()),
    "nowide": lambda: no_wide(second_auto()),
    "surplus25": lambda: surplus(second_auto(), 0.25), "surplus1": lambda: surplus(second_auto(), 0.01),
    "meantaps": lambda: mean_taps(second_auto()),
    "noshadow": lambda: no_shadow(second_auto()), "nophase": lambda: no_phase(second_auto()),
    "eighth": lambda: no_shadow(mean_taps(surplus(no_wide(shrunk(all_servable(second_auto()))), 0.25))),
    "dfauto": lambda: make_auto(m, dflash=copy.copy(d.dflash), ngram=False),
    "dfforced": lambda: forced_dflash(make_auto(m, dflash=copy.copy(d.dflash), ngram=False)),
    "ngdf": lambda: make_auto(m, dflash=copy.copy(d.dflash), ngram=8),
    "ngdf_never": lambda: never_models(make_auto(m, dflash=copy.copy(d.dflash), ngram=8)),
    "dfauto_nophase": lambda: no_phase(make_auto(m, dflash=copy.copy(d.dflash), ngram=False)),
    "ngauto": lambda: make_auto(m, ngram=8),
    "nowarm": lambda: no_warm(second_auto()),
    "never": lambda: never_models(second_auto()),
    "norun": lambda: no_run(second_auto()), "ngnorun": lambda: no_run(make_auto(m, ngram=8)),
    "nowake": lambda: no_wake(second_auto()), "ngnowake": lambda: no_wake(make_auto(m, ngram=8)),
    "dflash": lambda: d.dflash, "ngram": d.ngram, "mtp": lambda: d.mtp,
}


def train_prior():
    """auto whose DFlash and MTP drafters start from what training measured (eval.json's "training_eval": 8
    validation prompts cut at 64 tokens, a mean of per-prompt τ, no phases), as before the thirty-sixth session: the
    embedded model only (the figures `embedded/build_embedded.py --stage eval` kept)."""
    import json

    from glimmer_mlx.embedded import embedded_path

    if SET:
        raise SystemExit("trainprior: the embedded model only (its eval.json keeps training's figures)")
    saved = {}
    for kind, dr in (("dflash", d.dflash), ("mtp", d.mtp)):
        ev = json.loads((embedded_path(kind) / "eval.json").read_text())
        old = ev["training_eval"]["after"]
        saved[kind] = dr, dr.measured_tau
        dr.measured_tau = {"width": int(ev["width"]) - (kind == "dflash"), "greedy": old["tau_greedy"],
                           "sampling": old["tau_t1"]}
    try:
        return second_auto()
    finally:
        for dr, tau in saved.values():
            dr.measured_tau = tau


def old_wake(auto):
    """auto as before the thirty-sixth session: a stretch's wake still open when the request ends or the next
    stretch begins is charged whole to the stretch's option (`AutoDrafter._close_wake`)."""
    close, start, extend = auto._close_wake, auto.start, auto.extend

    def start_(taps, ids_):
        close()
        auto._stretch = 0.0
        start(taps, ids_)

    def extend_(taps, ids_):
        close()
        extend(taps, ids_)

    auto._close_wake = lambda undecided=False: close()
    auto.start, auto.extend = start_, extend_
    return auto


def one_draft_cost(auto):
    """auto as before the thirty-sixth session: a round's draft priced and learned alike in both regimes (its greedy
    calibration), not per regime (`Option.draft`)."""
    for opt in auto.chooser.options.values():
        opt.sampling_cost = None
    auto.chooser.rescore()
    return auto


make["trainprior"] = train_prior
make["oldwake"] = lambda: old_wake(second_auto())
make["onedraft"] = lambda: one_draft_cost(second_auto())
make["before36"] = lambda: one_draft_cost(old_wake(train_prior()))

kept = None


def warmed(weight=None):
    global kept
    if kept is None:
        teacher = second_auto()

        def learn():
            for r in range(int(os.environ.get("AB_LEARN", "2"))):
                for c in cats:
                    glimmer_mlx.generate(m, ids[c], max_tokens=maxt, temperature=T, seed=1000 + r, drafter=teacher)

        kept = ab_setup.taught(teacher, learn)
    student = second_auto()
    print("warm:", ab_setup.warm(student, kept, weight), "estimates restored", flush=True)
    return student


make["warm"], make["warmfull"] = warmed, lambda: warmed(1.0)
drafter = {mo: make[mo]() for mo in modes}
seconds = {mo: [] for mo in modes}
requests = []  # per request: mode, category, repeat, seconds a token, rounds (plain among them), τ; an auto's choices
toks = {}
for r in range(reps):
    for ci, c in enumerate(cats):
        for mo in task_order(modes, r * len(cats) + ci):
            time.sleep(SETTLE)
            before = dict(drafter[mo].chooser.chosen) if hasattr(drafter[mo], "chooser") else None
            res = glimmer_mlx.generate(m, ids[c], max_tokens=maxt, temperature=T, seed=r, drafter=drafter[mo],
                                       block_size=8 if mo == "dflash" else None)
            seconds[mo].append(res.stats.generation_time / res.stats.generation_tokens)
            ex = res.stats.extra
            rec = {"mode": mo, "category": c, "rep": r, "s_token": seconds[mo][-1], "tokens": len(res.tokens),
                   "rounds": ex.get("rounds"), "plain_rounds": ex.get("plain_rounds"), "tau": ex.get("tau")}
            if before is not None:
                rec["chosen"] = {f"{n}:{k}": v - before.get((n, k), 0)
                                 for (n, k), v in drafter[mo].chooser.chosen.items() if v != before.get((n, k), 0)}
            requests.append(rec)
            if T == 0:
                toks.setdefault(c, res.tokens)
                assert res.tokens == toks[c], (mo, c)
base = sum(seconds["ar"])
print("T", T, "reps", reps, "tokens", maxt, "x plain:", {mo: round(base / sum(v), 3) for mo, v in seconds.items()},
      "ar ms/token %.2f" % (1e3 * statistics.mean(seconds["ar"])))
for mo, dr in drafter.items():
    if hasattr(dr, "chooser"):
        sm = dr.chooser.summary()
        print(mo, "chosen", sm["chosen"], "ledger", sm.get("ledger_saved_ms"), sm.get("ledger_elapsed_ms"),
              sm.get("barred"), "scale", sm["speed_scale_now"])
out = os.environ.get("AB_OUT")
if out:  # every run's seconds per token and each auto's summary, appended as one JSON line per sitting
    import json
    import platform
    import time

    sitting = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "set": SET or "embedded",
               "temperature": T, "reps": reps, "max_tokens": maxt, "machine": platform.machine(),
               "ld_preload": os.environ.get("LD_PRELOAD", ""),
               "x_plain": {mo: base / sum(v) for mo, v in seconds.items()},
               "seconds_per_token": seconds,
               "auto": {mo: dr.chooser.summary() for mo, dr in drafter.items() if hasattr(dr, "chooser")},
               "requests": requests,
               # what each auto measured as it was built (its draft and catch-up priors, in the calibration's seconds;
               # whether its cost curve was the cached one, or why that was measured again)
               "built": {mo: {"draft_costs": dr.draft_costs, "catch_up": dr.catch_up,
                              "calibration": {k: v for k, v in dr.calibration.items()
                                              if k in ("cached", "replaced", "checked_plain_token_s",
                                                       "checked_shape")}}
                         for mo, dr in drafter.items() if hasattr(dr, "draft_costs")}}
    with open(out, "a") as f:
        f.write(json.dumps(sitting) + "\n")
