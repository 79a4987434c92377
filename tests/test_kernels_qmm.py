"""Small-row affine-quantized matmul: the .metal kernel (through the MSL-on-CPU harness, and through MLX on a Mac)
against the pure-MLX reference, numpy and MLX's stock `quantized_matmul`; the QuantizedLinear routing."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from glimmer_mlx.kernels import quantized as qm
from glimmer_mlx.kernels._core import metal_available
from msl_harness import harness

needs_cxx = pytest.mark.skipif(harness.find_compiler() is None,
                               reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")
needs_metal = pytest.mark.skipif(not metal_available(), reason="needs Metal (Apple GPU); this MLX build has none")


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

# (M, K, N, bits, group, dtype): M = 1, 2, 7, 16; N not a multiple of the 4 simdgroups per threadgroup
CASES = [
    (1, 256, 40, 4, 64, mx.float32),
    (2, 512, 37, 4, 32, mx.float32),
    (7, 384, 21, 8, 128, mx.float32),
    (16, 256, 18, 4, 64, mx.bfloat16),
    (16, 256, 9, 8, 64, mx.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-b{c[3]}-g{c[4]}-{c[5]}")
def test_reference_matches_numpy_and_stock(case):
    M, K, N, bits, gs, dtype = case
    x, w, s, b = make(0, M, K, N, bits, gs, dtype)
    ref = qm.qmm_reference(x, w, s, b, group_size=gs, bits=bits)
    oracle = np.array(x.astype(mx.float32), dtype=np.float64) @ numpy_dequant(w, s, b, bits, gs).T
    scale = np.abs(oracle).max()
    np.testing.assert_allclose(np.array(ref.astype(mx.float32)), oracle, atol=TOL[dtype] * scale, rtol=0)
    stock = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)
    np.testing.assert_allclose(np.array(ref.astype(mx.float32)), np.array(stock.astype(mx.float32)),
                               atol=2 * TOL[dtype] * scale, rtol=0)


@needs_cxx
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-b{c[3]}-g{c[4]}-{c[5]}")
def test_kernel_matches_reference(case):
    M, K, N, bits, gs, dtype = case
    x, w, s, b = make(1, M, K, N, bits, gs, dtype)
    got = harness.run(qm.qmm_call(x, w, s, b, group_size=gs, bits=bits))[0]
    ref = qm.qmm_reference(x, w, s, b, group_size=gs, bits=bits)
    assert got.dtype == dtype and got.shape == (M, N)
    scale = float(mx.abs(ref.astype(mx.float32)).max().item())
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype] * scale, rtol=0)


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
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{c[2]}-b{c[3]}-g{c[4]}-{c[5]}")
def test_metal_kernel_matches_reference(case):
    M, K, N, bits, gs, dtype = case
    x, w, s, b = make(1, M, K, N, bits, gs, dtype)
    got = qm.qmm_call(x, w, s, b, group_size=gs, bits=bits).run_metal()[0]
    ref = qm.qmm_reference(x, w, s, b, group_size=gs, bits=bits)
    scale = float(mx.abs(ref.astype(mx.float32)).max().item())
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype] * scale, rtol=0)
