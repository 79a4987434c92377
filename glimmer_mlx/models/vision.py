"""The Muse Glimmer vision tower, adapter, projection and perception norm in MLX (reference doc §4), numerically
equal to transformers' `MuseGlimmerVisionModel` + `MuseGlimmerModel.get_image_features`.

Input is what the processor produces (`glimmer_mlx.image_processing`, or transformers' processor): patch rows in
raster order per frame, features laid out (t, c, y, x), plus the grid (t, gh, gw) in patches. Every frame is
encoded independently (frames of a video never attend to each other, nor do different images), so images are
encoded one at a time; that is mathematically what transformers' packed `cu_seqlens` forward computes.

Module names equal the checkpoint's (after the `model.` prefix): `vision_tower.…`, `vision_adapter.…`,
`vision_projection.weight`, so `dict(tree_flatten(encoder.parameters()))` has exactly the checkpoint's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

F32 = mx.float32

# Above this many attention scores (heads x queries x keys) a full-attention layer is computed in query chunks,
# so the CPU path never materialises more than ~256 MB of fp32 scores at once.
MAX_SCORES = 1 << 26


class VisionConfigError(ValueError):
    """A `vision_config` this runtime cannot run."""


@dataclass
class VisionConfig:
    """transformers' `MuseGlimmerVisionConfig` (reference doc §1.2) plus the projector fields of the top config."""

    patch_size: int = 14
    patch_temporal: int = 2
    merge_size: int = 2
    pos_emb_height: int = 32
    pos_emb_width: int = 32
    hidden_size: int = 1536
    intermediate_size: int = 8960
    num_hidden_layers: int = 50
    num_attention_heads: int = 16
    head_dim: int | None = None
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    layer_types: list[str] = field(default_factory=list)
    # from the top-level MuseGlimmerConfig
    out_hidden_size: int = 6144
    projector_hidden_size: int = 4096
    projector_hidden_act: str = "gelu"
    text_hidden_size: int = 6656
    text_rms_norm_eps: float = 1e-5

    @property
    def window(self) -> int:
        """Side of an attention window, in patches (transformers: window_size // patch_size = pos_emb_height)."""
        return self.pos_emb_height

    @classmethod
    def from_model_config(cls, config) -> "VisionConfig":
        """From a glimmer_mlx `ModelConfig` (its verbatim `vision` dict and the top-level `raw` dict)."""
        v = dict(config.vision or {})
        raw = config.raw or {}
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v[k] for k in v if k in known and v[k] is not None and k not in ("rope_theta", "layer_types")}
        rope = v.get("rope_parameters") or v.get("rope_scaling") or {}
        rt = rope.get("rope_type", rope.get("type", "axial"))
        if rt != "axial":
            raise VisionConfigError(f"vision_config: rope_type {rt!r} is not supported (Muse Glimmer uses 'axial')")
        kw["rope_theta"] = float(rope.get("rope_theta", v.get("rope_theta") or 10000.0))
        cfg = cls(**kw)
        cfg.out_hidden_size = raw.get("out_hidden_size", cfg.hidden_size * cfg.merge_size**2)
        cfg.projector_hidden_size = raw.get("projector_hidden_size", 4096)
        cfg.projector_hidden_act = raw.get("projector_hidden_act", "gelu")
        cfg.text_hidden_size = config.text.hidden_size
        cfg.text_rms_norm_eps = config.text.rms_norm_eps
        L = cfg.num_hidden_layers
        cfg.layer_types = list(v.get("layer_types") or [
            "full_attention" if (i + 1) % 4 == 0 or i == L - 1 else "window_attention" for i in range(L)])
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise VisionConfigError(f"vision_config: layer_types has {len(self.layer_types)} entries, expected "
                                    f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {"full_attention", "window_attention"})
        if bad:
            raise VisionConfigError(f"vision_config: unsupported layer type(s) {bad}")
        if self.pos_emb_height != self.pos_emb_width:
            raise VisionConfigError(f"vision_config: a non-square position table ({self.pos_emb_height}x"
                                    f"{self.pos_emb_width}) is not supported (transformers assumes a square one)")
        hd = self.head_dim or self.hidden_size // self.num_attention_heads
        if hd * self.num_attention_heads != self.hidden_size or hd % 4:
            raise VisionConfigError(f"vision_config: hidden_size {self.hidden_size} / {self.num_attention_heads} "
                                    "heads must give a head dim divisible by 4 (axial RoPE)")
        if self.out_hidden_size != self.hidden_size * self.merge_size**2:
            raise VisionConfigError(f"config.json: out_hidden_size {self.out_hidden_size} != vision hidden_size x "
                                    f"merge_size^2 = {self.hidden_size * self.merge_size**2}")
        for name in ("hidden_act", "projector_hidden_act"):
            if getattr(self, name) not in _ACTS:
                raise VisionConfigError(f"vision {name} {getattr(self, name)!r} is not supported "
                                        f"(supported: {', '.join(_ACTS)})")


_ACTS = {"gelu": nn.gelu, "gelu_pytorch_tanh": nn.gelu_approx, "gelu_new": nn.gelu_approx, "silu": nn.silu,
         "relu": nn.relu, "quick_gelu": nn.gelu_fast_approx}


# ---------------------------------------------------------------------------------------------------------------
# Index tables per frame grid (numpy, cached): position-embedding taps, RoPE angles, windows, pixel shuffle.


@lru_cache(maxsize=64)
def position_taps(gh: int, gw: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear (align_corners=False) taps into the side x side table with zero padding, including transformers'
    transposition quirk (reference doc §4.1). Returns (indices [gh*gw, 4] int32, weights [gh*gw, 4] float32),
    patches in raster order. Arithmetic in float32 exactly as transformers' `_interpolation_axis_taps_weights`."""
    p = np.arange(gh * gw, dtype=np.int64)
    # transformers passes grid (t, w, h): the "row" axis has size gw and rows are p // gh
    row, col = p // gh, p % gh

    def axis(index, size):
        src = (index.astype(np.float32) + np.float32(0.5)) * np.float32(side) / np.float32(size) - np.float32(0.5)
        floor = np.floor(src)
        offsets = np.arange(2, dtype=np.int64)
        raw = floor.astype(np.int64)[:, None] + offsets
        taps = np.clip(raw, 0, side - 1)
        dist = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))
        w = np.maximum(np.float32(1) - dist, np.float32(0)).astype(np.float32)
        w = w * ((raw >= 0) & (raw <= side - 1))
        return taps, w.astype(np.float32)

    ht, hw_ = axis(row, gw)
    wt, ww = axis(col, gh)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    w = (hw_[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return idx.astype(np.int32), w.astype(np.float32)


@lru_cache(maxsize=64)
def rope_angles(gh: int, gw: int, head_dim: int, theta: float) -> np.ndarray:
    """Axial RoPE angles [gh*gw, head_dim] (float32), raster order: (col+1)·inv then (row+1)·inv, twice."""
    spatial = head_dim // 2
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial))))
    inv = inv.astype(np.float32)
    r, c = np.divmod(np.arange(gh * gw), gw)
    fc = (c + 1).astype(np.float32)[:, None] * inv
    fr = (r + 1).astype(np.float32)[:, None] * inv
    half = np.concatenate([fc, fr], axis=-1)
    return np.concatenate([half, half], axis=-1).astype(np.float32)


@lru_cache(maxsize=64)
def window_groups(gh: int, gw: int, side: int) -> tuple[tuple[np.ndarray, ...], np.ndarray] | None:
    """Windows of side x side patches tiling a frame from the top-left, grouped by shape so each group runs as one
    batched attention. Returns (per-group index arrays [n_windows, rows*cols] into the frame's raster order,
    inverse permutation taking the concatenated group outputs back to raster order), or None when one window
    covers the whole frame (then window attention is full attention)."""
    if gh <= side and gw <= side:
        return None
    grid = np.arange(gh * gw).reshape(gh, gw)
    groups: dict[tuple[int, int], list[np.ndarray]] = {}
    for r0 in range(0, gh, side):
        for c0 in range(0, gw, side):
            blk = grid[r0 : r0 + side, c0 : c0 + side]
            groups.setdefault(blk.shape, []).append(blk.reshape(-1))
    arrays = tuple(np.stack(v).astype(np.int32) for v in groups.values())
    order = np.concatenate([a.reshape(-1) for a in arrays])
    return arrays, np.argsort(order).astype(np.int32)


@lru_cache(maxsize=64)
def shuffle_index(gh: int, gw: int, m: int) -> np.ndarray:
    """Gather index of the m x m pixel shuffle: merged token (R, C) in raster order takes patches (mR+i, mC+j)
    for i, j in 0..m-1 (i slowest). Shape [gh*gw] int32."""
    idx = np.arange(gh * gw).reshape(gh // m, m, gw // m, m).transpose(0, 2, 1, 3).reshape(-1)
    return idx.astype(np.int32)


# ---------------------------------------------------------------------------------------------------------------
# Modules


class Linear(nn.Linear):
    """nn.Linear with zero initial weights: they always come from the checkpoint, and building the encoder must not
    draw from MLX's global random state (loading a model would otherwise shift every later unseeded init)."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True):
        nn.Module.__init__(self)
        self.weight = mx.zeros((output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((output_dims,))


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, dims: int):
        nn.Module.__init__(self)
        self.weight = mx.zeros((num_embeddings, dims))


def _rotate_half(x):
    h = x.shape[-1] // 2
    return mx.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def attend(q, k, v, scale: float):
    """Bidirectional attention over [B, H, L, hd]; long sequences are processed in query chunks."""
    B, H, L, _ = q.shape
    if B * H * L * L <= MAX_SCORES:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    step = max(1, MAX_SCORES // (B * H * L))
    outs = [mx.fast.scaled_dot_product_attention(q[:, :, s : s + step], k, v, scale=scale) for s in range(0, L, step)]
    return mx.concatenate(outs, axis=2)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        D = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim or D // self.n_heads
        self.q_proj = Linear(D, D, bias=True)
        self.k_proj = Linear(D, D, bias=True)
        self.v_proj = Linear(D, D, bias=True)
        self.proj = Linear(D, D, bias=True)
        self.scale = self.head_dim**-0.5

    def __call__(self, x, cos, sin, frames: int, windows):
        """x [N, D] for `frames` frames of equal size (raster order per frame); windows: `window_groups(...)` or
        None for attention over each whole frame."""
        N, D = x.shape
        H, hd = self.n_heads, self.head_dim
        q = self.q_proj(x).reshape(N, H, hd)
        k = self.k_proj(x).reshape(N, H, hd)
        v = self.v_proj(x).reshape(N, H, hd)
        dt = q.dtype
        qf, kf = q.astype(F32), k.astype(F32)  # RoPE in fp32, cast back (transformers' apply_rotary_pos_emb_vision)
        q = (qf * cos + _rotate_half(qf) * sin).astype(dt)
        k = (kf * cos + _rotate_half(kf) * sin).astype(dt)
        n = N // frames
        if windows is None:
            def split(t):  # [frames, H, n, hd]
                return t.reshape(frames, n, H, hd).transpose(0, 2, 1, 3)

            o = attend(split(q), split(k), split(v), self.scale)
            o = o.transpose(0, 2, 1, 3).reshape(N, D)
        else:
            groups, inv = windows
            outs = []
            for f in range(frames):
                qf_, kf_, vf_ = (t[f * n : (f + 1) * n] for t in (q, k, v))
                parts = []
                for g in groups:
                    gi = mx.array(g)
                    nw, lw = g.shape

                    def gather(t):  # [n_windows, H, rows*cols, hd]
                        return t[gi.reshape(-1)].reshape(nw, lw, H, hd).transpose(0, 2, 1, 3)

                    og = attend(gather(qf_), gather(kf_), gather(vf_), self.scale)
                    parts.append(og.transpose(0, 2, 1, 3).reshape(nw * lw, D))
                outs.append(mx.concatenate(parts, axis=0)[mx.array(inv)])
            o = outs[0] if frames == 1 else mx.concatenate(outs, axis=0)
        return self.proj(o)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTS[cfg.hidden_act]

    def __call__(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, kind: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-5)  # hard-coded 1e-5 in transformers
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.windowed = kind == "window_attention"

    def __call__(self, x, cos, sin, frames, windows):
        x = x + self.attn(self.norm1(x), cos, sin, frames, windows if self.windowed else None)
        return x + self.mlp(self.norm2(x))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        P, Tp = cfg.patch_size, cfg.patch_temporal
        self.patch_embedding = Linear(Tp * 3 * P * P, cfg.hidden_size, bias=False)
        self.position_embedding_table = Embedding(cfg.pos_emb_height * cfg.pos_emb_width, cfg.hidden_size)
        self.side = cfg.pos_emb_height
        self.frame_dim = 3 * P * P
        self.Tp = Tp

    def __call__(self, pixels: mx.array, frames: int, gh: int, gw: int) -> mx.array:
        W = self.patch_embedding.weight
        if pixels.shape[-1] == self.frame_dim and self.Tp > 1:
            # one copy of a still image's patch (the processor duplicates it Tp times): sum the Tp weight slices
            W = W.reshape(W.shape[0], self.Tp, self.frame_dim).sum(axis=1)
        h = pixels.astype(W.dtype) @ W.T
        idx, w = position_taps(gh, gw, self.side)
        table = self.position_embedding_table.weight
        pos = (table[mx.array(idx)].astype(F32) * mx.array(w)[:, :, None]).sum(axis=1).astype(h.dtype)
        if frames > 1:
            pos = mx.tile(pos, (frames, 1))
        return h + pos


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.ln_pre = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = [VisionLayer(cfg, t) for t in cfg.layer_types]
        self.ln_post = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, pixels: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """pixels [t*gh*gw, Tp*3*P*P] (or [gh*gw, 3*P*P] for a still image); returns the pixel-shuffled
        [t*gh*gw/m², Dv*m²] features."""
        cfg = self.cfg
        t, gh, gw = (int(x) for x in grid)
        m = cfg.merge_size
        if gh % m or gw % m:
            raise ValueError(f"grid {gh}x{gw} is not a multiple of merge_size {m}")
        if pixels.shape[0] != t * gh * gw:
            raise ValueError(f"pixel rows {pixels.shape[0]} != t*h*w = {t * gh * gw} for grid {(t, gh, gw)}")
        h = self.ln_pre(self.patch_embedder(pixels, t, gh, gw))
        hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        ang = rope_angles(gh, gw, hd, cfg.rope_theta)
        if t > 1:
            ang = np.tile(ang, (t, 1))
        # transformers casts cos/sin to the hidden dtype before applying them in fp32
        cos = mx.array(np.cos(ang))[:, None, :].astype(h.dtype).astype(F32)
        sin = mx.array(np.sin(ang))[:, None, :].astype(h.dtype).astype(F32)
        windows = window_groups(gh, gw, cfg.window)
        for layer in self.layers:
            h = layer(h, cos, sin, t, windows)
        h = self.ln_post(h)
        idx = shuffle_index(gh, gw, m)
        if t > 1:
            idx = (idx[None, :] + (np.arange(t) * gh * gw)[:, None]).reshape(-1).astype(np.int32)
        h = h[mx.array(idx)]
        D = h.shape[-1]
        return h.reshape(-1, m * m, D).transpose(0, 2, 1).reshape(-1, D * m * m)


class VisionAdapter(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = Linear(cfg.out_hidden_size, cfg.projector_hidden_size, bias=False)
        self.fc2 = Linear(cfg.projector_hidden_size, cfg.projector_hidden_size, bias=False)
        self.act = _ACTS[cfg.projector_hidden_act]

    def __call__(self, x):
        return self.act(self.fc2(self.act(self.fc1(x))))  # GELU after both linears


class VisionEncoder(nn.Module):
    """Tower → adapter → projection → weightless RMSNorm: one image/video → its text-space embeddings."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg)
        self.vision_adapter = VisionAdapter(cfg)
        self.vision_projection = Linear(cfg.projector_hidden_size, cfg.text_hidden_size, bias=False)

    def __call__(self, pixels: mx.array, grid: tuple[int, int, int]) -> mx.array:
        """[t*gh*gw/m², D_text] embeddings, in the dtype of the weights."""
        x = self.vision_tower(pixels, grid)
        f = self.vision_projection(self.vision_adapter(x))
        return mx.fast.rms_norm(f.astype(F32), None, self.cfg.text_rms_norm_eps).astype(f.dtype)

    def num_tokens(self, grid) -> int:
        t, gh, gw = (int(x) for x in grid)
        return t * gh * gw // self.cfg.merge_size**2
