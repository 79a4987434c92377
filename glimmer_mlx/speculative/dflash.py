"""The DFlash drafter: a block-diffusion assistant that drafts a whole block in one forward from the target's taps;
loading it next to its target and checking that the two fit.

Trees (`propose_tree`, EAGLE-2 style dynamic trees, Li et al. 2024): the block's one forward gives a distribution
at every position pos+1..pos+k. The tree is the chain (exactly the drafts `propose` would give, drawn the same way)
plus, within the node budget, the best other nodes by cumulative draft probability: a node's score is the product
of the draft probabilities along its path, and nodes are added best first from the frontier of the kept tree
(`grow_tree`), so every kept node's parent is kept and a path is never deeper than the chain.

The approximation: a block's position j is conditioned on the anchor and the context only, not on the tokens at
positions before j (block diffusion drafts them in parallel), so a node's children are the top candidates of the
next position whatever the node's token is — an alternative at depth d is followed by the same depth d+1
candidates as the chain's node — and a path's score treats the positions as independent. That only shapes the tree
(how good a guess it is); whether anything is accepted is decided by `verify`, so output stays exactly the target's
whatever the tree holds: greedy accepts only paths equal to the target's argmax, and sampling is lossless for any
tree whose q rows say how each node's token was drawn.

Sampling (T > 0): the chain's nodes are sampled from their positions' processed q rows as in `propose` (their q
rows go to `verify.verify_tree_sampling`); every other node is a deterministic candidate (the next likeliest
tokens, chosen from the drafter's distributions without randomness given the chain), i.e. a point mass (q None).
The chain's node is always its parent's first child, so when it is tried it is distributed as q given everything
tried before it; each alternative is a fixed token given the siblings before it and is accepted with exactly its
target (residual) probability. Later chain draws that shape which alternatives exist are independent of the
verifier's uniforms, and a point-mass candidate is exact for any fixed candidate list, so the walk stays lossless.
(Point masses would be exact for the chain's nodes too — they are drawn independently of the verifier's uniforms —
but their q rows accept more: min(p, q) >= p·q token by token.)
Sampling the alternatives without replacement from q would need q_c = q with the earlier siblings removed and
renormalized for each of them; deterministic candidates need no q at all, keep the chain round's random draws
unchanged (a tree with a budget of the chain's length *is* the chain round) and, after a rejection, accept each
alternative with its full residual target probability.
"""

from __future__ import annotations

import copy
import heapq
import itertools
from pathlib import Path

import mlx.core as mx

from ..cache import CacheRewindError, KVCache, rewind_cache
from ..config import ConfigError
from ..prompt_cache import copy_cache
from ..loading import CheckpointError, check_weights, load_weights, parse_dtype, quantize_like
from ..models.assistant import Assistant, AssistantConfig
from .protocol import MeasuredTau, read_measured_tau
from .tree import TokenTree
from .verify import draft_tokens

DRAFT_LOGITS = ("raw", "target")

TREE_TOP_K = 8  # candidates per block position a tree node may have as children


class DFlashDrafter:
    """A DFlash assistant bound to its target: proposes blocks, never accepts them.

    draft_logits: "target" (default) — the target's multiplier + softcap, so q lives on the same scale as p;
    "raw" — the bare `lm_head`, as transformers does. Greedy output is the same either way (monotone transform);
    at temperature 1 "target" measured τ 2.24 vs 1.13 for "raw" on our trained tiny pair (BENCHMARKS.md).
    """

    kind = "dflash"
    variant = "dflash"  # what stats and benchmark labels call it (`dflash2.DFlash2Drafter`: "dflash2")

    def __init__(self, assistant: Assistant, target, draft_logits: str = "target"):
        if draft_logits not in DRAFT_LOGITS:
            raise ValueError(f"draft_logits must be one of {DRAFT_LOGITS}, got {draft_logits!r}")
        self.assistant, self.target, self.draft_logits = assistant, target, draft_logits
        self.config = assistant.config
        self.block_size = self.config.block_size
        self.taps = tuple(self.config.target_layer_ids)
        self.measured_tau: MeasuredTau | None = None  # from the folder's eval.json
        self.cache = None  # the drafter's context K/V (None before `start`)
        self.ctx = None  # target taps of committed positions not yet in `cache`
        self.source: str | None = None  # the folder it was loaded from (`load_dflash`)

    @property
    def max_drafts(self) -> int:
        return self.block_size - 1

    width_name = "block_size - 1"

    def make_cache(self):
        return self.assistant.make_cache()

    def fork(self) -> "DFlashDrafter":
        """The same drafter (shared weights) with its own, empty state (a batch row's)."""
        d = copy.copy(self)
        d.cache = d.ctx = None
        return d

    def copy_state(self) -> "DFlashDrafter":
        """The same drafter with an independent copy of its current state (a prompt-cache entry's, handed to the
        row that continues it while the entry keeps its own)."""
        d = copy.copy(self)
        d.cache = None if self.cache is None else copy_cache(self.cache)
        return d  # ctx (an array, never written in place) is shared

    # -- the drafter protocol (speculative.protocol.Drafter) -----------------------------------------------------
    def start(self, taps: list[mx.array], ids: list[int]) -> None:
        """After the prefill: `taps` cover every prompt position; `ids` = prompt + the first generated token."""
        self.cache = self.make_cache()
        self.ctx = mx.concatenate(taps, axis=-1)

    def propose(self, anchor: int, pos: int, k: int, sampler, history: list[int]):
        """k drafts for positions pos+1..pos+k (the anchor sits at `pos`); returns (drafts, q_logprobs | None)."""
        h = self.draft_hidden(anchor, self.ctx, pos, self.cache)
        self.ctx = None  # consumed: its K/V now live in the drafter cache
        return draft_tokens(self.logits(h[:k]), sampler, history)

    # -- token trees (speculative.engine.TreeDecoder; module docstring) ------------------------------------------
    def enable_trees(self) -> None:
        """Nothing to keep: a tree comes from the block's own per-position distributions."""

    def propose_tree(self, anchor: int, pos: int, depth: int, budget: int, sampler, history: list[int]):
        """The chain of up to `depth` drafts (fewer when the budget or the block is smaller: exactly `propose`'s),
        and with the rest of `budget` the best other nodes by cumulative draft probability, at most `depth` deep.
        Returns (tree, q): q[c] the q row chain node c was sampled from (T > 0), None for the other nodes (point
        masses); q None at greedy."""
        k = max(1, min(depth, budget, self.max_drafts))
        h = self.draft_hidden(anchor, self.ctx, pos, self.cache)
        self.ctx = None  # consumed: its K/V now live in the drafter cache
        logits = self.logits(h[:k])
        drafts, q = draft_tokens(logits, sampler, history)
        # scores: the rows the chain was drawn from (T > 0), the draft distribution at temperature 1 (greedy)
        lp = q if q is not None else logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        K = min(self.tree_top_k, lp.shape[-1])
        top = mx.argsort(-lp, axis=-1)[:, :K]
        vals = mx.take_along_axis(lp, top, axis=-1)
        chain_lp = mx.take_along_axis(lp, mx.array(drafts, dtype=mx.int32)[:, None], axis=-1)[:, 0]
        mx.eval(top, vals, chain_lp)
        cands = [list(zip(t, v)) for t, v in zip(top.tolist(), vals.tolist())]
        tree = grow_tree(anchor, drafts, chain_lp.tolist(), k, budget, lambda d, token: cands[d])
        return tree, tree_q(tree, q, len(drafts))

    tree_top_k = TREE_TOP_K

    def accept(self, taps: list[mx.array], new_tokens: list[int]) -> None:
        """The target's taps of the newly committed positions (anchor + accepted drafts) become the next context."""
        rows = mx.concatenate(taps, axis=-1)
        self.ctx = rows if self.ctx is None else mx.concatenate([self.ctx, rows], axis=1)

    # -- prompt-cache reuse (session.Session): continue the state on a new prompt instead of restarting -------------
    def context_length(self) -> int:
        """Target positions the drafter's state covers (its context cache + the pending context rows)."""
        if self.cache is None:
            return 0
        return self.cache[0].offset + (0 if self.ctx is None else self.ctx.shape[1])

    def rewind_context(self, keep: int) -> int:
        """Forget the context at positions >= `keep`. Returns the position p <= keep from which the target's taps
        must be handed over again with `extend` (the target cache must then hold exactly positions < p).

        Full-attention layers rewind freely. A sliding layer's cache keeps no spare rows (max_rewind 0), so when it
        cannot rewind it is replaced by an empty cache starting at keep − window: the rows its window still needs
        are recomputed from the target's taps (p = keep − window). Changes nothing and raises `CacheRewindError`
        when no state exists."""
        have = self.context_length()
        if self.cache is None:
            raise CacheRewindError("the DFlash drafter has no state to rewind (start() was never called)")
        keep = max(0, min(keep, have))
        stored = self.cache[0].offset
        if keep >= stored:  # only pending rows (not yet in the drafter cache) are dropped
            n = keep - stored
            self.ctx = None if n == 0 or self.ctx is None else self.ctx[:, :n]
            return keep
        self.ctx = None
        try:
            rewind_cache(self.cache, stored - keep)
            return keep
        except CacheRewindError:
            pass
        windows = [self.config.window(i) for i in range(len(self.cache))]
        start = max(0, keep - max(w for w in windows if w is not None))
        for i, c in enumerate(self.cache):
            if windows[i] is None:
                c.rewind(c.offset - start)
            else:
                self.cache[i] = KVCache(window=c.window, max_rewind=c.max_rewind, first_position=start)
        return start

    def extend(self, taps: list[mx.array], ids: list[int]) -> None:
        """Continue after `rewind_context`: `taps` are the target's taps of the positions from the rewind point on
        (up to the new prompt's end); `ids` = the whole new prompt + its first generated token."""
        if self.cache is None:
            raise RuntimeError("DFlash drafter: extend() before start()")
        if self.context_length() + taps[0].shape[1] != len(ids) - 1:
            raise RuntimeError(f"DFlash drafter out of sync: its context covers {self.context_length()} positions, "
                               f"{taps[0].shape[1]} new tap rows do not reach the prompt end ({len(ids) - 1})")
        self.accept(taps, [])

    def parts(self) -> tuple:
        return (self,)

    def stats(self) -> dict:
        return {}

    def draft_hidden(self, anchor: int, ctx_taps: mx.array, pos: int, cache, block: int | None = None) -> mx.array:
        """Final hidden states of the block [anchor, mask × (block−1)] at positions pos.. → [block−1, D] (rows 1..)."""
        B = block or self.block_size
        ids = mx.array([[anchor] + [self.config.mask_token_id] * (B - 1)], dtype=mx.int32)
        noise = self.target.embed_raw(ids)
        return self.assistant(noise, ctx_taps, pos, cache)[0, 1:]

    def propose_hidden(self, h: mx.array, k: int, sampler, history: list[int]):
        """`propose` from the block's hidden states already computed (`draft_hidden_batch`); the anchor is
        history[-1]."""
        return draft_tokens(self.logits(h[:k]), sampler, history)

    def logits(self, h: mx.array) -> mx.array:
        if self.draft_logits == "raw":
            return self.target.lm_head_raw(h).astype(mx.float32)
        return self.target.logits(h)


def batches_with(a: "DFlashDrafter", b: "DFlashDrafter") -> bool:
    """Whether two drafters' blocks can be drafted in one forward (`draft_hidden_batch`): DFlash drafters (v1 or
    v2) of the same assistant model (forks of one drafter: batch rows), each with its own started state."""
    return (isinstance(a, DFlashDrafter) and type(a) is type(b) and a.assistant is b.assistant
            and a.target is b.target and a.cache is not None and b.cache is not None)


def draft_hidden_batch(drafters: list["DFlashDrafter"], anchors: list[int], positions: list[int]) -> list[mx.array]:
    """The blocks of several DFlash drafters (rows of a batch, `batches_with` each other) in one drafter model
    forward (`models.assistant.batch_forward`): row r's block [anchors[r], mask…] at positions[r], its pending
    context into its own cache. Returns each row's hidden states [block−1, D], as its own `draft_hidden` gives them;
    their pending contexts are consumed."""
    first = drafters[0]
    B = first.block_size
    ids = mx.array([[a] + [first.config.mask_token_id] * (B - 1) for a in anchors], dtype=mx.int32)
    h = first.assistant.batch(first.target.embed_raw(ids), [d.ctx for d in drafters], positions,
                              [d.cache for d in drafters])
    for d in drafters:
        d.ctx = None  # consumed: its K/V now live in the drafter's cache
    return [h[r, 1:] for r in range(len(drafters))]


def propose_batch(drafters: list["DFlashDrafter"], anchors: list[int], positions: list[int], ks: list[int], samplers,
                  histories) -> list[tuple]:
    """Several rows' `propose` (`batches_with` each other), their blocks in one drafter forward
    (`draft_hidden_batch`) and, for DFlash v1, their draft logits in one lm_head call; each row draws its drafts with
    its own sampler and history, as alone. Returns each row's (drafts, q)."""
    hs = draft_hidden_batch(drafters, anchors, positions)
    if type(drafters[0]) is not DFlashDrafter:  # DFlash 2: each row's selector walk from its block
        return [d.propose_hidden(h, k, s, hist) for d, h, k, s, hist in zip(drafters, hs, ks, samplers, histories)]
    z = drafters[0].logits(mx.stack([h[: max(ks)] for h in hs]))
    return [draft_tokens(z[r, :k], s, hist) for r, (k, s, hist) in enumerate(zip(ks, samplers, histories))]


def grow_tree(anchor: int, chain: list[int], chain_lp: list[float], depth: int, budget: int, children) -> TokenTree:
    """The chain (its first min(len, budget, depth) drafts; chain_lp[j]: draft j's log-probability given its parent),
    then best first by cumulative log-probability (the sum along the path) the frontier's nodes until `budget` draft
    nodes, at most `depth` deep. children(d, token): the candidates [(token, log-prob), …], best first, that may
    follow a node of depth d holding `token` (row d of the block). Every kept node's parent is kept (a child is only
    offered once its parent is in the tree, and never scores above it); the chain's nodes come first (indices
    1..n), so each is its parent's first child; a chain node's other children skip the chain's token."""
    n = max(0, min(len(chain), budget, depth))
    tokens, parents, depths, scores = [int(anchor)] + [int(t) for t in chain[:n]], list(range(-1, n)), \
        list(range(n + 1)), [0.0]
    for x in chain_lp[:n]:
        scores.append(scores[-1] + float(x))
    lists: dict[int, list] = {}
    skip: dict[int, int | None] = {i: (tokens[i + 1] if i < n else None) for i in range(n + 1)}
    heap: list = []
    order = itertools.count()  # ties: offered first, kept first

    def offer(node: int, r: int) -> None:
        cl = lists[node]
        while r < len(cl) and cl[r][0] == skip[node]:
            r += 1
        if r < len(cl) and cl[r][1] > -float("inf"):
            heapq.heappush(heap, (-(scores[node] + cl[r][1]), next(order), node, r))

    def open_node(node: int) -> None:
        if depths[node] < depth:
            lists[node] = children(depths[node], tokens[node])
            offer(node, 0)

    for i in range(n + 1):
        open_node(i)
    while len(tokens) - 1 < budget and heap:
        _, _, par, r = heapq.heappop(heap)
        token, lp = lists[par][r]
        i = len(tokens)
        tokens.append(int(token))
        parents.append(par)
        depths.append(depths[par] + 1)
        scores.append(scores[par] + float(lp))
        skip[i] = None
        offer(par, r + 1)  # the parent's next candidate
        open_node(i)
    return TokenTree(tokens, parents)


def tree_q(tree: TokenTree, q, n_chain: int):
    """The q rows `verify.verify_tree_sampling` takes for a `grow_tree` tree: the chain's nodes 1..n_chain their
    sampled rows, every other node None (a deterministic candidate); None at greedy (q None)."""
    if q is None:
        return None
    return [None] + [q[j] for j in range(n_chain)] + [None] * (len(tree) - 1 - n_chain)


def check_fit(cfg: AssistantConfig, target, where) -> None:
    t = target.args
    problems = []
    if cfg.hidden_size != t.hidden_size:
        problems.append(f"hidden_size {cfg.hidden_size} != target hidden_size {t.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {t.num_hidden_layers} layers")
    if not 0 <= cfg.mask_token_id < t.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocabulary ({t.vocab_size})")
    if problems:
        raise CheckpointError(f"{where}: drafter does not fit the target: " + "; ".join(problems))


def load_dflash(path: Path, raw: dict, target, *, dtype=None, draft_logits: str = "target") -> DFlashDrafter:
    """The DFlash assistant in folder `path` (config.json already read: `raw`; `model_type: muse_glimmer_assistant`,
    weights with or without a `model.` prefix), bound to `target`. dtype None = the target's."""
    try:
        cfg = AssistantConfig.from_dict(raw, where=str(path / "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    check_fit(cfg, target, path)
    assistant = Assistant(cfg)
    load_module(assistant, Assistant.sanitize(load_weights(path)), path, raw, target, dtype)
    return finish_loading(DFlashDrafter(assistant, target, draft_logits), path)


def load_module(module, weights: dict, path, raw: dict, target, dtype=None) -> None:
    """A drafter module's weights from its checkpoint (quantized like `glimmer convert -q` wrote them, when its
    config says so), checked name by name and shape by shape, cast to `dtype` (None: the target's), evaluated."""
    if isinstance(raw.get("quantization"), dict):  # converted by `glimmer convert -q` (mlx-lm layout)
        quantize_like(module, raw["quantization"], weights)
    check_weights(module, weights, path, raw.get("quantization"), kind="drafter ", names_hint=None)
    dt = parse_dtype(dtype) or target.model.norm.weight.dtype
    module.load_weights([(k, v.astype(dt) if mx.issubdtype(v.dtype, mx.floating) else v)
                         for k, v in weights.items()], strict=True)
    mx.eval(module.parameters())
    module.eval()


def finish_loading(drafter: DFlashDrafter, path) -> DFlashDrafter:
    drafter.source = str(path)
    drafter.measured_tau = read_measured_tau(path, "dflash")  # τ measured when it was trained (auto's estimate)
    return drafter
