"""The DFlash 2 drafter (`DFlash2DraftModel`, the public DFlash 2 head for Muse Glimmer): DFlash v1's parallel block
drafter (`models.assistant`) plus a two-tap dynamic depthwise causal convolution around both sublayers of every
layer and a pairwise candidate path selector (speculative-decoding notes §6).

Per layer, on the block axis (`[anchor, mask × (B−1)]`, taps never crossing the block's start: block row 0 reads
zero padding, row 1 reads the anchor):

    x, d = attention_conv.prepare(input_layernorm(h))      # Conv_0(x)_t = Σ_j (base[0, j] + d_0[t, j]) · x_{t−j}
    h    = h + attention_conv.finish(self_attn(x), d)      # Conv_1(o)_t = Σ_j (base[1, j] + d_1[t, j]) · o_{t−j}
    x, d = mlp_conv.prepare(post_attention_layernorm(h))
    h    = h + mlp_conv.finish(mlp(x), d)

where `d = kernel_projection(normed h)` reshaped to [2 sites (prepare, finish), K taps, D / conv_group_size groups]:
one predicted correction per tap and channel group, shared by the group's `conv_group_size` channels; the base kernel
`base_kernel` [2, K, D] is per channel. Attention is v1's (`DraftAttention`) with the ports' window rule: context
keys seen iff q − k < W, block keys always.

The selector (`CandidateSelector`) walks the block left to right from the anchor: at draft j it keeps the top-k tokens
of the draft logits and scores candidate b after the previous pick a as S_j(a, b) = U_j(b) + ⟨A[a] ⊙ H h_j, B[b]⟩
(unary draft logit + a rank-R bilinear term: predecessor codebook A, projected hidden state H h_j, successor
codebook B); the speculative drafter (`speculative.dflash2`) picks the argmax at T = 0 and samples at T > 0.

Checkpoint layout (z-lab/dflash `tests/fixtures/dflash2-safetensors-header.json`): `fc.weight`, `hidden_norm.weight`,
`norm.weight`, `layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.*, mlp.*}` as v1 and
`layers.{i}.{attention_conv, mlp_conv}.{base_kernel, kernel_projection.weight}`, `candidate_selector.{
hidden_projection.weight, predecessor_codebook, successor_codebook}`. Config: `architectures: ["DFlash2DraftModel"]`
with the DFlash fields under `dflash_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..config import ConfigError
from .assistant import AssistantConfig, AssistantRMSNorm, DraftAttention, DraftRope, batch_forward
from .glimmer import MLP

ARCHITECTURE = "DFlash2DraftModel"
SELECTOR_FIELDS = ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")


def is_dflash2_config(raw: dict) -> bool:
    """A DFlash 2 drafter's config: its architecture, or the selector / convolution fields in `dflash_config`."""
    if ARCHITECTURE in [str(a) for a in (raw.get("architectures") or [])]:
        return True
    dc = raw.get("dflash_config")
    return isinstance(dc, dict) and all(k in dc for k in SELECTOR_FIELDS)


@dataclass
class DFlash2Config(AssistantConfig):
    vocab_size: int = 202048
    conv_group_size: int = 16
    conv_kernel_size: int = 2
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    num_target_layers: int | None = None

    @classmethod
    def from_dict(cls, d: dict, where: str = "config.json") -> "DFlash2Config":
        if not is_dflash2_config(d):
            raise ConfigError(f"{where}: not a DFlash 2 drafter (architectures has no {ARCHITECTURE!r} and "
                              f"dflash_config lacks {', '.join(SELECTOR_FIELDS)})")
        dc = d.get("dflash_config")
        if not isinstance(dc, dict):
            raise ConfigError(f"{where}: dflash_config must be an object with the DFlash fields")
        missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids") + SELECTOR_FIELDS if k not in dc]
        if missing:
            raise ConfigError(f"{where}: dflash_config lacks {', '.join(missing)}")
        if d.get("is_causal") is True:
            raise ConfigError(f"{where}: is_causal true: DFlash 2 block attention is bidirectional")
        flat = {k: v for k, v in d.items() if k != "dflash_config"}
        flat.update(dc)
        for k in ("vocab_size",) + SELECTOR_FIELDS:
            v = flat.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{where}: {k} must be a positive integer, got {v!r}")
        if "rope_theta" not in flat and not (flat.get("rope_parameters") or {}).get("rope_theta"):
            raise ConfigError(f"{where}: no rope_theta (rope_parameters.rope_theta)")
        cfg = cls.from_fields(flat, where)
        if cfg.hidden_size % cfg.conv_group_size:
            raise ConfigError(f"{where}: hidden_size {cfg.hidden_size} is not a multiple of conv_group_size "
                              f"{cfg.conv_group_size}")
        if cfg.selector_top_k > cfg.vocab_size:
            raise ConfigError(f"{where}: selector_top_k {cfg.selector_top_k} > vocab_size {cfg.vocab_size}")
        if cfg.conv_kernel_size > cfg.block_size:
            raise ConfigError(f"{where}: conv_kernel_size {cfg.conv_kernel_size} > block_size {cfg.block_size}")
        return cfg

    def to_dict(self) -> dict:
        """The published layout: model fields at the top, the DFlash fields under `dflash_config`."""
        dflash = {k: getattr(self, k) for k in ("block_size", "mask_token_id", "target_layer_ids",
                                                 "output_multiplier", "final_logit_softcapping") + SELECTOR_FIELDS}
        top = {k: getattr(self, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "rms_norm_eps", "rope_parameters", "max_position_embeddings",
                                              "sliding_window", "layer_types", "hidden_act", "vocab_size",
                                              "num_target_layers")}
        return dict(architectures=[ARCHITECTURE], model_type="qwen3", is_causal=False, attention_bias=False,
                    tie_word_embeddings=False, use_sliding_window=self.sliding_window is not None,
                    dflash_config=dflash, **top)


def grouped_dynamic_conv(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """out[t, c] = Σ_j (base[j, c] + dynamic[t, j, c // group_size]) · x[t − j, c], x[t < 0] = 0.

    x [N, L, D] (L: the block axis), dynamic [N, L, K, G], base [K, D]. Compiled per shape (the taps' shifts are
    shape-dependent slices): one fused kernel instead of ~4 small ones per tap."""
    return _conv(x, dynamic, base, group_size)


def _grouped_dynamic_conv(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    N, L, D = x.shape
    K, G = base.shape[0], D // group_size
    xs = x.reshape(N, L, G, group_size)
    out = None
    for j in range(K):
        v = xs if j == 0 else mx.concatenate([mx.zeros_like(xs[:, :j]), xs[:, : L - j]], axis=1)
        coef = base[j].reshape(1, 1, G, group_size).astype(x.dtype) + dynamic[:, :, j, :, None].astype(x.dtype)
        out = coef * v if out is None else out + coef * v
    return out.reshape(N, L, D)


_conv = mx.compile(_grouped_dynamic_conv)


class GroupedDynamicCausalConv(nn.Module):
    """The convolution of one sublayer: its input side (`prepare`) and its output side (`finish`) share one kernel
    projection, evaluated on the sublayer's (normed) input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [N, L, D] normed sublayer input → (its convolution, the finish side's dynamic kernel [N, L, K, G])."""
        d = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return grouped_dynamic_conv(x, d[:, :, 0], self.base_kernel[0], self.group_size), d[:, :, 1]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_dynamic_conv(y, dynamic, self.base_kernel[1], self.group_size)


class DFlash2Layer(nn.Module):
    def __init__(self, cfg: DFlash2Config, i: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, i, window_rule="strict")
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        K, G = cfg.conv_kernel_size, cfg.conv_group_size
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, K, G)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, K, G)

    def __call__(self, h, ctx, pos, rope, cache, ctx_mask=None):
        x, d = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, ctx, pos, rope, cache, ctx_mask), d)
        x, d = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), d)

    def batch(self, h, ctxs, positions, rope, caches):
        """`__call__` for several rows' blocks, each with its own cache (`DraftAttention.batch`; the convolutions
        never cross a block, so they run on the rows as they are)."""
        x, d = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn.batch(x, ctxs, positions, rope, caches), d)
        x, d = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), d)


class CandidateSelector(nn.Module):
    """Top-k candidates per block position and the pairwise scores of a left-to-right path through them."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        self.predecessor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))

    def candidates(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """logits [..., V] → (the top-k token ids [..., k], their logits: the unary scores [..., k])."""
        cand = mx.stop_gradient(mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k :])
        return cand, mx.take_along_axis(logits, cand, axis=-1)

    def project(self, h: mx.array) -> mx.array:
        """Final hidden states [..., D] → the bilinear term's middle factor [..., R] (fp32)."""
        return self.hidden_projection(h).astype(mx.float32)

    def successors(self, cand: mx.array) -> mx.array:
        """Candidate ids [..., k] → their successor codes [..., k, R] (fp32)."""
        return self.successor_codebook[cand].astype(mx.float32)

    def scores(self, unary: mx.array, hp: mx.array, succ: mx.array, prev: mx.array) -> mx.array:
        """S(a, b) = U(b) + Σ_r A[a, r] · Hh[r] · B[b, r] for the predecessor ids `prev` [...]: unary [..., k],
        hp [..., R], succ [..., k, R] → [..., k] (fp32)."""
        a = self.predecessor_codebook[prev].astype(mx.float32)  # [..., R]
        return unary.astype(mx.float32) + ((a * hp)[..., None, :] * succ).sum(axis=-1)


class DFlash2(nn.Module):
    """`h = drafter(noise_embeds, ctx_taps, pos, cache)` → final-normed hidden states of the block [N, B, D]; the
    same call as v1's `Assistant`, so v1's drafter, training batches and loss drive it unchanged."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = [DFlash2Layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = AssistantRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg)
        self.rope = DraftRope(cfg)

    def encode(self, ctx_taps: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(ctx_taps))

    def batch(self, noise_embeds, ctx_taps: list, positions: list[int], caches: list) -> mx.array:
        return batch_forward(self, noise_embeds, ctx_taps, positions, caches)

    def __call__(self, noise_embeds, ctx_taps, pos: int, cache=None, ctx_mask=None):
        c = self.encode(ctx_taps)
        cache = cache if cache is not None else [None] * len(self.layers)
        h = noise_embeds
        for layer, lc in zip(self.layers, cache):
            h = layer(h, c, pos, self.rope, lc, ctx_mask)
        return self.norm(h)

    def draft_logits(self, raw: mx.array) -> mx.array:
        """The target's raw `lm_head` output on the drafter's hidden states → the draft logits of the checkpoint's
        own `output_multiplier` and `final_logit_softcapping` (fp32): the selector's unary scores."""
        z = raw.astype(mx.float32) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return cap * mx.tanh(z / cap) if cap else z

    def make_cache(self) -> list[KVCache]:
        """Context-only K/V per layer: a sliding layer keeps the W − 1 rows its window (q − k < W) can reach."""
        return [KVCache(window=None if layer.self_attn.window is None else layer.self_attn.reach + 1, max_rewind=0)
                for layer in self.layers]

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """`model.` prefixes dropped; codebooks saved as `….weight` (an `nn.Embedding` port's naming) accepted."""
        out = {}
        for k, v in weights.items():
            k = k[len("model."):] if k.startswith("model.") else k
            for name in ("predecessor_codebook", "successor_codebook"):
                if k == f"candidate_selector.{name}.weight":
                    k = f"candidate_selector.{name}"
            out[k] = v
        return out
