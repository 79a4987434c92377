"""A normal (non-editable) install works offline: the wheel carries the Metal kernel bodies, the benchmark prompts and
the embedded model set, so `glimmer generate` without --model runs from a fresh virtualenv with no source tree on
the path."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(out), str(REPO)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("glimmer_mlx-*.whl")
    return whl


def test_wheel_holds_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for part in ("glimmer-tiny/model.safetensors", "glimmer-tiny/tokenizer.json", "glimmer-tiny/config.json",
                 "glimmer-tiny-dflash/model.safetensors", "glimmer-tiny-dflash/eval.json",
                 "glimmer-tiny-mtp/mtp.safetensors"):
        assert f"glimmer_mlx/embedded/{part}" in names
    assert "glimmer_mlx/bench/prompts/prompts.json" in names
    assert {f"glimmer_mlx/metal_kernels/{p.name}" for p in (REPO / "metal_kernels").glob("*.metal")} <= names
    assert not any(n.startswith(("tests/", "embedded/", "benchmarks/")) for n in names)


def test_glimmer_generate_from_a_fresh_virtualenv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)  # ensurepip: the pip bundled with Python, offline
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies (mlx, tokenizers, …) come from this interpreter's site-packages; a path listed in a .pth file
    # is added without running that folder's own .pth files, so an editable install of the project is not seen
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", GLIMMER_MLX_CACHE_DIR=str(tmp_path / "cache"))
    where = subprocess.run([str(py), "-c", "import glimmer_mlx; print(glimmer_mlx.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(env_dir)  # the installed copy, not the source tree
    run = subprocess.run([str(env_dir / "bin" / "glimmer"), "generate", "-p", "hi", "-m", "4"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "using the embedded target" in run.stderr and str(env_dir) in run.stderr
    assert "generation: 4 tok" in run.stderr  # (four tokens of the model's message header: nothing visible yet)
