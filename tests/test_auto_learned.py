"""What `auto` learned, kept across processes (`speculative.auto.learned`): a new AutoDrafter on the same target
starts from the estimates the last one wrote, moved halfway back to its prior; a drafter that changed starts afresh;
a file that is not a valid one is reported in one line and not used."""

from __future__ import annotations

import json

import pytest

import glimmer_mlx
from glimmer_mlx.speculative.auto import AcceptanceStats, make_auto
from glimmer_mlx.speculative.auto import learned


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """A tiny target and a random DFlash drafter (block 4) for it."""
    from hf_fixtures import build_hf_drafter

    path, _ = tiny_checkpoint(seed=6)
    model, _ = glimmer_mlx.load(path)
    d = path.parent / "dflash_for_learned"
    if not d.exists():
        build_hf_drafter(seed=3).save_pretrained(d)
    return model, d


def _auto(tiny, folder, drafter=None, **kw):
    model, dpath = tiny
    d = glimmer_mlx.load_drafter(drafter or dpath, model)
    return make_auto(model, dflash=d, ngram=4, calibration_dir=folder, **kw)


@pytest.fixture(autouse=True)
def keeping(monkeypatch):
    """What a user's process does (the suite turns it off elsewhere: tests/conftest.py)."""
    monkeypatch.delenv(learned.ENV, raising=False)


def _teach(auto):
    """Rounds the way decoding reports them: DFlash greedy rounds of 3 drafts mostly rejected, a 2-gram's offers in
    the opening phase mostly accepted."""
    dflash, two = auto.chooser.options["dflash"], auto.chooser.options["ngram@2"]
    for i in range(40):
        dflash.acceptance("greedy").update(3, 1 if i % 4 == 0 else 0)
        two.acceptance("greedy#0").update(2, 2 if i % 5 else 0)


def _halfway(fresh: AcceptanceStats, taught: AcceptanceStats) -> list[float]:
    """The alphas of `taught`'s counts moved halfway back to `fresh`'s (the prior's), computed here."""
    s = AcceptanceStats(fresh.max_k, fresh.decay)
    s.acc = [b + (a - b) * 0.5 for a, b in zip(taught.acc, fresh.acc)]
    s.tried = [b + (a - b) * 0.5 for a, b in zip(taught.tried, fresh.tried)]
    s.shrink = fresh.shrink + (taught.shrink - fresh.shrink) * 0.5
    s.then = fresh.then
    return s.alphas()


def test_a_new_auto_starts_where_the_last_one_left_off(tiny, tmp_path):
    first = _auto(tiny, tmp_path)
    assert first.memory is not None and first.memory.restored == 0
    _teach(first)
    assert first.remember() and first.memory.path.is_file()
    assert first.memory.path.name.startswith("learned-")
    second = _auto(tiny, tmp_path)
    fresh = _auto(tiny, tmp_path / "elsewhere")  # a folder with no file: the priors
    assert second.memory.restored == 2 and fresh.memory.restored == 0
    for name, key in (("dflash", "greedy"), ("ngram@2", "greedy#0")):
        got = second.chooser.options[name].acceptance(key).alphas()
        want = _halfway(fresh.chooser.options[name].acceptance(key), first.chooser.options[name].acceptance(key))
        assert got == pytest.approx(want, abs=1e-12)
        assert got != pytest.approx(fresh.chooser.options[name].acceptance(key).alphas(), abs=1e-3)
    # what it learned moves what it chooses by: DFlash's expected tokens fall toward what its rounds measured
    e = lambda a: a.chooser.options["dflash"].acceptance("greedy").expected_tokens(3)  # noqa: E731
    assert e(first) < e(second) < e(fresh)
    assert second.stats()["auto"]["learned"]["restored"] == 2
    # options never observed are not written (nothing learned of them) and start from their prior
    raw = json.loads(second.memory.path.read_text())
    assert set(raw["options"]) == {"dflash", "ngram@2"}
    assert second.chooser.options["ngram@3"].stats == {}
    # how far its requests differed (`Option.here_weight`) is kept as it was measured
    from glimmer_mlx.speculative.auto.chooser import HERE_WEIGHT
    first.chooser.options["dflash"].between["greedy"] = (12.0, 0.1, 0.3)  # W = 0.3 / 0.1 = 3
    assert first.remember(force=True)
    third = _auto(tiny, tmp_path)
    assert third.chooser.options["dflash"].between == {"greedy": (12.0, 0.1, 0.3)}
    assert third.chooser.options["dflash"].here_weight("greedy") == pytest.approx(3.0)
    assert fresh.chooser.options["dflash"].here_weight("greedy") == HERE_WEIGHT
    # a file written before the fiftieth session keeps that measure as "between" (its requests' whole ratios
    # squared, biased up by auto's own plain verdicts): not an error, not used; the estimates beside it are
    raw = json.loads(first.memory.path.read_text())
    raw["options"]["dflash"]["between"] = raw["options"]["dflash"].pop("halves")
    first.memory.path.write_text(json.dumps(raw))
    said = []
    old = _auto(tiny, tmp_path, log=said.append)
    assert old.chooser.options["dflash"].between == {}
    assert old.chooser.options["dflash"].here_weight("greedy") == HERE_WEIGHT
    assert old.memory.restored == third.memory.restored > 0
    assert not any(str(old.memory.path) in x and "not used" in x for x in said)  # (a cost curve's may be: load)


def test_what_a_process_did_not_touch_is_written_back_as_the_file_had_it(tiny, tmp_path):
    """An estimate restored and never updated is written back at the file's counts (a restart does not halve it
    again); an option this process does not have keeps its entry."""
    first = _auto(tiny, tmp_path)
    _teach(first)
    first.remember(force=True)
    kept = json.loads(first.memory.path.read_text())["options"]
    model, _ = tiny
    second = make_auto(model, ngram=4, calibration_dir=tmp_path)  # no DFlash drafter this time
    assert second.memory.restored == 1
    second.chooser.options["ngram@3"].acceptance("greedy").update(2, 1)  # something new, so it writes
    assert second.remember(force=True)
    now = json.loads(second.memory.path.read_text())["options"]
    assert now["dflash"] == kept["dflash"] and now["ngram@2"] == kept["ngram@2"] and "ngram@3" in now
    third = _auto(tiny, tmp_path)  # so the next one restores DFlash at half of what the first one measured
    assert third.memory.restored == 3
    got = third.chooser.options["dflash"].acceptance("greedy").alphas()
    want = _halfway(_auto(tiny, tmp_path / "none").chooser.options["dflash"].acceptance("greedy"),
                    first.chooser.options["dflash"].acceptance("greedy"))
    assert got == pytest.approx(want, abs=1e-12)


def test_written_when_changed_at_most_every_few_seconds(tiny, tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(learned.time, "monotonic", lambda: clock[0])
    auto = _auto(tiny, tmp_path)
    assert not auto.remember(force=True)  # nothing learned yet: no file
    assert not auto.memory.path.exists()
    _teach(auto)
    assert auto.remember() and auto.memory.writes == 1
    auto.chooser.options["dflash"].acceptance("greedy").update(3, 3)
    clock[0] += learned.REMEMBER_EVERY / 2
    assert not auto.remember()  # too soon
    clock[0] += learned.REMEMBER_EVERY
    assert auto.remember() and auto.memory.writes == 2
    clock[0] += 10 * learned.REMEMBER_EVERY
    assert not auto.remember() and not auto.remember(force=True)  # unchanged since
    auto.chooser.options["dflash"].acceptance("greedy").update(3, 0)
    assert auto.remember(force=True) and auto.memory.writes == 3


def test_a_changed_drafter_starts_from_its_prior(tiny, tmp_path):
    first = _auto(tiny, tmp_path)
    _teach(first)
    first.remember(force=True)
    model, dpath = tiny
    other = tmp_path / "retrained"  # the same drafter trained again: its own eval.json
    other.mkdir()
    for f in dpath.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "eval.json").write_text(json.dumps({"width": 4, "after": {"tau_greedy": 3.0, "tau_t1": 2.0}}))
    second = _auto(tiny, tmp_path, drafter=other)
    assert second.memory.restored == 1  # the 2-gram's estimates, not DFlash's
    assert second.chooser.options["dflash"].stats == {}
    assert second.chooser.options["ngram@2"].acceptance("greedy#0").alphas() != pytest.approx(
        _auto(tiny, tmp_path / "none").chooser.options["ngram@2"].acceptance("greedy#0").alphas(), abs=1e-3)


def _valid(tmp_path, tiny) -> dict:
    auto = _auto(tiny, tmp_path)
    _teach(auto)
    auto.remember(force=True)
    return json.loads(auto.memory.path.read_text())


@pytest.mark.parametrize("damage, field", [
    (lambda raw: b"\xff\xfe not json", "codec"),
    (lambda raw: b"{\"format\": 1, \"options\": ", "Expecting"),
    (lambda raw: [1, 2], "format"),
    (lambda raw: {**raw, "format": 99}, "format"),
    (lambda raw: {**raw, "options": []}, "options"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "stats": {
        "greedy": {**raw["options"]["dflash"]["stats"]["greedy"], "acc": [1e9, 0, 0]}}}}}, "more drafts accepted"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "stats": {
        "greedy": {**raw["options"]["dflash"]["stats"]["greedy"], "tried": [1.0]}}}}}, "tried"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "stats": {
        "greedy": {**raw["options"]["dflash"]["stats"]["greedy"], "shrink": float("nan")}}}}}, "shrink"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "stats": {
        "greedy": {**raw["options"]["dflash"]["stats"]["greedy"], "acc": ["1", 0, 0]}}}}}, "acc"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "stats": {"beam": {}}}}}, "beam"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "stats": {"greedy#9": {}}}}}, "greedy#9"),
    (lambda raw: b" " * (learned.MAX_BYTES + 1), "larger than"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "halves": []}}}, "halves: not an object"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "halves": {"beam": [1, 0, 0]}}}},
     "halves.beam"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "halves": {
        "greedy": [1.0, float("nan"), 0.4]}}}}, "halves.greedy"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "halves": {"greedy": [1.0, 0.1]}}}},
     "three finite numbers"),
    (lambda raw: {**raw, "options": {"dflash": {**raw["options"]["dflash"], "halves": {
        "greedy": [-1.0, 0.1, 0.4]}}}}, "negative"),
])
def test_a_bad_file_is_named_in_one_line_and_not_used(tiny, tmp_path, damage, field):
    raw = _valid(tmp_path, tiny)
    path = next(tmp_path.glob("learned-*.json"))
    bad = damage(raw)
    path.write_bytes(bad if isinstance(bad, bytes) else json.dumps(bad).encode())
    said = []
    auto = _auto(tiny, tmp_path, log=said.append)
    fresh = _auto(tiny, tmp_path / "none")
    assert auto.memory.restored == 0
    lines = [s for s in said if "learned-" in s]
    assert len(lines) == 1 and "\n" not in lines[0] and str(path) in lines[0] and field in lines[0], said
    for name in ("dflash", "ngram@2"):
        assert auto.chooser.options[name].stats == {} == fresh.chooser.options[name].stats
    _teach(auto)  # it goes on and keeps what it learns now, in place of the bad file
    assert auto.remember(force=True)
    assert _auto(tiny, tmp_path).memory.restored == 2


def test_no_file_without_a_cost_curve_folder(tiny, tmp_path, monkeypatch):
    """A cost curve given (synthetic tables) keeps nothing; a folder removed before exit gets nothing written; nor
    does a cold start asked for (remember=False, or `GLIMMER_MLX_AUTO_LEARNED=off`)."""
    model, dpath = tiny
    curve = {L: 0.001 * L for L in range(1, 17)}
    given = make_auto(model, dflash=glimmer_mlx.load_drafter(dpath, model), ngram=4, verify_costs=curve)
    assert given.memory is None and not given.remember(force=True)
    cold = _auto(tiny, tmp_path, remember=False)
    _teach(cold)
    assert cold.memory is None and not cold.remember(force=True)
    for off in ("off", "0", "No", "false"):
        monkeypatch.setenv(learned.ENV, off)
        assert _auto(tiny, tmp_path).memory is None
    monkeypatch.setenv(learned.ENV, "on")
    assert _auto(tiny, tmp_path).memory is not None
    gone = tmp_path / "gone"
    auto = _auto(tiny, gone)
    _teach(auto)
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    assert not auto.remember(force=True) and not gone.exists()
    assert not list(tmp_path.glob("learned-*"))


def test_processes_writing_at_once_never_leave_a_torn_file(tiny, tmp_path):
    """Two autos on one target writing over each other (two servers) while a third reads: every read is a whole file,
    one writer's or the other's (`files.write_atomic`), and the last writer's stays."""
    import threading

    a, b = _auto(tiny, tmp_path), _auto(tiny, tmp_path)
    _teach(a)
    for _ in range(3):
        b.chooser.options["ngram@3"].acceptance("greedy").update(2, 2)
    errors, reads = [], []
    reading, writers_done = threading.Event(), threading.Event()

    def write(auto, name):
        try:
            assert reading.wait(30)
            for i in range(40):
                auto.chooser.options[name].acceptance("greedy").update(2, i % 3)
                assert auto.remember(force=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def read():  # reads for as long as the writers write (a fixed count of reads could end before the first write)
        try:
            reading.set()
            while not writers_done.is_set() or not reads:
                if a.memory.path.exists():
                    reads.append(set(json.loads(a.memory.path.read_text())["options"]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    writers = [threading.Thread(target=write, args=(a, "dflash")), threading.Thread(target=write, args=(b, "ngram@3"))]
    reader = threading.Thread(target=read)
    for t in [reader, *writers]:
        t.start()
    for t in writers:
        t.join()
    writers_done.set()
    reader.join()
    assert not errors and reads
    assert all(r in ({"dflash", "ngram@2"}, {"ngram@3"}) for r in reads), reads
    last = json.loads(a.memory.path.read_text())["options"]
    assert set(last) in ({"dflash", "ngram@2"}, {"ngram@3"})
