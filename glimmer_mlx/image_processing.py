"""Image (and still-frame video) pre-processing equal to transformers' `MuseGlimmerImageProcessor` /
`MuseGlimmerVideoProcessor` / `MuseGlimmerProcessor` (reference doc §5), without torch.

Resampling. transformers' Muse Glimmer processors exist only with the torchvision backend (there is no PIL
backend for them; without torchvision they cannot be constructed at all). With torchvision >= 0.27 on a CPU they
resize with `torchvision.transforms.v2.functional.resize(uint8 tensor, LANCZOS, antialias=True)`, which is
`torch.nn.functional.interpolate(mode="lanczos", antialias=True)` on the uint8 tensor: a separable antialiased
Lanczos-3 filter, horizontal pass first, each pass with int16 fixed-point weights and rounding to uint8 in
between. `resize_lanczos` reproduces that kernel bit for bit (checked against torch in the tests). Pillow's own
LANCZOS resize is *not* the same (it may run the vertical pass first and uses other fixed-point weights: up to
tens of levels apart on noisy images), so Pillow is used only to decode.

Other steps: RGB conversion composites transparency onto white (transformers' `convert_to_rgb` for PIL inputs);
files are opened with Pillow and EXIF-rotated (as transformers' `load_image` does for paths); rescale 1/255 and
normalise with mean = std = 0.5 in float32 as the torchvision backend does ((x - 127.5) / 127.5); patches in
raster order, features (c, y, x) — the model's temporal duplication of still images is applied by the patch
embedding (see `models/vision.py`), and `hf_pixel_values` gives transformers' duplicated layout.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MAX_IMAGE_TOKENS = 4096
MAX_VIDEO_FRAME_TOKENS = 144
# Decoded images larger than this are refused (a 12k x 10k photo is fine; a decompression bomb is not).
MAX_PIXELS = 128_000_000
MAX_FILE_BYTES = 512 * 1024 * 1024

IMAGE_TOKEN = "<|patch|>"
IMAGE_START = "<|image_start|>"
IMAGE_END = "<|image_end|>"
VIDEO_TOKEN = "<|video|>"
VIDEO_START = "<|vid_start|>"
VIDEO_END = "<|vid_end|>"
VIDEO_SEP = "<|vid_frame_separator|>"
FRAME_TIMESTAMP_FORMAT = "Time: {timestamp:.1f}s"


class ImageError(ValueError):
    """An image input that cannot be used; the message names the file (or the argument position)."""


@dataclass
class ProcessedImage:
    """One image (or video) ready for the vision encoder."""

    pixels: np.ndarray  # [t*gh*gw, 3*P*P] float32 (one copy per temporal group for images, t=1)
    grid: tuple[int, int, int]  # (t, gh, gw) in patches
    key: str  # content hash of the decoded pixels + processing settings (the feature cache key)
    source: str = ""
    frames_per_group: int = 1  # 1: still image (one copy of each patch); Tp: video (Tp frames per row)

    @property
    def num_tokens(self) -> int:
        t, gh, gw = self.grid
        return t * gh * gw // MERGE_SIZE**2

    def hf_pixel_values(self, temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> np.ndarray:
        """transformers' layout [t*gh*gw, Tp*3*P*P], a still image's patch repeated Tp times."""
        if self.frames_per_group == temporal_patch_size:
            return self.pixels
        return np.concatenate([self.pixels] * temporal_patch_size, axis=-1)


# ---------------------------------------------------------------------------------------------------------------
# Geometry


def smart_resize(height: int, width: int, patch_size: int = PATCH_SIZE * MERGE_SIZE,
                 max_tokens: int = MAX_IMAGE_TOKENS) -> tuple[int, int]:
    """transformers' `smart_resize`: the integer grid of `patch_size` units closest to the aspect ratio within
    `max_tokens` units; returns the target (height, width) in pixels."""
    ih, iw = height / patch_size, width / patch_size
    ratio = iw / ih if ih > 0 else 1.0
    if ih * iw > max_tokens:
        ih = (max_tokens / ratio) ** 0.5
        iw = ih * ratio
    cands = list(set(itertools.product([math.floor(ih), math.ceil(ih)], [math.floor(iw), math.ceil(iw)])))
    cands = [(a, b) for a, b in cands if a >= 1 and b >= 1 and a * b <= max_tokens]
    if not cands:
        cands = [(max(1, round(ih)), max(1, round(iw)))]
    a, b = min(cands, key=lambda g: abs(g[0] / g[1] - height / width))
    return a * patch_size, b * patch_size


# ---------------------------------------------------------------------------------------------------------------
# torch's uint8 antialiased Lanczos resize (what torchvision >= 0.27 runs on CPU), in numpy


def _lanczos(x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    m = np.abs(x) < 3.0
    px = math.pi * x[m]
    with np.errstate(invalid="ignore", divide="ignore"):
        out[m] = np.where(px == 0.0, 1.0, 3.0 * np.sin(px) * np.sin(px / 3.0) / (px * px))
    return out


def _int_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output pixel: first input index, int16-range fixed-point weights [out, K], and their precision."""
    scale = in_size / out_size
    support = 3.0 * scale if scale >= 1.0 else 3.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    K = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    xmin = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C truncation == floor for >= 0
    xmax = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    j = np.arange(K, dtype=np.float64)[None, :]
    w = _lanczos((j + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(j < (xmax - xmin)[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), w)
    wt_max = w.max()
    prec = 0
    for prec in range(22):
        if int(0.5 + wt_max * (1 << (prec + 1))) >= (1 << 15):
            break
    v = w * (1 << prec)
    wi = np.where(v < 0, np.trunc(-0.5 + v), np.trunc(0.5 + v)).astype(np.int32)
    return xmin, wi, prec


def _pass_rows(a: np.ndarray, out_size: int, chunk: int = 128) -> np.ndarray:
    """Resample axis 0 of a uint8 array [n, ...] to out_size. The fixed-point sums are formed by a banded float64
    matrix product per block of output rows: every product and partial sum is an integer below 2**53, so this is
    exactly torch's int32 accumulation, then `>> precision` (floor) and saturation to uint8."""
    n = a.shape[0]
    xmin, wi, prec = _int_weights(n, out_size)
    K = wi.shape[1]
    flat = a.reshape(n, -1)
    out = np.empty((out_size, flat.shape[1]), dtype=np.uint8)
    scale = float(1 << prec)
    for c0 in range(0, out_size, chunk):
        c1 = min(c0 + chunk, out_size)
        lo = int(xmin[c0:c1].min())
        hi = int(min(n, xmin[c0:c1].max() + K))
        band = np.zeros((c1 - c0, hi - lo), dtype=np.float64)
        for r in range(c0, c1):
            k = min(K, n - xmin[r])  # taps past the end carry zero weight
            band[r - c0, xmin[r] - lo : xmin[r] - lo + k] = wi[r, :k]
        acc = band @ flat[lo:hi].astype(np.float64) + float(1 << (prec - 1))
        out[c0:c1] = np.clip(np.floor(acc / scale), 0, 255).astype(np.uint8)
    return out.reshape((out_size,) + a.shape[1:])


def resize_lanczos(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, C] → [height, width, C], equal to torch's `interpolate(uint8, mode="lanczos", antialias=True,
    align_corners=False)` (horizontal pass, round to uint8, vertical pass)."""
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img
    out = img
    if w != width:
        out = np.ascontiguousarray(_pass_rows(np.ascontiguousarray(out.swapaxes(0, 1)), width).swapaxes(0, 1))
    if h != height:
        out = _pass_rows(out, height)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _describe(src, i: int | None) -> str:
    if isinstance(src, (str, os.PathLike)):
        return str(src)
    return f"image {i}" if i is not None else "image"


def _to_rgb(img, where: str) -> np.ndarray:
    """transformers' `convert_to_rgb` for PIL images: transparency composited onto white."""
    from PIL import Image

    try:
        has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
        if has_alpha:
            rgba = img.convert("RGBA")
            bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            rgb = Image.alpha_composite(bg, rgba).convert("RGB")
        else:
            rgb = img.convert("RGB")
        arr = np.asarray(rgb, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{where}: unreadable image ({type(e).__name__}: {e})") from None
    if arr.ndim != 3 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ImageError(f"{where}: empty image (size {img.size})")
    return arr


def _check_size(w: int, h: int, where: str, max_pixels: int) -> None:
    if w <= 0 or h <= 0:
        raise ImageError(f"{where}: empty image ({w}x{h} pixels)")
    if w * h > max_pixels:
        raise ImageError(f"{where}: image too large ({w}x{h} = {w * h:,} pixels; the limit is {max_pixels:,}): "
                         "possibly a decompression bomb; downscale it first")


def load_image(src, *, index: int | None = None, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """A path (str / PathLike), raw bytes, a PIL image or a uint8 array [H, W, 3|4] → RGB uint8 [H, W, 3].

    Raises `ImageError` (a ValueError) naming the file for missing, empty, unreadable, truncated or oversized
    images; the pixel count is checked from the header before anything is decoded."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    where = _describe(src, index)
    if isinstance(src, np.ndarray):
        a = src
        if a.ndim == 2:
            a = a[:, :, None]
        if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
            raise ImageError(f"{where}: expected an array [H, W] or [H, W, 1|3|4], got shape {src.shape}")
        _check_size(a.shape[1], a.shape[0], where, max_pixels)
        if a.dtype != np.uint8:
            raise ImageError(f"{where}: expected a uint8 array, got {a.dtype}")
        mode = {1: "L", 3: "RGB", 4: "RGBA"}[a.shape[-1]]
        return _to_rgb(Image.fromarray(a[..., 0] if mode == "L" else a, mode), where)
    if isinstance(src, Image.Image):
        _check_size(src.width, src.height, where, max_pixels)
        return _to_rgb(src, where)
    if isinstance(src, (bytes, bytearray)):
        data = bytes(src)
    elif isinstance(src, (str, os.PathLike)):
        p = Path(src)
        if not p.exists():
            raise ImageError(f"{where}: no such file")
        if not p.is_file():
            raise ImageError(f"{where}: not a file")
        size = p.stat().st_size
        if size == 0:
            raise ImageError(f"{where}: empty file (0 bytes)")
        if size > MAX_FILE_BYTES:
            raise ImageError(f"{where}: file too large ({size:,} bytes; the limit is {MAX_FILE_BYTES:,})")
        data = p.read_bytes()
    else:
        raise ImageError(f"{where}: unsupported image input of type {type(src).__name__} (give a path, bytes, a "
                         "PIL image or a uint8 array)")
    if not data:
        raise ImageError(f"{where}: empty image data (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
            _check_size(img.width, img.height, where, max_pixels)
            img.load()
            img = ImageOps.exif_transpose(img)
        except ImageError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"{where}: refused as a possible decompression bomb ({e})") from None
        except UnidentifiedImageError:
            raise ImageError(f"{where}: unreadable image (not a format Pillow can decode)") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise ImageError(f"{where}: unreadable or truncated image ({type(e).__name__}: {e})") from None
    return _to_rgb(img, where)


# ---------------------------------------------------------------------------------------------------------------
# Processing


def _normalize(a: np.ndarray) -> np.ndarray:
    """uint8 → float32 (x - 127.5) / 127.5: transformers' fused rescale(1/255) + normalize(0.5, 0.5)."""
    return (a.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)


def preprocess_image(src, *, max_tokens: int = MAX_IMAGE_TOKENS, index: int | None = None,
                     max_pixels: int = MAX_PIXELS) -> ProcessedImage:
    """Decode (see `load_image`), smart-resize to 28-px units within `max_tokens` merged tokens, Lanczos-resize,
    normalise and cut into 14-px patches (raster order, features (c, y, x))."""
    rgb = load_image(src, index=index, max_pixels=max_pixels)
    return preprocess_array(rgb, max_tokens=max_tokens, source=_describe(src, index))


def preprocess_array(rgb: np.ndarray, *, max_tokens: int = MAX_IMAGE_TOKENS, source: str = "") -> ProcessedImage:
    P, M = PATCH_SIZE, MERGE_SIZE
    h, w = rgb.shape[:2]
    H, W = smart_resize(h, w, P * M, max_tokens)
    digest = hashlib.sha256()
    digest.update(f"image:{h}x{w}:{max_tokens}:".encode())
    digest.update(np.ascontiguousarray(rgb).tobytes())
    x = _normalize(resize_lanczos(rgb, H, W))  # [H, W, 3]
    gh, gw = H // P, W // P
    pixels = x.reshape(gh, P, gw, P, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3 * P * P)
    return ProcessedImage(np.ascontiguousarray(pixels), (1, gh, gw), digest.hexdigest(), source)


def preprocess_video(frames, *, max_frame_tokens: int = MAX_VIDEO_FRAME_TOKENS,
                     max_pixels: int = MAX_PIXELS) -> ProcessedImage:
    """Already-sampled video frames (a list of paths / PIL images / uint8 arrays, or a uint8 array [T, H, W, 3])
    → transformers' `MuseGlimmerVideoProcessor(do_sample_frames=False)` output: every frame smart-resized within
    `max_frame_tokens`, the last frame repeated up to a multiple of 2, rows (group, row, col) each holding two
    consecutive frames' patches, layout (t, c, y, x). Frame sampling (reference doc §5.2: 2 fps, at most 96) is
    the caller's: see `sample_frame_indices`."""
    P, M, Tp = PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = list(frames)
    frames = list(frames)
    if not frames:
        raise ImageError("video: no frames")
    rgbs = [load_image(f, index=i, max_pixels=max_pixels) for i, f in enumerate(frames)]
    shapes = {a.shape for a in rgbs}
    if len(shapes) != 1:
        raise ImageError(f"video: all frames must have the same size, got {sorted(shapes)}")
    h, w = rgbs[0].shape[:2]
    H, W = smart_resize(h, w, P * M, max_frame_tokens)
    digest = hashlib.sha256()
    digest.update(f"video:{len(rgbs)}:{h}x{w}:{max_frame_tokens}:".encode())
    for a in rgbs:
        digest.update(np.ascontiguousarray(a).tobytes())
    x = np.stack([_normalize(resize_lanczos(a, H, W)) for a in rgbs])  # [T, H, W, 3]
    if pad := -len(x) % Tp:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    T = len(x)
    gt, gh, gw = T // Tp, H // P, W // P
    # [gt, Tp, gh, P, gw, P, 3] -> [gt, gh, gw, Tp, 3, P, P]
    pixels = x.reshape(gt, Tp, gh, P, gw, P, 3).transpose(0, 2, 4, 1, 6, 3, 5).reshape(gt * gh * gw, Tp * 3 * P * P)
    return ProcessedImage(np.ascontiguousarray(pixels), (gt, gh, gw), digest.hexdigest(), "video", Tp)


def _torch_linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace(start, end, steps) in float32 (its CPU kernel: from the start below the midpoint, from the
    end above it)."""
    if steps == 1:
        return np.array([start], dtype=np.float32)
    step = np.float32((np.float32(end) - np.float32(start)) / np.float32(steps - 1))
    i = np.arange(steps)
    half = steps // 2
    lo = np.float32(start) + step * i.astype(np.float32)
    hi = np.float32(end) - step * (steps - i - 1).astype(np.float32)
    return np.where(i < half, lo, hi).astype(np.float32)


def sample_frame_indices(total_frames: int, source_fps: float | None, *, fps: float = 2.0, max_frames: int = 96,
                         temporal_patch_size: int = TEMPORAL_PATCH_SIZE) -> list[int]:
    """transformers' `MuseGlimmerVideoProcessor.sample_frames` (reference doc §5.2); source_fps None → 24."""
    src = float(source_fps) if source_fps else 24.0
    n = min(int(total_frames * fps / src), max_frames, total_frames)
    n = max(temporal_patch_size, (n // temporal_patch_size) * temporal_patch_size)
    n = min(n, total_frames)
    return [int(v) for v in _torch_linspace_f32(0, total_frames - 1, n).astype(np.int64)]


# ---------------------------------------------------------------------------------------------------------------
# Placeholder expansion (MuseGlimmerProcessor), on token ids


def image_token_ids(tokenizer, config=None) -> dict[str, int]:
    """Ids of the processor's special tokens from the tokenizer; `<|patch|>` / `<|video|>` must agree with the
    model config's image / video token ids."""
    names = {"patch": IMAGE_TOKEN, "image_start": IMAGE_START, "image_end": IMAGE_END, "video": VIDEO_TOKEN,
             "vid_start": VIDEO_START, "vid_end": VIDEO_END, "vid_sep": VIDEO_SEP}
    out = {k: tokenizer.token_to_id(v) for k, v in names.items()}
    if config is not None:
        if out["patch"] is not None and out["patch"] != config.image_token_id:
            raise ValueError(f"tokenizer id of {IMAGE_TOKEN} ({out['patch']}) differs from config.json "
                             f"image_token_id ({config.image_token_id})")
        if out["video"] is not None and out["video"] != config.video_token_id:
            raise ValueError(f"tokenizer id of {VIDEO_TOKEN} ({out['video']}) differs from config.json "
                             f"video_token_id ({config.video_token_id})")
    return out


def expand_image_placeholders(ids: list[int], images: list[ProcessedImage], *, image_token_id: int,
                              image_start_id: int, image_end_id: int, insert_after: int | None = None) -> list[int]:
    """Each `<|patch|>` (one per image, in order) → `<|image_start|> <|patch|>×N <|image_end|>`.

    A prompt with no `<|patch|>` at all gets one per image inserted at its start (after a leading BOS id
    `insert_after`, when given and present)."""
    n = sum(1 for t in ids if t == image_token_id)
    if n == 0 and images:
        at = 1 if (insert_after is not None and ids and ids[0] == insert_after) else 0
        ids = ids[:at] + [image_token_id] * len(images) + ids[at:]
        n = len(images)
    if n != len(images):
        raise ValueError(f"the prompt has {n} image placeholder(s) ({IMAGE_TOKEN}) but {len(images)} image(s) were "
                         f"given: put one {IMAGE_TOKEN} where each image goes (or none, to put all of them first)")
    out, k = [], 0
    for t in ids:
        if t == image_token_id:
            out += [image_start_id] + [image_token_id] * images[k].num_tokens + [image_end_id]
            k += 1
        else:
            out.append(t)
    return out


def video_placeholder_text(grid: tuple[int, int, int], timestamps: list[float]) -> str:
    """MuseGlimmerProcessor's replacement for one `<|video|>`: per temporal group a timestamp and its tokens."""
    t, gh, gw = grid
    per = gh * gw // MERGE_SIZE**2
    ts = list(timestamps[::TEMPORAL_PATCH_SIZE])[:t]
    while len(ts) < t:
        ts.append(ts[-1] if ts else 0.0)
    s = VIDEO_START
    for g, v in enumerate(ts):
        s += FRAME_TIMESTAMP_FORMAT.format(timestamp=v) + VIDEO_TOKEN * per
        s += VIDEO_SEP if g < t - 1 else VIDEO_END
    return s
