"""The Muse Glimmer DFlash drafter (`muse_glimmer_assistant`), numerically equal to transformers'
`MuseGlimmerAssistantModel` (reference doc §7).

Per round the drafter sees the target's tapped hidden states of the newly committed positions (the *context*,
projected by `encoder.fc` + RMSNorm and injected as extra K/V into every layer) and a block
`[anchor, mask × (B−1)]` embedded with the target's raw embedding table. Block queries attend bidirectionally to
the block and to the context within the inclusive window `|q − k| ≤ W`. Only context K/V are cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..config import ConfigError, normalize_rope_parameters
from .glimmer import MLP, norm_then_gain


@dataclass
class AssistantConfig:
    hidden_size: int = 6656
    intermediate_size: int = 19968
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=dict)
    max_position_embeddings: int = 131072
    sliding_window: int | None = 2048
    layer_types: list[str] = field(default_factory=list)
    hidden_act: str = "silu"
    block_size: int = 16
    mask_token_id: int = 201818
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 13, 25, 37, 49])

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "AssistantConfig":
        if d.get("model_type") != "muse_glimmer_assistant":
            raise ConfigError(f"{where}: model_type {d.get('model_type')!r} is not a DFlash drafter "
                              "(expected 'muse_glimmer_assistant')")
        return cls.from_fields(d, where)

    @classmethod
    def from_fields(cls, d: dict, where: str = "config.json") -> "AssistantConfig":
        """The config from a flat dict of its fields (no model_type check): what `from_dict` and DFlash 2's config
        (`models.dflash2.DFlash2Config`, whose checkpoints say `model_type: qwen3`) share."""
        known = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in known and v is not None}
        rp = dict(d)
        if not (d.get("rope_parameters") or {}).get("rope_theta") and "rope_theta" not in d:
            rp["rope_theta"] = 500000.0  # MuseGlimmerAssistantConfig.default_theta
        kw["rope_parameters"] = normalize_rope_parameters(rp)
        if kw["rope_parameters"]["rope_type"] != "default":
            raise ConfigError(f"{where}: drafter rope_type {kw['rope_parameters']['rope_type']!r} is not supported")
        cfg = cls(**kw)
        if not cfg.layer_types:
            cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
        if len(cfg.layer_types) != cfg.num_hidden_layers:
            raise ConfigError(f"{where}: layer_types has {len(cfg.layer_types)} entries, expected "
                              f"{cfg.num_hidden_layers}")
        if cfg.block_size < 2:
            raise ConfigError(f"{where}: block_size must be >= 2, got {cfg.block_size}")
        return cfg

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


class AssistantRMSNorm(nn.Module):
    """Llama-style: normalise in fp32, cast to the input dtype, then multiply by the gain."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x):
        return norm_then_gain(x, self.weight, self.eps)


class DraftAttention(nn.Module):
    def __init__(self, cfg: AssistantConfig, i: int, window_rule: str = "inclusive"):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=False)
        self.q_norm = AssistantRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = AssistantRMSNorm(hd, cfg.rms_norm_eps)
        self.window = cfg.window(i)
        # "inclusive" (transformers' MuseGlimmerAssistantModel): a key is seen iff |q − k| <= W. "strict" (DFlash 2,
        # as its public ports mask): context keys iff q − k < W, every block key always.
        self.window_rule = window_rule
        self.scale = hd**-0.5

    @property
    def reach(self) -> int:
        """The largest q − k at which a context key is still seen (sliding layers only)."""
        return self.window - (1 if self.window_rule == "strict" else 0)

    def _kv(self, x, rope, offset):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        return rope(k, offset), v

    def __call__(self, x, ctx, pos: int, rope, cache: KVCache | None, ctx_mask: mx.array | None = None):
        """x: normed block [1, B, D] at positions pos..pos+B-1; ctx: new context rows [1, n, D] at positions
        pos-n..pos-1 (already appended to nothing: this call stores their K/V in `cache`)."""
        B_, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B_, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = rope(q, pos)
        kb, vb = self._kv(x, rope, pos)
        n = ctx.shape[1]
        if cache is None:  # context-only forward (tests / training): ctx holds the whole context from position pos-n
            kc, vc = self._kv(ctx, rope, pos - n) if n else (kb[..., :0, :], vb[..., :0, :])
            k0 = pos - n
        else:
            if n:
                kc, vc = self._kv(ctx, rope, pos - n)
                cache.append(kc, vc)
            lo = 0 if self.window is None else pos - self.reach
            kc, vc, k0 = cache.view(lo)
        keys = mx.concatenate([kc, kb], axis=2)
        values = mx.concatenate([vc, vb], axis=2)
        mask = None
        if self.window is not None and k0 < pos + L - 1 - self.reach:
            kpos = mx.concatenate([mx.arange(k0, k0 + kc.shape[2]), mx.arange(pos, pos + L)])[None, :]
            qpos = mx.arange(pos, pos + L)[:, None]
            mask = mx.abs(qpos - kpos) <= self.reach
            if self.window_rule == "strict":
                mask = mask | (kpos >= pos)
        if ctx_mask is not None:  # training: per-sample valid context rows [B, n] (left padding is masked out)
            valid = mx.concatenate([ctx_mask, mx.ones((B_, L), dtype=mx.bool_)], axis=1)[:, None, None, :]
            mask = valid if mask is None else (mask[None, None] & valid)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B_, L, -1))


    def batch(self, x, ctxs: list, positions: list[int], rope, caches: list) -> mx.array:
        """`__call__` for R rows at once, each with its own context cache: x [R, L, D] the rows' normed blocks (row
        r at positions positions[r]..), ctxs[r] its new context rows [n_r, D] (n_r may be 0). The new context K/V of
        every row come from one projection and go into each row's own cache; the rows' cached keys are left-padded
        to the longest and masked, so every row attends to exactly the keys it would alone."""
        R, L, _ = x.shape
        pos = mx.array(positions, dtype=mx.int32)
        q = self.q_norm(self.q_proj(x).reshape(R, L, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = rope(q, pos)
        kb, vb = self._kv(x, rope, pos)
        sizes = [c.shape[0] for c in ctxs]
        if sum(sizes):  # every row's new context in one projection (RoPE per row below, at its own positions)
            kc_all, vc_all = self._kv(mx.concatenate([c for c in ctxs if c.shape[0]], axis=0)[None],
                                      lambda t, _: t, 0)
        views, a = [], 0
        for r, (n, p0, cache) in enumerate(zip(sizes, positions, caches)):
            if n:
                cache.append(rope(kc_all[..., a:a + n, :], p0 - n), vc_all[..., a:a + n, :])
                a += n
            lo = 0 if self.window is None else p0 - self.reach
            views.append(cache.view(lo) if cache.keys is not None else (kb[r:r + 1, :, :0], vb[r:r + 1, :, :0], p0))
        N = max(v[0].shape[2] for v in views)
        keys, values, masks = [], [], []
        qpos = mx.arange(L)[:, None]
        for r, (kc, vc, k0) in enumerate(views):
            n, pad = kc.shape[2], N - kc.shape[2]
            widths = [(0, 0), (0, 0), (pad, 0), (0, 0)]
            keys.append(mx.concatenate([mx.pad(kc, widths), kb[r:r + 1]], axis=2))
            values.append(mx.concatenate([mx.pad(vc, widths), vb[r:r + 1]], axis=2))
            p0 = positions[r]
            kpos = mx.concatenate([mx.full((pad,), -1, mx.int32), mx.arange(k0, k0 + n, dtype=mx.int32),
                                   mx.arange(p0, p0 + L, dtype=mx.int32)])[None, :]
            m = kpos >= 0  # the left padding is never seen
            if self.window is not None:
                near = mx.abs(qpos + p0 - kpos) <= self.reach
                if self.window_rule == "strict":
                    near = near | (kpos >= p0)
                m = m & near
            masks.append(m)
        mask = mx.stack(masks)[:, None]  # [R, 1, L, N + L]
        o = mx.fast.scaled_dot_product_attention(q, mx.concatenate(keys), mx.concatenate(values), scale=self.scale,
                                                 mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(R, L, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: AssistantConfig, i: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, i)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, h, ctx, pos, rope, cache, ctx_mask=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx, pos, rope, cache, ctx_mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def batch(self, h, ctxs, positions, rope, caches):
        h = h + self.self_attn.batch(self.input_layernorm(h), ctxs, positions, rope, caches)
        return h + self.mlp(self.post_attention_layernorm(h))


class ContextEncoder(nn.Module):
    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.output_norm_enc = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, x):
        return self.output_norm_enc(self.fc(x))


class DraftRope:
    def __init__(self, cfg: AssistantConfig):
        theta = cfg.rope_parameters["rope_theta"]
        self.dims, self.base = cfg.head_dim, theta

    def __call__(self, x, offset):
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0, offset=offset)


class Assistant(nn.Module):
    """`h = drafter(noise_embeds, ctx_taps, pos, cache)` → final-normed hidden states of the block [1, B, D]."""

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        self.config = cfg
        self.encoder = ContextEncoder(cfg)
        self.layers = [DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = DraftRope(cfg)

    def __call__(self, noise_embeds, ctx_taps, pos: int, cache=None, ctx_mask=None):
        """noise_embeds [1, B, D]: raw target embeddings of [anchor, mask…] at positions pos..pos+B-1.
        ctx_taps [1, n, k·D]: concatenated target taps of the n context positions pos-n..pos-1 that the cache has
        not seen yet (without a cache: the whole context). ctx_mask [B, n] (training only, without a cache): which
        context rows each sample may see."""
        c = self.encoder(ctx_taps)
        cache = cache if cache is not None else [None] * len(self.layers)
        h = noise_embeds
        for layer, lc in zip(self.layers, cache):
            h = layer(h, c, pos, self.rope, lc, ctx_mask)
        return self.norm(h)

    def encode(self, ctx_taps: mx.array) -> mx.array:
        """Concatenated target taps [..., k·D] → the context rows the layers attend to [..., D]."""
        return self.encoder(ctx_taps)

    def batch(self, noise_embeds, ctx_taps: list, positions: list[int], caches: list) -> mx.array:
        return batch_forward(self, noise_embeds, ctx_taps, positions, caches)

    def make_cache(self) -> list[KVCache]:
        """Context-only K/V per layer; a sliding layer keeps the W rows its window can still reach."""
        return [KVCache(window=None if w is None else w + 1, max_rewind=0)
                for w in (self.config.window(i) for i in range(self.config.num_hidden_layers))]

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in weights.items()}


def batch_forward(model, noise_embeds, ctx_taps: list, positions: list[int], caches: list) -> mx.array:
    """A DFlash drafter's forward (`Assistant`, `dflash2.DFlash2`) for R rows at once, each with its own cache
    (`DraftAttention.batch`): noise_embeds [R, B, D]; ctx_taps[r]: row r's new context taps [1, n_r, k·D] or None
    (all rows' encoded in one call); caches[r]: its per-layer caches. Returns [R, B, D], each row as its own forward
    gives it."""
    sizes = [0 if c is None else c.shape[1] for c in ctx_taps]
    if sum(sizes):
        enc = model.encode(mx.concatenate([c for c in ctx_taps if c is not None and c.shape[1]], axis=1))[0]
    ctxs, a = [], 0
    for n in sizes:
        ctxs.append(enc[a:a + n] if n else noise_embeds[0, :0])
        a += n
    h = noise_embeds
    for i, layer in enumerate(model.layers):
        h = layer.batch(h, ctxs, positions, model.rope, [c[i] for c in caches])
    return model.norm(h)
