"""Quantization modes and recipes: which bits each module gets. `convert` applies them; `info --plan` estimates
their memory from a config alone."""

from __future__ import annotations

import re

MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}  # (group_size, bits)
MIXED_RECIPES = {"mixed_2_6": (2, 6), "mixed_3_4": (3, 4), "mixed_3_6": (3, 6), "mixed_4_6": (4, 6)}  # mlx-lm's
# Ours, chosen among 9 candidates by measured KL at no more memory than mixed_4_6 (BENCHMARKS.md): 4-bit base,
# k_proj / v_proj at 8 bits in every layer (Glimmer has 2 KV heads: k/v are 1/16 the size of q, so 8 bits there cost
# ~0.1 bit per weight), embed_tokens and lm_head at 6 bits. 30B text tower: 16.4 GB vs mixed_4_6's 16.9 GB, with
# 2.3-7x lower KL than mixed_4_6 on two trained tiny targets.
GLIMMER_RECIPES = {"glimmer_4_6": (4, 6)}
RECIPES = tuple(MIXED_RECIPES) + tuple(GLIMMER_RECIPES)

VISION_LINEAR_RE = re.compile(
    r"^(vision_tower\.layers\.\d+\.(attn\.(q_proj|k_proj|v_proj|proj)|mlp\.fc[12])|vision_adapter\.fc[12]|"
    r"vision_projection)\.weight$")


def recipe_bits(recipe: str, path: str, index: int, num_layers: int) -> int:
    """Bits for module `path` under `recipe`; `index` is the layer index found as mlx-lm finds it."""
    low, high = (MIXED_RECIPES | GLIMMER_RECIPES)[recipe]
    n = num_layers
    more = index < n // 8 or index >= 7 * n // 8 or (index - n // 8) % 3 == 2
    if recipe in GLIMMER_RECIPES:
        if re.search(r"(^|\.)(k_proj|v_proj)$", path):
            return 8
        return high if re.search(r"(^|\.)(lm_head|embed_tokens)$", path) else low
    if ("v_proj" in path or "v_a_proj" in path or "v_b_proj" in path) and more:
        return high
    if "down_proj" in path and more:
        return high
    if "lm_head" in path:
        return high
    return low


def layer_index(path: str, layer_location: int) -> int:
    """The layer index in module `path` at dotted position `layer_location` (0 when there is none), as mlx-lm finds
    it for its mixed recipes."""
    parts = path.split(".")
    if len(parts) > layer_location and parts[layer_location].isdigit():
        return int(parts[layer_location])
    return 0
