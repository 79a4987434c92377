"""GLIMMER_KERNELS and the dispatchers: Metal only when available and supported, the reference otherwise."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import glimmer_mlx
from glimmer_mlx import kernels
from glimmer_mlx.kernels import _core, accept

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
