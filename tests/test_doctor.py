"""`glimmer doctor`: the report names the machine and MLX build as Python sees them, every registered kernel with
the verdict a fresh self-test gives (here: no Metal, or Metal simulated through the MSL-on-CPU harness with a
working / failing kernel builder) and the speed of the path that is used."""

from __future__ import annotations

import json
import platform

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from glimmer_mlx import doctor
from glimmer_mlx.cli import app
from glimmer_mlx.kernels import _core
from msl_harness import harness

no_metal = pytest.mark.skipif(_core.metal_available(), reason="checks the report without Metal")


@pytest.fixture
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("GLIMMER_MLX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(_core.ENV, raising=False)
    _core.reset_selftests()
    yield tmp_path
    _core.reset_selftests()


@no_metal
def test_report_without_metal(private_cache):
    rep = doctor.diagnose(calls=2, windows=1)
    names = [e.name for e in _core.selftests()]
    assert {"greedy_accept", "rejection_accept"} <= set(names)
    assert [r["kernel"] for r in rep["kernels"]] == names
    for r in rep["kernels"]:
        assert (r["status"], r["reason"], r["kernel_us"]) == ("unavailable", "not available: no Metal", None)
        assert r["path"] == _core.selftests()[names.index(r["kernel"])].builtin and r["builtin_us"] > 0
    assert rep["mlx_build"]["mlx"] == mx.__version__ and rep["mlx_build"]["metal_available"] is False
    assert rep["machine"]["platform"] == platform.platform()
    text = doctor.format_report(rep)
    assert platform.platform() in text and f"mlx {mx.__version__}" in text and "Metal not available" in text
    for r in rep["kernels"]:
        line = next(ln for ln in text.splitlines() if ln.startswith(r["kernel"] + " "))
        assert "not available: no Metal" in line and r["path"] in line and "no Metal" in line
    assert not (private_cache / _core.SELFTEST_FILE).exists()


@no_metal
def test_cli_json_and_text(private_cache):
    runner = CliRunner()
    res = runner.invoke(app, ["doctor", "--json", "--calls", "1", "--windows", "1"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert {r["kernel"]: r["status"] for r in rep["kernels"]} == {e.name: "unavailable" for e in _core.selftests()}
    assert rep["timing"] == {"calls_per_window": 1, "windows": 1}
    res = runner.invoke(app, ["doctor", "--no-speed"])
    assert res.exit_code == 0 and "greedy_accept" in res.stdout and "not available: no Metal" in res.stdout
    assert "timing:" not in res.stdout
    res = runner.invoke(app, ["doctor", "--calls", "0"])
    assert res.exit_code != 0 and "--calls and --windows must be at least 1" in res.output


@pytest.mark.skipif(harness.find_compiler() is None, reason="needs the MSL-on-CPU harness (a C++20 compiler)")
def test_report_with_metal_simulated(private_cache, monkeypatch):
    """Metal 'available' with launches through the harness: a working kernel is 'ok' and timed; one whose build
    fails is reported with the compiler's message and the built-in path."""
    monkeypatch.setattr(_core, "metal_available", lambda: True)
    monkeypatch.setattr(doctor, "metal_available", lambda: True)
    greedy = next(e for e in _core.selftests() if e.name == "greedy_accept")
    monkeypatch.setattr(doctor, "selftests", lambda: [greedy])

    def harness_build(spec):
        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None):
            return harness.run(_core.KernelCall(spec, list(inputs), list(output_shapes), list(output_dtypes), grid,
                                                threadgroup, list(template), init_value), check_races=False)
        return kernel

    monkeypatch.setattr(_core.KernelSpec, "build", harness_build)
    rep = doctor.diagnose(calls=1, windows=1)
    (r,) = rep["kernels"]
    assert (r["status"], r["path"]) == ("ok", "metal kernel") and r["kernel_us"] > 0 and r["speedup"] > 0
    assert r["process_verdict"] == "ok"
    _core.reset_selftests()
    (private_cache / _core.SELFTEST_FILE).unlink()  # else the next "process" keeps the cached ok verdict

    def broken_build(spec):
        raise RuntimeError("program_source:3:1: error: unknown type name 'simdgroup_matrix8'")

    monkeypatch.setattr(_core.KernelSpec, "build", broken_build)
    with pytest.warns(RuntimeWarning, match="greedy_accept disabled"):
        rep = doctor.diagnose(calls=1, windows=1)
    (r,) = rep["kernels"]
    assert r["status"] == "failed" and "unknown type name" in r["reason"] and r["kernel_us"] is None
    assert r["path"] == greedy.builtin and r["process_verdict"] == "failed"
    line = next(ln for ln in doctor.format_report(rep).splitlines() if ln.startswith("greedy_accept"))
    assert "failed: build or launch failed: RuntimeError" in line and greedy.builtin in line


def test_blas_advice_names_the_spinning_openblas_threads_on_few_cores(private_cache, monkeypatch):
    """OpenBLAS preloaded on a machine of 4 cores or fewer with its idle threads left to busy-wait: the report says
    what to set (BENCHMARKS.md, issue 20, twelfth session); set, one thread, many cores or another BLAS: nothing."""
    from glimmer_mlx.machine import blas_advice

    ob = "preloaded /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
    assert "OPENBLAS_THREAD_TIMEOUT=4" in blas_advice(ob, {}, 2)
    assert blas_advice(ob, {"OPENBLAS_THREAD_TIMEOUT": "4"}, 2) is None
    assert blas_advice(ob, {"OPENBLAS_NUM_THREADS": "1"}, 2) is None
    assert blas_advice(ob, {}, 16) is None
    assert blas_advice("bundled reference BLAS (mlx/libblas.so)", {}, 2) is None
    rep = doctor.diagnose(speed=False)
    rep["machine"].update(blas=ob, blas_env={}, nproc=2)
    lines = doctor.format_report(rep).splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("BLAS:"))
    assert "OPENBLAS_THREAD_TIMEOUT=4" in lines[i + 1]
    rep["machine"].update(blas_env={"OPENBLAS_THREAD_TIMEOUT": "4"})
    text = doctor.format_report(rep)
    assert "busy-waiting" not in text and "BLAS:     " + ob + "; OPENBLAS_THREAD_TIMEOUT=4" in text
