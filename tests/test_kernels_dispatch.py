"""GLIMMER_KERNELS and the dispatchers: Metal only when available, self-tested and supported, the built-in path
otherwise; the runtime self-test and its fallback (a compile failure, a wrong result, a failure at a call)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx import kernels
from glimmer_mlx.kernels import _core, accept
from msl_harness import harness

KERNELS = ("greedy_accept.metal", "rejection_accept.metal", "block_attention_partial.metal",
           "block_attention_combine.metal", "qmm_small.metal")


def test_mode_switch(monkeypatch):
    monkeypatch.delenv(_core.ENV, raising=False)
    assert kernels.mode() == "auto"
    monkeypatch.setenv(_core.ENV, "Reference")
    assert kernels.mode() == "reference" and kernels.use_metal() is False
    monkeypatch.setenv(_core.ENV, "gpu")
    with pytest.raises(ValueError, match="GLIMMER_KERNELS must be one of"):
        kernels.mode()


@pytest.mark.skipif(_core.metal_available(), reason="checks the behaviour without Metal")
def test_without_metal_auto_is_reference_and_metal_is_an_error(monkeypatch):
    monkeypatch.setenv(_core.ENV, "auto")
    assert kernels.use_metal() is False
    x = mx.array(np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32))
    assert kernels.greedy_accept(x, [1, 2, 3]) == accept.greedy_accept_reference(x, [1, 2, 3])
    monkeypatch.setenv(_core.ENV, "metal")
    with pytest.raises(kernels.KernelUnavailable, match="no Metal back-end"):
        kernels.greedy_accept(x, [1, 2, 3])


@pytest.mark.skipif(not _core.metal_available(), reason="needs Metal (Apple GPU); this MLX build has none")
def test_reference_switch_on_a_mac(monkeypatch):
    monkeypatch.setenv(_core.ENV, "reference")
    assert kernels.use_metal() is False
    monkeypatch.setenv(_core.ENV, "auto")
    assert kernels.use_metal() is True


def test_kernel_bodies_are_found_and_packaged():
    d = _core.kernel_dir()
    for name in KERNELS:
        assert (d / name).is_file(), name
        assert _core.load_source(name).strip()
    # the wheel ships them as package data under glimmer_mlx/metal_kernels (a link to metal_kernels/ in a checkout)
    pkg = Path(glimmer_mlx.__file__).parent / "metal_kernels"
    assert all((pkg / name).is_file() for name in KERNELS)
    text = (Path(glimmer_mlx.__file__).parent.parent / "pyproject.toml")
    if text.is_file():
        assert '"metal_kernels/*.metal"' in text.read_text()


def test_every_kernel_builds_without_metal():
    """Building (not calling) works on any MLX build: the specs are consistent with the bodies."""
    from glimmer_mlx.kernels import attention, quantized

    for spec in (accept.GREEDY, accept.REJECTION, attention.PARTIAL, attention.COMBINE, quantized.QMM):
        assert spec.build() is spec.build()  # built once and cached
        for name in spec.input_names + spec.output_names:
            assert name in spec.source, (spec.name, name)


# -- runtime self-test and fallback (Metal simulated: launches go through the MSL-on-CPU harness) ---------------------
needs_cxx = pytest.mark.skipif(harness.find_compiler() is None,
                               reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")


class Builder:
    """A replacement kernel builder (`KernelSpec.build`): launches run through the harness, optionally on a
    mutated body or failing the way a Metal compiler does; counts launches per kernel."""

    def __init__(self, fail: str | None = None, mutate=None):
        self.fail, self.mutate, self.launches = fail, mutate, []

    def __call__(self, spec):
        if self.fail:
            raise RuntimeError(self.fail)

        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
            s = spec if self.mutate is None else self.mutate(spec)
            self.launches.append(spec.name)
            return harness.run(_core.KernelCall(s, list(inputs), list(output_shapes), list(output_dtypes), grid,
                                                threadgroup, list(template), init_value))
        return kernel


@pytest.fixture
def fake_metal(monkeypatch, tmp_path):
    """Metal 'available', a private cache dir, fresh verdicts; returns a function installing a Builder."""
    monkeypatch.delenv(_core.ENV, raising=False)
    monkeypatch.setenv("GLIMMER_MLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_core, "metal_available", lambda: True)
    _core.reset_selftests()

    def install(builder):
        monkeypatch.setattr(_core.KernelSpec, "build", lambda spec: builder(spec))
        return builder

    yield install
    _core.reset_selftests()


def logits_case():
    x = np.random.default_rng(4).standard_normal((4, 2500)).astype(np.float32)
    x[0, [9, 9 + 1024]] = 9.0  # a tie inside one thread's strided range
    sel = x.argmax(-1)
    return mx.array(x), [int(sel[0]), int(sel[1]), int(sel[2] + 1) % 2500]


@needs_cxx
def test_selftest_passes_the_dispatcher_uses_the_kernel_and_later_processes_reuse_the_verdict(fake_metal, tmp_path):
    b = fake_metal(Builder())
    x, drafts = logits_case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on success
        assert kernels.greedy_accept(x, drafts) == accept.greedy_accept_reference(x, drafts) == (2, int(
            np.argmax(np.array(x[2]))))
    assert _core.kernel_stats()["greedy_accept"] == {"status": "ok", "path": "metal kernel", "reason": "",
                                                     "cached": False}
    n_test = len(b.launches)
    assert n_test >= 2  # the self-test's launch(es) and the call's own
    cache = json.loads((tmp_path / _core.SELFTEST_FILE).read_text())
    assert [r["status"] for r in cache.values()] == ["ok"]
    # a new process: the verdict comes from disk, no self-test launch, the call runs the kernel
    _core.reset_selftests()
    before = len(b.launches)
    assert kernels.greedy_accept(x, drafts) == accept.greedy_accept_reference(x, drafts)
    assert len(b.launches) == before + 1
    assert _core.verdict("greedy_accept").cached is True
    # another GPU / MLX version / kernel text: tested again
    _core.reset_selftests()
    real = _core.gpu_identity()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_core, "gpu_identity", lambda: {**real, "gpu": "Apple M9 Ultra"})
        assert _core.verdict("greedy_accept").cached is False
    assert len(json.loads((tmp_path / _core.SELFTEST_FILE).read_text())) == 2


@needs_cxx
def test_rejection_selftest_passes_through_the_harness(fake_metal):
    fake_metal(Builder())
    v = _core.verdict("rejection_accept")
    assert v.status == "ok", v.reason
    rng = np.random.default_rng(0)
    z = rng.standard_normal((3, 900)).astype(np.float32)
    lp = mx.array(z - np.log(np.exp(z).sum(-1, keepdims=True)))
    args = (lp, lp[:2] * 1.1, [int(np.argmax(z[0])), 4], mx.array([0.3, 0.6, 0.2]))
    assert kernels.rejection_accept_logprobs(*args) == accept.rejection_accept_reference_logprobs(*args)


def test_compile_failure_warns_once_and_falls_back_for_the_process(fake_metal, tmp_path, monkeypatch):
    fake_metal(Builder(fail="program_source:12:3: error: use of undeclared identifier 'simd_max2'"))
    x, drafts = logits_case()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        results = [kernels.greedy_accept(x, drafts) for _ in range(3)]
    assert results == [accept.greedy_accept_reference(x, drafts)] * 3
    msgs = [str(m.message) for m in w if issubclass(m.category, RuntimeWarning)]
    assert len(msgs) == 1 and "greedy_accept disabled" in msgs[0] and "undeclared identifier" in msgs[0]
    st = _core.kernel_stats()["greedy_accept"]
    assert st["status"] == "failed" and st["path"].startswith("pure-MLX reference")
    assert st["reason"].startswith("build or launch failed: RuntimeError")
    cache = json.loads((tmp_path / _core.SELFTEST_FILE).read_text())
    assert [r["status"] for r in cache.values()] == ["failed"]
    monkeypatch.setenv(_core.ENV, "metal")  # kernels required: the failure is an error
    with pytest.raises(kernels.KernelUnavailable, match="failed its self-test"):
        kernels.greedy_accept(x, drafts)


@needs_cxx
def test_wrong_result_is_caught_by_the_selftest(fake_metal):
    """A kernel that compiles but mis-computes (here: ties resolved to the last index inside a thread's range)
    fails the self-test; the dispatcher answers with the reference, also on inputs the broken kernel gets wrong."""
    def keep_last(spec):
        return dataclasses.replace(spec, name=spec.name + "_last", text=spec.source.replace("key > bk", "key >= bk"))

    b = fake_metal(Builder(mutate=keep_last))
    x, drafts = logits_case()
    broken = b(accept.GREEDY)(inputs=[x, mx.array([4, 2500], dtype=mx.int32)], template=[("T", mx.float32)],
                              grid=(1024, 4, 1), threadgroup=(1024, 1, 1), output_shapes=[(4,)],
                              output_dtypes=[mx.int32])[0]
    assert broken.tolist()[0] == 9 + 1024  # the mutant really is wrong here
    with pytest.warns(RuntimeWarning, match="wrong result on the self-test inputs"):
        assert kernels.greedy_accept(x, drafts) == accept.greedy_accept_reference(x, drafts)
    assert _core.kernel_stats()["greedy_accept"]["status"] == "failed"


@needs_cxx
def test_a_kernel_failing_at_a_real_call_is_demoted(fake_metal):
    b = fake_metal(Builder())
    x, drafts = logits_case()
    assert _core.verdict("greedy_accept").ok
    b.fail = "Metal: command buffer execution failed (Caused GPU Timeout Error)"
    with pytest.warns(RuntimeWarning, match="failed at a call: RuntimeError: Metal: command buffer"):
        assert kernels.greedy_accept(x, drafts) == accept.greedy_accept_reference(x, drafts)
    assert _core.kernel_stats()["greedy_accept"]["status"] == "failed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # demoted once; later calls are quietly the reference
        assert kernels.greedy_accept(x, drafts) == accept.greedy_accept_reference(x, drafts)


@pytest.mark.skipif(_core.metal_available(), reason="checks the behaviour without Metal")
def test_verdicts_without_metal_and_with_the_reference_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("GLIMMER_MLX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(_core.ENV, raising=False)
    _core.reset_selftests()
    v = _core.verdict("greedy_accept")
    assert (v.status, v.reason) == ("unavailable", "not available: no Metal")
    assert not (tmp_path / _core.SELFTEST_FILE).exists()  # nothing was tested, nothing cached
    _core.reset_selftests()
    monkeypatch.setenv(_core.ENV, "reference")
    assert _core.verdict("greedy_accept").status == "disabled"
    _core.reset_selftests()
    with pytest.raises(ValueError, match="no registered self-test"):
        _core.verdict("no_such_kernel")


def test_time_calls_evaluates_once_per_window(monkeypatch):
    evals = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evals.append(len(a[0]) if isinstance(a[0], list) else 1),
                                                real_eval(*a)))
    x = mx.ones((10,))
    us = _core.time_calls(lambda: x * 2, calls=7, windows=3, warmup=1)
    assert us > 0 and evals == [1, 7, 7, 7]  # the warm-up, then one eval of 7 outputs per window


@pytest.mark.skipif(_core.metal_available(), reason="checks the behaviour without Metal")
def test_kernel_bench_without_metal_times_builtin_and_reference(monkeypatch):
    """`glimmer bench kernels` on a tiny vocabulary: the kernel column is "no Metal", the built-in and reference
    columns are measured, one row per (kernel, k+1); the greedy paths it times agree with a numpy argmax."""
    from glimmer_mlx.bench import kernels as kb

    evals = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evals.append(1), real_eval(*a)))
    res = kb.run_kernel_bench(rows=(1, 3), kernels=("accept_greedy", "accept_sampling"), vocab=300, calls=4,
                              windows=2, warmup=0)
    assert res["kernel_status"] == {"accept_greedy": "no Metal", "accept_sampling": "no Metal"}
    assert [(r["kernel"], r["rows"]) for r in res["results"]] == [
        ("accept_greedy", 1), ("accept_sampling", 1), ("accept_greedy", 3), ("accept_sampling", 3)]
    assert all(r["kernel_us"] is None and r["builtin_us"] > 0 and r["reference_us"] > 0 for r in res["results"])
    # 4 paths x 2 timed paths x 2 windows = one eval per window (plus the few set-up evals of the inputs)
    assert len(evals) <= 2 * 2 * 2 * 2 + 2 * 3
    x = np.random.default_rng(1).standard_normal((3, 300)).astype(np.float32)
    d = x.argmax(-1)[:2].tolist()
    assert accept.greedy_accept_reference_arrays(mx.array(x), d).tolist() == [2, int(x[2].argmax())]
    text = kb.render_kernel_table(res)
    assert [c.header for c in text.columns][3:6] == ["Metal kernel", "built-in MLX", "reference"]
