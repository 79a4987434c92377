"""Token trees for speculative verification (SpecInfer, Miao et al. 2024; Medusa; EAGLE-2).

A `TokenTree` holds candidate continuations of the committed tokens merged into a trie. Node 0 is the root: the
anchor, the last committed token, whose KV is not cached yet; every other node is a draft token whose parent comes
before it (topological order), so the nodes flatten into one verify forward as they are. Node i sits at position
"anchor position + depth(i)" and attends to the committed context and to its own ancestors (itself included): the
attention inputs the target's forward takes (`Model.__call__(tree=...)`, `cache.tree_mask`). A chain is the tree
whose every node has at most one child.

Acceptance over a tree is decided in `verify` (`verify_tree_greedy`, `verify_tree_sampling`); committing the
accepted path in the caches is `cache.keep_path`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class TokenTree:
    """tokens[i], parents[i] (-1 for the root, node 0; otherwise < i). Sibling order is the order of the indices."""

    def __init__(self, tokens: list[int], parents: list[int]):
        if not tokens or len(tokens) != len(parents) or parents[0] != -1:
            raise ValueError("a token tree needs a root (node 0, parent -1) and one parent per token")
        for i, p in enumerate(parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"node {i}: parent {p} must be an earlier node (topological order)")
        self.tokens = [int(t) for t in tokens]
        self.parents = [int(p) for p in parents]
        self.depths = [0] * len(tokens)
        self.children: list[list[int]] = [[] for _ in tokens]
        for i, p in enumerate(self.parents[1:], 1):
            self.depths[i] = self.depths[p] + 1
            if any(self.tokens[c] == self.tokens[i] for c in self.children[p]):
                raise ValueError(f"node {i}: token {self.tokens[i]} repeats a sibling's (merge paths with from_paths)")
            self.children[p].append(i)

    @classmethod
    def from_paths(cls, root: int, paths, budget: int, max_depth: int | None = None) -> "TokenTree":
        """The trie of `paths` (token lists continuing `root`) in their order of preference, with at most `budget`
        nodes besides the root and at most `max_depth` tokens per path: a path is cut where the budget runs out."""
        tokens, parents = [int(root)], [-1]
        child: dict[tuple[int, int], int] = {}
        for path in paths:
            node = 0
            for t in list(path)[:max_depth]:
                key = (node, int(t))
                nxt = child.get(key)
                if nxt is None:
                    if len(tokens) - 1 >= budget:
                        break
                    nxt = child[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                node = nxt
        return cls(tokens, parents)

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "TokenTree":
        return cls([root] + list(drafts), list(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def path(self, i: int) -> list[int]:
        """The nodes from the root's first child down to node i (empty for the root)."""
        out = []
        while i > 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def path_tokens(self, i: int) -> list[int]:
        return [self.tokens[j] for j in self.path(i)]

    def ancestors(self) -> np.ndarray:
        """[N, N] bool: a[i, j] when node j is node i or one of its ancestors."""
        n = len(self)
        a = np.zeros((n, n), dtype=bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                a[i] = a[p]
            a[i, i] = True
        return a

    def attention_inputs(self) -> tuple[mx.array, mx.array]:
        """(depths [N] int32, ancestors [N, N] bool): what `Model.__call__(tree=...)` takes."""
        return mx.array(self.depths, dtype=mx.int32), mx.array(self.ancestors())
