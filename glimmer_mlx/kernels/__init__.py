"""Custom Metal kernels for block verification, each with a pure-MLX reference and a dispatcher.

Bodies live in `metal_kernels/*.metal` (shipped in the wheel as `glimmer_mlx/metal_kernels`). A dispatcher runs the
Metal kernel only when `mx.metal.is_available()` and the shapes/dtypes are supported, else the reference;
`GLIMMER_KERNELS=reference` forces the reference, `GLIMMER_KERNELS=metal` requires Metal.

- `greedy_accept(logits, drafts)`: fused argmax + accepted length + next token (two ints to the host).
- `rejection_accept(p, q, drafts, u)`: fused rejection-sampling acceptance with an inverse-CDF residual draw
  (`rejection_accept_logprobs` takes the processed log-probs, as the verifier has them).
- `block_attention(q, k, v, scale=, qk=, window=)`: k+1 <= 16 queries against a long KV cache (GQA, window).
- `qmm(x, w, scales, biases, group_size=, bits=)`: small-row affine 4/8-bit quantized matmul.
"""

from ._core import ENV, KernelUnavailable, metal_available, mode, use_metal
from .accept import (greedy_accept, greedy_accept_reference, rejection_accept, rejection_accept_logprobs,
                     rejection_accept_reference, rejection_accept_reference_logprobs)
from .attention import block_attention, block_attention_reference
from .quantized import KernelQuantizedLinear, install_block_kernels, qmm, qmm_reference

__all__ = [
    "ENV", "KernelUnavailable", "metal_available", "mode", "use_metal",
    "greedy_accept", "greedy_accept_reference", "rejection_accept", "rejection_accept_logprobs",
    "rejection_accept_reference", "rejection_accept_reference_logprobs",
    "block_attention", "block_attention_reference", "qmm", "qmm_reference", "KernelQuantizedLinear",
    "install_block_kernels",
]
