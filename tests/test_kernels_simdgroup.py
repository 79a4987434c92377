"""The harness's `simdgroup_matrix` emulation (tests/msl_harness/msl_simdgroup.h) against numpy: the lane layout of
`thread_elements()`, load/store (row stride, origin, transpose), multiply-accumulate in float/half/bfloat (mixed
too), and the errors for what is undefined on the GPU (a partial simdgroup, divergent lanes, divergent pointers)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.kernels._core import KernelCall, KernelSpec
from msl_harness import harness

pytestmark = pytest.mark.skipif(harness.find_compiler() is None,
                                reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")


def call(name, body, inputs, names, out_shape, out_dtype, grid=(32, 1, 1), tg=(32, 1, 1), template=()):
    spec = KernelSpec(f"sg_test_{name}", "", tuple(names), ("out",), text=body)
    return KernelCall(spec, list(inputs), [out_shape], [out_dtype], grid, tg, list(template))


def layout(lane):
    """Element coordinates of a lane's two thread_elements (as written down in MLX's steel MMAFrag::get_coord)."""
    qid = lane // 4
    row = (qid & 4) + (lane // 2) % 4
    col = (qid & 2) * 2 + (lane % 2) * 2
    return (row, col), (row, col + 1)


def test_thread_elements_layout_and_row_reduction():
    """Each lane's two elements after a load are the ones the layout names; the row sum over lanes xor 1 and xor 8
    is the matrix row's sum (the reduction MLX's attention uses)."""
    body = """
    uint lane = thread_index_in_simdgroup;
    simdgroup_matrix<float, 8, 8> m;
    simdgroup_load(m, a, 8);
    vec2<float> e = m.thread_elements();
    float s = e[0] + e[1];
    s += simd_shuffle_xor(s, ushort(1));
    s += simd_shuffle_xor(s, ushort(8));
    out[lane * 3] = e[0];
    out[lane * 3 + 1] = e[1];
    out[lane * 3 + 2] = s;
    """
    a = np.arange(64, dtype=np.float32).reshape(8, 8) * 1.5 - 7
    out = np.array(harness.run(call("layout", body, [mx.array(a)], ["a"], (96,), mx.float32))[0]).reshape(32, 3)
    for lane in range(32):
        (r0, c0), (r1, c1) = layout(lane)
        assert out[lane, 0] == a[r0, c0] and out[lane, 1] == a[r1, c1], lane
        assert out[lane, 2] == pytest.approx(a[r0].sum()), lane


MMA_BODY = """
simdgroup_matrix<TM, 8, 8> A, B, C, D;
simdgroup_load(A, a, LDA);                                // cols 0..7 of a [8, LDA]
simdgroup_load(B, b, 8, vec2<unsigned long>{0, 0}, TRB);  // b [8, 8], optionally transposed
simdgroup_load(C, c, 16, vec2<unsigned long>{8, 0});      // cols 8..15 of c [8, 16]
simdgroup_multiply_accumulate(D, A, B, C);
simdgroup_store(D, out, 8);
"""


@pytest.mark.parametrize("dtype,transpose", [(mx.float32, False), (mx.float32, True), (mx.float16, False),
                                             (mx.bfloat16, True)])
def test_multiply_accumulate_load_origin_transpose(dtype, transpose):
    rng = np.random.default_rng(1)
    lda = 11
    a = rng.standard_normal((8, lda)).astype(np.float32)
    b = rng.standard_normal((8, 8)).astype(np.float32)
    c = rng.standard_normal((8, 16)).astype(np.float32)
    ins = [mx.array(x).astype(dtype) for x in (a, b, c)]
    got = harness.run(call(f"mma_{transpose}", MMA_BODY, ins, ["a", "b", "c"], (8, 8), dtype,
                           template=[("TM", dtype), ("LDA", lda), ("TRB", transpose)]))[0]
    af, bf, cf = (np.array(x.astype(mx.float32), dtype=np.float64) for x in ins)
    expect = af[:, :8] @ (bf.T if transpose else bf) + cf[:, 8:]
    tol = {mx.float32: 1e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expect, rtol=tol, atol=tol * 4)


def test_mixed_precision_transposed_store_and_constructors():
    """half A/B into a float accumulator (as MLX's steel kernels mix them); a diagonal-constructed C; a transposed
    store; make_filled_simdgroup_matrix."""
    body = """
    simdgroup_matrix<half, 8, 8> A, B;
    simdgroup_load(A, a, 8);
    simdgroup_load(B, b, 8);
    simdgroup_matrix<float, 8, 8> C = simdgroup_matrix<float, 8, 8>(2.5f);
    simdgroup_matrix<float, 8, 8> D;
    simdgroup_multiply_accumulate(D, A, B, C);
    simdgroup_store(D, out, 8, vec2<unsigned long>{0, 0}, true);
    simdgroup_matrix<float, 8, 8> F = make_filled_simdgroup_matrix<float, 8, 8>(-1.0f);
    simdgroup_multiply(D, A, B);
    simdgroup_multiply_accumulate(D, A, B, F);
    simdgroup_store(D, out + 64, 16);
    """
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, 8)).astype(np.float16)
    b = rng.standard_normal((8, 8)).astype(np.float16)
    got = np.array(harness.run(call("mixed", body, [mx.array(a), mx.array(b)], ["a", "b"], (64 + 128,),
                                    mx.float32))[0])
    ab = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got[:64].reshape(8, 8), (ab + 2.5 * np.eye(8)).T, rtol=1e-5, atol=1e-5)
    second = got[64:].reshape(8, 16)
    np.testing.assert_allclose(second[:, :8], ab - 1.0, rtol=1e-5, atol=1e-5)
    assert np.isnan(second[:, 8:]).all()  # columns 8..15 of the 16-wide rows untouched (0xFF bytes)


def test_a_chain_of_tiles_is_a_matmul():
    """[16, 24] @ [24, 16] from 8x8 tiles with accumulation over K, two simdgroups each owning 8 output rows."""
    body = """
    uint sg = simdgroup_index_in_threadgroup;
    for (int nt = 0; nt < 2; nt++) {
      simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int kt = 0; kt < 3; kt++) {
        simdgroup_matrix<float, 8, 8> A, B;
        simdgroup_load(A, a + sg * 8 * 24 + kt * 8, 24);
        simdgroup_load(B, b + kt * 8 * 16 + nt * 8, 16);
        simdgroup_multiply_accumulate(acc, A, B, acc);
      }
      simdgroup_store(acc, out + sg * 8 * 16 + nt * 8, 16);
    }
    """
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 24)).astype(np.float32)
    b = rng.standard_normal((24, 16)).astype(np.float32)
    got = harness.run(call("chain", body, [mx.array(a), mx.array(b)], ["a", "b"], (16, 16), mx.float32,
                           grid=(64, 1, 1), tg=(64, 1, 1)))[0]
    np.testing.assert_allclose(np.array(got), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    ("if (thread_index_in_simdgroup < 16) { simdgroup_load(m, a, 8); }", "16 of the 32 lanes|deadlock"),
    ("simdgroup_load(m, a + (thread_index_in_simdgroup & 1), 8);", "different pointers"),
    ("simdgroup_load(m, a, 8 + (thread_index_in_simdgroup & 1));", "different pointers"),
    ("if (thread_index_in_simdgroup == 3) { return; } simdgroup_load(m, a, 8);", "31 of the 32 lanes"),
    ("simdgroup_load(m, a, 8, vec2<unsigned long>{1, 0}, true);", "origin with transpose"),
])
def test_undefined_uses_are_errors(bad, match):
    body = f"""
    simdgroup_matrix<float, 8, 8> m;
    {bad}
    out[thread_index_in_simdgroup] = m.thread_elements()[0];
    """
    a = mx.zeros((8, 10))
    with pytest.raises(harness.HarnessError, match=match):
        harness.run(call(f"bad_{abs(hash(bad)) % 10**6}", body, [a], ["a"], (32,), mx.float32))


def test_a_partial_simdgroup_cannot_run_a_matrix_operation():
    body = """
    simdgroup_matrix<float, 8, 8> m;
    simdgroup_load(m, a, 8);
    out[thread_index_in_threadgroup] = m.thread_elements()[0];
    """
    with pytest.raises(harness.HarnessError, match="24 of the 32 lanes"):
        harness.run(call("partial", body, [mx.zeros((8, 8))], ["a"], (24,), mx.float32, grid=(24, 1, 1),
                         tg=(24, 1, 1)))
