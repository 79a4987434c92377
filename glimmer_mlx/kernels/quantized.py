"""Small-row affine-quantized matmul: `x[M <= 16, K] @ dequant(Wq)^T` reading each packed weight word once for all
M rows (`metal_kernels/qmm_small.metal`), for the k+1 rows of a verification forward.

`qmm_reference` is the pure-MLX definition (dequantize in float32, matmul in float32, one rounding);
`KernelQuantizedLinear` is an `nn.QuantizedLinear` that routes 2..16-row inputs through the dispatcher on Metal and
is installed on a model by `install_block_kernels` (a no-op without Metal).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ._core import FLOAT_DTYPES, KernelCall, KernelSpec, use_metal

QMM = KernelSpec("glimmer_qmm_small", "qmm_small.metal", ("x", "w", "scales", "biases", "meta"), ("y",))

MAX_ROWS = 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def _check(x, w, scales, biases, group_size: int, bits: int):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"unsupported bits {bits}")
    if K % group_size:
        raise ValueError(f"K={K} is not a multiple of group_size={group_size}")
    N = w.shape[0]
    if w.dtype != mx.uint32 or w.shape[1] * 32 != K * bits:
        raise ValueError(f"packed weight must be uint32 [N, K*bits/32] = [{N}, {K * bits // 32}], got "
                         f"{w.dtype} {tuple(w.shape)}")
    if tuple(scales.shape) != (N, K // group_size) or biases is None or tuple(biases.shape) != tuple(scales.shape):
        raise ValueError(f"scales and biases must be [{N}, {K // group_size}] (affine mode)")
    return M, K, N


def qmm_reference(x, w, scales, biases, *, group_size: int = 64, bits: int = 4) -> mx.array:
    """x [M, K] @ dequantize(w)^T → [M, N] in x's dtype."""
    _check(x, w, scales, biases, group_size, bits)
    wf = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    return (x.astype(mx.float32) @ wf.T).astype(x.dtype)


def qmm_call(x, w, scales, biases, *, group_size: int = 64, bits: int = 4) -> KernelCall:
    M, K, N = _check(x, w, scales, biases, group_size, bits)
    if not supported(x, w, scales, biases, group_size, bits):
        raise ValueError(f"qmm kernel: unsupported shapes/dtypes x {x.dtype} {tuple(x.shape)}, bits {bits}, "
                         f"group {group_size}")
    return KernelCall(QMM, [x, w, scales.astype(x.dtype), biases.astype(x.dtype),
                            mx.array([M, N, K], dtype=mx.int32)],
                      output_shapes=[(M, N)], output_dtypes=[x.dtype], grid=(32, N, 1), threadgroup=(32, 4, 1),
                      template=[("T", x.dtype), ("M", M), ("BITS", bits), ("GS", group_size)])


def supported(x, w, scales, biases, group_size: int, bits: int) -> bool:
    return (x.ndim == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in FLOAT_DTYPES and bits in BITS
            and group_size in GROUP_SIZES and biases is not None and w.dtype == mx.uint32
            and x.shape[1] % group_size == 0 and w.shape[1] * 32 == x.shape[1] * bits
            and scales.dtype in FLOAT_DTYPES and biases.dtype in FLOAT_DTYPES)


def qmm(x, w, scales, biases, *, group_size: int = 64, bits: int = 4) -> mx.array:
    """Dispatcher: the Metal kernel when enabled and supported, else the reference."""
    if use_metal() and supported(x, w, scales, biases, group_size, bits):
        return qmm_call(x, w, scales, biases, group_size=group_size, bits=bits).run_metal()[0]
    return qmm_reference(x, w, scales, biases, group_size=group_size, bits=bits)


class KernelQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose 2..16-row calls (block verification) use the small-row kernel on Metal; every
    other call (decode, prefill, unsupported modes) is the stock `mx.quantized_matmul`."""

    def __call__(self, x):
        rows = x.size // x.shape[-1] if x.ndim else 0
        if (2 <= rows <= MAX_ROWS and getattr(self, "mode", "affine") == "affine" and use_metal()
                and supported(x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self.get("biases"),
                              self.group_size, self.bits)):
            y = qmm(x.reshape(rows, x.shape[-1]), self["weight"], self["scales"], self["biases"],
                    group_size=self.group_size, bits=self.bits)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            if "bias" in self:
                y = y + self["bias"]
            return y
        return super().__call__(x)


def install_block_kernels(model) -> int:
    """Route the block-verification matmuls of `model`'s affine 4/8-bit `QuantizedLinear` layers through the
    small-row kernel. Only when Metal kernels are in use; returns the number of layers switched (0 on CPU)."""
    if not use_metal():
        return 0
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear and getattr(m, "mode", "affine") == "affine" and m.bits in BITS \
                and m.group_size in GROUP_SIZES:
            m.__class__ = KernelQuantizedLinear
            n += 1
    return n
