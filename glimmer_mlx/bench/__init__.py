"""Speed benchmarks, one home for all of them.

- `glimmer bench` (every decoding mode on the shipped prompt sets, in one sitting): `settings` (modes, profiles,
  prompts), `runner` (the protocol; every mode of ours through `strategy`), `report` (tables, chart);
- `glimmer bench-plain` (plain decoding, ours vs mlx-lm): `plain`, on checkpoints `checkpoint` writes with mlx-lm's
  own classes;
- `glimmer bench kernels` (the custom kernels vs their references vs stock MLX): `kernels`;
- `describe`: what a result records about its model and its repeated measurements.

The machine each result describes comes from `glimmer_mlx.machine`."""

from .checkpoint import glimmer_config, make_random_checkpoint
from .kernels import render_kernel_table, run_kernel_bench
from .plain import bench_plain, compare_logits, decode_step_profile, format_plain
from .report import markdown_table, render_table, write_chart
from .runner import BenchError, encode_prompts, machine_fingerprint_info, run_bench
from .settings import DEFAULT_MODES, PROFILES, BenchSettings, expand_modes, load_prompts

__all__ = ["BenchError", "BenchSettings", "DEFAULT_MODES", "PROFILES", "bench_plain", "compare_logits",
           "decode_step_profile", "encode_prompts", "expand_modes", "format_plain", "glimmer_config", "load_prompts",
           "machine_fingerprint_info", "make_random_checkpoint", "markdown_table", "render_kernel_table",
           "render_table", "run_bench", "run_kernel_bench", "write_chart"]
