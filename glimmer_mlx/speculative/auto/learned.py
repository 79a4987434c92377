"""What `auto` learned of its options' acceptance, kept across processes: one JSON file per target model beside the
cost curve's (`calibrate`, `machine.cache_dir()`), `learned-<target>.json`.

Within a process every request starts from what the requests before it measured (`chooser.AcceptanceStats`, per
option and regime and phase of a response). A new process started again from each drafter's eval.json τ: a server
restarted, every `glimmer chat`, every bench sitting re-learned — exploring and carrying model drafters — what the
last one knew (on the embedded model's served prompts the batch carried DFlash for its first ~16 of 60 runs of two
rows before its estimates said it did not pay: BENCHMARKS.md, issue 24). Now a process starts where the last one
that served this target left off, its evidence counted at `RESTORE_WEIGHT` of its weight (what it measured may have
been other work: the estimates still move, and exploring can still pay).

With each option's estimates goes how far its requests were measured to differ from them (`Option.here_weight`,
its "halves": what the odd and even rounds of its requests shared), restored as it was. A file written before the
fiftieth session keeps that measure as "between" (a request's whole ratio squared, which auto's own plain verdicts
biased up: `chooser.HERE_WEIGHT`); it is left unused, the estimates beside it restored as ever.

Each option's entry names the drafter it was measured with (`option_fingerprint`: its kind, draft width, tree rows
and checkpoint files): an option whose drafter changed starts from its prior again, the others keep what they
learned. The file is written atomically (`files.write_atomic`) at most every `REMEMBER_EVERY` seconds when a request
starts or a batch row finishes, and at exit; two processes serving the same target each write their own estimates,
the last one's stays. A file that cannot be read as such is reported in one line and not used.
`GLIMMER_MLX_AUTO_LEARNED=off` (or 0, no, false) makes a process neither read nor write it: a cold start, for a
benchmark of what a fresh process does."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

from ...files import write_atomic
from .calibrate import hash_checkpoint
from .chooser import AutoChooser

FORMAT = 1
RESTORE_WEIGHT = 0.5  # the share of a saved estimate's evidence (beyond its prior) a new process starts with
REMEMBER_EVERY = 10.0  # seconds between two writes of the file while decoding (`Memory.remember`)
MAX_BYTES = 1 << 20  # a larger file is not ours (a saved state is a few kB)
SPREAD_KEY = "halves"  # an option's entry's measure of how far its requests differ (`Option.between`)


ENV = "GLIMMER_MLX_AUTO_LEARNED"


def enabled() -> bool:
    """Whether this process keeps what auto learns (`ENV`; on unless it says off)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "off", "no", "false")


class LearnedError(ValueError):
    """A learned-estimates file that cannot be used; the message names the field."""


def drafter_fingerprint(drafter) -> str:
    """What a drafter's acceptance depends on besides the target: its kind, draft width, the checkpoint it was
    loaded from (config and eval.json contents, weight files' names and sizes) — or, for one not loaded from a
    folder, its source's name."""
    h = hashlib.sha256(f"{drafter.kind}:{drafter.max_drafts}".encode())
    source = getattr(drafter, "source", None)
    if source:
        h.update(str(source).encode())
        if Path(str(source)).is_dir():
            hash_checkpoint(h, source, ("config.json", "eval.json"))
    return h.hexdigest()[:12]


def option_fingerprint(drafter_fp: str, opt) -> str:
    """An option's key in the file: its drafter's fingerprint, its most drafts and its tree rows (None: a chain)."""
    return hashlib.sha256(f"{drafter_fp}:{opt.name}:{opt.max_k}:{opt.rows}".encode()).hexdigest()[:12]


def snapshot(chooser: AutoChooser, fingerprints: dict[str, str]) -> dict:
    """{option: {"fingerprint", "stats": {key: {"acc", "tried", "shrink"}}[, "halves": {regime: [n, σ², q]}]}} of
    every option with a fingerprint ("halves": how far its requests were measured to differ, `Option.here_weight`)."""
    out = {}
    for name, opt in chooser.options.items():
        fp = fingerprints.get(name)
        if fp is None or not opt.stats:
            continue
        out[name] = {"fingerprint": fp, "stats": {key: {"acc": list(s.acc), "tried": list(s.tried), "shrink": s.shrink}
                                                  for key, s in sorted(opt.stats.items())}}
        if opt.between:
            out[name][SPREAD_KEY] = {r: list(v) for r, v in sorted(opt.between.items())}
    return out


def parse_between(raw, chooser: AutoChooser, fingerprints: dict[str, str]) -> dict[tuple[str, str], tuple]:
    """{(option, regime): (requests counted, σ², q)} of the file's "halves" entries that fit the chooser's options
    (`parse` checked the rest of the file; an entry's "between", an earlier version's measure, is not read); raises
    LearnedError naming the first field that is not one."""
    out = {}
    for name, entry in raw["options"].items():
        opt = chooser.options.get(name)
        if opt is None or entry.get("fingerprint") != fingerprints.get(name) or SPREAD_KEY not in entry:
            continue
        between = entry[SPREAD_KEY]
        if not isinstance(between, dict):
            raise LearnedError(f"options.{name}.{SPREAD_KEY}: not an object")
        for regime, v in between.items():
            where = f"options.{name}.{SPREAD_KEY}.{regime}"
            if regime not in ("greedy", "sampling"):
                raise LearnedError(f"{where}: not a regime (greedy or sampling)")
            if not isinstance(v, list) or len(v) != 3 or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in v):
                raise LearnedError(f"{where}: expected [requests, variance, q], three finite numbers")
            if v[0] < 0 or v[2] < 0:
                raise LearnedError(f"{where}: a negative count or q")
            out[(name, regime)] = (float(v[0]), float(v[1]), float(v[2]))
    return out


def _counts(raw, where: str, n: int) -> list[float]:
    if not isinstance(raw, list) or len(raw) != n:
        raise LearnedError(f"{where}: expected a list of {n} numbers")
    out = []
    for x in raw:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise LearnedError(f"{where}: {x!r} is not a finite count ≥ 0")
        out.append(float(x))
    return out


def parse(raw, chooser: AutoChooser, fingerprints: dict[str, str]) -> dict[tuple[str, str], tuple]:
    """{(option, key): (acc, tried, shrink)} of the file's entries that fit the chooser's options (same fingerprint);
    raises LearnedError naming the first field that is not a valid count table."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise LearnedError(f"format: not {FORMAT}")
    options = raw.get("options")
    if not isinstance(options, dict):
        raise LearnedError("options: not an object")
    out = {}
    for name, entry in options.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("stats"), dict):
            raise LearnedError(f"options.{name}: not an object with stats")
        opt = chooser.options.get(name)
        if opt is None or entry.get("fingerprint") != fingerprints.get(name):
            continue  # an option this process does not have, or measured with another drafter
        for key, s in entry["stats"].items():
            where = f"options.{name}.stats.{key}"
            regime, _, phase = key.partition("#")
            if regime not in ("greedy", "sampling") or (
                    phase and not (phase.isdigit() and int(phase) <= len(chooser.phases or ()))):
                raise LearnedError(f"{where}: not a regime (greedy or sampling, #0-#{len(chooser.phases or ())})")
            if not isinstance(s, dict):
                raise LearnedError(f"{where}: not an object")
            acc = _counts(s.get("acc"), f"{where}.acc", opt.max_k)
            tried = _counts(s.get("tried"), f"{where}.tried", opt.max_k)
            shrink = _counts([s.get("shrink")], f"{where}.shrink", 1)[0]
            if any(a > t + 1e-9 for a, t in zip(acc, tried)):
                raise LearnedError(f"{where}: more drafts accepted than tried")
            out[(name, key)] = (acc, tried, shrink)
    return out


def restore(chooser: AutoChooser, entries: dict[tuple[str, str], tuple], weight: float = RESTORE_WEIGHT) -> int:
    """Set the chooser's estimates from `parse`'s entries, each moved toward its prior to `weight` of its evidence
    (`AcceptanceStats.age`). Returns how many were set."""
    for (name, key), (acc, tried, shrink) in entries.items():
        stats = chooser.options[name].acceptance(key)  # made from the option's prior
        stats.acc, stats.tried, stats.shrink = list(acc), list(tried), shrink
        stats.age(weight)
    if entries:
        chooser.rescore()
    return len(entries)


class Memory:
    """The learned-estimates file of one `AutoDrafter`: `load` once, `remember` as it decodes."""

    def __init__(self, directory, target_fp: str, fingerprints: dict[str, str]):
        self.path = Path(directory) / f"learned-{target_fp}.json"
        self.target = target_fp
        self.fingerprints = fingerprints
        self.restored = 0  # estimates set from the file
        self.saved_at: float | None = None  # time.monotonic() of the latest write
        self.writes = 0
        self._last: dict | None = None  # what the latest write (or the load) held: unchanged estimates are not written
        # (option, key) -> (the counts restored, the file's own): an estimate this process left as it restored it is
        # written back as the file had it, not at `RESTORE_WEIGHT` again (else every restart would halve what an
        # option never chosen since had shown, until it was explored afresh)
        self._kept: dict[tuple[str, str], tuple] = {}
        # the file's entries of options this process does not have (or has with another drafter): written back as
        # they were unless it learns that option itself (a chat without MTP does not erase what a server with it kept)
        self._foreign: dict[str, dict] = {}

    def load(self, chooser: AutoChooser, log=None) -> int:
        """Start `chooser` from the file, if there is one that fits; a bad one is reported (`log`) and left unused."""
        try:
            if not self.path.is_file():
                return 0
            if self.path.stat().st_size > MAX_BYTES:
                raise LearnedError(f"larger than {MAX_BYTES} bytes")
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            entries = parse(raw, chooser, self.fingerprints)
            between = parse_between(raw, chooser, self.fingerprints)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, LearnedError) as e:
            if log:
                log(f"auto: {self.path}: not used ({e}); starting from the drafters' own estimates")
            return 0
        self._foreign = {name: entry for name, entry in raw["options"].items()
                         if name not in chooser.options or entry.get("fingerprint") != self.fingerprints.get(name)}
        self.restored = restore(chooser, entries)
        for (name, regime), v in between.items():
            chooser.options[name].between[regime] = v
        for (name, key), (acc, tried, shrink) in entries.items():
            st = chooser.options[name].stats[key]
            self._kept[(name, key)] = ((list(st.acc), list(st.tried), st.shrink),
                                       {"acc": acc, "tried": tried, "shrink": shrink})
        self._last = self.state(chooser)
        if log and self.restored:
            log(f"auto: starting from what earlier runs learned ({self.restored} estimates, {self.path})")
        return self.restored

    def state(self, chooser: AutoChooser) -> dict:
        """What the file should hold now: the chooser's estimates (`snapshot`), those it left as restored as the
        file had them, and the file's entries of options it does not have."""
        out = snapshot(chooser, self.fingerprints)
        for name, entry in self._foreign.items():
            out.setdefault(name, entry)
        for (name, key), (restored, original) in self._kept.items():
            got = out.get(name, {}).get("stats", {}).get(key)
            if got is not None and (got["acc"], got["tried"], got["shrink"]) == restored:
                out[name]["stats"][key] = original
        return out

    def remember(self, chooser: AutoChooser, force: bool = False) -> bool:
        """Write the chooser's estimates (`state`) if they changed (or the file is gone) and `REMEMBER_EVERY`
        seconds passed since the latest write (force: whenever they changed). Never creates the folder: a process
        whose cost curve's folder is gone (a test's temporary one, removed before exit) writes nothing. Whether it
        wrote."""
        now = time.monotonic()
        if not force and self.saved_at is not None and now - self.saved_at < REMEMBER_EVERY:
            return False
        state = self.state(chooser)
        if not state or not self.path.parent.is_dir() or (state == self._last and self.path.is_file()):
            return False
        try:
            write_atomic(self.path, json.dumps({"format": FORMAT, "target": self.target,
                                                "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                "options": state}))
        except OSError:
            return False  # a read-only or full cache folder: the estimates are only this process's
        self._last, self.saved_at = state, now
        self.writes += 1
        return True

    def stats(self) -> dict:
        return {"path": str(self.path), "restored": self.restored, "writes": self.writes}
