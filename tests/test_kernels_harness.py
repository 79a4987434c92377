"""The MSL-on-CPU harness itself: it compiles the text MLX generates, and barriers, simd collectives, threadgroup
memory and its error detection behave as on the GPU. Kernel-specific tests are in test_kernels_{accept,attention,
qmm}.py."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from glimmer_mlx.kernels import accept, attention
from glimmer_mlx.kernels._core import KernelCall, KernelSpec, kernel_dir
from msl_harness import harness

pytestmark = pytest.mark.skipif(harness.find_compiler() is None,
                                reason="MSL-on-CPU harness needs a C++20 compiler (g++ or clang++); none found")


def call(body, inputs, names, out_shape, out_dtype, grid, tg, template=(), init_value=None, outputs=("out",)):
    spec = KernelSpec(f"harness_test_{abs(hash(body)) % 10**8}", "", tuple(names), tuple(outputs), text=body)
    shapes = out_shape if isinstance(out_shape, list) else [out_shape]
    dtypes = out_dtype if isinstance(out_dtype, list) else [out_dtype]
    return KernelCall(spec, list(inputs), shapes, dtypes, grid, tg, list(template), init_value)


def test_generated_source_is_mlx_text_with_the_exact_body():
    c = accept.greedy_argmax_call(mx.zeros((3, 100)))
    src = harness.generated_source(c)
    body = (kernel_dir() / "greedy_accept.metal").read_text()
    assert body.strip() in src  # the .metal file verbatim
    assert "[[kernel]] void custom_kernel_glimmer_greedy_argmax" in src
    assert "uint3 threads_per_threadgroup [[threads_per_threadgroup]]" in src
    tu, params = harness.translate(src)
    assert [p[1] for p in params if p[0] == "buffer"] == ["logits", "meta", "sel"]
    assert "tg_array<uint[32]>" in tu and "threadgroup uint tg_key" not in tu


def test_grid_positions_partial_threadgroups_and_template():
    # grid 70 x 3 with threadgroups of 32 x 2: partial groups at the edges, as Metal's dispatchThreads
    body = """
    uint3 p = thread_position_in_grid;
    uint3 g = threadgroup_position_in_grid;
    out[p.y * 70 + p.x] = int(p.x * 1000 + p.y * 100 + g.x * 10 + g.y) * SIGN;
    """
    c = call(body, [mx.zeros((1,))], ["dummy"], (3, 70), mx.int32, (70, 3, 1), (32, 2, 1), [("SIGN", -1)])
    out = np.array(harness.run(c)[0])
    x, y = np.meshgrid(np.arange(70), np.arange(3))
    expect = -(x * 1000 + y * 100 + (x // 32) * 10 + (y // 2))
    np.testing.assert_array_equal(out, expect)


def test_barrier_and_threadgroup_memory_reduction():
    body = """
    uint t = thread_index_in_threadgroup;
    threadgroup float buf[256];
    buf[t] = inp[threadgroup_position_in_grid.x * 256 + t];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = 128; s > 0; s >>= 1) {
      if (t < s) { buf[t] += buf[t + s]; }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (t == 0) { out[threadgroup_position_in_grid.x] = buf[0]; }
    """
    x = mx.arange(1024).astype(mx.float32)
    c = call(body, [x], ["inp"], (4,), mx.float32, (1024, 1, 1), (256, 1, 1))
    np.testing.assert_array_equal(np.array(harness.run(c)[0]), np.arange(1024).reshape(4, 256).sum(1))


def test_simd_collectives():
    body = """
    uint l = thread_index_in_simdgroup;
    float v = inp[thread_position_in_grid.x];
    out[thread_position_in_grid.x * 5 + 0] = simd_sum(v);
    out[thread_position_in_grid.x * 5 + 1] = simd_max(v);
    out[thread_position_in_grid.x * 5 + 2] = simd_shuffle(v, (l + 3) % 32);
    out[thread_position_in_grid.x * 5 + 3] = simd_prefix_exclusive_sum(v);
    out[thread_position_in_grid.x * 5 + 4] = simd_shuffle_down(v, 1);
    """
    rng = np.random.default_rng(0)
    x = rng.integers(-50, 50, 64).astype(np.float32)
    c = call(body, [mx.array(x)], ["inp"], (64, 5), mx.float32, (64, 1, 1), (64, 1, 1))
    out = np.array(harness.run(c)[0])
    g = x.reshape(2, 32)
    np.testing.assert_array_equal(out[:, 0], np.repeat(g.sum(1), 32))
    np.testing.assert_array_equal(out[:, 1], np.repeat(g.max(1), 32))
    np.testing.assert_array_equal(out[:, 2], np.roll(g, -3, axis=1).reshape(-1))
    np.testing.assert_array_equal(out[:, 3], (np.cumsum(g, 1) - g).reshape(-1))
    down = np.concatenate([g[:, 1:], g[:, -1:]], axis=1)  # the last lane keeps its own value
    np.testing.assert_array_equal(out[:, 4], down.reshape(-1))


def test_lanes_that_returned_are_inactive_in_simd_collectives():
    body = """
    uint l = thread_index_in_simdgroup;
    if (l >= 20) { return; }
    out[l] = simd_sum(1.0f);
    """
    c = call(body, [mx.zeros((1,))], ["dummy"], (20,), mx.float32, (32, 1, 1), (32, 1, 1))
    np.testing.assert_array_equal(np.array(harness.run(c)[0]), np.full(20, 20.0))


def test_missing_barrier_is_detected_as_schedule_dependent():
    safe = """
    uint t = thread_index_in_threadgroup;
    threadgroup float buf[64];
    buf[t] = float(t) + 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[t] = buf[(t + 1) % 64];
    """
    c = call(safe, [mx.zeros((1,))], ["dummy"], (64,), mx.float32, (64, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(np.array(harness.run(c)[0]), (np.arange(64) + 1) % 64 + 1)
    racy = safe.replace("threadgroup_barrier(mem_flags::mem_threadgroup);", "")  # read a neighbour's slot unsynced
    c = call(racy, [mx.zeros((1,))], ["dummy"], (64,), mx.float32, (64, 1, 1), (64, 1, 1))
    with pytest.raises(harness.HarnessError, match="depends on the thread schedule"):
        harness.run(c)


def test_divergent_barrier_is_a_deadlock_error():
    body = """
    uint t = thread_index_in_threadgroup;
    if (t < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); }
    out[t] = 1.0f;
    """
    c = call(body, [mx.zeros((1,))], ["dummy"], (64,), mx.float32, (64, 1, 1), (64, 1, 1))
    with pytest.raises(harness.HarnessError, match="deadlock"):
        harness.run(c)


def test_out_of_bounds_write_and_unwritten_output_are_visible():
    body = """
    uint t = thread_position_in_grid.x;
    if (t > 0) { out[t + 1] = 1.0f; }  // skips out[0], out[1]; writes one past the end
    """
    c = call(body, [mx.zeros((1,))], ["dummy"], (8,), mx.float32, (8, 1, 1), (8, 1, 1))
    with pytest.raises(harness.HarnessError, match="out-of-bounds write"):
        harness.run(c)
    c = call(body.replace("t + 1", "t"), [mx.zeros((1,))], ["dummy"], (8,), mx.float32, (8, 1, 1), (8, 1, 1))
    out = np.array(harness.run(c)[0])
    assert np.isnan(out[0]) and np.all(out[1:] == 1.0)  # outputs start uninitialised (NaN bytes), as in MLX
    c = call(body.replace("t + 1", "t"), [mx.zeros((1,))], ["dummy"], (8,), mx.float32, (8, 1, 1), (8, 1, 1),
             init_value=0.0)
    assert np.array(harness.run(c)[0])[0] == 0.0


def test_uninitialised_threadgroup_memory_reads_nan():
    body = """
    uint t = thread_index_in_threadgroup;
    threadgroup float buf[64];
    if (t < 32) { buf[t] = 1.0f; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[t] = buf[t];
    """
    c = call(body, [mx.zeros((1,))], ["dummy"], (64,), mx.float32, (64, 1, 1), (64, 1, 1))
    out = np.array(harness.run(c)[0])
    assert np.all(out[:32] == 1.0) and np.all(np.isnan(out[32:]))


def test_half_and_bfloat_inputs_round_trip():
    body = """
    uint t = thread_position_in_grid.x;
    out[t] = T(float(inp[t]) * 2.0f);
    """
    x = mx.array(np.linspace(-3, 3, 37).astype(np.float32))
    for dt in (mx.float16, mx.bfloat16):
        c = call(body, [x.astype(dt)], ["inp"], (37,), dt, (37, 1, 1), (32, 1, 1), [("T", dt)])
        got = harness.run(c)[0]
        assert got.dtype == dt
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array((x.astype(dt) * 2).astype(mx.float32)))


def test_strided_inputs_are_real_views_when_not_forced_contiguous():
    """With ensure_row_contiguous=False MLX passes views (an offset pointer + strides); the harness does the same
    with padded buffers, so a body that ignores the strides reads padding (NaN) instead of the data."""
    honest = """
    uint i = thread_position_in_grid.y, j = thread_position_in_grid.x;
    out[i * 4 + j] = inp[i * inp_strides[0] + j * inp_strides[1]];
    """
    naive = """
    uint i = thread_position_in_grid.y, j = thread_position_in_grid.x;
    out[i * 4 + j] = inp[i * 4 + j] + 0.0f * float(inp_strides[0]);
    """
    x = mx.arange(12).astype(mx.float32).reshape(3, 4)
    for body, ok in ((honest, True), (naive, False)):
        spec = KernelSpec(f"harness_view_{ok}", "", ("inp",), ("out",), text=body, ensure_row_contiguous=False)
        c = KernelCall(spec, [x], [(12,)], [mx.float32], (4, 3, 1), (4, 3, 1))
        out = np.array(harness.run(c)[0])
        assert np.array_equal(out, np.arange(12, dtype=np.float32)) == ok


# -- memory flags, write races, out-of-bounds reads -------------------------------------------------------------------
EXCHANGE = """
uint t = thread_index_in_threadgroup;
threadgroup float buf[64];
buf[t] = float(t) + 1.0f;
threadgroup_barrier(mem_flags::mem_threadgroup);
out[t] = buf[(t + 1) % 64];
"""


def exchange(body, tg=64):
    return call(body, [mx.zeros((1,))], ["dummy"], (64,), mx.float32, (64, 1, 1), (tg, 1, 1))


def test_a_barrier_without_mem_threadgroup_does_not_publish_threadgroup_writes():
    """Metal: threadgroup_barrier(mem_none) synchronises execution only; another thread's threadgroup write need
    not be visible after it. The harness publishes threadgroup writes only at barriers with mem_threadgroup."""
    np.testing.assert_array_equal(np.array(harness.run(exchange(EXCHANGE))[0]), (np.arange(64) + 1) % 64 + 1)
    for flags in ("mem_none", "mem_device"):
        body = EXCHANGE.replace("mem_flags::mem_threadgroup", f"mem_flags::{flags}")
        with pytest.raises(harness.HarnessError, match="no barrier with mem_flags::mem_threadgroup published"):
            harness.run(exchange(body))
        # the plain shared-memory model (what the harness did before) would have accepted it
        out = harness.run_once(exchange(body), strict=False)[0]
        np.testing.assert_array_equal(out, (np.arange(64) + 1) % 64 + 1)
    # flags combined with | still publish
    both = EXCHANGE.replace("mem_flags::mem_threadgroup", "mem_flags::mem_threadgroup | mem_flags::mem_device")
    np.testing.assert_array_equal(np.array(harness.run(exchange(both))[0]), (np.arange(64) + 1) % 64 + 1)


def test_simdgroup_barrier_with_mem_threadgroup_publishes_its_lanes_writes():
    """(The harness then publishes them to the whole threadgroup, more than Metal promises to other simdgroups.)"""
    inside = EXCHANGE.replace("buf[(t + 1) % 64]", "buf[(t & ~31u) + ((t + 1) & 31u)]").replace(
        "threadgroup_barrier(mem_flags::mem_threadgroup)", "simdgroup_barrier(mem_flags::mem_threadgroup)")
    want = (np.arange(64) // 32) * 32 + (np.arange(64) + 1) % 32 + 1
    np.testing.assert_array_equal(np.array(harness.run(exchange(inside))[0]), want)
    with pytest.raises(harness.HarnessError, match="mem_threadgroup published"):
        harness.run(exchange(inside.replace("simdgroup_barrier(mem_flags::mem_threadgroup)",
                                            "simdgroup_barrier(mem_flags::mem_none)")))


def test_threadgroup_write_race_is_an_error():
    body = """
    uint t = thread_index_in_threadgroup;
    threadgroup float buf[4];
    buf[0] = float(t);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[t] = buf[0];
    """
    with pytest.raises(harness.HarnessError, match="write race"):
        harness.run(exchange(body))
    same = body.replace("buf[0] = float(t);", "buf[0] = 7.0f;")  # every thread writes the same value: benign
    np.testing.assert_array_equal(np.array(harness.run(exchange(same))[0]), np.full(64, 7.0))


def test_out_of_bounds_reads_are_detected():
    body = """
    uint t = thread_position_in_grid.x;
    out[t] = inp[int(t) + SHIFT - 1];
    """
    x = mx.arange(100).astype(mx.float32)

    def c(shift):
        return call(body, [x], ["inp"], (100,), mx.float32, (100, 1, 1), (64, 1, 1), [("SHIFT", shift)])

    np.testing.assert_array_equal(np.array(harness.run(c(1))[0]), np.arange(100))
    with pytest.raises(harness.HarnessError, match=r"out-of-bounds access past the end of input 'inp' \(byte \+0"):
        harness.run(c(2))  # thread 99 reads inp[100]
    with pytest.raises(harness.HarnessError, match=r"out-of-bounds access before the start of input 'inp' \(byte -4"):
        harness.run(c(0))  # thread 0 reads inp[-1]
    wild = body.replace("int(t) + SHIFT - 1", "t + SHIFT - 1")  # uint: thread 0 reads inp[4294967295]
    with pytest.raises(harness.HarnessError, match="outside every buffer"):
        harness.run(call(wild, [x], ["inp"], (100,), mx.float32, (100, 1, 1), (64, 1, 1), [("SHIFT", 0)]))
    rd = body.replace("out[t] = inp[int(t) + SHIFT - 1];", "out[t] = float(inp_shape[t % 3]) * float(SHIFT);")
    c3 = call(rd, [x], ["inp"], (100,), mx.float32, (100, 1, 1), (64, 1, 1), [("SHIFT", 1)])
    with pytest.raises(harness.HarnessError, match="inp_shape"):
        harness.run(c3)  # a 1-d input's shape has one entry


# -- the escaped mutant classes of the issue, on the real kernels ------------------------------------------------------
def mutated(spec, old, new):
    src = spec.source
    assert old in src, f"mutation site {old!r} not in {spec.filename}: update the mutant"
    return dataclasses.replace(spec, name=f"{spec.name}_m{abs(hash((old, new))) % 10**8}", text=src.replace(old, new))


def test_acceptance_kernels_relying_on_barriers_without_mem_threadgroup_are_caught():
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((3, 3000)).astype(np.float32))
    g = accept.greedy_argmax_call(x)
    np.testing.assert_array_equal(np.array(harness.run(g)[0]), np.array(mx.argmax(x, axis=-1)))
    z = rng.standard_normal((3, 3000)).astype(np.float32)
    lp = mx.array(z - np.log(np.exp(z).sum(-1, keepdims=True)))
    r = accept.rejection_accept_logprobs_call(lp, lp[:2] + 0.1, [1, 2], mx.array([0.3, 0.4, 0.5]))
    harness.run(r)
    for c in (g, r):
        c.spec = mutated(c.spec, "threadgroup_barrier(mem_flags::mem_threadgroup)",
                         "threadgroup_barrier(mem_flags::mem_none)")
        with pytest.raises(harness.HarnessError, match="mem_threadgroup published"):
            harness.run(c)


def big_score_attention(scale_q):
    """Hq 2 / Hkv 1, L 2, 150 keys in 3 chunks of 64, D 32; one chunk's scores far above the others'."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 2, 32)).astype(np.float32) * scale_q
    k = rng.standard_normal((1, 1, 150, 32)).astype(np.float32)
    k[:, :, 70:90] *= 4
    v = rng.standard_normal((1, 1, 150, 32)).astype(np.float32)
    return mx.array(q), mx.array(k), mx.array(v)


def run_attention(q, k, v, partial=None, combine=None):
    part, comb = attention.block_attention_calls(q, k, v, scale=1.0, qk=148, split=64)
    if partial is not None:
        part.spec = partial
    o_part, ml = harness.run(part)
    c = comb(o_part, ml)
    if combine is not None:
        c.spec = combine
    return np.array(harness.run(c)[0])


def test_removing_the_running_max_subtraction_is_caught_by_scores_in_the_hundreds():
    """Softmax without subtracting the running maximum is the same math until exp overflows: with scores of a few
    units every mutant passes, with scores in the hundreds (exp2 overflows above 128) each one is caught — in the
    partial pass and in the combine."""
    no_max_partial = mutated(attention.PARTIAL, "const float mn = max(m, bmax);",
                             "const float mn = max(m, bmax) == -INFINITY ? -INFINITY : 0.0f;")
    no_max_combine = mutated(attention.COMBINE, "const float mn = max(m, ms);",
                             "const float mn = max(m, ms) == -INFINITY ? -INFINITY : 0.0f;")
    for scale_q, caught in ((0.3, False), (12.0, True)):
        q, k, v = big_score_attention(scale_q)
        scores = np.array(q)[0] @ np.array(k)[0, 0].T
        assert (np.abs(scores).max() > 100) == caught
        want = np.array(attention.block_attention_reference(q, k, v, scale=1.0, qk=148))[0]
        good = run_attention(q, k, v)
        np.testing.assert_allclose(good, want, rtol=2e-3, atol=2e-3)
        for spec in ({"partial": no_max_partial}, {"combine": no_max_combine}):
            got = run_attention(q, k, v, **spec)
            ok = bool(np.isfinite(got).all() and np.allclose(got, want, rtol=2e-3, atol=2e-3))
            assert ok != caught, (scale_q, list(spec))


def test_attention_relying_on_a_barrier_without_mem_threadgroup_is_caught():
    q, k, v = big_score_attention(0.3)
    broken = mutated(attention.PARTIAL, "threadgroup_barrier(mem_flags::mem_threadgroup);",
                     "threadgroup_barrier(mem_flags::mem_none);")
    with pytest.raises(harness.HarnessError, match="mem_threadgroup published"):
        run_attention(q, k, v, partial=broken)


def test_a_constant_input_assigned_to_a_device_pointer_is_refused():
    """MLX passes inputs of fewer than 8 elements as `constant T*`; `const device T* x = that` does not compile on
    Metal (the harness's address-space macros are empty, so it is checked on the text). The rejection kernel's
    k = 0 dummy q is such an input."""
    call_ = accept.rejection_accept_logprobs_call(mx.zeros((1, 300)), None, [], mx.array([0.5]))
    assert "const constant float* q" in harness.generated_source(call_)
    harness.run(call_)
    call_.spec = mutated(call_.spec, "auto qr = q +", "const device TQ* qr = q +")
    with pytest.raises(harness.HarnessError, match="'q' is in the constant address space"):
        harness.run(call_)
