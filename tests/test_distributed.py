"""Tensor parallelism (glimmer_mlx/distributed.py) across 2 processes on this machine: `mlx.launch -n 2 --backend ring`
over loopback runs this file as the worker (`python tests/test_distributed.py worker SPEC OUT`); each rank writes
what it generated, the test compares it with single-process decoding in the test process (the oracle: the unsharded
model through the same public `generate`).

One launch runs every scenario (plain / DFlash / MTP greedy, seeded T = 1, a random fp32 checkpoint, a 4-bit one, a
1-KV-head one whose KV head both ranks replicate), so the start-up (two interpreters + MLX) is paid once. KV-head
replication over 4 ranks is checked in process too (`FakeGroup`, the collectives patched)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[11, 50, 77, 300, 21, 9, 402], [5, 90, 13, 13, 60, 7, 71, 200, 4]]
N_TOKENS = 12
TREE_PROMPT = [11, 50, 77, 300, 21, 9, 402, 50, 77, 300]
TREE_TOKENS = 80


def scenarios(m, d, random_model, quantized_model) -> dict:
    """What both sides decode: the embedded (trained, fp32) target plainly and with its DFlash and MTP drafters, greedy
    and seeded T = 1; the random fp32 checkpoint greedy (two prompts) and T = 1; the 4-bit one greedy (tp only: a
    pipeline stage holds whole layers, quantized or not)."""
    from glimmer_mlx.generate import generate

    runs = {}
    for mode, drafter in (("ar", None), ("dflash", d.dflash), ("mtp", d.mtp)):
        for temp in (0.0, 1.0):
            runs[f"{mode}/{temp}"] = generate(m, PROMPTS[0], max_tokens=N_TOKENS, drafter=drafter, temperature=temp,
                                              seed=7).tokens
    runs["random"] = [generate(random_model, ids, max_tokens=N_TOKENS).tokens for ids in PROMPTS]
    runs["random/1.0"] = generate(random_model, PROMPTS[0], max_tokens=N_TOKENS, temperature=1.0, seed=3).tokens
    if quantized_model is not None:
        runs["quantized"] = generate(quantized_model, PROMPTS[1], max_tokens=N_TOKENS).tokens
    return runs


def tree_runs(m, d) -> dict:
    """Token trees (issue 23) on the embedded target, greedy DFlash / MTP / n-gram trees long enough that off-chain
    paths are accepted (`cache.keep_path` moves rows: test_tree_scenarios_accept_off_chain_paths) and a seeded T = 1
    DFlash tree."""
    from glimmer_mlx.generate import generate
    from glimmer_mlx.strategy import DecodeSpec

    runs = {}
    for mode, drafter, nodes in (("dflash", d.dflash, 16), ("mtp", d.mtp, 8),
                                 ("ngram", d.select(DecodeSpec("ngram", None))[0], 6)):
        runs[mode] = generate(m, TREE_PROMPT, max_tokens=TREE_TOKENS, drafter=drafter, tree=nodes).tokens
    runs["dflash/1.0"] = generate(m, TREE_PROMPT, max_tokens=40, drafter=d.dflash, tree=16, temperature=1.0,
                                  seed=5).tokens
    return runs


def microbatch_runs(m, d) -> dict:
    """Plain (the 10-token prompt's prefill split too), DFlash and MTP greedy, DFlash seeded T = 1."""
    from glimmer_mlx.generate import generate

    runs = {"ar": generate(m, TREE_PROMPT, max_tokens=24).tokens}
    for mode, drafter in (("dflash", d.dflash), ("mtp", d.mtp)):
        runs[mode] = generate(m, TREE_PROMPT, max_tokens=40, drafter=drafter).tokens
    runs["dflash/1.0"] = generate(m, TREE_PROMPT, max_tokens=40, drafter=d.dflash, temperature=1.0, seed=5).tokens
    return runs


def kv_runs(m) -> list:
    """Greedy decoding of both prompts (the KV-replicated checkpoint)."""
    from glimmer_mlx.generate import generate

    return [generate(m, ids, max_tokens=N_TOKENS).tokens for ids in PROMPTS]


def run_scenarios(spec: dict, out: Path) -> None:
    """The worker: every rank loads its slices and decodes each scenario; rank r writes out/rank{r}.json."""
    import mlx.core as mx
    import numpy as np

    from glimmer_mlx.distributed import (DistributedError, check_same, expose_taps, init_group, load_sharded,
                                         local_weight_bytes, lockstep)
    from glimmer_mlx.generate import stream_generate
    from glimmer_mlx.strategy import load_drafters

    g = init_group()
    res: dict = {"rank": g.rank(), "size": g.size()}
    if spec.get("die"):  # rank 1 leaves (exit code 0: the launcher lets rank 0 carry on) or hangs after 3 chunks
        m, _ = load_sharded(spec["target"], g)
        t0 = time.monotonic()
        try:
            # the hanging rank's own watchdog waits longer: the test is about the rank left waiting for it
            timeout = spec["timeout"] if g.rank() == 0 else 60.0
            for i, _chunk in enumerate(lockstep(stream_generate(m, PROMPTS[0], max_tokens=200), g, timeout=timeout,
                                                every=1)):
                if i == 3 and g.rank() == 1:
                    if spec["die"] == "exit":
                        os._exit(0)
                    time.sleep(120)
        except DistributedError as e:
            res.update(error=str(e), seconds=time.monotonic() - t0)
        (out / f"rank{g.rank()}.json").write_text(json.dumps(res))
        return
    if spec.get("kv4"):  # KV-head replication over 4 real ranks: 1 and 2 KV heads, 4 query heads
        for key, path in spec["kv4"].items():
            km, _ = load_sharded(path, g)
            a = km.model.layers[0].self_attn
            cache = km.make_cache()
            km(mx.array([PROMPTS[0]]), cache)
            res[key] = {"runs": kv_runs(km), "n_kv": a.n_kv, "n_heads": a.n_heads,
                        "k": np.array(a.k_proj.weight).tolist(), "cache_heads": [c.keys.shape[1] for c in cache]}
        (out / f"rank{g.rank()}.json").write_text(json.dumps(res))
        return
    if spec.get("microbatch"):  # micro-batched pipeline forwards
        for mb in spec["microbatch"]:
            m, _ = load_sharded(spec["target"], g, strategy="pp", microbatch=mb)
            d = load_drafters(m, embedded=True)
            expose_taps(m, d.dflash.taps + d.mtp.taps)
            res[str(mb)] = microbatch_runs(m, d)
        (out / f"rank{g.rank()}.json").write_text(json.dumps(res))
        return
    if spec.get("trees"):  # token trees under tp and pp
        for strategy in ("tp", "pp"):
            m, _ = load_sharded(spec["target"], g, strategy=strategy)
            d = load_drafters(m, embedded=True)
            expose_taps(m, d.dflash.taps + d.mtp.taps)
            res[strategy] = tree_runs(m, d)
        (out / f"rank{g.rank()}.json").write_text(json.dumps(res))
        return
    mx.reset_peak_memory()
    m, _ = load_sharded(spec["target"], g)
    res["load_peak"], res["weights"] = mx.get_peak_memory(), local_weight_bytes(m)
    d = load_drafters(m, embedded=True)
    res["runs"] = scenarios(m, d, load_sharded(spec["random"], g)[0], load_sharded(spec["quantized"], g)[0])
    del m, d
    km, _ = load_sharded(spec["kvrep"], g)  # 1 KV head over 2 ranks: replicated
    res["kvrep_runs"] = kv_runs(km)
    a = km.model.layers[0].self_attn
    cache = km.make_cache()
    km(mx.array([PROMPTS[0]]), cache)
    res["kvrep"] = {"n_kv": a.n_kv, "n_heads": a.n_heads, "k": np.array(a.k_proj.weight).tolist(),
                    "v": np.array(a.v_proj.weight).tolist(), "cache_heads": [c.keys.shape[1] for c in cache]}
    del km, a, cache
    mx.reset_peak_memory()
    pm, _ = load_sharded(spec["target"], g, strategy="pp")
    res["pp_load_peak"], res["pp_weights"] = mx.get_peak_memory(), local_weight_bytes(pm)
    pd = load_drafters(pm, embedded=True)
    expose_taps(pm, pd.dflash.taps + pd.mtp.taps)
    res["pp_runs"] = scenarios(pm, pd, load_sharded(spec["random"], g, strategy="pp")[0], None)
    try:  # a rank that was given another model is named
        check_same(g, model=spec["target"] if g.rank() == 0 else spec["random"])
    except DistributedError as e:
        res["disagree"] = str(e)
    from types import SimpleNamespace as Chunk  # two ranks whose second chunks differ: the lockstep check stops them

    try:
        res["lockstep_seen"] = [c.tokens for c in lockstep(iter([Chunk(tokens=[5, 6]), Chunk(tokens=[7 + g.rank()]),
                                                                 Chunk(tokens=[8])]), g, every=1)]
    except DistributedError as e:
        res["diverged"] = str(e)
    (out / f"rank{g.rank()}.json").write_text(json.dumps(res))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.path.insert(0, str(ROOT))
    run_scenarios(json.loads(sys.argv[2]), Path(sys.argv[3]))
    sys.exit(0)

import pytest  # noqa: E402

LAUNCH = shutil.which("mlx.launch") or (str(Path(sys.executable).parent / "mlx.launch")
                                        if (Path(sys.executable).parent / "mlx.launch").exists() else None)
pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed (MLX's distributed launcher)")


def launch(spec: dict, out: Path, timeout: float = 300, n: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [LAUNCH, "-n", str(n), "--backend", "ring", "--", sys.executable, str(Path(__file__).resolve()), "worker",
           json.dumps(spec), str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def quantized_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The random tiny checkpoint quantized to 4 bits (group 32: a row-split input of 32 columns) by the converter."""
    from glimmer_mlx.convert import convert

    src, _ = tiny_checkpoint(seed=3)
    out = tmp_path_factory.mktemp("q4") / "q4"
    convert(str(src), str(out), quantize=True, q_bits=4, q_group_size=32, evaluate=False)
    return out


@pytest.fixture(scope="module")
def two_ranks(tiny_checkpoint, quantized_checkpoint, tmp_path_factory):
    from glimmer_mlx.embedded import embedded_path

    rnd, _ = tiny_checkpoint(seed=3)
    kvrep, _ = tiny_checkpoint(seed=5, num_key_value_heads=1)  # 4 query heads, 1 KV head: 2 ranks replicate it
    spec = {"target": str(embedded_path("target")), "random": str(rnd), "quantized": str(quantized_checkpoint),
            "kvrep": str(kvrep)}
    out = tmp_path_factory.mktemp("tp")
    r = launch(spec, out)
    done = all((out / f"rank{i}.json").exists() for i in range(2))
    assert r.returncode == 0 and done, r.stdout[-2000:] + r.stderr[-4000:]  # (mlx.launch can exit 0 when a rank failed)
    return spec, [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]


def single_process(spec):
    """The oracle: the unsharded models, one process."""
    from glimmer_mlx import load
    from glimmer_mlx.strategy import load_drafters

    m, _ = load(spec["target"])
    return scenarios(m, load_drafters(m, embedded=True), load(spec["random"])[0], load(spec["quantized"])[0])


@pytest.fixture(scope="module")
def one_process(two_ranks):
    return single_process(two_ranks[0])


@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_two_ranks_decode_exactly_as_one_process(two_ranks, one_process, strategy):
    spec, ranks = two_ranks
    want = one_process
    assert [r["size"] for r in ranks] == [2, 2]
    for r in ranks:
        got = r["runs" if strategy == "tp" else "pp_runs"]
        assert set(got) == set(want) - ({"quantized"} if strategy == "pp" else set())
        for k in got:
            assert got[k] == want[k], (r["rank"], strategy, k)
    # the scenarios are not degenerate: sampling differs from greedy, and the runs produce tokens
    assert want["ar/1.0"] != want["ar/0.0"] and all(len(v) for v in want.values())


def test_tp_replicates_a_kv_head_over_more_ranks_than_kv_heads(two_ranks):
    """1 KV head, 4 query heads, 2 ranks: each rank holds query heads 2r, 2r+1 and the whole (one) KV head's K/V
    rows, its caches hold that one head, and greedy decoding is the single process's (fp32)."""
    import numpy as np

    from glimmer_mlx import load

    spec, ranks = two_ranks
    m, _ = load(spec["kvrep"])
    a = m.model.layers[0].self_attn
    assert a.n_kv == 1 and a.n_heads == 4
    want = kv_runs(m)
    assert all(len(t) for t in want)
    for r in ranks:
        assert r["kvrep_runs"] == want, r["rank"]
        k = r["kvrep"]
        assert k["n_kv"] == 1 and k["n_heads"] == 2
        assert np.array_equal(np.array(k["k"], dtype=np.float32), np.array(a.k_proj.weight))  # head_dim rows
        assert np.array_equal(np.array(k["v"], dtype=np.float32), np.array(a.v_proj.weight))
        assert np.array(k["k"]).shape == (a.head_dim, m.args.hidden_size)
        assert set(k["cache_heads"]) == {1}


def test_tree_scenarios_accept_off_chain_paths(monkeypatch):
    """The tree scenarios are not degenerate: on one process, DFlash and MTP trees accept paths that are not the
    chain (rows moved by keep_path), which the 2-process runs must then reproduce."""
    from glimmer_mlx import load
    from glimmer_mlx.cache import KVCache
    from glimmer_mlx.embedded import embedded_path
    from glimmer_mlx.generate import generate
    from glimmer_mlx.strategy import load_drafters

    moved = []
    real = KVCache.keep_rows
    monkeypatch.setattr(KVCache, "keep_rows", lambda self, off, rows: (moved.append(rows != list(range(len(rows)))),
                                                                        real(self, off, rows))[1])
    m, _ = load(embedded_path("target"))
    d = load_drafters(m, embedded=True)
    for drafter, nodes in ((d.dflash, 16), (d.mtp, 8)):
        moved.clear()
        generate(m, TREE_PROMPT, max_tokens=TREE_TOKENS, drafter=drafter, tree=nodes)
        assert any(moved), drafter.kind


@pytest.mark.slow  # ~60-120 s: a launch decoding 4 trees per strategy on two ranks sharing two cores
def test_token_trees_over_two_ranks_decode_exactly_as_one_process(tmp_path):
    """`--tree` under tp and pp: each rank's tree verify forward (tree mask, per-node RoPE through the sharded
    attention; under pp through RemoteLayer / StageBoundary) and its keep_path compaction (under pp the other
    stage's layers keep `PositionCache` books) give the single process's tokens."""
    from glimmer_mlx import load
    from glimmer_mlx.embedded import embedded_path
    from glimmer_mlx.strategy import load_drafters

    r = launch({"target": str(embedded_path("target")), "trees": True}, tmp_path)
    done = all((tmp_path / f"rank{i}.json").exists() for i in range(2))
    assert r.returncode == 0 and done, r.stdout[-2000:] + r.stderr[-4000:]
    m, _ = load(embedded_path("target"))
    want = tree_runs(m, load_drafters(m, embedded=True))
    assert all(len(v) for v in want.values())
    for i in range(2):
        res = json.loads((tmp_path / f"rank{i}.json").read_text())
        for strategy in ("tp", "pp"):
            assert res[strategy] == want, (i, strategy)


@pytest.mark.slow  # ~40-90 s: a launch decoding 4 scenarios twice on two ranks
def test_micro_batched_pipeline_decodes_exactly_as_one_process(tmp_path):
    """--distributed pp --pp-microbatch 2 and 16 (a verify block of 9 or 16 rows split into 2 / one row each; the
    prompt's prefill split too): greedy plain, DFlash and MTP and seeded T = 1 DFlash give the single process's
    tokens."""
    from glimmer_mlx import load
    from glimmer_mlx.embedded import embedded_path
    from glimmer_mlx.strategy import load_drafters

    r = launch({"target": str(embedded_path("target")), "microbatch": [2, 16]}, tmp_path)
    done = all((tmp_path / f"rank{i}.json").exists() for i in range(2))
    assert r.returncode == 0 and done, r.stdout[-2000:] + r.stderr[-4000:]
    m, _ = load(embedded_path("target"))
    want = microbatch_runs(m, load_drafters(m, embedded=True))
    assert all(len(v) for v in want.values())
    for i in range(2):
        res = json.loads((tmp_path / f"rank{i}.json").read_text())
        for mb in ("2", "16"):
            assert res[mb] == want, (i, mb)


def test_micro_batches_in_process_equal_the_unsplit_forward(monkeypatch):
    """One stage (the collectives the identity): a pipelined forward split into 3 or 6 micro-batches after a
    4-token prefix gives the unsplit forward's logits and taps (fp32 rounding of smaller products only) and the same
    cache; a forward of one row and a token tree run unsplit."""
    import mlx.core as mx

    from glimmer_mlx import load
    from glimmer_mlx.distributed import expose_taps, microbatch_sizes, pipeline_model
    from glimmer_mlx.embedded import embedded_path

    monkeypatch.setattr(mx.distributed, "all_sum", lambda v, group=None, stream=None: v)
    monkeypatch.setattr(mx.distributed, "all_gather", lambda v, group=None, stream=None: v)
    assert microbatch_sizes(10, 3) == [4, 3, 3] and microbatch_sizes(2, 5) == [1, 1]
    ids = mx.array([TREE_PROMPT])
    got = {}
    for mb in (1, 3, 6):
        m, _ = load(embedded_path("target"))
        pipeline_model(m, FakeGroup(0, 1), microbatch=mb)
        expose_taps(m, [1, 3])
        c = m.make_cache()
        m(ids[:, :4], c)
        logits, taps = m(ids[:, 4:], c, taps=[1, 3, 5])
        tree = (mx.array([0, 1, 1, 2]), mx.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=mx.bool_))
        tree_logits = m(mx.array([[5, 6, 7, 8]]), c, tree=tree)  # a tree: unsplit
        got[mb] = (logits, taps, [(x.offset, x.keys) for x in c], tree_logits)
    ref = got[1]
    for mb in (3, 6):
        logits, taps, caches, tree_logits = got[mb]
        assert mx.abs(tree_logits - ref[3]).max().item() < 1e-4
        assert mx.abs(logits - ref[0]).max().item() < 1e-4
        assert mx.array_equal(logits.argmax(-1), ref[0].argmax(-1)).item()
        for a, b in zip(taps, ref[1]):
            assert a.shape == b.shape and mx.abs(a - b).max().item() < 1e-4
        for (o, k), (ro, rk) in zip(caches, ref[2]):
            assert o == ro == len(TREE_PROMPT) + 4 and mx.abs(k - rk).max().item() < 1e-4


def test_pp_microbatch_is_checked():
    from glimmer_mlx.distributed import pipeline_model

    with pytest.raises(ValueError, match=r"--pp-microbatch must be an integer in \[1, 64\], got 0"):
        pipeline_model(None, FakeGroup(0, 2), microbatch=0)


def test_position_cache_keeps_the_books_of_a_real_cache():
    """A pipeline rank's cache for another stage's layer (no rows) answers every rewind / keep-path check as a real
    KVCache of the same window does, through appends, rewinds and tree compactions past the window."""
    import random

    import mlx.core as mx

    from glimmer_mlx.cache import CacheRewindError, KVCache
    from glimmer_mlx.distributed import PositionCache

    rng = random.Random(0)
    for window in (None, 8):
        real, pos = KVCache(window, max_rewind=4), PositionCache(window, max_rewind=4)
        for _ in range(300):
            op = rng.choice(["append", "append", "rewind", "keep"])
            if op == "append":
                L = rng.choice([1, 1, 3, 9])
                kv = mx.zeros((1, 1, L, 2))
                real.append(kv, kv)
                pos.advance(L)
            else:
                n = rng.randint(0, 7)
                off = real.offset - n
                rows = sorted(rng.sample(range(n), rng.randint(1, n))) if op == "keep" and n else None
                verdicts = []
                for c in (real, pos):
                    try:
                        c.keep_rows(off, rows) if rows else c.rewind(n)
                        verdicts.append("ok")
                    except (CacheRewindError, ValueError) as e:
                        verdicts.append(str(e))
                assert verdicts[0] == verdicts[1], (op, n, rows, verdicts)
            assert (pos.offset, pos.start, pos.rows) == (real.offset, real.start, real.rows)


@pytest.mark.slow  # ~30-90 s: four ranks on two cores
def test_kv_head_replication_over_four_real_ranks(tiny_checkpoint, tmp_path):
    """`mlx.launch -n 4 --backend ring` over loopback: 4 query heads with 1 KV head (each rank holds it) and with 2
    (ranks 0-1 hold KV head 0, ranks 2-3 head 1): each rank's k_proj is its KV head's rows, its caches hold 1 head,
    and greedy decoding of both prompts is the single process's (fp32)."""
    import numpy as np

    from glimmer_mlx import load

    paths = {"kv1": str(tiny_checkpoint(seed=5, num_key_value_heads=1)[0]), "kv2": str(tiny_checkpoint(seed=3)[0])}
    r = launch({"kv4": paths}, tmp_path, n=4)
    done = all((tmp_path / f"rank{i}.json").exists() for i in range(4))
    assert r.returncode == 0 and done, r.stdout[-2000:] + r.stderr[-4000:]
    for key, path in paths.items():
        m, _ = load(path)
        a = m.model.layers[0].self_attn
        hd, n_kv = a.head_dim, a.n_kv
        assert a.n_heads == 4 and n_kv == int(key[-1])
        want = kv_runs(m)
        assert all(len(t) for t in want)
        for i in range(4):
            res = json.loads((tmp_path / f"rank{i}.json").read_text())
            assert res["size"] == 4
            got = res[key]
            assert got["runs"] == want, (key, i)
            assert got["n_kv"] == 1 and got["n_heads"] == 1 and set(got["cache_heads"]) == {1}
            h = i // (4 // n_kv)  # the KV head rank i's query head uses
            assert np.array_equal(np.array(got["k"], dtype=np.float32), np.array(a.k_proj.weight)[h * hd:(h + 1) * hd])


class FakeGroup:
    """rank/size only: enough to build one rank's sharded layers in process (the collectives are patched)."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@pytest.mark.parametrize("kv_heads, quantized", [(2, False), (1, False), (2, True)])
def test_kv_head_replication_in_process_over_4_fake_ranks(tiny_checkpoint, monkeypatch, kv_heads, quantized):
    """4 ranks, 4 query heads, 2 (or 1) KV heads: rank r holds the K/V rows of KV head r // (4 / Hkv), the one its
    query head uses, its cache holds 1 head, and the ranks' o_proj partial outputs (all_sum patched to the identity)
    add up to the unsharded attention. Quantized: k/v_proj affine 4-bit (g32), split into quantized shards."""
    import mlx.core as mx
    import mlx.nn as nn

    from glimmer_mlx import load
    from glimmer_mlx.cache import KVCache
    from glimmer_mlx.distributed import kv_heads_per_rank, shard_model

    path, _ = tiny_checkpoint(seed=3, **({} if kv_heads == 2 else {"num_key_value_heads": 1}))

    def loaded():
        m, _ = load(path)
        if quantized:
            nn.quantize(m, group_size=32, bits=4,
                        class_predicate=lambda p, mod: p.endswith(("k_proj", "v_proj")) and isinstance(mod, nn.Linear))
        return m

    full = loaded()
    hd = full.args.head_dim
    share = 4 // kv_heads
    assert kv_heads_per_rank(4, kv_heads, 4) == (1, share)
    x = mx.random.normal((1, 5, full.args.hidden_size), key=mx.random.key(0))
    want = {i: full.model.layers[i].self_attn(x, full.rope, KVCache(window=None)) for i in (0, 1)}
    monkeypatch.setattr(mx.distributed, "all_sum", lambda v, group=None, stream=None: v)
    parts = {0: [], 1: []}
    for r in range(4):
        m = loaded()
        shard_model(m, FakeGroup(r, 4))
        for i in (0, 1):
            a, fa = m.model.layers[i].self_attn, full.model.layers[i].self_attn
            h = r // share
            assert a.n_kv == 1 and a.n_heads == 1
            assert isinstance(a.k_proj, nn.QuantizedAllToShardedLinear if quantized else nn.AllToShardedLinear)
            for name in ("k_proj", "v_proj"):
                for leaf in ("weight", "scales", "biases") if quantized else ("weight",):
                    got, whole = getattr(getattr(a, name), leaf), getattr(getattr(fa, name), leaf)
                    assert mx.array_equal(got, whole[h * hd:(h + 1) * hd]).item(), (name, leaf)
            assert mx.array_equal(a.q_proj.weight, fa.q_proj.weight[r * hd:(r + 1) * hd]).item()
            c = KVCache(window=None)
            parts[i].append(a(x, m.rope, c))
            assert c.keys.shape[1] == 1
    for i in (0, 1):
        assert mx.abs(sum(parts[i]) - want[i]).max().item() < 1e-5


def test_each_rank_holds_and_peaks_at_about_half_the_weights(two_ranks):
    from glimmer_mlx import load
    from glimmer_mlx.distributed import local_weight_bytes

    spec, ranks = two_ranks
    m, _ = load(spec["target"])
    full = local_weight_bytes(m)
    c = m.args
    replicated = sum(v.nbytes for k, v in __import__("mlx.utils", fromlist=["x"]).tree_flatten(m.parameters())
                     if "norm" in k)
    for r in ranks:
        assert r["weights"] == (full - replicated) // 2 + replicated, (r["weights"], full)
        # the load's peak: the rank's own weights plus at most one tensor slice being cast/copied
        assert r["load_peak"] <= r["weights"] + c.vocab_size * c.hidden_size * 4 // 2 + 1024, (r["load_peak"], full)


def test_pipeline_ranks_hold_their_stage_and_half_the_vocabulary(two_ranks):
    from mlx.utils import tree_flatten

    from glimmer_mlx import load

    spec, ranks = two_ranks
    m, _ = load(spec["target"])
    sizes = {k: v.nbytes for k, v in tree_flatten(m.parameters())}
    L = m.args.num_hidden_layers
    for r in ranks:  # 6 layers: rank 0 computes layers 0-2, rank 1 layers 3-5
        mine = range(r["rank"] * L // 2, (r["rank"] + 1) * L // 2)
        want = sum(b for k, b in sizes.items() if k.startswith("model.layers.") and int(k.split(".")[2]) in mine)
        want += sum(b for k, b in sizes.items() if k.startswith(("model.embed_tokens.", "lm_head."))) // 2
        want += sum(b for k, b in sizes.items() if k.startswith("model.norm."))
        assert r["pp_weights"] == want, (r["rank"], r["pp_weights"], want)
        assert r["pp_load_peak"] <= want + 1024


def test_ranks_that_disagree_on_the_model_get_one_clear_line(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        assert "ranks disagree on the model: rank(s) [1] differ from rank 0" in r["disagree"]


def test_ranks_whose_tokens_diverge_are_stopped_by_the_lockstep_check(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        assert "lockstep_seen" not in r
        assert f"rank {r['rank']}: ranks diverged (committed tokens per rank: [3, 3], hashes differ)" in r["diverged"]


@pytest.mark.slow  # ~6-20 s each: two more launches
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_rank_that_dies_or_hangs_mid_generation_ends_the_other_with_a_clear_error(how, tmp_path):
    from glimmer_mlx.embedded import embedded_path

    t0 = time.monotonic()
    r = launch({"target": str(embedded_path("target")), "die": how, "timeout": 4.0}, tmp_path, timeout=90)
    took = time.monotonic() - t0
    assert took < 60
    if how == "exit":
        res = json.loads((tmp_path / "rank0.json").read_text())
        assert "rank 0: lost contact with another rank mid-generation" in res["error"], res
        assert res["seconds"] < 30
    else:  # rank 0 blocks inside a collective: the watchdog ends it
        assert "error: rank 0: no progress from the other ranks for" in r.stderr, r.stderr[-3000:]
        assert not (tmp_path / "rank0.json").exists()


def test_without_a_launcher_or_with_one_rank_the_error_says_how_to_launch():
    from glimmer_mlx.distributed import DistributedError, init_group

    with pytest.raises(DistributedError, match="mlx.launch -n 2 --backend ring"):
        init_group()
    os.environ.update(MLX_RANK="0", MLX_HOSTFILE="")  # as `mlx.launch -n 1` sets them
    try:
        with pytest.raises(DistributedError, match=r"world size 1 \(mlx.launch started a single process\)"):
            init_group()
    finally:
        del os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"]


def test_dimensions_that_do_not_split_evenly_are_named(tiny_checkpoint):
    from glimmer_mlx import load
    from glimmer_mlx.distributed import check_shardable

    path, _ = tiny_checkpoint(seed=3)
    m, _ = load(path)  # 4 query heads, 2 KV heads, MLP 128, vocab 512
    with pytest.raises(ValueError, match="tensor parallelism over 3 ranks: num_attention_heads 4 is not divisible by "
                       "3; intermediate_size 128 is not divisible by 3; vocab_size 512 is not divisible by 3"):
        check_shardable(m, 3)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by 8"):
        check_shardable(m, 8)
    check_shardable(m, 2)
    check_shardable(m, 4)  # 4 ranks > 2 KV heads: replicated
    from types import SimpleNamespace

    from glimmer_mlx.distributed import shard_problems

    c = SimpleNamespace(num_attention_heads=12, num_key_value_heads=4, intermediate_size=96, vocab_size=96, head_dim=8)
    assert shard_problems(c, 6) == ["num_key_value_heads 4 is not divisible by 6, and 6 ranks cannot replicate them "
                                    "(KV-head replication needs the ranks to be a multiple of num_key_value_heads and "
                                    "num_attention_heads to divide by the ranks)"]


def test_auto_is_refused():
    from glimmer_mlx.distributed import check_mode

    with pytest.raises(ValueError, match="wall-clock"):
        check_mode("auto", None)
    with pytest.raises(ValueError, match="wall-clock"):
        check_mode("dflash", "auto")
    check_mode("dflash", 4)


def test_cli_two_ranks_print_once_what_one_process_prints():
    """`mlx.launch -n 2 -- glimmer generate --distributed tp`: rank 0 alone writes the text, and it is the
    single-process text (greedy, MTP speculation); a single process asking for --distributed fails in one line."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    args = ["generate", "-p", "Once upon a time", "-m", "16", "--mode", "mtp", "--quiet"]
    glimmer = [sys.executable, "-m", "glimmer_mlx.cli"]
    one = subprocess.run(glimmer + args, capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--"] + glimmer + args + ["--distributed", "tp"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert two.returncode == 0 and "error" not in two.stderr, two.stderr[-2000:]
    assert one.stdout.strip() and two.stdout == one.stdout
    alone = subprocess.run(glimmer + args + ["--distributed", "tp"], capture_output=True, text=True, timeout=120,
                           env=env)
    assert alone.returncode == 1
    assert "error: --distributed: no distributed backend could be initialised" in alone.stderr
    assert "mlx.launch -n 2 --backend ring" in alone.stderr
