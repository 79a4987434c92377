"""Small-row affine-quantized matmul: the .metal kernel (through the MSL-on-CPU harness, and through MLX on a Mac)
against the pure-MLX reference, numpy and MLX's stock `quantized_matmul`; the QuantizedLinear routing."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from glimmer_mlx.kernels import _core
from glimmer_mlx.kernels import quantized as qm
from glimmer_mlx.kernels._core import metal_available
from msl_harness import harness

needs_cxx = pytest.mark.skipif(harness.find_compiler() is None,
                               reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")
needs_metal = pytest.mark.skipif(not metal_available(), reason="needs Metal (Apple GPU); this MLX build has none")


@pytest.fixture
def simulated_metal(monkeypatch, tmp_path):
    """Metal 'available', every launch through the MSL-on-CPU harness, a private self-test cache, fresh verdicts;
    yields the list of launched kernel names."""
    launched = []

    def through_harness(call):
        launched.append(call.spec.name)
        return harness.run(call)

    monkeypatch.delenv(_core.ENV, raising=False)
    monkeypatch.setattr(_core, "metal_available", lambda: True)
    monkeypatch.setattr(_core.KernelCall, "run_metal", through_harness)
    monkeypatch.setattr(_core, "selftest_cache_path", lambda: tmp_path / "kernel-selftest.json")
    monkeypatch.setattr(qm, "checked_variants", set())
    _core.reset_selftests()
    yield launched
    _core.reset_selftests()


def make(seed, M, K, N, bits, gs, dtype):
    rng = np.random.default_rng(seed)
    wf = mx.array(rng.standard_normal((N, K)).astype(np.float32) * 0.05).astype(dtype)
    w, s, b = mx.quantize(wf, group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    return x, w, s, b


def numpy_dequant(w, s, b, bits, gs):
    w = np.array(w).astype(np.uint64)
    per = 32 // bits
    vals = np.stack([(w >> np.uint64(bits * e)) & np.uint64((1 << bits) - 1) for e in range(per)], -1)
    q = vals.reshape(w.shape[0], -1).astype(np.float64)
    s = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), gs, axis=1)
    b = np.repeat(np.array(b.astype(mx.float32), dtype=np.float64), gs, axis=1)
    return q * s + b


TOL = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 2.5e-2}


def case_id(c):
    return f"M{c[0]}-K{c[1]}-N{c[2]}-b{c[3]}-g{c[4]}-{str(c[5]).split('.')[-1]}"


# (M, K, N, bits, group, dtype): M = 1, 2, 3, 5, 8, 9, 16 (one and two 8-row tiles, partial ones); N not a multiple
# of the 8 columns of a threadgroup; K with fewer 32-value blocks than the 4 simdgroups that split it (96) and with
# many (1024); every group size and both widths; fp32 / fp16 / bf16
CASES = [
    (1, 256, 40, 4, 64, mx.float32),
    (2, 512, 37, 4, 32, mx.float32),
    (3, 96, 13, 4, 32, mx.float32),
    (5, 384, 21, 8, 128, mx.float16),
    (8, 256, 16, 4, 64, mx.bfloat16),
    (9, 1024, 18, 4, 128, mx.float32),
    (16, 256, 9, 8, 64, mx.float16),
]
SLOW_CASES = [(M, 512, 27, bits, gs, dt) for M in range(1, 17) for bits, gs, dt in
              ((4, 64, mx.bfloat16), (8, 32, mx.float32))]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reference_matches_numpy_and_stock(case):
    M, K, N, bits, gs, dtype = case
    x, w, s, b = make(0, M, K, N, bits, gs, dtype)
    ref = qm.qmm_reference(x, w, s, b, group_size=gs, bits=bits)
    oracle = np.array(x.astype(mx.float32), dtype=np.float64) @ numpy_dequant(w, s, b, bits, gs).T
    scale = np.abs(oracle).max()
    np.testing.assert_allclose(np.array(ref.astype(mx.float32)), oracle, atol=TOL[dtype] * scale, rtol=0)
    stock = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)
    # MLX's CPU quantized_matmul rounds in the input dtype along the way (bf16: visibly): a looser bound
    np.testing.assert_allclose(np.array(ref.astype(mx.float32)), np.array(stock.astype(mx.float32)),
                               atol=3 * TOL[dtype] * scale, rtol=0)


def check_kernel(case, seed=1):
    M, K, N, bits, gs, dtype = case
    x, w, s, b = make(seed, M, K, N, bits, gs, dtype)
    got = harness.run(qm.qmm_call(x, w, s, b, group_size=gs, bits=bits))[0]
    assert got.dtype == dtype and got.shape == (M, N)
    oracle = np.array(x.astype(mx.float32), dtype=np.float64) @ numpy_dequant(w, s, b, bits, gs).T
    scale = np.abs(oracle).max()
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), oracle, atol=TOL[dtype] * scale, rtol=0)
    ref = qm.qmm_reference(x, w, s, b, group_size=gs, bits=bits)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype] * scale, rtol=0)


@needs_cxx
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_numpy_and_reference(case):
    check_kernel(case)


@needs_cxx
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_id)
def test_kernel_sweep(case):
    check_kernel(case)


@needs_cxx
def test_dispatcher_and_linear_take_the_kernel_where_the_table_says(simulated_metal, monkeypatch):
    """Metal simulated (launches through the harness) on an M2-class GPU: 2..16-row calls of a big matrix take the
    kernel (after its self-test passed), M = 1 and an M3-class GPU at M <= 5 take mx.quantized_matmul, as does
    everything without Metal."""
    launched = simulated_metal
    monkeypatch.setattr(qm, "gpu_architecture", lambda: (14, "g"))
    assert _core.kernel_enabled("qmm") and len(launched) == len(qm.selftest_inputs())
    launched.clear()
    monkeypatch.setattr(_core, "metal_available", lambda: False)
    x, w, s, b = make(4, 6, 256, 24, 4, 64, mx.float16)
    stock = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
    assert np.array_equal(np.array(qm.qmm(x, w, s, b, group_size=64, bits=4)), np.array(stock)) and not launched
    monkeypatch.setattr(_core, "metal_available", lambda: True)
    # K = 256 is below every size threshold: on gen 14 MLX would run qmv up to M = 13 -> the kernel
    got = qm.qmm(x, w, s, b, group_size=64, bits=4)
    assert launched == ["glimmer_qmm_small"]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(stock.astype(mx.float32)), atol=4e-3,
                               rtol=4e-3)
    launched.clear()
    qm.qmm(x[:1], w, s, b, group_size=64, bits=4)  # M = 1: MLX's qmv
    monkeypatch.setattr(qm, "gpu_architecture", lambda: (15, "s"))
    qm.qmm(x[:5], w, s, b, group_size=64, bits=4)  # gen 15, M = 5: qmv_wide reads the weights once
    assert launched == []
    # the QuantizedLinear subclass: rows over the leading axes, bias added, same numbers as the stock layer
    lin = nn.QuantizedLinear(256, 24, bias=True, group_size=64, bits=4)
    xin = mx.array(np.random.default_rng(5).standard_normal((1, 7, 256)).astype(np.float32))
    before = lin(xin)
    lin.__class__ = qm.KernelQuantizedLinear
    got = lin(xin)  # gen 15, 7 rows: qmv_wide would read twice -> the kernel
    assert launched == ["glimmer_qmm_small"] and got.shape == before.shape
    np.testing.assert_allclose(np.array(got), np.array(before), atol=1e-4, rtol=1e-4)
    launched.clear()
    lin(xin[:, :1])  # decode: stock
    assert launched == []


@needs_cxx
def test_a_variant_that_is_wrong_at_first_use_is_demoted(simulated_metal, monkeypatch):
    monkeypatch.setattr(qm, "gpu_architecture", lambda: (14, "g"))
    assert _core.kernel_enabled("qmm")
    through_harness = _core.KernelCall.run_metal

    def wrong_for_m3(call):
        out = through_harness(call)
        return [out[0] * 1.5] if ("M", 3) in call.template else out

    monkeypatch.setattr(_core.KernelCall, "run_metal", wrong_for_m3)
    x, w, s, b = make(6, 3, 256, 16, 4, 64, mx.float32)
    with pytest.warns(RuntimeWarning, match="qmm disabled"):
        got = qm.qmm(x, w, s, b, group_size=64, bits=4)
    np.testing.assert_array_equal(np.array(got), np.array(qm.builtin_qmm(x, w, s, b, group_size=64, bits=4)))
    assert _core.kernel_stats()["qmm"]["status"] == "failed"
    simulated_metal.clear()
    qm.qmm(x[:2], w, s, b, group_size=64, bits=4)
    assert simulated_metal == []


def test_dispatch_table_follows_mlx_dispatch_and_measurements(monkeypatch):
    """The reasoned rule, case by case from MLX 0.32's quantized.cpp: the kernel only where MLX's path reads the
    weights more than once; a MEASURED entry overrides it."""
    big = (4096, 4096)  # K, N
    assert qm.parse_architecture("applegpu_g15s") == (15, "s") and qm.parse_architecture("x86_64") is None
    assert qm.choose(4, *big, arch=None)[0] == "mlx"
    # M2 (gen 14): qmv below the limit of 10 rows (K = N = 4096), split-K qmm from 10 on
    assert qm.mlx_path(4, *big, 14, "g") == ("qmv", 4) and qm.choose(4, *big, arch=(14, "g"))[0] == "kernel"
    assert qm.mlx_path(10, *big, 14, "g")[0] == "qmm_splitk" and qm.choose(10, *big, arch=(14, "g"))[0] == "mlx"
    assert qm.choose(1, *big, arch=(14, "g"))[0] == "mlx"
    # M3 (gen 15): qmv_wide in tiles of 5 vectors up to 14 rows, split-K qmm at 15
    assert qm.mlx_path(5, *big, 15, "s") == ("qmv_wide", 1) and qm.choose(5, *big, arch=(15, "s"))[0] == "mlx"
    assert qm.mlx_path(6, *big, 15, "s") == ("qmv_wide", 2) and qm.choose(6, *big, arch=(15, "s"))[0] == "kernel"
    assert qm.choose(15, *big, arch=(15, "s"))[0] == "mlx" and qm.choose(14, *big, arch=(15, "s"))[0] == "kernel"
    # larger matrices lower the limit; 'd' parts raise it
    assert qm.mlx_qmv_limit(8192, 8192, 14, "g") == 6 and qm.mlx_qmv_limit(8192, 8192, 14, "d") == 12
    assert qm.mlx_qmv_limit(2048, 2048, 17, "s") == 33
    monkeypatch.setitem(qm.MEASURED, (15, "s", 6), ("mlx", "bench on an M3 Pro"))
    assert qm.choose(6, *big, arch=(15, "s")) == ("mlx", "measured: bench on an M3 Pro")


def test_shape_errors_and_support():
    x, w, s, b = make(2, 4, 256, 8, 4, 64, mx.float32)
    with pytest.raises(ValueError, match="multiple of group_size"):
        qm.qmm_reference(x[:, :200], w, s, b, group_size=64, bits=4)
    with pytest.raises(ValueError, match="packed weight"):
        qm.qmm_reference(x, w, s, b, group_size=64, bits=8)
    assert qm.supported(x, w, s, b, 64, 4)
    assert not qm.supported(mx.zeros((17, 256)), w, s, b, 64, 4)  # > 16 rows
    assert not qm.supported(x, w, s, None, 64, 4)  # not affine
    with pytest.raises(ValueError, match="unsupported shapes"):
        qm.qmm_call(mx.zeros((17, 256)), w, s, b, group_size=64, bits=4)


def test_quantized_linear_routing_is_inert_without_metal():
    lin = nn.QuantizedLinear(256, 24, bias=True, group_size=64, bits=4)
    model = nn.Sequential(lin)
    x = mx.array(np.random.default_rng(0).standard_normal((1, 5, 256)).astype(np.float32))
    before = lin(x)
    assert qm.install_block_kernels(model) == 0  # no Metal here: nothing switched
    assert type(lin) is nn.QuantizedLinear
    # the subclass itself falls back to the stock op when the kernels are not in use
    lin.__class__ = qm.KernelQuantizedLinear
    np.testing.assert_array_equal(np.array(lin(x)), np.array(before))


@needs_metal
@pytest.mark.parametrize("case", CASES + SLOW_CASES, ids=case_id)
def test_metal_kernel_matches_reference(case):
    M, K, N, bits, gs, dtype = case
    x, w, s, b = make(1, M, K, N, bits, gs, dtype)
    got = qm.qmm_call(x, w, s, b, group_size=gs, bits=bits).run_metal()[0]
    ref = qm.qmm_reference(x, w, s, b, group_size=gs, bits=bits)
    scale = float(mx.abs(ref.astype(mx.float32)).max().item())
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype] * scale, rtol=0)
