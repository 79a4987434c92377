"""The prompt through the target in chunks, filling its cache (and collecting the drafters' taps)."""

from __future__ import annotations

import mlx.core as mx

DEFAULT_PREFILL_STEP = 512


def prefill(model, cache, ids: list[int], step: int = DEFAULT_PREFILL_STEP, taps=None, input_embeddings=None):
    """Run the prompt through the model in chunks; return the last position's logits [1, V] (and taps for all
    positions when `taps` is given). input_embeddings: the prompt's normed embeddings [1, len(ids), D] to feed
    instead of the ids (images: placeholder rows replaced by image features); `ids` still give the length."""
    if not ids:
        raise ValueError("empty prompt: give at least one token")
    if input_embeddings is not None and input_embeddings.shape[1] != len(ids):
        raise ValueError(f"input_embeddings cover {input_embeddings.shape[1]} positions, the prompt has {len(ids)}")
    arr = mx.array(ids, dtype=mx.int32)[None]
    tapped_all = []
    for s in range(0, len(ids), step):
        chunk = arr[:, s : s + step]
        last = s + step >= len(ids)
        kw = {} if input_embeddings is None else {"input_embeddings": input_embeddings[:, s : s + step]}
        out = model(chunk, cache, taps=taps, last=1, **kw)  # logits of the last position only, taps or not
        if taps is not None:
            logits, tapped = out
            tapped_all.append(tapped)
        else:
            logits = out
        if not last:
            mx.eval([c.state for c in cache] + ([t for t in tapped_all[-1]] if taps is not None else []))
    if taps is None:
        return logits[:, -1]
    joined = [mx.concatenate([t[i] for t in tapped_all], axis=1) for i in range(len(taps))]
    return logits[:, -1], joined
