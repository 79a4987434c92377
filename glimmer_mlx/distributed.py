"""Tensor parallelism for the Glimmer target on MLX's distributed backend (`mx.distributed`, launched with
`mlx.launch -n N --backend ring|jaccl|mpi`).

Sharding (`shard_model`, Megatron-style, MLX's own sharded layers): per decoder layer the attention's q/k/v and its
output gate are column-split by heads (`nn.AllToShardedLinear`), `o_proj` row-split (`nn.ShardedToAllLinear`, one
`all_sum`); the MLP's gate/up column-split, `down_proj` row-split (one `all_sum`). Each rank keeps
`num_attention_heads / N` query heads and `num_key_value_heads / N` KV heads — head h of rank r is global head
r·H/N + h, so a GQA group never straddles ranks — and its KV caches hold only those heads. With more ranks than KV
heads (N a multiple of Hkv, H divisible by N) the KV heads are replicated, as vLLM does: rank r holds the K/V
projection rows of the one KV head its query heads use (global KV head r // (N/Hkv)), and its caches hold that head
(`kv_heads_per_rank`). Everything that acts on
the residual stream (the sandwich norms, the per-head weightless q/k norms, RoPE, the final norm) is replicated and
runs on full hidden states, so every tap a drafter asks for is the full hidden state on every rank. Affine-quantized
layers are sharded the same way (`nn.QuantizedAllToShardedLinear` / `nn.QuantizedShardedToAllLinear`).

The vocabulary is split too (`VocabShardedEmbedding`, `VocabShardedHead`): rank r holds rows [r·V/N, (r+1)·V/N) of the
embedding table and the lm_head; a lookup is a masked local lookup + `all_sum` (exact: one non-zero term per row), the
logits are the local slice + `all_gather`. Why split rather than replicate lm_head: it is 202 048 × 6656 in Glimmer
(2.7 GB in bf16 per copy, twice that with the untied embedding), and — the reason that decides it — the gathered
logits are bitwise identical on every rank *by construction* (each slice is computed on exactly one rank and copied),
whatever the ranks' kernels do differently. Every token decision (sampling, greedy argmax, speculative acceptance,
the drafters' own drafts, which also go through the target's logits) is a function of gathered logits, the sampler's
key chain (same seed on every rank: `agree_seed`) and earlier decisions, so by induction all ranks decide the same
tokens and issue the same collectives in the same order: lockstep without a per-round broadcast. The drafters
(DFlash, MTP) are replicated: they are small, and a broadcast of rank 0's drafts would add a round trip per round.
`LockstepGuard` still checks it (a tiny `all_gather` of the committed tokens' hash every few chunks). `auto` chooses
rounds by wall-clock timings measured per rank, so it is refused (`check_mode`).

Pipeline parallelism (`pipeline_model`, `--distributed pp`): rank r keeps only a contiguous stage of layers
(`stage_of`), the others are weightless `RemoteLayer`s whose caches only count positions; after each stage's last
layer and after every layer a drafter taps (`expose_taps`), a `StageBoundary` hands the owner's residual stream to
every rank (an all_sum of the owner's value and zeros: exact; N = 2 moves the same bytes as a send/recv pair, and the
last stage's output must reach every rank anyway). The vocabulary is split as above. Stages run one after another,
or, with `microbatch` > 1, a forward's rows run as a wavefront of micro-batches (`PipelinedTextModel`: stage s + 1
works on micro-batch m − 1 while stage s works on m; the same output). Every collective stays on one dependency
chain on every rank (the micro-batched forward evaluates its hand-overs one by one in a fixed order), so all ranks
run them in the same order. Another stage's layers keep `PositionCache` books (no rows; the offset and a sliding
window's compaction point as a real cache would move them), so rewinds and token trees' `keep_path` compactions are
checked alike on every rank.

Resident sessions (`glimmer chat|serve|agent --distributed`): `follower.py` (rank 0 leads, the others follow).

Loading (`load_sharded`): the model is built lazily (`loading.load_model(lazy=True)`: every check, no data read), then
each sharded parameter is read from its safetensors shard as only this rank's slice (a memory-mapped file, the slice
copied out), so a rank's peak memory is about its share of the weights plus the replicated norms.

Failures: `init_group` (no backend, world size 1), `check_same` (ranks disagree on the model or the options:
fingerprints compared with an `all_gather`), `DistributedError` when a peer is lost mid-generation (the ring backend
raises at once when a peer's sockets close), and `Watchdog` bounds the wait when a peer hangs instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .cache import DEFAULT_MAX_REWIND, KVCache
from .loading import CheckpointError, load_model, parse_dtype, read_safetensors_header, resolve_path, weight_files
from .models.glimmer import Model, TextModel
from .tokenizer import TokenizerError, load_tokenizer

STRATEGIES = ("tp", "pp")
LOCKSTEP_EVERY = 16  # chunks between two lockstep checks (and one at the end)
DEFAULT_TIMEOUT = 600.0  # seconds without progress before a rank gives up (a peer hung): loading + a long prefill


class DistributedError(RuntimeError):
    """A distributed run that cannot start or continue; the message is one line naming the rank and the cause."""


def _empty_hostfile(value: str | None) -> bool:
    """Whether MLX_HOSTFILE (a path, as `mlx.launch` writes it, or the JSON itself) lists no hosts: what
    `mlx.launch -n 1` / a single host sets up."""
    if value is None:
        return False
    if value.strip() and Path(value).is_file():
        value = Path(value).read_text()
    return not value.strip()


def init_group(backend: str = "any") -> mx.distributed.Group:
    """The world group; DistributedError without a backend or with a single process."""
    if not mx.distributed.is_available():
        raise DistributedError("--distributed: this MLX build has no distributed backend (mx.distributed is "
                               "unavailable)")
    if os.environ.get("MLX_RANK") is not None and _empty_hostfile(os.environ.get("MLX_HOSTFILE")):
        raise DistributedError("--distributed: world size 1 (mlx.launch started a single process); launch with "
                               "`mlx.launch -n 2 --backend ring -- glimmer …` (or --hosts h1,h2)")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as e:
        raise DistributedError(f"--distributed: no distributed backend could be initialised ({e}); launch with "
                               f"`mlx.launch -n 2 --backend ring -- glimmer …`") from None
    if group.size() == 1:
        raise DistributedError("--distributed: world size 1; launch with `mlx.launch -n 2 --backend ring -- "
                               "glimmer …` (or --hosts h1,h2)")
    return group


# -- sharding ------------------------------------------------------------------------------------------------------

def kv_heads_per_rank(num_attention_heads: int, num_key_value_heads: int, n: int) -> tuple[int, int]:
    """(KV heads each rank holds, ranks sharing each KV head) for tensor parallelism over `n` ranks: split when
    `num_key_value_heads` divides by `n`; replicated (one KV head per rank, each held by n / num_key_value_heads
    ranks, vLLM's scheme) when `n` is a multiple of it and the query heads still split evenly. ValueError otherwise."""
    if num_key_value_heads % n == 0:
        return num_key_value_heads // n, 1
    if n % num_key_value_heads == 0 and num_attention_heads % n == 0:
        return 1, n // num_key_value_heads
    raise ValueError(f"num_key_value_heads {num_key_value_heads} is not divisible by {n}, and {n} ranks cannot "
                     f"replicate them (KV-head replication needs the ranks to be a multiple of num_key_value_heads "
                     f"and num_attention_heads to divide by the ranks)")


def shard_problems(c, n: int, quantization: dict | None = None) -> list[str]:
    """What keeps a text config `c` (TextConfig or anything with its fields) from splitting over `n` ranks."""
    problems = []
    for name, v in (("num_attention_heads", c.num_attention_heads), ("intermediate_size", c.intermediate_size),
                    ("vocab_size", c.vocab_size)):
        if v % n:
            problems.append(f"{name} {v} is not divisible by {n}")
    if c.num_attention_heads % n == 0:  # (otherwise the query heads' line says it)
        try:
            kv_heads_per_rank(c.num_attention_heads, c.num_key_value_heads, n)
        except ValueError as e:
            problems.append(str(e))
    if quantization is not None:
        gs = quantization.get("group_size", 64)
        for name, v in (("num_attention_heads·head_dim", c.num_attention_heads * c.head_dim),
                        ("intermediate_size", c.intermediate_size)):
            if v % n == 0 and (v // n) % gs:
                problems.append(f"{name} / {n} = {v // n} (a row-split layer's input) is not a multiple of the "
                                f"quantization group size {gs}")
    return problems


def check_shardable(model: Model, n: int) -> None:
    """ValueError naming the dimension that cannot be split evenly over `n` ranks (KV heads fewer than the ranks are
    replicated when they can be: `kv_heads_per_rank`)."""
    problems = shard_problems(model.args, n, model.config.quantization)
    if problems:
        raise ValueError(f"tensor parallelism over {n} ranks: " + "; ".join(problems))


class InMemorySlices:
    """Slices of a model's own (loaded or lazy) parameters."""

    def __init__(self, model: nn.Module):
        self.params = dict(tree_flatten(model.parameters()))

    def take(self, name: str, axis: int, rank: int, n: int) -> mx.array:
        w = self.params[name]
        size = w.shape[axis] // n
        idx = [slice(None)] * w.ndim
        idx[axis] = slice(rank * size, (rank + 1) * size)
        return mx.contiguous(w[tuple(idx)])


_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "I32": np.int32, "U8": np.uint8,
       "I8": np.int8, "U16": np.uint16, "I16": np.int16, "I64": np.int64, "U64": np.uint64, "F64": np.float64}


class FileSlices:
    """Slices read straight from a checkpoint's safetensors shards (memory-mapped; only the slice is copied out), cast
    as `loading.load_model` casts (floating tensors to `dtype` when given)."""

    def __init__(self, path: Path, dtype=None):
        self.dtype = parse_dtype(dtype)
        self.where: dict[str, tuple[Path, int, str, tuple]] = {}  # checkpoint name -> (file, data offset, dtype, shape)
        for f in weight_files(path):
            header = read_safetensors_header(f)
            with open(f, "rb") as fh:
                start = 8 + struct.unpack("<Q", fh.read(8))[0]
            for k, info in header.items():
                self.where[k] = (f, start + info["data_offsets"][0], info["dtype"], tuple(info["shape"]))
        text, _ = Model.sanitize({k: k for k in self.where})
        self.names = text  # model parameter name -> checkpoint name

    def take(self, name: str, axis: int, rank: int, n: int) -> mx.array:
        ck = self.names.get(name)
        if ck is None:
            raise CheckpointError(f"sharded load: parameter {name!r} has no tensor in the checkpoint")
        f, offset, st, shape = self.where[ck]
        if st not in _NP:
            raise CheckpointError(f"{f}: tensor '{ck}' has dtype {st}, which sharded loading cannot slice")
        mm = np.memmap(f, dtype=_NP[st], mode="r", offset=offset, shape=shape)
        axis = axis % len(shape)
        size = shape[axis] // n
        idx = [slice(None)] * len(shape)
        idx[axis] = slice(rank * size, (rank + 1) * size)
        a = mx.array(np.ascontiguousarray(mm[tuple(idx)]))
        del mm
        if st == "BF16":
            a = a.view(mx.bfloat16)
        if self.dtype is not None and mx.issubdtype(a.dtype, mx.floating):
            a = a.astype(self.dtype)
        mx.eval(a)
        return a


def _is_quantized(m) -> bool:
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def _linear_params(m) -> list[str]:
    return [k for k in ("weight", "scales", "biases", "bias") if k in m]


def shard_linear(m: nn.Module, path: str, how: str, src, group, part: tuple[int, int] | None = None) -> nn.Module:
    """`m` (Linear or QuantizedLinear at `path`) as MLX's sharded layer holding this rank's slice: `how` is
    "all-to-sharded" (output rows split) or "sharded-to-all" (input columns split, an all_sum after). `part`
    (all-to-sharded only): (index, count) — hold output slice `index` of `count` instead of slice rank of N (a
    replicated KV head: several ranks hold the same slice)."""
    r, n = group.rank(), group.size()
    part = part or (r, n)
    quant = _is_quantized(m)
    out_dims = m.weight.shape[0]
    in_dims = m.weight.shape[1] * 32 // m.bits if quant else m.weight.shape[1]
    bias = "bias" in m
    if how == "all-to-sharded":
        cls = nn.QuantizedAllToShardedLinear if quant else nn.AllToShardedLinear
    else:
        cls = nn.QuantizedShardedToAllLinear if quant else nn.ShardedToAllLinear
    kw = {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")} if quant else {}
    if how == "all-to-sharded":
        out_dims = out_dims // part[1] * n  # MLX's layer holds out_dims / N rows: make that the part's rows
    sl = cls(in_dims, out_dims, bias, group=group, **kw)
    new = {}
    for k in _linear_params(m):
        if how == "all-to-sharded":
            new[k] = src.take(f"{path}.{k}", 0, *part)
        elif k == "bias":
            new[k] = src.take(f"{path}.{k}", 0, 0, 1)  # added after the all_sum: the full bias on every rank
        else:
            new[k] = src.take(f"{path}.{k}", -1, r, n)
    if quant and "biases" not in new:
        sl.biases = None
    sl.update(new)
    return sl


def gather_last(z: mx.array, group) -> mx.array:
    """Concatenate every rank's `z` along its last axis (rank order); one all_gather."""
    n, shape = group.size(), z.shape
    g = mx.distributed.all_gather(z.reshape(-1, shape[-1]), group=group)  # [n·M, Vr], rank-major
    return g.reshape(n, -1, shape[-1]).transpose(1, 0, 2).reshape(*shape[:-1], n * shape[-1])


class VocabShardedEmbedding(nn.Module):
    """Rows [start, start + rows) of an embedding table (float or affine-quantized). `__call__` is the full lookup
    (local rows, zeros elsewhere, all_sum); `as_linear` the full logits (local slice, all_gather)."""

    def __init__(self, weight, start: int, vocab: int, group, *, scales=None, biases=None, group_size=None,
                 bits=None, mode="affine"):
        super().__init__()
        self.weight = weight
        if scales is not None:
            self.scales = scales
            if biases is not None:
                self.biases = biases
        self.start, self.rows, self.vocab = start, weight.shape[0], vocab
        self.quant = None if scales is None else (group_size, bits, mode)
        self.group = group
        self.freeze()

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        local = mx.where(inside, local, 0)
        if self.quant is None:
            e = self.weight[local]
        else:
            gs, bits, mode = self.quant
            b = self.get("biases")
            e = mx.dequantize(self.weight[local], scales=self.scales[local],
                              biases=b[local] if b is not None else None, group_size=gs, bits=bits, mode=mode)
        e = mx.where(inside[..., None], e, mx.zeros((), e.dtype))
        return mx.distributed.all_sum(e, group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        if self.quant is None:
            z = x @ self.weight.T
        else:
            gs, bits, mode = self.quant
            z = mx.quantized_matmul(x, self.weight, scales=self.scales, biases=self.get("biases"), transpose=True,
                                    group_size=gs, bits=bits, mode=mode)
        return gather_last(z, self.group)


class VocabShardedHead(nn.Module):
    """An untied lm_head split by vocabulary rows (MLX's column-parallel layer) with the logits gathered."""

    def __init__(self, shard: nn.Module, group):
        super().__init__()
        self.shard = shard
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return gather_last(self.shard(x), self.group)


def shard_embedding(m: nn.Module, src, group, vocab: int) -> VocabShardedEmbedding:
    r, n = group.rank(), group.size()
    w = src.take("model.embed_tokens.weight", 0, r, n)
    if not _is_quantized(m):
        return VocabShardedEmbedding(w, r * (vocab // n), vocab, group)
    biases = src.take("model.embed_tokens.biases", 0, r, n) if "biases" in m else None
    scales = src.take("model.embed_tokens.scales", 0, r, n)
    return VocabShardedEmbedding(w, r * (vocab // n), vocab, group, scales=scales, biases=biases,
                                 group_size=m.group_size, bits=m.bits, mode=getattr(m, "mode", "affine"))


def shard_model(model: Model, group, src=None) -> Model:
    """Tensor-parallel `model` in place over `group` (see the module docstring); `src`: where the slices come from
    (`FileSlices` for a sharded load; default: the model's own parameters). Returns the model."""
    n, r = group.size(), group.rank()
    check_shardable(model, n)
    c = model.args
    kv_local, share = kv_heads_per_rank(c.num_attention_heads, c.num_key_value_heads, n)
    # split: slice r of N; replicated: the one KV head rank r's query heads use (query heads [r·H/N, (r+1)·H/N) all
    # belong to GQA group r // share, since H/N divides the group size H/Hkv)
    kv_part = (r, n) if share == 1 else (r // share, c.num_key_value_heads)
    src = src if src is not None else InMemorySlices(model)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        a = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj"):
            setattr(a, name, shard_linear(getattr(a, name), f"{p}.self_attn.{name}", "all-to-sharded", src, group,
                                          kv_part if name in ("k_proj", "v_proj") else None))
        a.o_proj = shard_linear(a.o_proj, f"{p}.self_attn.o_proj", "sharded-to-all", src, group)
        a.n_heads //= n
        a.n_kv = kv_local
        mlp = layer.mlp
        mlp.gate_proj = shard_linear(mlp.gate_proj, f"{p}.mlp.gate_proj", "all-to-sharded", src, group)
        mlp.up_proj = shard_linear(mlp.up_proj, f"{p}.mlp.up_proj", "all-to-sharded", src, group)
        mlp.down_proj = shard_linear(mlp.down_proj, f"{p}.mlp.down_proj", "sharded-to-all", src, group)
    model.model.embed_tokens = shard_embedding(model.model.embed_tokens, src, group, model.args.vocab_size)
    if not model.args.tie_word_embeddings:
        model.lm_head = VocabShardedHead(shard_linear(model.lm_head, "lm_head", "all-to-sharded", src, group), group)
    model.tp_group = group
    return model


# -- pipeline parallelism ------------------------------------------------------------------------------------------

class RemoteLayer(nn.Module):
    """A decoder layer another stage computes: no weights; its cache (a `PositionCache`) only counts positions (so
    `cache[0].offset`, the engine's position, stays right on every rank, and rewinds work unchanged)."""

    def __call__(self, x, rope, cache=None, tree=None):
        if cache is not None:
            if isinstance(cache, PositionCache):
                cache.advance(x.shape[1])
            else:
                cache.offset += x.shape[1]
        return x


class PositionCache(KVCache):
    """The cache of a layer another stage computes: no rows, but the bookkeeping a `KVCache` of the same window
    would do (the offset; for a sliding window, where compaction moves the buffer's start), so that every rank's
    rewind and keep-path checks answer alike whichever layers it holds — a rank whose check alone failed would start
    a conversation over while the others continue. A token tree's accepted path (`keep_rows`) only moves the offset."""

    def __init__(self, window=None, max_rewind: int = DEFAULT_MAX_REWIND, first_position: int = 0):
        super().__init__(window, max_rewind, first_position)
        self.capacity = 0  # rows the real cache's buffer would hold

    def advance(self, L: int) -> None:
        """As `KVCache.append` of L rows would move offset, start and the buffer's capacity."""
        n = self.rows
        if n + L > self.capacity:
            keep = n if self.retained is None else min(n, self.retained)
            if keep + L > self.capacity:
                self.capacity = ((keep + L + self.step - 1) // self.step) * self.step
            self.start += n - keep
        self.offset += L

    def append(self, k, v) -> None:
        self.advance(k.shape[2])

    def keep_rows(self, offset: int, kept_rows: list[int]) -> None:
        self.check_keep(offset, kept_rows)
        self.offset = offset + len(kept_rows)


def position_caches(model: Model) -> None:
    """Make `model.make_cache` give its `RemoteLayer`s `PositionCache`s (the other layers' caches unchanged)."""
    base = type(model).make_cache

    def make_cache(max_rewind: int = DEFAULT_MAX_REWIND):
        caches = base(model, max_rewind=max_rewind)
        remote = [isinstance(getattr(layer, "layer", layer), RemoteLayer) for layer in model.model.layers]
        return [PositionCache(c.window, c.max_rewind, c.origin) if r else c for c, r in zip(caches, remote)]

    model.make_cache = make_cache


class StageBoundary(nn.Module):
    """After `layer` (this rank's, or a `RemoteLayer`), the owner's output on every rank: an `all_sum` of the owner's
    value and zeros elsewhere (exact). Placed after each stage's last layer and after every tapped layer."""

    def __init__(self, layer: nn.Module, owner: int, group):
        super().__init__()
        self.layer, self.owner, self.group = layer, owner, group

    def __call__(self, x, rope, cache=None, tree=None):
        y = self.layer(x, rope, cache) if tree is None else self.layer(x, rope, cache, tree)
        if self.group.rank() != self.owner:
            # zeros that still depend on y: every collective stays on one dependency chain, so all ranks run them in
            # the same order (zeros_like would cut the earlier collectives off this rank's graph)
            y = mx.where(mx.array(False), y, mx.zeros((), y.dtype))
        return mx.distributed.all_sum(y, group=self.group)


def stage_of(layer: int, n_layers: int, n: int) -> int:
    """The stage (rank) computing `layer`: contiguous, as even as possible (the first stages take the remainder)."""
    bounds = [round(i * n_layers / n) for i in range(n + 1)]
    return next(s for s in range(n) if bounds[s] <= layer < bounds[s + 1])


def pipeline_model(model: Model, group, src=None, taps=(), microbatch: int = 1) -> Model:
    """Pipeline-parallel `model` in place: rank r keeps only its stage's layers (`stage_of`); the others become
    `RemoteLayer`s; the residual stream passes stage to stage through a `StageBoundary` after each stage's last layer
    and after every layer in `taps` (a drafter's taps must be the full hidden state on every rank: `expose_taps`).
    The embedding table and lm_head are vocab-split across the ranks as in `shard_model`, logits gathered.
    microbatch: forwards of several rows run as up to this many micro-batches (`PipelinedTextModel`; 1: unsplit)."""
    n, r = group.size(), group.rank()
    if not isinstance(microbatch, int) or isinstance(microbatch, bool) or not 1 <= microbatch <= 64:
        raise ValueError(f"--pp-microbatch must be an integer in [1, 64], got {microbatch!r}")
    L = len(model.model.layers)
    if L < n:
        raise ValueError(f"pipeline parallelism over {n} ranks: the model has only {L} layers")
    if model.args.vocab_size % n:
        raise ValueError(f"pipeline parallelism over {n} ranks: vocab_size {model.args.vocab_size} is not divisible "
                         f"by {n}")
    src = src if src is not None else InMemorySlices(model)
    layers = []
    for i, layer in enumerate(model.model.layers):
        if stage_of(i, L, n) == r:
            p = f"model.layers.{i}"
            names = [k for k, _ in tree_flatten(layer.parameters())]
            layer.update(_unflatten({k: src.take(f"{p}.{k}", 0, 0, 1) for k in names}))
            layers.append(layer)
        else:
            layers.append(RemoteLayer())
    model.model.layers = layers
    model.pp_group = group
    model.model.__class__ = PipelinedTextModel
    model.model.pp_group, model.model.microbatch = group, microbatch
    position_caches(model)
    expose_taps(model, taps)
    model.model.embed_tokens = shard_embedding(model.model.embed_tokens, src, group, model.args.vocab_size)
    if not model.args.tie_word_embeddings:
        model.lm_head = VocabShardedHead(shard_linear(model.lm_head, "lm_head", "all-to-sharded", src, group), group)
    return model


def microbatch_sizes(L: int, m: int) -> list[int]:
    """`L` rows in min(m, L) consecutive micro-batches, as even as possible (the first ones take the remainder)."""
    m = max(1, min(m, L))
    return [L // m + (i < L % m) for i in range(m)]


class PipelinedTextModel(TextModel):
    """A pipelined text tower whose forwards of several rows run as micro-batches (`pipeline_model(microbatch=M)`):
    the L rows of a verify block (or a prefill chunk) are split into M consecutive micro-batches and scheduled as a
    wavefront, stage s working on micro-batch t − s at tick t. Each tick, every rank first computes its own stage's
    layers for its micro-batch (evaluated), then all ranks hand over that tick's boundaries in one fixed order
    (stage 0's first), so stage s + 1 works on micro-batch m − 1 while stage s works on m.

    Why it is the unsplit forward: micro-batch m reaches layer i after micro-batch m − 1 went through it, so layer
    i's cache then holds the committed context and every earlier row's K/V, and the causal mask of m's rows (from
    the cache's offset) sees exactly the keys the unsplit block's mask gives those rows; RoPE positions come from the
    same offsets. Only the floating-point grouping of the matrix products differs (fewer rows per product), as between
    a verify block and plain decoding. Token trees run unsplit (a tree's later nodes see only their ancestors among
    the earlier ones, not every earlier row)."""

    microbatch = 1

    def __call__(self, inputs, cache=None, *, input_embeddings=None, taps=(), rope=None, tree=None):
        h = self.embed(inputs) if input_embeddings is None else input_embeddings
        L = h.shape[1]
        if self.microbatch <= 1 or tree is not None or cache is None or L < 2:
            return super().__call__(inputs, cache, input_embeddings=h, taps=taps, rope=rope, tree=tree)
        mx.eval(h)  # the embedding's all_sum first on every rank (the hand-overs below are evaluated one by one)
        group = self.pp_group
        r, n = group.rank(), group.size()
        segments, start = [], 0  # runs of layers ending at a stage boundary: (first, last, owner stage)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, StageBoundary):
                segments.append((start, i, layer.owner))
                start = i + 1
        sizes = microbatch_sizes(L, self.microbatch)
        bounds = np.cumsum([0] + sizes).tolist()
        x = [h[:, bounds[m]:bounds[m + 1]] for m in range(len(sizes))]  # each micro-batch's current hidden state
        out = {}  # (layer index, micro-batch) -> a boundary's output (the taps)
        for t in range(len(sizes) + n - 1):
            ticks = [(k, t - seg[2]) for k, seg in enumerate(segments) if 0 <= t - seg[2] < len(sizes)]
            ticks.sort(key=lambda e: segments[e[0]][2])  # by stage, then by segment within the stage
            y = {}
            for k, m in ticks:  # this rank's compute first (a stage's segments of one micro-batch run in order)
                first, last, owner = segments[k]
                if owner != r:
                    for i in range(first, last + 1):
                        c = cache[i]
                        c.advance(sizes[m]) if isinstance(c, PositionCache) else setattr(c, "offset",
                                                                                          c.offset + sizes[m])
                    continue
                v = x[m]
                for i in range(first, last + 1):
                    layer = self.layers[i]
                    v = (layer.layer if isinstance(layer, StageBoundary) else layer)(v, rope, cache[i])
                if any(e[1] == m and e[0] > k and segments[e[0]][2] == r for e in ticks):
                    x[m] = v  # the next segment of this stage (a tap inside it) runs after this boundary
                y[k, m] = v
            if y:
                mx.eval(list(y.values()))
            for k, m in ticks:  # the hand-overs, in the same order on every rank
                first, last, owner = segments[k]
                mine = y.get((k, m))
                v = mine if mine is not None else mx.zeros(x[m].shape, x[m].dtype)
                x[m] = mx.distributed.all_sum(v, group=group)
                mx.eval(x[m])
                out[last, m] = x[m]
        last = len(self.layers) - 1
        hs = self.norm(mx.concatenate(x, axis=1))
        tapped = [hs if i == last else mx.concatenate([out[i, m] for m in range(len(sizes))], axis=1) for i in taps]
        return hs, tapped


def _unflatten(flat: dict) -> dict:
    from mlx.utils import tree_unflatten
    return tree_unflatten(list(flat.items()))


def expose_taps(model: Model, taps=()) -> None:
    """Make the layers in `taps` (and every stage's last layer) stage boundaries of a pipelined `model` (a no-op for
    a tensor-parallel one: its residual stream is full on every rank after each layer)."""
    group = getattr(model, "pp_group", None)
    if group is None:
        return
    L = len(model.model.layers)
    n = group.size()
    want = {i for i in range(L) if i == L - 1 or stage_of(i, L, n) != stage_of(i + 1, L, n)}
    want |= {int(t) for t in taps}
    for i, layer in enumerate(model.model.layers):
        inner = layer.layer if isinstance(layer, StageBoundary) else layer
        model.model.layers[i] = StageBoundary(inner, stage_of(i, L, n), group) if i in want else inner


def load_sharded(path_or_repo, group, dtype=None, strategy: str = "tp", microbatch: int = 1):
    """(model, tokenizer) with this rank's part of the target only (its slices for "tp", its stage's layers for "pp"):
    lazy build and checks, the part read from the shards, the replicated rest evaluated. The MTP weights stay lazy
    (the drafter loads them whole). microbatch: "pp" only (`pipeline_model`)."""
    path = resolve_path(path_or_repo)
    model = load_model(path, dtype, lazy=True)
    if microbatch != 1 and strategy != "pp":
        raise ValueError("--pp-microbatch needs --distributed pp (tensor parallelism has no stages to overlap)")
    if strategy == "pp":
        pipeline_model(model, group, FileSlices(path, dtype), microbatch=microbatch)
    else:
        check_shardable(model, group.size())
        shard_model(model, group, FileSlices(path, dtype))
    mx.eval(model.parameters())
    try:
        tokenizer = load_tokenizer(path, model.config)
    except (TokenizerError, OSError, ValueError) as e:
        raise CheckpointError(str(e)) from None
    return model, tokenizer


def local_weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


# -- agreement between ranks ---------------------------------------------------------------------------------------

def checkpoint_fingerprint(path_or_repo) -> str:
    """sha256 of config.json, every weight file's name, size and safetensors header, and its first 64 KiB of data."""
    path = resolve_path(path_or_repo)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in weight_files(path):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(f.name.encode() + str(f.stat().st_size).encode() + fh.read(n) + fh.read(65536))
    return h.hexdigest()


def _digest_ints(text: str) -> mx.array:
    d = hashlib.sha256(text.encode()).digest()[:16]
    return mx.array(np.frombuffer(d, dtype=np.int32).copy())


def check_same(group, **values) -> None:
    """DistributedError unless every rank passes the same `values` (each compared by a hash, one all_gather)."""
    names = sorted(values)
    mine = mx.stack([_digest_ints(json.dumps(values[k], sort_keys=True, default=str)) for k in names])
    every = np.array(mx.distributed.all_gather(mine[None], group=group))  # [N, len(names), 4]
    for i, k in enumerate(names):
        differ = [r for r in range(every.shape[0]) if not np.array_equal(every[r, i], every[0, i])]
        if differ:
            raise DistributedError(f"--distributed: ranks disagree on the {k}: rank(s) {differ} differ from rank 0 "
                                   f"(this is rank {group.rank()}); give every rank the same {k}")


def broadcast_ints(values: list[int] | None, group) -> list[int]:
    """Rank 0's list of non-negative ints on every rank (others pass anything, e.g. None)."""
    mine = values if group.rank() == 0 else []
    n = int(mx.distributed.all_sum(mx.array(len(mine), dtype=mx.int32), group=group).item())
    buf = mx.array(mine, dtype=mx.int32) if group.rank() == 0 else mx.zeros((n,), dtype=mx.int32)
    return [int(x) for x in np.array(mx.distributed.all_sum(buf, group=group))] if n else []


def agree_seed(seed: int | None, group) -> int:
    """Rank 0's seed (its own random one when None) on every rank: seeded sampling must draw the same keys."""
    if seed is None and group.rank() == 0:
        seed = int.from_bytes(os.urandom(3), "little")
    return broadcast_ints([seed] if group.rank() == 0 else None, group)[0]


def start(strategy: str, backend: str = "any") -> mx.distributed.Group:
    """The group for `--distributed STRATEGY` (DistributedError: unknown or unimplemented strategy, no backend, a
    single process)."""
    if strategy not in STRATEGIES:
        raise DistributedError(f"--distributed: unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    return init_group(backend)


def load_agreed(path_or_repo, group, dtype=None, strategy: str = "tp", microbatch: int = 1, **options):
    """`load_sharded` after checking that every rank names the same checkpoint (`checkpoint_fingerprint`) and passes
    the same `options` (a rank that cannot read its checkpoint disagrees, so every rank fails with the same line)."""
    try:
        fp, problem = checkpoint_fingerprint(path_or_repo), None
    except (CheckpointError, OSError) as e:
        fp, problem = f"unreadable: {e}", e
    check_same(group, model=fp, options=dict(options, strategy=strategy, microbatch=microbatch))
    if problem is not None:
        raise CheckpointError(str(problem))
    return load_sharded(path_or_repo, group, dtype, strategy, microbatch)


def check_mode(mode: str, width) -> None:
    """ValueError for decoding that is not lockstep-safe across ranks (wall-clock choices)."""
    if mode == "auto" or width == "auto":
        raise ValueError("--distributed: 'auto' chooses rounds from wall-clock timings measured on each rank, which "
                         "differ between ranks; give --mode ar|dflash|mtp|ngram and an integer --block-size")


# -- bounded waits and lockstep ------------------------------------------------------------------------------------

class Watchdog:
    """Exits the process with one error line when `beat` is not called for `timeout` seconds (a peer that hangs
    leaves this rank blocked inside a collective, where no exception can reach it)."""

    def __init__(self, timeout: float, rank: int, what: str = "progress"):
        self.timeout, self.rank, self.what = timeout, rank, what
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                sys.stderr.write(f"error: rank {self.rank}: no {self.what} for {idle:.0f} s (another rank died or "
                                 f"hung); exiting\n")
                sys.stderr.flush()
                os._exit(3)


class LockstepGuard:
    """Counts and hashes the committed tokens; `check` compares them across ranks (one small all_gather)."""

    def __init__(self, group):
        self.group, self.count, self.hash = group, 0, 0

    def add(self, tokens) -> None:
        for t in tokens:
            self.hash = (self.hash * 1000003 + int(t) + 1) % 2147483647
            self.count += 1

    def check(self) -> None:
        every = np.array(mx.distributed.all_gather(mx.array([[self.count, self.hash]], dtype=mx.int32),
                                                   group=self.group))
        if not (every == every[0]).all():
            raise DistributedError(f"rank {self.group.rank()}: ranks diverged (committed tokens per rank: "
                                   f"{every[:, 0].tolist()}, hashes differ); stopping")


def lockstep(chunks, group, *, timeout: float = DEFAULT_TIMEOUT, every: int = LOCKSTEP_EVERY):
    """Pass a token stream's chunks (objects with `.tokens`) through, checking lockstep every `every` chunks and at the
    end, with a `Watchdog` over the whole stream; a lost peer becomes a one-line DistributedError."""
    guard, dog = LockstepGuard(group), Watchdog(timeout, group.rank(), "progress from the other ranks")
    try:
        for i, chunk in enumerate(chunks):
            dog.beat()
            guard.add(getattr(chunk, "tokens", ()) or ())
            if (i + 1) % every == 0:
                guard.check()
            yield chunk
        dog.beat()
        guard.check()
    except RuntimeError as e:
        if isinstance(e, DistributedError) or "[ring]" not in str(e) and "[mpi]" not in str(e) \
                and "[jaccl]" not in str(e):
            raise
        raise DistributedError(f"rank {group.rank()}: lost contact with another rank mid-generation ({e})") from None
    finally:
        dog.stop()
