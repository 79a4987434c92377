"""Images in a prompt: pre-process, encode (with the model's feature cache), expand placeholders, embed.

`prepare_prompt(model, tokenizer, ids, images)` returns the expanded token ids and the prompt embeddings
[1, L, D] that the prefill feeds to the text tower instead of the ids (reference doc §4.5, §5.3).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .image_processing import (MAX_IMAGE_TOKENS, ProcessedImage, expand_image_placeholders, image_token_ids,
                               preprocess_image)


def require_vision(model):
    enc = getattr(model, "vision", None)
    if enc is None:
        why = getattr(model, "vision_unavailable", None) or "this is a text-only checkpoint (no vision tower)"
        raise ValueError(f"images were given but the model cannot encode them: {why}")
    return enc


def encode(model, item: ProcessedImage) -> mx.array:
    """Features [num_tokens, D] of one pre-processed image or video, from the model's LRU cache when the same
    content was encoded before."""
    enc = require_vision(model)
    cache = model.feature_cache
    key = f"{item.key}:{item.frames_per_group}"
    hit = cache.get(key)
    if hit is not None:
        return hit
    feats = enc(mx.array(item.pixels), item.grid)
    mx.eval(feats)
    cache.put(key, feats)
    return feats


def process_images(images, *, max_tokens: int = MAX_IMAGE_TOKENS) -> list[ProcessedImage]:
    if images is None:
        return []
    if (isinstance(images, (str, bytes, np.ndarray)) or not hasattr(images, "__iter__")
            or hasattr(images, "getbands")):
        images = [images]  # one image given bare (a path, bytes, an array [H, W, C] or a PIL image)
    out = []
    for i, im in enumerate(images):
        out.append(im if isinstance(im, ProcessedImage) else preprocess_image(im, max_tokens=max_tokens, index=i))
    return out


def prepare_prompt(model, tokenizer, ids: list[int], images, *, max_tokens: int = MAX_IMAGE_TOKENS):
    """(expanded ids, embeddings [1, L, D]) for a prompt with one `<|patch|>` per image (or none: then all
    images go first, after a leading BOS)."""
    require_vision(model)
    items = process_images(images, max_tokens=max_tokens)
    if not items:
        raise ValueError("images=[] given: pass at least one image, or images=None")
    if tokenizer is None:
        raise ValueError("images need a tokenizer (for the <|image_start|> / <|image_end|> token ids)")
    tid = image_token_ids(tokenizer, model.config)
    missing = [n for n in ("patch", "image_start", "image_end") if tid[n] is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join('<|' + n + '|>' for n in missing)} token(s); it cannot "
                         "describe images to this model")
    bos = getattr(model.args, "bos_token_id", None)
    expanded = expand_image_placeholders(list(ids), items, image_token_id=model.config.image_token_id,
                                         image_start_id=tid["image_start"], image_end_id=tid["image_end"],
                                         insert_after=bos)
    feats = [encode(model, it) for it in items]
    emb = model.embed_multimodal(expanded, {model.config.image_token_id: feats})
    return expanded, emb
