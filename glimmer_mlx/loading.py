"""Local folder or Hub repo id → config + safetensors (lazy, sharded) → sanitize → model.

Every failure names the file and tensor involved and says what was expected and what was found.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import ConfigError, ModelConfig, parse_config
from .files import FileFormatError, open_binary, present
from .files import read_json as read_json_file
from .models.glimmer import Model, expected_vision_shapes
from .models.vision import VisionConfig, VisionEncoder
from .tokenizer import TokenizerError, load_tokenizer


class CarriedWeights:
    """Tensors a checkpoint holds beyond the text tower (e.g. `mtp.*`), kept lazily for the component that owns them.
    Not an nn.Module, so they are not parameters of the model."""

    def __init__(self, weights: dict):
        self.weights = weights

    def __len__(self):
        return len(self.weights)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file/tensor and expected vs actual."""


DTYPES = {"bf16": mx.bfloat16, "bfloat16": mx.bfloat16, "fp16": mx.float16, "float16": mx.float16,
          "fp32": mx.float32, "float32": mx.float32}

# every dtype of the safetensors format (bytes per element; None: packed below a byte, size not checked here)
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U64": 8, "C64": 8,
                "F4": None, "F6_E2M3": None, "F6_E3M2": None}

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "README.md"]


def parse_dtype(dtype) -> mx.Dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, mx.Dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of bf16, fp16, fp32")
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32") from None


def resolve_path(path_or_repo: str | os.PathLike) -> Path:
    """A local folder, or a Hub repo id downloaded (or found in the local cache) with huggingface-hub."""
    p = Path(path_or_repo).expanduser()
    try:
        p.stat()
        found = True
    except FileNotFoundError:
        found = False
        if os.path.islink(p):
            raise CheckpointError(f"{p}: dangling symbolic link (it points to {os.readlink(p)}, which does not "
                                  "exist)") from None
    except OSError as e:
        reason = "symbolic link loop" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise CheckpointError(f"{p}: cannot open the checkpoint folder ({reason})") from None
    if found:
        if not p.is_dir():
            raise CheckpointError(f"{p}: expected a checkpoint folder, found a file")
        return p
    s = str(path_or_repo)
    if s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise CheckpointError(f"{s}: no such folder (and not a Hub repo id of the form 'owner/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    # the same spellings huggingface-hub accepts (read here, not at import, so a changed environment counts)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    try:
        return Path(snapshot_download(s, allow_patterns=HUB_PATTERNS, local_files_only=offline))
    except LocalEntryNotFoundError:
        if offline:
            raise CheckpointError(
                f"{s}: no such local folder, and HF_HUB_OFFLINE is set and this Hub repo is not in the local "
                "Hugging Face cache; download it first (unset HF_HUB_OFFLINE) or pass a local folder"
            ) from None
        raise CheckpointError(
            f"{s}: no such local folder, and it could not be downloaded from the Hub (no network?) nor found in "
            "the local cache"
        ) from None
    except Exception as e:  # repository not found, gated, HTTP errors…
        raise CheckpointError(f"{s}: could not fetch from the Hub: {type(e).__name__}: {e}") from None


def read_json(path: Path, expect: type | None = None):
    """A checkpoint's JSON file (files.read_json: folders, links, permissions, UTF-8 and JSON errors name the file);
    expect=dict also checks it is a JSON object."""
    try:
        return read_json_file(path, expect)
    except FileFormatError as e:
        raise CheckpointError(str(e)) from None


def has_file(path: Path) -> bool:
    """files.present, failing as a CheckpointError."""
    try:
        return present(path)
    except FileFormatError as e:
        raise CheckpointError(str(e)) from None


def load_config(path: Path) -> ModelConfig:
    cfg_path = path / "config.json"
    if not has_file(cfg_path):
        raise CheckpointError(f"{path}: no config.json in the checkpoint folder")
    try:
        return parse_config(read_json(cfg_path), where=str(cfg_path))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and validate a safetensors header without loading data: {name: {dtype, shape, data_offsets}}."""
    try:
        has_file(path)
        with open_binary(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, header length missing)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header (header claims {n} bytes, file has {size - 8} "
                    "after the length prefix)"
                )
            raw = f.read(n)
    except FileFormatError as e:
        raise CheckpointError(str(e)) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (expected a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: corrupt safetensors header ('__metadata__' must map names to strings)")
    data_size = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                      for x in (begin, end, *shape)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor '{name}'") from None
        if dtype not in _ST_ITEMSIZE:
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {dtype!r}, which is not a safetensors dtype "
                                  f"(known: {', '.join(_ST_ITEMSIZE)})")
        if begin > end:
            raise CheckpointError(
                f"{path}: corrupt: tensor '{name}' has data offsets [{begin}, {end}] (begin after end)"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated: tensor '{name}' ends at byte {end} of the data section but the file holds "
                f"only {data_size} data bytes"
            )
        item = _ST_ITEMSIZE.get(dtype)
        if item is not None and end - begin != math.prod(shape) * item:
            raise CheckpointError(
                f"{path}: corrupt: tensor '{name}' of dtype {dtype} and shape {shape} needs "
                f"{math.prod(shape) * item} bytes, header gives {end - begin}"
            )
    last = None  # the non-empty tensor reaching furthest so far, in data order (zero-size tensors overlap nothing)
    for b1, e1, name in sorted((i["data_offsets"][0], i["data_offsets"][1], k) for k, i in header.items() if
                               i["data_offsets"][1] > i["data_offsets"][0]):
        if last is not None and b1 < last[1]:
            raise CheckpointError(f"{path}: corrupt: tensors '{last[2]}' and '{name}' share bytes (data offsets "
                                  f"[{last[0]}, {last[1]}] and [{b1}, {e1}])")
        if last is None or e1 > last[1]:
            last = (b1, e1, name)
    return header


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if has_file(index):
        wm = read_json(index, dict).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: no 'weight_map'")
        bad = [v for v in wm.values() if not isinstance(v, str) or not v or Path(v).name != v or v in (".", "..")]
        if bad:
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names in the "
                                  f"checkpoint folder, got {bad[0]!r}")
        files = sorted(set(wm.values()))
        missing = [f for f in files if not has_file(path / f)]
        if missing:
            raise CheckpointError(f"{index}: shard(s) listed in the index are missing from {path}: {missing}")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    for f in files:
        has_file(f)  # a folder or a broken link named *.safetensors fails here, naming it
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files (and no model.safetensors.index.json)")
    return files


def shard_headers(path: Path):
    """(shard file, its checked safetensors header) for every weight file of the checkpoint, each shard also checked
    against the index (every tensor the index places in it is there)."""
    files = weight_files(path)  # checks the index itself first
    index = path / "model.safetensors.index.json"
    wm = read_json(index)["weight_map"] if has_file(index) else None
    for f in files:
        header = read_safetensors_header(f)
        if wm is not None:
            absent = [k for k, v in wm.items() if v == f.name and k not in header]
            if absent:
                raise CheckpointError(f"{f}: tensor(s) listed for this shard in the index are absent: {absent[:5]}")
        yield f, header


def checkpoint_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} over all shards from the safetensors headers alone (nothing else is read), with every
    header check of the loader: sizes and offsets against each file's size, index vs shards, no tensor twice."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    where: dict[str, Path] = {}
    for f, header in shard_headers(path):
        for k, info in header.items():
            if k in out:
                raise CheckpointError(f"{f}: tensor '{k}' is also present in {where[k]}")
            out[k], where[k] = (info["dtype"], tuple(info["shape"])), f
    return out


def load_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of a checkpoint, lazily (mx.load maps the files; nothing is read until evaluated)."""
    weights: dict[str, mx.array] = {}
    for f, _ in shard_headers(path):
        try:
            loaded = mx.load(str(f))
        except Exception as e:
            raise CheckpointError(f"{f}: could not read safetensors file: {e}") from None
        dup = set(loaded) & set(weights)
        if dup:
            raise CheckpointError(f"{f}: tensor(s) also present in another shard: {sorted(dup)[:5]}")
        weights.update(loaded)
    return weights


def quantize_like(model: nn.Module, quant: dict, weights: dict[str, mx.array], prefix: str = "") -> None:
    """Turn Linear/Embedding modules into their quantized versions wherever the checkpoint has `.scales`
    (mlx-lm's layout: global `group_size/bits/mode`, optional per-module overrides keyed by module path).
    prefix: the module's path in the checkpoint (e.g. "mtp.") when `weights` are named relative to it."""
    def predicate(p, m):
        if not hasattr(m, "to_quantized"):
            return False
        if f"{p}.scales" not in weights:
            return False
        override = quant.get(prefix + p)
        if isinstance(override, dict):
            return override
        return True

    nn.quantize(
        model,
        group_size=quant.get("group_size", 64),
        bits=quant["bits"],
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )


def _is_float(v) -> bool | None:
    """Whether a tensor (an mx.array, or a header entry's _Shape) holds floating-point numbers; None: unknown."""
    d = getattr(v, "dtype", None)
    if d is None:
        return None
    if isinstance(d, str):
        return d in ("F64", "F32", "F16", "BF16") or d.startswith(("F8_", "F6_", "F4"))
    return mx.issubdtype(d, mx.floating)


_MX_ST_NAMES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int64: "I64", mx.int32: "I32",
                mx.int16: "I16", mx.int8: "I8", mx.uint64: "U64", mx.uint32: "U32", mx.uint16: "U16", mx.uint8: "U8",
                mx.bool_: "BOOL"}


def _dtype_name(v) -> str:
    """The safetensors name of a tensor's dtype (as the header spells it)."""
    d = v.dtype
    return d if isinstance(d, str) else _MX_ST_NAMES.get(d, str(d).removeprefix("mlx.core."))


TARGET_NAMES_HINT = "checkpoint names are shown after mapping 'model.language_model.' → 'model.'"


def check_weights(model: nn.Module, weights: dict[str, mx.array], where, quant_cfg: dict | None = None, *,
                  kind: str = "", prefix: str = "", names_hint: str | None = TARGET_NAMES_HINT) -> None:
    """The checkpoint's tensors against the module built from config.json: none missing, none extra, every shape
    equal. kind ("drafter ", "MTP ") and prefix (prepended to the names shown) say whose tensors they are."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))

    def names(keys):
        return f"{[prefix + k for k in keys[:8]]}{' …' if len(keys) > 8 else ''}"

    if missing:
        hint = f"; {names_hint}" if names_hint else ""
        raise CheckpointError(f"{where}: missing {kind}tensor(s) {names(missing)} ({len(missing)} missing{hint})")
    if extra:
        hint = ""
        if quant_cfg is None and any(k.endswith((".scales", ".biases")) for k in extra):
            hint = "; the checkpoint looks quantized (.scales/.biases) but config.json has no 'quantization' entry"
        raise CheckpointError(f"{where}: unexpected {kind}tensor(s) {names(extra)} ({len(extra)} extra){hint}")
    for k, v in expected.items():
        want, got = _is_float(v), _is_float(weights[k])
        if want is not None and got is not None and want != got:
            raise CheckpointError(
                f"{where}: {kind}tensor '{prefix}{k}' has dtype {_dtype_name(weights[k])}, expected "
                f"{'a floating-point dtype' if want else f'{_dtype_name(v)} (quantized weights)'}")
        if tuple(weights[k].shape) != tuple(v.shape):
            quant = ""
            if quant_cfg is not None:
                quant = (f" (quantized with bits={quant_cfg.get('bits')}, group_size={quant_cfg.get('group_size', 64)} "
                         "per config.json 'quantization')")
            raise CheckpointError(
                f"{where}: {kind}tensor '{prefix}{k}' has shape {tuple(weights[k].shape)}, expected {tuple(v.shape)} "
                f"from config.json{quant}")


def check_vision(config: ModelConfig, vision: dict[str, mx.array], where: Path) -> None:
    if not vision:
        return
    if not config.has_vision:
        raise CheckpointError(f"{where}: vision tensors present but config.json has no vision_config")
    if config.quantization is not None:
        return  # quantized vision layouts are checked by the vision tower when it loads them
    expected = expected_vision_shapes(config)
    missing = sorted(set(expected) - set(vision))
    extra = sorted(set(vision) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: missing vision tensor(s) {['model.' + k for k in missing[:8]]}")
    if extra:
        raise CheckpointError(f"{where}: unexpected vision tensor(s) {['model.' + k for k in extra[:8]]}")
    for k, shape in expected.items():
        if tuple(vision[k].shape) != shape:
            raise CheckpointError(
                f"{where}: tensor 'model.{k}' has shape {tuple(vision[k].shape)}, expected {shape} from config.json"
            )


def _attach_vision(model: Model, config: ModelConfig, vision: dict[str, mx.array], dtype, lazy: bool) -> None:
    """Build the vision encoder from the checkpoint's (already checked) vision tensors. Text-only checkpoints get
    none; a vision tower this runtime cannot run yet leaves `model.vision` None with the reason in
    `model.vision_unavailable` (raised when images are given), so the text path still loads."""
    if not vision:
        if config.has_vision:
            model.vision_unavailable = "the checkpoint has a vision_config but no vision tensors"
        return
    if any(k.endswith((".scales", ".biases")) for k in vision):
        model.vision_unavailable = ("quantized vision tower weights are not supported yet (quantize only the text "
                                    "tower, or keep the vision tensors in bf16/fp16/fp32)")
        return

    try:
        vcfg = VisionConfig.from_model_config(config)
    except ValueError as e:
        model.vision_unavailable = str(e)
        return
    enc = VisionEncoder(vcfg)
    items = [(k, v.astype(dtype) if dtype is not None and mx.issubdtype(v.dtype, mx.floating) else v)
             for k, v in vision.items()]
    enc.load_weights(items, strict=True)
    if not lazy:
        mx.eval(enc.parameters())
    enc.eval()
    model.set_vision(enc)


def _split_checked(path: Path, config: ModelConfig, weights: dict):
    """(model, text, vision, mtp): the checkpoint's tensors (arrays or anything with a .shape) mapped and checked
    against the model config.json describes."""
    text, vision = Model.sanitize(weights)
    mtp = {k: text.pop(k) for k in [k for k in text if k.startswith(("mtp.", "model.mtp."))]}
    model = Model(config)
    if config.text.tie_word_embeddings:
        text.pop("lm_head.weight", None)
    if config.quantization is not None:
        quantize_like(model, config.quantization, text)
    check_weights(model, text, path, config.quantization)
    check_vision(config, vision, path)
    return model, text, vision, mtp


class _Shape:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def check_checkpoint(path: Path, config: ModelConfig | None = None, *, require_weights: bool = True) -> dict | None:
    """What `load` checks, from config.json and the safetensors headers only (no tensor data is read): every header
    against its file's size, the index against the shards, every tensor name and shape against config.json,
    generation_config.json and the tokenizer files. Returns {"files", "tensors", "bytes"}; raises CheckpointError naming the file (and
    tensor) otherwise. require_weights=False: None for a folder without any weight file (config.json only)."""
    config = config or load_config(path)
    if not require_weights and not has_file(path / "model.safetensors.index.json") \
            and not any(path.glob("*.safetensors")):
        return None
    tensors = checkpoint_tensors(path)
    _split_checked(path, config, {k: _Shape(s, d) for k, (d, s) in tensors.items()})
    gen_eos_ids(path)
    try:
        load_tokenizer(path, config)
    except (TokenizerError, FileFormatError) as e:
        raise CheckpointError(str(e)) from None
    files = weight_files(path)
    return {"files": len(files), "tensors": len(tensors), "bytes": sum(f.stat().st_size for f in files)}


def gen_eos_ids(path: Path) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list of ids), [] without the file."""
    gc = path / "generation_config.json"
    if not has_file(gc):
        return []
    e = read_json(gc, dict).get("eos_token_id")
    ids = [e] if isinstance(e, int) else (e or [])
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{gc}: 'eos_token_id' must be a token id or a list of token ids, got {e!r}")
    return ids


def load_model(path: Path, dtype=None, *, lazy: bool = False) -> Model:
    config = load_config(path)
    dtype = parse_dtype(dtype)
    model, text, vision, mtp = _split_checked(path, config, load_weights(path))
    if dtype is not None:
        text = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in text.items()}
        vision = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in vision.items()}
    model.load_weights(list(text.items()), strict=True)
    _attach_vision(model, config, vision, dtype, lazy)
    model.path = path
    model.mtp_weights = CarriedWeights(mtp)  # MTP layers, built on demand by speculative.load_drafter
    model.eos_token_ids = set(config.text.eos_token_ids) | set(gen_eos_ids(path))
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model


def load(path_or_repo, dtype=None, *, lazy: bool = False):
    """`model, tokenizer = glimmer_mlx.load(path_or_repo, dtype=None)`.

    dtype: None keeps the checkpoint's dtype; "bf16" | "fp16" | "fp32" (or an mx.Dtype) casts floating weights.
    tokenizer is None when the checkpoint has no tokenizer files (token ids still work).
    """
    path = resolve_path(path_or_repo)
    model = load_model(path, dtype, lazy=lazy)
    try:
        tokenizer = load_tokenizer(path, model.config)
    except (TokenizerError, FileFormatError) as e:
        raise CheckpointError(str(e)) from None
    return model, tokenizer
