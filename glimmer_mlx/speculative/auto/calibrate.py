"""The verify cost curve `auto` decides with: seconds of a target forward over L = 1..max tokens (the verify of L − 1
drafts) and of a pipelined plain token, measured once per machine and model and cached as JSON in the cache folder
(`machine.cache_dir()`), keyed by the machine's and the model's fingerprints and the taps the forward produces."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path

import mlx.core as mx

from ...cache import rewind_cache
from ...files import write_atomic
from ...machine import cache_dir, machine_fingerprint
from ...runtime.plain import plain_token_seconds
from ...runtime.prefill import prefill
from ...sampling import Sampler, SamplingParams

CALIBRATION_CONTEXT = 128  # prompt tokens in the cache while the verify cost curve is measured
# the calibration also times one forward over this many positions (its scratch context, fed again): where a batch's
# step over B·L positions goes past the curve's widest verify, its cost is interpolated toward this compute-bound
# point instead of extrapolated from the curve's last (noisy, nearly flat) slope
WIDE_ROWS = CALIBRATION_CONTEXT


def hash_checkpoint(h, folder, names: tuple[str, ...] = ("config.json",)) -> None:
    """Feed `h` a checkpoint folder's identity: the contents of its files `names` (those present, in that order),
    then each weight file's name and size (cheap: the weights are not read)."""
    p = Path(folder)
    for name in names:
        if (p / name).is_file():
            h.update((p / name).read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())


def model_fingerprint(model) -> str:
    """Short hash of the target: its config and weight files (name, size), or its architecture when not from disk."""
    h = hashlib.sha256()
    path = getattr(model, "path", None)
    if path is not None and (Path(path) / "config.json").exists():
        hash_checkpoint(h, path)
    else:
        h.update(repr(sorted(vars(model.args).items(), key=lambda kv: kv[0])).encode())
    h.update(str(model.model.norm.weight.dtype).encode())
    return h.hexdigest()[:12]


def scratch_ids(model, n: int) -> list[int]:
    """n token ids for timing runs (2, 3, … wrapping below the vocabulary size)."""
    return [2 + i % max(2, model.args.vocab_size - 2) for i in range(n)]


def measure_verify_costs(model, cache, taps, max_k: int, repeats: int = 3) -> dict[int, float]:
    """Seconds for a target forward over L = 1..max_k+1 tokens at the cache's current length (rewound after)."""
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


def wide_forward_seconds(model, cache, ids: list[int], taps, repeats: int = 2) -> float:
    """Seconds of one forward over the len(ids) positions the cache holds last (rewound and fed again; min of
    `repeats`): the compute-bound end of the cost curve."""
    best = float("inf")
    for _ in range(repeats):
        rewind_cache(cache, len(ids))
        t0 = time.perf_counter()
        mx.eval(model(mx.array([ids], dtype=mx.int32), cache, taps=tuple(taps)))
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(model, taps, max_len: int, context: int = CALIBRATION_CONTEXT,
              repeats: int = 5) -> tuple[dict[int, float], float, float]:
    """({L: seconds of a target forward over L tokens (with `taps`)}, seconds per pipelined plain token without
    taps, seconds of a forward over `context` (= WIDE_ROWS) positions), the first two after `context` cached
    tokens."""
    cache = model.make_cache()
    ids = scratch_ids(model, context)
    logits, tapped = prefill(model, cache, ids, taps=tuple(taps))
    mx.eval(logits, tapped)
    wide = wide_forward_seconds(model, cache, ids, taps)
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
    # plain stretches compute no taps (a drafter catches up when it next drafts): the plain token is timed without
    plain = min(plain_token_seconds(model, cache) for _ in range(2))
    return costs, min(plain, costs[1]), max(wide, costs[max(costs)])


# a cached curve is used while a plain token measured now is within these bounds of the cached one (x now / cached);
# outside them (calibrated while another process loaded the machine, a changed power mode) it is measured again: the
# speed scale corrects drift only from plain tokens, and a plain cost calibrated 2.5x too high once made auto draft
# every round with nothing it ever measured saying otherwise
STALE = (0.5, 2.0)
# ... and while its shape holds: the verify of SHAPE_ROWS rows over a 1-row forward, measured now, within these bounds
# of the cached curve's ratio. A curve calibrated under a burst of load can keep a plausible plain token yet be flat
# (a cached file once said 1..8 rows cost the same, 16 ms, with a 6.7 ms plain token: auto then priced every draft
# as free and explored drafters that lost)
SHAPE = (0.67, 1.5)
SHAPE_ROWS = 9
# a 1-row forward with taps (unpipelined) that costs more than this many pipelined plain tokens of the same
# calibration means one of the two was timed under load: the file is not used
CONSISTENT = 1.6


def scratch_cache(model, context: int = 32):
    """A cache holding a short scratch context: what the checks of a cached curve measure on (they run every time
    `auto` is built, so they share one prefill)."""
    cache = model.make_cache()
    mx.eval(prefill(model, cache, scratch_ids(model, context)))
    return cache


def check_plain_token(model, cache=None, repeats: int = 2) -> float:
    """Seconds per pipelined plain token now: the least of `repeats` runs of the calibration's loop (8 tokens each,
    on a short scratch context) after one untimed, as the calibration takes the least of its own. It is auto's speed
    scale until its plain tokens measure one (`AutoChooser.first_check_rounds`), and a new process runs its first
    plain tokens slow: on the trained tiny set the first run after the session was set up took 3.0-3.5 ms a token
    in four processes of five, where runs a few seconds later took 2.6-2.7. Without the untimed run the check read
    3.3-3.7 ms in five new processes whose later checks settled at 2.7-2.9 (auto then started 15-30 % fast of the
    machine, its drafters' rounds priced that much cheap); with it 2.8-3.0 in four of five, 3.4 in one."""
    cache = cache if cache is not None else scratch_cache(model)
    plain_token_seconds(model, cache, n=8)  # the untimed run
    return min(plain_token_seconds(model, cache, n=8) for _ in range(repeats))


def check_shape(model, taps, rows: int, cache=None, repeats: int = 3) -> float:
    """C(rows) / C(1) measured now on a short scratch context (min over `repeats` alternating passes, after a
    warm-up pass): what a cached curve's shape is checked against."""
    cache = cache if cache is not None else scratch_cache(model)
    best = {1: float("inf"), rows: float("inf")}
    for r in range(repeats + 1):
        for L in best:
            t0 = time.perf_counter()
            mx.eval(model(mx.zeros((1, L), dtype=mx.int32), cache, taps=tuple(taps)))
            if r:
                best[L] = min(best[L], time.perf_counter() - t0)
            rewind_cache(cache, L)
    return best[rows] / best[1]


def cached_problem(model, taps, costs: dict[int, float], plain: float) -> tuple[str | None, dict]:
    """Why a cached curve (costs, plain token) should not be used now (None: use it), and what was measured."""
    if costs[1] > CONSISTENT * plain:
        return (f"its 1-row forward ({1000 * costs[1]:.2f} ms) is {costs[1] / plain:.1f}x its plain token "
                f"({1000 * plain:.2f} ms): one of them was timed under load"), {}
    cache = scratch_cache(model)
    now = check_plain_token(model, cache)
    if not STALE[0] <= now / plain <= STALE[1]:
        return (f"its plain token ({1000 * plain:.2f} ms) is off from one measured now ({1000 * now:.2f} ms)",
                {"checked_plain_token_s": now})
    rows = min(SHAPE_ROWS, max(costs))
    measured = {"checked_plain_token_s": now}
    if rows > 1:
        ratio, cached = check_shape(model, taps, rows, cache), costs[rows] / costs[1]
        measured["checked_shape"] = {"rows": rows, "now": round(ratio, 3), "cached": round(cached, 3)}
        if not SHAPE[0] <= ratio / cached <= SHAPE[1]:
            return (f"its {rows}-row verify costs {cached:.2f}x a 1-row forward, {ratio:.2f}x measured now",
                    measured)
    return None, measured


def load_or_calibrate(model, taps, max_len: int, *, directory=None, recalibrate: bool = False,
                      log=None) -> tuple[dict[int, float], dict]:
    """The verify cost curve for this machine and model, from the cache file or measured now (then cached).

    Returns ({L: seconds}, info) with info = {"path", "cached", "machine", "model", "context", "plain_token_s"}
    (plain_token_s: seconds per token of pipelined plain decoding, measured with the curve) and, where a cached curve
    was measured again, "replaced": why it was not used (with the checks measured: `cached_problem`). On the 2-core
    VM here a process's check replaced the cached curve twice in one session with no other load, unlogged; the
    curves measured then differed from each other by more than their checks would (`glimmer bench` keeps this
    info in its JSON)."""
    d = Path(directory) if directory is not None else cache_dir()
    machine, mod = machine_fingerprint(), model_fingerprint(model)
    taps = sorted(int(t) for t in taps)
    path = d / f"costs-{machine}-{mod}-taps{'_'.join(map(str, taps)) or 'none'}.json"
    info = {"path": str(path), "machine": machine, "model": mod, "context": CALIBRATION_CONTEXT}
    replaced = {}  # why a cached curve was not used, and what was measured: kept with what is measured instead
    if path.exists() and not recalibrate:
        try:
            raw = json.loads(path.read_text())
            costs = {int(L): float(c) for L, c in raw["costs_s"].items()}
            # (files from before the plain token was timed without taps are measured again)
            # (files from before the wide forward was timed, too)
            if (all(L in costs for L in range(1, max_len + 1)) and raw.get("plain_taps") is False
                    and "wide_forward_s" in raw):
                plain = float(raw["plain_token_s"])
                wide = {"rows": int(raw["wide_forward_s"]["rows"]), "seconds": float(raw["wide_forward_s"]["seconds"])}
                problem, measured = cached_problem(model, taps, costs, plain)
                if problem is None:
                    return costs, {**info, "cached": True, "plain_token_s": plain, "wide_forward_s": wide,
                                   **measured}
                replaced = {"replaced": problem, **measured}
                if log:  # measured while the machine was busy (or on other hardware): the whole curve is suspect
                    log(f"the cached calibration is not used: {problem}; measuring it again")
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            pass  # unreadable, too short or a zero plain token: measure again
    if log:
        log(f"calibrating the verify cost curve (L = 1..{max_len}) for this machine and model → {path}")
    costs, plain, wide_s = calibrate(model, taps, max_len)
    wide = {"rows": WIDE_ROWS, "seconds": wide_s}
    write_atomic(path, json.dumps({"machine": machine, "model": mod, "taps": taps, "context": CALIBRATION_CONTEXT,
                                   "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "costs_s": {str(L): c for L, c in costs.items()}, "plain_token_s": plain,
                                   "plain_taps": False, "wide_forward_s": wide},
                                  indent=2))
    return costs, {**info, "cached": False, "plain_token_s": plain, "wide_forward_s": wide, **replaced}




def round_seconds(d, taps: list, ids: list[int], k: int, sampler) -> float:
    """Seconds of one round of k drafts by model drafter `d` right after a start on the scratch context `ids` with
    its `taps` (the class's own methods: a shallow copy carries the instance's attributes, wrappers included; the
    drafts are read back as ints, so the round is evaluated; at T > 0 so are the drafts' distributions)."""
    kind = type(d)
    kind.start(d, taps, ids + [ids[-1]])
    t0 = time.perf_counter()
    _, q = kind.propose(d, ids[-1], len(ids), k, sampler, ids + [ids[-1]])
    if q is not None:
        mx.eval(q)
    return time.perf_counter() - t0


def measure_draft_costs(target, drafters: dict, taps: tuple, tap_idx: dict, context: int = 32,
                        repeats: int = 3, temperature: float = 0.0) -> dict[str, tuple[float, float]]:
    """{drafter: (fixed, per_draft)}: seconds one round of each model drafter costs as fixed + per_draft · k, from a
    round at one draft and one at its most, measured now on a scratch context of `context` tokens (the minimum of
    `repeats` rounds of each after a warm-up): the starting estimate of what drafting costs (without it a drafter's
    first rounds would be chosen on a guess; its shape is the drafter's own: DFlash's block costs the same whatever
    k, MTP runs every depth each round and only the drafted ones' logits). n-gram lookup costs ~nothing and is
    skipped. Each drafter is timed on a shallow copy (its weights, a state of its own): its own state is untouched.
    temperature: the rounds' (0: greedy drafts; > 0: sampled drafts and their distributions kept for the acceptance
    test, which cost more: the embedded DFlash 2's start and 7-draft round 6.5-6.8 ms greedy, 8.6-9.2 ms at T = 1)."""
    model_drafters = {n: copy.copy(d) for n, d in drafters.items() if n != "ngram"}
    if not model_drafters:
        return {}
    ids = scratch_ids(target, context)
    _, tapped = prefill(target, target.make_cache(), ids, taps=taps)
    mx.eval(tapped)
    sampler = Sampler(SamplingParams(temperature=temperature), 0)
    out = {}
    for n, d in model_drafters.items():
        widths = sorted({1, d.max_drafts})
        best = dict.fromkeys(widths, float("inf"))
        for r in range(repeats + 1):
            for k in widths:
                seconds = round_seconds(d, [tapped[i] for i in tap_idx[n]], ids, k, sampler)
                if r:  # the first pass warms up (kernels built on first use)
                    best[k] = min(best[k], seconds)
        lo, hi = best[widths[0]], best[widths[-1]]
        per_draft = max(0.0, (hi - lo) / (widths[-1] - widths[0])) if len(widths) > 1 else 0.0
        out[n] = (max(0.0, lo - per_draft), per_draft)
    return out


# positions of backlog beyond the draft costs' context that a model drafter's catch-up is timed over
# (`measure_catch_up`): a prompt's worth, about, where the per-position cost shows above one round's noise; and
# CATCH_UP_WIDE times as many, where a cost that grows with the context it attends over shows too
CATCH_UP_ROWS = 128
CATCH_UP_WIDE = 4


def measure_catch_up(target, drafters: dict, taps: tuple, tap_idx: dict, context: int = 32,
                     rows: int = CATCH_UP_ROWS, repeats: int = 1) -> dict[str, tuple[float, float]]:
    """{drafter: (seconds per position of backlog, seconds per position² of context)}: what each model drafter's
    round costs more for the target positions it has yet to take in — its own work on them, the taps given (a
    drafter takes its backlog in lazily, in its next round: DFlash's context K/V, an MTP layer's forward over them).
    A backlog of L positions ending at position P costs per · L + quad · (P² − (P − L)²): an MTP layer's forward
    over its backlog attends over every position before it, so its cost per position grows with the context (the
    trained tiny set's: 17 µs a position over 128 of them, 38 over 512; the embedded one's 43 and 73 — priced at the
    first, the tiny set's MTP explorations ~550 positions behind cost ~2x what they were priced at, and auto ran
    ~4 % under n-gram lookup alone where auto without MTP did not); DFlash's context K/V does not (quad ~0).
    Timed now as the differences between a one-draft round right after a start on `context` positions and one
    after a start on `context + rows` and on `context + CATCH_UP_WIDE · rows` (the minimum of `repeats` of each
    after a warm-up): a start on n positions is a backlog of n from position 0. Each drafter is timed on a shallow
    copy, as in `measure_draft_costs`."""
    model_drafters = {n: copy.copy(d) for n, d in drafters.items() if n != "ngram"}
    if not model_drafters:
        return {}
    wide = rows * CATCH_UP_WIDE
    ids = scratch_ids(target, context + wide)
    _, tapped = prefill(target, target.make_cache(), ids[:context], taps=taps)
    # the wide starts' taps: the scratch context's, repeated (what a drafter does with them costs the same whatever
    # they hold, and a forward over context + rows positions would cost a slow machine ~0.5 s more)
    reps = -(-(context + wide) // context)
    tapped = [mx.concatenate([t] * reps, axis=1)[:, : context + wide] for t in tapped]
    mx.eval(tapped)
    sampler = Sampler(SamplingParams())
    out = {}
    for n, d in model_drafters.items():
        best = {}
        for r in range(repeats + 1):
            for L in (context, context + rows, context + wide):
                seconds = round_seconds(d, [tapped[i][:, :L] for i in tap_idx[n]], ids[:L], 1, sampler)
                if r:  # the first pass warms up (kernels built on first use)
                    best[L] = min(best.get(L, float("inf")), seconds)
        # (T(c + R) − T(c)) / R = per + quad · (2c + R), at R = rows and R = wide
        near = (best[context + rows] - best[context]) / rows
        far = (best[context + wide] - best[context]) / wide
        quad = max(0.0, (far - near) / (wide - rows))
        out[n] = (max(0.0, near - quad * (2 * context + rows)), quad)
    return out
