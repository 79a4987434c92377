"""The solo chooser's host time on a recorded trace (issue 20): `record` runs auto on the shipped prompts (the trained
tiny set with AB_SET=DIR), greedy, REPS repeats of MAX_TOKENS tokens, and keeps every call the engine and
`AutoDrafter` make into its `AutoChooser` (method, arguments) with the chooser as it was before the first (pickled);
`replay` runs those calls again on a copy of that chooser, RUNS times, and prints the fastest run's milliseconds and a
hash of every answer. Two versions of the chooser that decide alike print the same hash on the same trace (a change
meant to save host time must not change a decision); their times, alternated process by process, compare the
chooser alone — no forward, no timing noise in the decisions (the trace fixes every input).

    AB_SET=/tmp/pair3 python benchmarks/chooser_replay.py record TRACE [REPS [MAX_TOKENS]]
    PYTHONHASHSEED=0 python benchmarks/chooser_replay.py replay TRACE [RUNS]
"""
import copy
import hashlib
import pickle
import sys
import time

from glimmer_mlx.speculative.auto import chooser as C


def record(path: str, reps: int, max_tokens: int) -> None:
    from ab_setup import second_auto, session_and_prompts

    import glimmer_mlx

    sys.argv = sys.argv[:1] + ["0", str(reps), str(max_tokens)]  # what `session_and_prompts` reads
    s, ids, _ = session_and_prompts()
    auto = second_auto(s)
    ch = auto.chooser
    start, calls, depth = pickle.dumps(ch), [], [0]
    for name, f in list(vars(C.AutoChooser).items()):
        if name.startswith("__") or not callable(f) or isinstance(f, (staticmethod, classmethod)):
            continue

        def wrapped(self, *a, _f=f, _name=name, **k):
            if self is ch and depth[0] == 0:  # a call from outside the chooser
                calls.append((_name, copy.deepcopy(a), copy.deepcopy(k)))
            depth[0] += 1
            try:
                return _f(self, *a, **k)
            finally:
                depth[0] -= 1
        setattr(C.AutoChooser, name, wrapped)
    for r in range(reps):
        for c in ids:
            glimmer_mlx.generate(s.model, ids[c], max_tokens=max_tokens, temperature=0.0, seed=r, drafter=auto)
    with open(path, "wb") as f:
        pickle.dump({"start": start, "calls": calls}, f)
    print(f"{len(calls)} calls recorded to {path}")


def replay(path: str, runs: int) -> None:
    with open(path, "rb") as f:
        trace = pickle.load(f)
    best, digest = None, None
    for _ in range(runs):
        ch, calls = pickle.loads(trace["start"]), copy.deepcopy(trace["calls"])
        t = time.perf_counter()
        answers = [getattr(ch, name)(*a, **k) for name, a, k in calls]
        took = time.perf_counter() - t
        best = took if best is None else min(best, took)
        h = hashlib.sha256()
        for x in answers:
            h.update(repr(sorted(x) if isinstance(x, (set, frozenset)) else x).encode())
        digest = h.hexdigest()[:16]
    print(f"replay of {len(trace['calls'])} calls: fastest of {runs} {1e3 * best:.1f} ms, answers {digest}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "replay"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "record":
        record(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 4, int(sys.argv[4]) if len(sys.argv) > 4 else 96)
    else:
        replay(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 15)
