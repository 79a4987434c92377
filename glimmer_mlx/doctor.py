"""`glimmer doctor`: what a bug report about the custom kernels needs — the machine, the MLX build, each registered
kernel's verdict (tested now, not read from the cache), the path the dispatchers use, and its speed against the
built-in MLX path on the self-test inputs. `diagnose()` gathers it as a dict (`--json`), `format_report()` renders it
as plain text to paste."""

from __future__ import annotations

import os
import platform
import sys

import mlx.core as mx

from .kernels import ENV, metal_available, mode, run_selftest, selftests, time_calls
from .kernels import verdict as process_verdict
from .machine import apple_chip, blas_advice, cache_dir, machine_info, package_version


def mlx_build() -> dict:
    """The MLX packages, the default device, whether Metal is there and what it says about the GPU."""
    try:
        info = {k: str(v) for k, v in mx.device_info().items()}
    except Exception as e:  # an MLX without device_info
        info = {"error": f"{type(e).__name__}: {e}"}
    return {"mlx": package_version("mlx") or getattr(mx, "__version__", None),
            "mlx_metal": package_version("mlx-metal"), "mlx_cpu": package_version("mlx-cpu"),
            "python": sys.version.split()[0], "default_device": str(mx.default_device()),
            "metal_available": metal_available(), "device_info": info}


def _fresh_verdict(entry) -> dict:
    """The kernel tested now (Metal only), with the verdict this process's dispatchers hold."""
    try:
        m = mode()
    except ValueError as e:
        return {"status": "error", "path": entry.builtin, "reason": str(e)}
    if m == "reference":
        return {"status": "disabled", "path": entry.builtin, "reason": f"{ENV}=reference"}
    if not metal_available():
        return {"status": "unavailable", "path": entry.builtin, "reason": "not available: no Metal"}
    v = run_selftest(entry)
    held = process_verdict(entry.name)
    return {"status": v.status, "path": "metal kernel" if v.ok else entry.builtin, "reason": v.reason,
            "selftest_s": v.seconds, "process_verdict": held.status, "process_verdict_cached": held.cached}


def diagnose(*, speed: bool = True, calls: int = 50, windows: int = 5) -> dict:
    """Machine, MLX build, and per registered kernel: verdict, path used, µs per call of the kernel (when it
    passed) and of the built-in on the self-test inputs (`calls` calls per timing window, one eval per window)."""
    try:
        kmode = mode()
    except ValueError as e:
        kmode = f"invalid: {e}"
    rows = []
    for entry in selftests():
        row = {"kernel": entry.name, "builtin": entry.builtin, **_fresh_verdict(entry)}
        if speed:
            inputs = entry.make_inputs()
            builtin = entry.builtin_fn()
            row["builtin_us"] = time_calls(lambda: builtin(inputs), calls=calls, windows=windows)
            row["kernel_us"] = (time_calls(lambda: entry.run_kernel(inputs), calls=calls, windows=windows)
                                if row["status"] == "ok" else None)
            row["speedup"] = row["builtin_us"] / row["kernel_us"] if row["kernel_us"] else None
        rows.append(row)
    return {"machine": {**machine_info(), "chip": apple_chip(), "python_platform": platform.platform()},
            "mlx_build": mlx_build(), "kernels_mode": kmode, "env": {ENV: os.environ.get(ENV)},
            "selftest_cache": str(cache_dir() / "kernel-selftest.json"),
            "timing": {"calls_per_window": calls, "windows": windows} if speed else None, "kernels": rows}


def _fmt_us(v) -> str:
    return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def format_report(rep: dict) -> str:
    """Plain text, ready to paste into a bug report."""
    m, b = rep["machine"], rep["mlx_build"]
    env = m.get("blas_env") or {}
    advice = blas_advice(m["blas"], env, m.get("nproc"))
    lines = ["glimmer doctor", "",
             f"machine:  {m['platform']} | {m.get('chip') or m['cpu']} | {m['nproc']} cores | {m['ram_gib']} GiB",
             f"MLX:      mlx {b['mlx']} (mlx-metal {b['mlx_metal'] or '—'}, mlx-cpu {b['mlx_cpu'] or '—'}), "
             f"python {b['python']}, "
             f"default device {b['default_device']}, Metal {'available' if b['metal_available'] else 'not available'}",
             f"GPU:      {', '.join(f'{k}={v}' for k, v in b['device_info'].items()) or '—'}",
             f"BLAS:     {m['blas']}" + (f"; {' '.join(f'{k}={v}' for k, v in env.items())}" if env else ""),
             *([f"          {advice}"] if advice else []),
             f"kernels:  {ENV}={rep['kernels_mode']}; self-test cache {rep['selftest_cache']}"]
    if rep["timing"]:
        lines.append(f"timing:   self-test inputs, {rep['timing']['calls_per_window']} calls per window (one eval), "
                     f"median of {rep['timing']['windows']} windows")
    lines.append("")
    head = ("kernel", "verdict", "path used", "kernel µs", "built-in µs", "built-in/kernel")
    table = [head]
    for r in rep["kernels"]:
        verdict = "ok" if r["status"] == "ok" else (r["reason"] if r["status"] == "unavailable"
                                                     else f"{r['status']}: {r['reason']}")
        table.append((r["kernel"], verdict, r["path"],
                      _fmt_us(r.get("kernel_us")) if r["status"] == "ok" else ("no Metal" if r["status"] ==
                                                                               "unavailable" else "—"),
                      _fmt_us(r.get("builtin_us")),
                      f"{r['speedup']:.2f}×" if r.get("speedup") else "—"))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for row in table:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    if not rep["kernels"]:
        lines.append("(no kernel registered a self-test)")
    return "\n".join(lines)
