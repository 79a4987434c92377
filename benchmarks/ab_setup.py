"""What the interleaved A/B scripts share (`auto_vs_plain_ab.py`, `auto_overhead.py`, `ngram_overlap_ab.py`,
`host_gap.py`, `ngram_round_host.py`): their arguments T REPS [MAX_TOKENS], and the session and prompts — the
embedded model with the first prompt of each shipped category under the chat template, or with AB_SET=DIR the
trained tiny set (`bench_tiny_set.py`: its target, DFlash drafter and MTP layers; the prompts byte-encoded as `glimmer
bench` does); a second `auto` built as the session's, and the variants of auto these scripts compare; the time spent in
the verify forwards; `warm`, an auto started from what another one learned. Every auto these scripts build starts
cold (`GLIMMER_MLX_AUTO_LEARNED=off`, set on import), whatever earlier processes kept, unless `warm` gives it what a
teacher learned."""
import os
import sys
import time

os.environ["GLIMMER_MLX_AUTO_LEARNED"] = "off"

from glimmer_mlx.bench.runner import encode_prompts
from glimmer_mlx.bench.settings import load_prompts
from glimmer_mlx.session import load_session


def args() -> tuple[float, int, int]:
    """(T, REPS, MAX_TOKENS) from the command line (REPS 4 and MAX_TOKENS 96 when not given)."""
    return (float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 4,
            int(sys.argv[3]) if len(sys.argv) > 3 else 96)


def tiny_set(tiny: str):
    """(session, {category: its prompts' ids}) of the trained tiny set in `tiny` (`bench_tiny_set.py`): its target,
    DFlash drafter and MTP layers; the shipped prompts byte-encoded as `glimmer bench` does."""
    s = load_session(f"{tiny}/target", draft_model=f"{tiny}/dflash", mtp_model=f"{tiny}/mtp")
    encoded, _ = encode_prompts(load_prompts(), None, s.model.args.vocab_size)
    return s, encoded


def session_and_prompts():
    """(session, {category: prompt ids}, AB_SET or None). AB_PROMPT_TOKENS=N: each prompt lengthened to N tokens,
    its category's prompts repeated before it (a long context: a conversation's, an agent's)."""
    tiny = os.environ.get("AB_SET")
    prompts = load_prompts()
    if tiny:
        s, encoded = tiny_set(tiny)
        ids = {c: encoded[c][0] for c in prompts}
        every = encoded
    else:
        s = load_session(None)
        every = {c: [s.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                     tokenize=True) for t in p] for c, p in prompts.items()}
        ids = {c: every[c][0] for c in prompts}
    n = int(os.environ.get("AB_PROMPT_TOKENS", "0"))
    if n:
        for c in ids:
            pad = [t for p in every[c] for t in p]
            while len(pad) + len(ids[c]) < n:
                pad = pad + pad
            ids[c] = pad[-(n - len(ids[c])):] + ids[c] if n > len(ids[c]) else ids[c]
    return s, ids, tiny


def batch_prompts(tokenizer) -> list[list[int]]:
    """The shipped prompts' first two of each category under the chat template (the batch benchmarks' requests)."""
    p = load_prompts()
    texts = [p[c][0] for c in p] + [p[c][1 % len(p[c])] for c in p]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
            for t in texts]


def timed_steps(g) -> float:
    """Milliseconds a token of a `BatchGenerator` `g` whose requests were added: their prefills first (untimed),
    then every step until the last request finishes."""
    while g.waiting:
        g.step()
    t, n = time.perf_counter(), 0
    while len(g):
        for _, c in g.step():
            n += len(c.tokens)
    return 1e3 * (time.perf_counter() - t) / n


def second_auto(session, **options):
    """An auto built exactly as the session's (`strategy.Drafters.auto`: over copies of its drafters, MTP at auto's
    depth), but its own; `options` go on to `make_auto` (e.g. trees=False)."""
    import functools

    from glimmer_mlx import strategy

    d = session.drafters
    first, d._auto = d._auto, None
    build = strategy.make_auto
    strategy.make_auto = functools.partial(build, **options)
    try:
        return d.auto()
    finally:
        d._auto, strategy.make_auto = first, build


class _Every(frozenset):
    """A barred set holding every ledger entry of the options named (`never_models`)."""

    def __new__(cls, names):
        names = frozenset(names)
        out = super().__new__(cls, names)  # (listed as the options' names)
        out.names = names
        return out

    def __contains__(self, entry) -> bool:
        return entry.split("#", 1)[0] in self.names

    def __bool__(self) -> bool:
        return True


def never_models(auto):
    """auto whose model drafters' ledger entries (chains and trees, every phase) are barred throughout: they are
    carried and offered, and never drafted."""
    ch = auto.chooser
    ch._bar = lambda: None
    ch.barred = _Every(n for n in ch.options if not n.startswith("ngram"))
    ch.rescore()
    return auto


VARIANTS = ("ngauto", "nowarm", "nokeep", "auto2", "never")


def auto_variant(session, mode: str):
    """An auto of its own for `mode` (one of `VARIANTS`): ngauto, auto over n-gram lookup alone; nowarm, auto whose
    forwards never yield the model drafters' taps; nokeep, auto whose chooser never keeps a stretch's option by
    bounds (`AutoChooser.keep`); auto2, a second auto built as the session's (an A/A control); never, auto whose
    model drafters are carried and offered and never drafted (`never_models`)."""
    if mode not in VARIANTS:
        raise ValueError(f"no auto variant {mode!r}: one of {', '.join(VARIANTS)}")
    if mode == "ngauto":
        from glimmer_mlx.speculative.auto import make_auto

        return make_auto(session.model, ngram=8)
    a = second_auto(session)
    if mode == "nowarm":
        a._warm = lambda regime, remaining: False
    elif mode == "nokeep":
        a.chooser.keep = lambda *args, **kw: None
    elif mode == "never":
        never_models(a)
    return a


def timed_method(cls, name: str, add) -> None:
    """Wrap method `name` of `cls` so that each call's seconds go to add(name, seconds) (`time.perf_counter`; not a
    profiler, which inflates small Python calls many times over)."""
    f = getattr(cls, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            add(name, time.perf_counter() - t)
    setattr(cls, name, wrapper)


def time_verifies() -> list[float]:
    """Time every greedy verify (`verify_greedy`, where a verify forward is evaluated) from now on: returns the
    one-element list its seconds add up in (the caller reads and resets it)."""
    import glimmer_mlx.speculative.engine as engine

    spent, verify = [0.0], engine.verify_greedy

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return verify(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    engine.verify_greedy = timed
    return spent


def taught(teacher, learn) -> dict:
    """What `teacher` (an AutoDrafter) kept after `learn()` ran: a learned-estimates file's content (`warm`)."""
    from glimmer_mlx.speculative.auto import learned

    learn()
    return {"format": learned.FORMAT, "options": learned.snapshot(teacher.chooser, fingerprints(teacher))}


def fingerprints(auto) -> dict[str, str]:
    """Its options' fingerprints as the learned file keys them (`learned.option_fingerprint`: their most drafts and
    tree rows), one drafter fingerprint for all: an auto of this process whose calibration gave its tree other rows
    than the teacher's skips that option's entries, as a process would, instead of failing on their width."""
    from glimmer_mlx.speculative.auto import learned

    return {o: learned.option_fingerprint("ab", opt) for o, opt in auto.chooser.options.items()}


def warm(student, kept: dict, weight: float | None = None) -> int:
    """Start `student` (an AutoDrafter) from `taught`'s `kept`, as a new process starts from what the last one kept
    (`speculative.auto.learned`, at `learned.RESTORE_WEIGHT` unless `weight`). Returns the estimates restored."""
    from glimmer_mlx.speculative.auto import learned

    entries = learned.parse(kept, student.chooser, fingerprints(student))
    return learned.restore(student.chooser, entries, learned.RESTORE_WEIGHT if weight is None else weight)
