"""The Muse Glimmer text tower in MLX, numerically equal to transformers' `MuseGlimmerForConditionalGeneration`
text path (reference doc §3).

Module names follow mlx-lm's `muse_glimmer` port (`model.layers.{i}…`, `lm_head`) so saved text-only
checkpoints interoperate; `sanitize` maps the Hugging Face names (`model.language_model.*`) onto them.
"""

from __future__ import annotations

import math
from functools import partial
from collections import OrderedDict

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..cache import DEFAULT_MAX_REWIND, KVCache, make_cache, tree_mask
from ..config import ModelConfig, TextConfig, rope_inv_freq
from ..kernels.attention import block_attention
from ..kernels.attention import enabled as block_kernels_enabled

F32 = mx.float32

# The elementwise chains of a layer are compiled (shapeless, once per dtype, as mlx-lm compiles its swiglu and
# softcap): a decode step launches a few fused kernels instead of ~10 small ones per layer. The results are
# bit-identical to the uncompiled ops; plain decoding of the embedded model measured 14-19 % less time per token
# on this CPU (BENCHMARKS.md, "one engine"). Only elementwise ops and mx.fast norms are compiled: matmuls, the
# KV cache and the Metal kernels stay outside, so no shape-dependent Python runs inside a compiled function.
compiled = partial(mx.compile, shapeless=True)


@compiled
def rms(x: mx.array, eps: float) -> mx.array:
    """Weightless RMSNorm computed in fp32, cast back (transformers' `MuseGlimmerRMSNorm(with_scale=False)`)."""
    return mx.fast.rms_norm(x.astype(F32), None, eps).astype(x.dtype)


@compiled
def rms_scaled(x: mx.array, eps: float, scale: float) -> mx.array:
    return mx.fast.rms_norm(x.astype(F32), None, eps).astype(x.dtype) * scale


@compiled
def norm_then_gain(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """Llama-style RMSNorm: normalise in fp32, cast to the input dtype, then multiply by the gain (one fused kernel)."""
    return w * mx.fast.rms_norm(x.astype(F32), None, eps).astype(x.dtype)


@compiled
def gain_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x.astype(F32), w.astype(F32), eps).astype(x.dtype)


@compiled
def centered_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x.astype(F32), 1.0 + w.astype(F32), eps).astype(x.dtype)


@compiled
def gated(o: mx.array, g: mx.array) -> mx.array:
    return o * mx.sigmoid(g)


@compiled
def softcap_logits(z: mx.array, multiplier: float, cap: float) -> mx.array:
    z = z.astype(F32) * multiplier
    return mx.tanh(z / cap) * cap if cap else z


class RMSNorm(nn.Module):
    """Standard RMSNorm (gain `w`, init 1); multiply in fp32, round once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dim,))
        self.eps = eps

    def __call__(self, x):
        return gain_norm(x, self.weight, self.eps)


class CenteredRMSNorm(nn.Module):
    """Gain `1 + w` (init 0), with `1 + w` formed in fp32 as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dim,))
        self.eps = eps

    def __call__(self, x):
        return centered_norm(x, self.weight, self.eps)


ACTIVATIONS = {"silu": nn.silu, "gelu": nn.gelu, "gelu_pytorch_tanh": nn.gelu_approx, "gelu_new": nn.gelu_approx,
               "relu": nn.relu}
_GLUS: dict = {}


def gated_unit(name: str):
    """`act(gate) * up` for the activation `name`, compiled (one per activation)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}")
    if name not in _GLUS:
        act = ACTIVATIONS[name]
        _GLUS[name] = compiled(lambda gate, up: act(gate) * up)
    return _GLUS[name]


class Rope:
    """rotate-half RoPE with transformers' inverse frequencies and attention scaling (not a Module: no weights)."""

    def __init__(self, cfg: TextConfig):
        inv_freq, self.scaling = rope_inv_freq(cfg)
        self.freqs = mx.array(1.0 / inv_freq, dtype=F32)
        self.dims = cfg.head_dim

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        y = mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self.freqs)
        return y * self.scaling if self.scaling != 1.0 else y

    def at(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [1, H, L, D] with row i at position positions[i] (a token tree's nodes): the L rows become a batch of
        one-token sequences, each with its own offset (the same arithmetic as a consecutive run of positions)."""
        y = mx.fast.rope(x.transpose(2, 1, 0, 3), self.dims, traditional=False, base=None, scale=1.0,
                         offset=positions, freqs=self.freqs).transpose(2, 1, 0, 3)
        return y * self.scaling if self.scaling != 1.0 else y


def causal_mask(L: int, window: int | None, offset: int = 0) -> mx.array | None:
    """Mask for L queries at positions offset.. against keys 0..offset+L-1 (no cache)."""
    if L == 1 and offset == 0:
        return None
    q = mx.arange(offset, offset + L)[:, None]
    k = mx.arange(0, offset + L)[None, :]
    m = k <= q
    if window is not None:
        m = m & (k > q - window)
    return m


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=bias)
        self.gate_proj = nn.Linear(D, self.n_heads * hd, bias=False)
        self.eps = cfg.rms_norm_eps
        self.qk_scale = cfg.qk_scale_factor
        self.scale = hd**-0.5
        self.window = cfg.sliding_window if cfg.is_sliding(layer_idx) else None
        self.use_rope = cfg.uses_rope(layer_idx)

    def __call__(self, x: mx.array, rope: Rope, cache: KVCache | None, tree=None) -> mx.array:
        """tree: None, or (depths [L], ancestors [L, L]) of a token tree's flattened nodes (`Model.__call__`)."""
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv, self.head_dim)
        q = rms_scaled(q, self.eps, self.qk_scale).transpose(0, 2, 1, 3)
        k = rms(k, self.eps).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        if tree is not None:  # a token tree: per-node positions and the tree mask
            if self.use_rope:
                positions = offset + tree[0]
                q, k = rope.at(q, positions), rope.at(k, positions)
            if cache is not None:
                k, v, mask = cache.update(k, v, tree=tree)
            else:
                mask = tree_mask(tree[0], tree[1], 0, 0, self.window)
            if cache is not None and not cache.batched and block_kernels_enabled():
                # Metal only (the CPU path is unchanged): the block-verify kernel with the tree's ancestor bits
                o = block_attention(q, k, v, scale=self.scale, qk=k.shape[2] - L, window=self.window, tree=tree)
            else:
                o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
            return self.o_proj(gated(o, self.gate_proj(x)))
        if self.use_rope:
            q, k = rope(q, offset), rope(k, offset)
        if cache is not None:
            k, v, mask = cache.update(k, v)
        else:
            mask = causal_mask(L, self.window)
        if cache is not None and 1 < L <= 16 and not cache.batched and block_kernels_enabled():
            # Metal only (the CPU path is unchanged): fused block-verify attention; the L queries are the last L keys
            o = block_attention(q, k, v, scale=self.scale, qk=k.shape[2] - L, window=self.window)
        else:
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(gated(o, self.gate_proj(x)))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) · up(x)) (the target's, the MTP layers' and the DFlash drafter's)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.glu = gated_unit(activation)

    def __call__(self, x):
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        D = cfg.hidden_size
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        self.input_layernorm = CenteredRMSNorm(D, cfg.rms_norm_eps)
        self.post_attention_layernorm = CenteredRMSNorm(D, cfg.post_norm_eps)
        self.pre_feedforward_layernorm = CenteredRMSNorm(D, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = CenteredRMSNorm(D, cfg.post_norm_eps)

    def __call__(self, x, rope, cache=None, tree=None):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cache, tree))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_eps = cfg.rms_norm_eps

    def __call__(self, inputs, cache=None, *, input_embeddings=None, taps=(), rope=None, tree=None):
        """Returns (final-normed hidden, [tapped outputs in the order of `taps`]).

        Tap i is the residual-stream output of layer i, except that the last layer's tap is the final-normed
        hidden state, exactly as transformers' `hidden_states[i + 1]` (its last entry is the normed output)."""
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        cache = cache if cache is not None else [None] * len(self.layers)
        last = len(self.layers) - 1
        tapped = {}
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            h = layer(h, rope, c) if tree is None else layer(h, rope, c, tree)
            if i in taps and i != last:
                tapped[i] = h
        h = self.norm(h)
        if last in taps:
            tapped[last] = h
        return h, [tapped[i] for i in taps]

    def embed(self, ids):
        return rms(self.embed_tokens(ids), self.embed_eps)


class VisionWeights:
    """A read-only view of the vision encoder's tensors by checkpoint name (`vision_tower.…`, `vision_adapter.…`,
    `vision_projection.weight`); empty for text-only checkpoints."""

    def __init__(self, weights: dict[str, mx.array]):
        self.weights = weights

    def __len__(self):
        return len(self.weights)


class _Aside:
    """Holds a module outside its owner's parameter tree (an nn.Module attribute would become a child)."""

    def __init__(self, module):
        self.module = module


VISION_PREFIXES = ("vision_tower.", "vision_adapter.", "vision_projection.")


class FeatureCache:
    """LRU of encoded image / video features keyed by content hash (decoded pixels + processing settings), so
    the same image in a follow-up prompt is not encoded again."""

    def __init__(self, max_items: int = 16):
        self.max_items = max_items
        self._d: "OrderedDict[str, mx.array]" = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str):
        v = self._d.get(key)
        if v is None:
            self.misses += 1
            return None
        self.hits += 1
        self._d.move_to_end(key)
        return v

    def put(self, key: str, value: mx.array) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.max_items:
            self._d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __len__(self):
        return len(self._d)


class Model(nn.Module):
    """Muse Glimmer (text path). `model(ids, cache)` → logits [B, L, V] (fp32, after multiplier and softcap)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.args = config.text
        self.model_type = config.model_type
        self.model = TextModel(config.text)
        if not config.text.tie_word_embeddings:
            self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        self.rope = Rope(config.text)
        # the vision encoder (models/vision.py) is kept aside: `model.parameters()` stays the text tower's
        self._vision = _Aside(None)
        self.vision_unavailable: str | None = None  # why `vision` is None although the config has a vision tower
        self.feature_cache = FeatureCache()

    # -- vision ---------------------------------------------------------------------------------------------------
    @property
    def vision(self):
        """The `VisionEncoder` (tower + adapter + projection + perception norm), or None for text-only checkpoints."""
        return self._vision.module

    def set_vision(self, encoder) -> None:
        self._vision = _Aside(encoder)
        self.feature_cache.clear()

    @property
    def vision_weights(self) -> VisionWeights:
        enc = self.vision
        return VisionWeights({} if enc is None else dict(tree_flatten(enc.parameters())))

    def embed_multimodal(self, ids: list[int], features: dict[int, list[mx.array]]) -> mx.array:
        """Normed token embeddings [1, L, D] with the rows of each placeholder id in `features` (image / video
        token id → per-item features [n_i, D], in prompt order) replaced by those features (reference doc §4.5:
        placeholders are embedded as token 0, then overwritten; counts must match exactly)."""
        arr = np.asarray(ids, dtype=np.int64)
        mm = np.isin(arr, list(features))
        emb = self.model.embed(mx.array(np.where(mm, 0, arr).astype(np.int32))[None])
        for tok, feats in features.items():
            pos = np.nonzero(arr == tok)[0]
            n = sum(int(f.shape[0]) for f in feats)
            if n != len(pos):
                raise ValueError(f"placeholder token {tok}: {len(pos)} position(s) in the prompt but {n} feature rows")
            if n:
                f = mx.concatenate(feats, axis=0) if len(feats) > 1 else feats[0]
                emb[0, mx.array(pos.astype(np.int32))] = f.astype(emb.dtype)
        return emb

    # -- the pieces speculative decoding needs ------------------------------------------------------------------
    def embed_raw(self, ids: mx.array) -> mx.array:
        """Token embeddings *without* the embedding norm (the DFlash drafter's input)."""
        return self.model.embed_tokens(ids)

    def lm_head_raw(self, h: mx.array) -> mx.array:
        """The bare output projection: no multiplier, no softcap (transformers' draft logits)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def logits(self, h: mx.array) -> mx.array:
        """lm_head, then `T·tanh(z·m/T)`; computed in fp32."""
        return softcap_logits(self.lm_head_raw(h), self.args.output_multiplier,
                              self.args.final_logit_softcapping or 0.0)

    def __call__(self, inputs, cache=None, *, input_embeddings=None, taps=None, last: int | None = None,
                 tree=None):
        """Run the text tower.

        inputs: token ids [B, L]; input_embeddings: already-normed embeddings [B, L, D] instead of ids.
        taps: layer indices whose residual-stream outputs to return as well (the last layer's is the final-normed
        state, as in transformers' hidden_states); when given the call returns `(logits, [h_tap0, h_tap1, …])`. last: only compute logits for the last `last` positions.
        tree: a token tree's verify (batch 1): (depths [L] int32, ancestors [L, L] bool) of its flattened nodes —
        node i at position cache offset + depths[i], attending to the committed context and to the nodes j with
        ancestors[i, j] (itself included); see `cache.tree_mask`. It runs through the pure-MLX attention path.
        """
        if tree is not None:
            L = inputs.shape[1] if input_embeddings is None else input_embeddings.shape[1]
            B = inputs.shape[0] if input_embeddings is None else input_embeddings.shape[0]
            if B != 1 or tuple(tree[0].shape) != (L,) or tuple(tree[1].shape) != (L, L):
                raise ValueError(f"tree verify: batch 1 with depths [{L}] and ancestors [{L}, {L}], got batch {B}, "
                                 f"depths {tuple(tree[0].shape)}, ancestors {tuple(tree[1].shape)}")
        h, tapped = self.model(inputs, cache, input_embeddings=input_embeddings, taps=taps or (), rope=self.rope,
                               tree=tree)
        if last is not None:
            h = h[:, -last:]
        logits = self.logits(h)
        return logits if taps is None else (logits, tapped)

    def make_cache(self, max_rewind: int = DEFAULT_MAX_REWIND) -> list[KVCache]:
        return make_cache(self.args, max_rewind=max_rewind)

    @property
    def layers(self):
        return self.model.layers

    # -- checkpoint names ---------------------------------------------------------------------------------------
    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
        """Map checkpoint names onto this module tree. Returns (text weights, vision weights)."""
        text, vision = {}, {}
        for k, v in weights.items():
            if k.startswith("model.language_model."):
                text["model." + k[len("model.language_model.") :]] = v
            elif k.startswith("language_model.model."):
                text["model." + k[len("language_model.model.") :]] = v
            elif k.startswith("language_model.lm_head."):
                text["lm_head." + k[len("language_model.lm_head.") :]] = v
            elif k.startswith("model.") and k[len("model.") :].startswith(VISION_PREFIXES):
                vision[k[len("model.") :]] = v
            elif k.startswith(VISION_PREFIXES):
                vision[k] = v
            else:
                text[k] = v
        return text, vision


def expected_vision_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every vision tower / adapter / projection tensor (reference doc §2.2–2.3)."""
    v = dict(config.vision or {})
    Dv = v.get("hidden_size", 1536)
    Iv = v.get("intermediate_size", 8960)
    Lv = v.get("num_hidden_layers", 50)
    P, Tp = v.get("patch_size", 14), v.get("patch_temporal", 2)
    S = v.get("pos_emb_height", 32) * v.get("pos_emb_width", 32)
    raw = config.raw
    out_h = raw.get("out_hidden_size", 6144)
    proj_h = raw.get("projector_hidden_size", 4096)
    D = config.text.hidden_size
    shapes = {
        "vision_tower.patch_embedder.patch_embedding.weight": (Dv, Tp * 3 * P * P),
        "vision_tower.patch_embedder.position_embedding_table.weight": (S, Dv),
        "vision_tower.ln_pre.weight": (Dv,),
        "vision_tower.ln_pre.bias": (Dv,),
        "vision_tower.ln_post.weight": (Dv,),
        "vision_tower.ln_post.bias": (Dv,),
        "vision_adapter.fc1.weight": (proj_h, out_h),
        "vision_adapter.fc2.weight": (proj_h, proj_h),
        "vision_projection.weight": (D, proj_h),
    }
    for i in range(Lv):
        p = f"vision_tower.layers.{i}."
        for n in ("norm1", "norm2"):
            shapes[p + n + ".weight"] = (Dv,)
            shapes[p + n + ".bias"] = (Dv,)
        for n in ("q_proj", "k_proj", "v_proj", "proj"):
            shapes[p + f"attn.{n}.weight"] = (Dv, Dv)
            shapes[p + f"attn.{n}.bias"] = (Dv,)
        shapes[p + "mlp.fc1.weight"] = (Iv, Dv)
        shapes[p + "mlp.fc1.bias"] = (Iv,)
        shapes[p + "mlp.fc2.weight"] = (Dv, Iv)
        shapes[p + "mlp.fc2.bias"] = (Dv,)
    return shapes


def param_count(module: nn.Module) -> int:
    return sum(math.prod(v.shape) for _, v in tree_flatten(module.parameters()))
