"""Facts about the machine this process runs on: CPU / Apple chip, memory, the BLAS MLX calls, a fingerprint of what
makes timings differ between machines, and the cache folder where per-machine measurements are kept."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx

CACHE_ENV = "GLIMMER_MLX_CACHE_DIR"


def cache_dir() -> Path:
    """Where measurements kept per machine and model live: $GLIMMER_MLX_CACHE_DIR, else ~/.cache/glimmer-mlx."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "glimmer-mlx"


def blas_in_use() -> str:
    """The BLAS MLX's float32 matmuls call: a preloaded library (LD_PRELOAD) wins over the reference BLAS bundled
    in the mlx-cpu wheel (numpy's own OpenBLAS, if mapped, is not used by MLX and is not reported)."""
    pre = [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "blas" in p.lower()]
    if pre:
        return f"preloaded {pre[0]}"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    libs = sorted({Path(line.split()[-1]) for line in maps.splitlines() if "blas" in line.lower() and "/" in line})
    mlx_libs = [f"{p.parent.name}/{p.name}" for p in libs if p.parent.name.startswith("mlx")]
    return f"bundled reference BLAS ({', '.join(mlx_libs)})" if mlx_libs else "bundled"


# the environment that sets how many threads the BLAS runs and how long its idle ones spin (OpenBLAS reads it once,
# when it loads): a cost curve measured under one setting does not hold under another (BENCHMARKS.md, issue 20)
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT", "VECLIB_MAXIMUM_THREADS")


def blas_env() -> dict[str, str]:
    """The variables of `BLAS_ENV` that are set."""
    return {k: os.environ[k] for k in BLAS_ENV if k in os.environ}


def blas_advice(blas: str, env: dict[str, str], cores: int | None) -> str | None:
    """A line of advice about the BLAS's threading, or None: with OpenBLAS on 4 cores or fewer and its idle threads
    left to busy-wait (~0.1 s after every GEMM, by default), the plain tokens after a multi-row forward run up to twice
    as slow (BENCHMARKS.md, issue 20, twelfth session: on 2 cores plain decoding 5.8–6.3 ms a token, 4.8 with
    OPENBLAS_THREAD_TIMEOUT=4)."""
    if "openblas" not in blas.lower() or not cores or cores > 4:
        return None
    if "OPENBLAS_THREAD_TIMEOUT" in env or env.get("OPENBLAS_NUM_THREADS") == "1":
        return None
    return (f"OpenBLAS on {cores} cores with its idle threads busy-waiting: start with OPENBLAS_THREAD_TIMEOUT=4 "
            "in the environment (README, OpenBLAS note)")


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def apple_chip() -> str | None:
    """The chip's name on macOS (`sysctl machdep.cpu.brand_string`, e.g. "Apple M5 Max"), or None elsewhere."""
    if platform.system() != "Darwin":
        return None
    try:
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def total_memory() -> int | None:
    """Physical memory in bytes, or None when the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info() -> dict:
    """What a benchmark result records about the machine: platform, CPU, cores, RAM, MLX device and versions, BLAS."""
    mem = total_memory()
    return {
        "platform": platform.platform(),
        "cpu": cpu_model() or platform.processor(),
        "nproc": os.cpu_count(),
        "ram_gib": round(mem / 2**30, 1) if mem else None,
        "device": str(mx.default_device()),
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        "blas": blas_in_use(),
        "blas_env": blas_env(),
    }


def machine_fingerprint() -> str:
    """Short hash of what makes timings differ between machines: OS, CPU/chip, cores, RAM, MLX device and version,
    the BLAS in use and its threading environment (`BLAS_ENV`, where set)."""
    cpu = cpu_model() or apple_chip() or platform.processor()
    mem = total_memory() or 0
    parts = [platform.system(), platform.machine(), cpu, str(os.cpu_count()), str(mem // 2**30),
             str(mx.default_device()), package_version("mlx") or "", blas_in_use()]
    parts += [f"{k}={v}" for k, v in sorted(blas_env().items())]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]
