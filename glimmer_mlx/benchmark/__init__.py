"""`glimmer bench`: an honest, same-run speed comparison of every decoding mode (see runner.py for the protocol).

`glimmer_mlx.bench` (plain decoding vs mlx-lm on a random checkpoint, `glimmer bench-plain`) provides the machine
description reused here."""

from .report import markdown_table, render_table, write_chart
from .runner import BenchError, encode_prompts, machine_fingerprint_info, run_bench
from .settings import DEFAULT_MODES, PROFILES, BenchSettings, expand_modes, load_prompts

__all__ = ["BenchError", "BenchSettings", "DEFAULT_MODES", "PROFILES", "encode_prompts", "expand_modes",
           "load_prompts", "machine_fingerprint_info", "markdown_table", "render_table", "run_bench", "write_chart"]
