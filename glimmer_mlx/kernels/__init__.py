"""Custom Metal kernels for block verification, each with a pure-MLX reference and a dispatcher.

Bodies live in `metal_kernels/*.metal` (shipped in the wheel as `glimmer_mlx/metal_kernels`). A dispatcher runs the
Metal kernel only when `mx.metal.is_available()`, the kernel passed its runtime self-test (`kernel_enabled`, once per
process, cached on disk per GPU / OS / MLX version) and the shapes/dtypes are supported, else the built-in MLX path;
`GLIMMER_KERNELS=reference` forces the reference, `GLIMMER_KERNELS=metal` requires Metal and passing self-tests.
`kernel_stats()` says which kernels run and why the others do not; `selftests()` lists what each module registered.

- `greedy_accept(logits, drafts)`: fused argmax + accepted length + next token (two ints to the host).
- `rejection_accept_logprobs(p_lp, q_lp, drafts, u)`: fused rejection-sampling acceptance with an inverse-CDF
  residual draw, from the processed log-probs (`rejection_accept_reference` is the definition on probabilities).
- `block_attention(q, k, v, scale=, qk=, window=)`: k+1 <= 16 queries against a long KV cache (GQA, window).
- `qmm(x, w, scales, biases, group_size=, bits=)`: small-row affine 4/8-bit quantized matmul.
"""

from ._core import (ENV, KernelUnavailable, SelfTest, Verdict, kernel_enabled, kernel_stats, metal_available, mode,
                    register_selftest, run_selftest, selftests, time_calls, use_metal, verdict)
from .accept import (greedy_accept, greedy_accept_reference, rejection_accept_logprobs, rejection_accept_reference,
                     rejection_accept_reference_logprobs)
from .attention import block_attention, block_attention_reference
from .quantized import KernelQuantizedLinear, install_block_kernels, qmm, qmm_reference

__all__ = [
    "ENV", "KernelUnavailable", "SelfTest", "Verdict", "kernel_enabled", "kernel_stats", "metal_available", "mode",
    "register_selftest", "run_selftest", "selftests", "time_calls", "use_metal", "verdict",
    "greedy_accept", "greedy_accept_reference", "rejection_accept_logprobs",
    "rejection_accept_reference", "rejection_accept_reference_logprobs",
    "block_attention", "block_attention_reference", "qmm", "qmm_reference", "KernelQuantizedLinear",
    "install_block_kernels",
]
