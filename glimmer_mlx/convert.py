"""`glimmer convert`: streaming quantize-and-convert of Muse Glimmer targets (text tower, vision tensors, MTP
tensors) and DFlash drafters into mlx-lm's saved layout, with a quality report.

How it works
- **Plan first, from the safetensors headers alone** (nothing is read): every source tensor is validated against the
  model the config describes, mapped to its output name(s), dtype and shape (quantized weights become packed
  `weight` + `scales` (+ `biases` for affine)), and assigned to an output shard. So the shard count, every shard's
  exact size and the disk space needed are known before anything is written.
- **Stream tensor by tensor, in row chunks**: rows are read straight from the source file, cast / quantized with
  `mx.quantize` (groups never straddle rows, so chunking changes nothing) and written at their planned offsets in the
  shard file. Peak memory is one chunk plus the interpreter, independent of shard and tensor size.
- **Quality, also streamed**: the text tower is run layer by layer twice on a short sample, once with the source
  weights in fp32 and once with the written output (real quantized modules, read back from the new shards), and the
  logits compared (KL divergence, top-1 agreement). Drafters are measured by τ (mean acceptance length) before and
  after, against their target (`--target`).
- **Safety**: everything is written into a hidden temporary folder next to OUT, which is renamed to OUT only when the
  conversion (and its quality check) succeeded; any failure or interruption removes it. An existing OUT is refused
  without `force`, and free disk space is checked up front.

Decisions (measured; see BENCHMARKS.md "Conversion (issue 7)")
- Vision tensors are kept at the output dtype by default (`quantize_vision=True` quantizes the linear weights of
  tower, adapter and projection with the text recipe's base bits; norms, biases, patch and position embeddings stay).
  Measured with transformers on a random-weight model: 4-bit (g64) vision weights change the projected image
  features by 25% (relative L2), 8-bit by 1.4%. The tower is ~6% of the 30B's parameters (4-bit would save 2.7 of
  ~21 GB) and our vision loader does not read quantized vision weights yet, so quantizing them is opt-in. Vision
  tensors are named `vision_tower.*`, `vision_adapter.*`, `vision_projection.*` (which mlx-lm's `sanitize` drops, so
  converted multimodal checkpoints also load, text-only, in mlx-lm).
- MTP tensors (`mtp.*`, `model.mtp.*`) are always kept (never dropped, unlike mlx-lm) and their 2-D weights
  quantized like the text tower's; `num_mtp_layers` is carried in config.json unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import resource
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .config import ConfigError, parse_config
from .files import FileFormatError, present, read_text
from .files import read_json as read_json_file
from .generate import generate
from .loading import (CheckpointError, check_vision, check_weights, gen_eos_ids, has_file, load, parse_dtype,
                      quantize_like, read_json, read_safetensors_header, resolve_path, weight_files)
from .models.assistant import Assistant, AssistantConfig
from .models.glimmer import Model, rms
from .quantization import (GLIMMER_RECIPES, MIXED_RECIPES, MODE_DEFAULTS, RECIPES, VISION_LINEAR_RE, layer_index,
                           recipe_bits)
from .speculative import load_drafter
from .tokenizer import TokenizerError, check_chat_template, load_tokenizer


class ConvertError(CheckpointError):
    """A conversion that cannot start or did not finish; the message says why and what was (not) written."""


# --------------------------------------------------------------------------------------------------------------------
# Quantization modes and recipes

DEFAULT_MAX_SHARD_BYTES = 5 << 30  # mlx-lm's MAX_FILE_SIZE_GB (5 GiB)
CHUNK_ELEMS = 1 << 22  # rows per chunk are chosen so a chunk holds at most this many elements (16 MB in fp32)

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MTP_RE = re.compile(r"^(?:model\.)?mtp\.")
def is_mtp_name(name: str) -> bool:
    return bool(_MTP_RE.match(name))


@dataclass
class QuantSettings:
    """What to quantize and how. `recipe` (mlx-lm's `--quant-predicate`) overrides bits per module (affine only)."""

    quantize: bool = False
    bits: int | None = None
    group_size: int | None = None
    mode: str = "affine"
    recipe: str | None = None
    quantize_vision: bool = False

    def resolved(self) -> "QuantSettings":
        if self.recipe is not None:
            if self.recipe not in RECIPES:
                raise ConvertError(f"unknown quantization recipe {self.recipe!r} (known: {', '.join(RECIPES)})")
            if self.mode != "affine":
                raise ConvertError(f"recipe {self.recipe} is affine-only (mlx-lm's rule); got --q-mode {self.mode}")
            self = dataclasses.replace(self, quantize=True)
        if self.mode not in MODE_DEFAULTS:
            raise ConvertError(f"unknown quantization mode {self.mode!r} (known: {', '.join(MODE_DEFAULTS)})")
        gs, bits = MODE_DEFAULTS[self.mode]
        if self.recipe is not None:
            bits = (MIXED_RECIPES | GLIMMER_RECIPES)[self.recipe][0]
        gs, bits = self.group_size or gs, self.bits or bits
        if self.quantize:
            try:  # let mlx validate the combination (e.g. mxfp4 needs group size 32) before anything is planned
                mx.eval(mx.quantize(mx.zeros((1, gs * 2)), group_size=gs, bits=bits, mode=self.mode))
            except Exception as e:
                raise ConvertError(f"invalid quantization: mode {self.mode}, bits {bits}, group size {gs}: {e}") from None
        return dataclasses.replace(self, group_size=gs, bits=bits)

    @property
    def global_params(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def describe(self) -> str:
        if not self.quantize:
            return "none"
        if self.recipe:
            return f"{self.recipe} (affine, group size {self.group_size})"
        return f"{self.mode} {self.bits}-bit, group size {self.group_size}"


# --------------------------------------------------------------------------------------------------------------------
# safetensors dtypes

_ST = {  # safetensors name -> (mx dtype, numpy dtype used to read the raw bytes, itemsize)
    "F32": (mx.float32, np.float32, 4), "F16": (mx.float16, np.float16, 2), "BF16": (mx.bfloat16, np.uint16, 2),
    "F64": (None, np.float64, 8), "I64": (mx.int64, np.int64, 8), "I32": (mx.int32, np.int32, 4),
    "I16": (mx.int16, np.int16, 2), "I8": (mx.int8, np.int8, 1), "U64": (mx.uint64, np.uint64, 8),
    "U32": (mx.uint32, np.uint32, 4), "U16": (mx.uint16, np.uint16, 2), "U8": (mx.uint8, np.uint8, 1),
    "BOOL": (mx.bool_, np.bool_, 1),
}
_FLOAT_ST = ("F32", "F16", "BF16", "F64")
_MX_TO_ST = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.uint8: "U8"}
_ST_NAME = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _st_dtype(dtype: mx.Dtype) -> str:
    return _MX_TO_ST[dtype]


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def _from_raw(buf: bytes, st: str, shape) -> mx.array:
    mxd, npd, _ = _ST[st]
    arr = np.frombuffer(buf, dtype=npd).reshape(shape)
    if st == "F64":
        return mx.array(arr.astype(np.float32))
    a = mx.array(arr)
    return a.view(mx.bfloat16) if st == "BF16" else a


# --------------------------------------------------------------------------------------------------------------------
# The plan


@dataclass
class OutTensor:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int = 0  # within the shard's data section

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ST[self.dtype][2]


@dataclass
class Item:
    """One source tensor and the output tensor(s) it becomes."""

    src_name: str
    file: Path
    st_dtype: str
    shape: tuple[int, ...]
    data_start: int  # absolute byte offset of the tensor's data in the source file
    name: str  # output name (weight, when quantized)
    part: str  # "text" | "vision" | "mtp" | "drafter"
    quant: dict | None = None
    out_dtype: str | None = None  # safetensors dtype of a dense output (None: raw copy)
    outputs: list[OutTensor] = field(default_factory=list)
    shard: int = 0
    rel_error: float | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ST[self.st_dtype][2]

    @property
    def out_nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass
class Plan:
    src: Path
    src_arg: str
    kind: str  # "target" | "drafter"
    raw_config: dict
    out_config: dict
    items: list[Item]
    settings: QuantSettings
    dtype: str | None  # output float dtype name (None: each tensor keeps its own)
    shards: list[list[Item]]
    quantization: dict | None
    notes: list[str] = field(default_factory=list)

    @property
    def out_bytes(self) -> int:
        return sum(i.out_nbytes for i in self.items)

    @property
    def in_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def shard_name(self, k: int) -> str:
        return f"model-{k + 1:05d}-of-{len(self.shards):05d}.safetensors"


def _float_dtype_from_config(cfg: dict) -> str | None:
    for d in (cfg, cfg.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            v = d.get(key)
            if v in ("float16", "bfloat16", "float32"):
                return v
    return None


def _source_tensors(path: Path) -> list[tuple[str, Path, dict, int]]:
    """[(name, file, header entry, absolute data start)] over all shards, validated, in file/offset order."""
    files = weight_files(path)
    index = path / "model.safetensors.index.json"
    wm = read_json(index)["weight_map"] if has_file(index) else None
    out, seen = [], {}
    for f in files:
        header = read_safetensors_header(f)
        with open(f, "rb") as fh:
            (n,) = np.frombuffer(fh.read(8), dtype="<u8")
        start = 8 + int(n)
        if wm is not None:
            absent = [k for k, v in wm.items() if v == f.name and k not in header]
            if absent:
                raise CheckpointError(f"{f}: tensor(s) listed for this shard in the index are absent: {absent[:5]}")
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if name in seen:
                raise CheckpointError(f"{f}: tensor '{name}' is also present in {seen[name]}")
            seen[name] = f
            if info["dtype"] not in _ST:
                raise ConvertError(f"{f}: tensor '{name}' has dtype {info['dtype']}, which the converter cannot read "
                                   f"(supported: {', '.join(_ST)})")
            out.append((name, f, info, start + info["data_offsets"][0]))
    return out


def _quantizable_modules(module: nn.Module) -> set[str]:
    return {p for p, m in module.named_modules() if hasattr(m, "to_quantized")}


def build_plan(src, out_dtype=None, settings: QuantSettings | None = None, *, text_only: bool = False,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Plan:
    """Everything the conversion will write, from config.json and the safetensors headers (no tensor data read)."""
    settings = (settings or QuantSettings()).resolved()
    path = resolve_path(src)
    cfg_path = path / "config.json"
    if not has_file(cfg_path):
        raise CheckpointError(f"{path}: no config.json in the checkpoint folder")
    raw = read_json(cfg_path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object")
    if raw.get("quantization") or (isinstance(raw.get("quantization_config"), dict)
                                   and raw["quantization_config"]):
        raise ConvertError(f"{cfg_path}: the source is already quantized ('quantization' / 'quantization_config' in "
                           "config.json); convert from the original (unquantized) checkpoint")
    tensors = _source_tensors(path)
    if any(n.endswith(".scales") for n, *_ in tensors):
        raise ConvertError(f"{path}: the source has quantized tensors (*.scales); convert from the original "
                           "(unquantized) checkpoint")
    dtype = None
    if out_dtype is not None:
        try:
            dtype = _st_dtype(parse_dtype(out_dtype))
        except ValueError as e:
            raise ConvertError(str(e)) from None
    else:
        d = _float_dtype_from_config(raw)
        dtype = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}.get(d) if d else None

    is_drafter = raw.get("model_type") == "muse_glimmer_assistant"
    notes: list[str] = []
    shapes = {n: SimpleNamespace(shape=tuple(info["shape"]), dtype=info["dtype"]) for n, _, info, _ in tensors}
    if is_drafter:
        try:
            acfg = AssistantConfig.from_dict(raw, where=str(cfg_path))
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        module = Assistant(acfg)
        names = {n: next(iter(Assistant.sanitize({n: n}))) for n in shapes}
        mapped = {names[n]: v for n, v in shapes.items()}
        expected = dict(tree_flatten(module.parameters()))
        missing, extra = sorted(set(expected) - set(mapped)), sorted(set(mapped) - set(expected))
        if missing or extra:
            raise CheckpointError(f"{path}: drafter checkpoint does not match its config: missing {missing[:8]}, "
                                  f"unexpected {extra[:8]}")
        for k, v in expected.items():
            if tuple(mapped[k].shape) != tuple(v.shape):
                raise CheckpointError(f"{path}: drafter tensor '{k}' has shape {tuple(mapped[k].shape)}, expected "
                                      f"{tuple(v.shape)} from config.json")
        parts = {n: "drafter" for n in shapes}
        num_layers = acfg.num_hidden_layers
        qmods = _quantizable_modules(module)
        out_config = dict(raw)
    else:
        try:
            config = parse_config(raw, where=str(cfg_path))
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        model = Model(config)
        text_map, vision_map = Model.sanitize({n: n for n in shapes})  # output name -> source name
        mtp_map = {k: v for k, v in text_map.items() if is_mtp_name(k)}
        text_map = {k: v for k, v in text_map.items() if k not in mtp_map}
        mtp_map = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in mtp_map.items()}  # → mtp.*
        if config.text.tie_word_embeddings and "lm_head.weight" in text_map:
            notes.append("tied embeddings: the checkpoint's lm_head.weight is dropped (the loaders use the embedding)")
            text_map.pop("lm_head.weight")
        check_weights(model, {k: shapes[v] for k, v in text_map.items()}, path)
        check_vision(config, {k: shapes[v] for k, v in vision_map.items()}, path)
        if text_only and vision_map:
            notes.append(f"--text-only: {len(vision_map)} vision tensors dropped")
            vision_map = {}
        n_mtp = _num_mtp_layers(raw)
        if mtp_map and not n_mtp:
            notes.append(f"{len(mtp_map)} mtp.* tensors present but config.json has no num_mtp_layers; kept as they are")
        if n_mtp and not mtp_map:
            notes.append(f"config.json says num_mtp_layers={n_mtp} but the checkpoint has no mtp.* tensors")
        names = {v: k for k, v in {**text_map, **vision_map, **mtp_map}.items()}
        parts = {**{v: "text" for v in text_map.values()}, **{v: "vision" for v in vision_map.values()},
                 **{v: "mtp" for v in mtp_map.values()}}
        num_layers = config.text.num_hidden_layers
        qmods = _quantizable_modules(model)
        out_config = _target_out_config(raw, config, text_only or (not vision_map and config.model_type != "muse_glimmer"))

    layer_location = None
    for p in sorted(qmods):
        if "down_proj" in p:
            layer_location = next(i for i, s in enumerate(p.split(".")) if s.isdigit())
            break
    if settings.recipe and layer_location is None:
        raise ConvertError("Model does not have expected keys for mixed quant.")

    def quant_for(name: str, part: str, shape) -> dict | None:
        if not settings.quantize or len(shape) != 2 or not name.endswith(".weight"):
            return None
        p = name[: -len(".weight")]
        if part in ("text", "drafter"):
            if p not in qmods:
                return None
        elif part == "vision":
            if not settings.quantize_vision or not VISION_LINEAR_RE.match(name):
                return None
        elif part == "mtp":
            if "norm" in p.split(".")[-1]:
                return None
        params = dict(settings.global_params)
        if settings.recipe:
            bits = (recipe_bits(settings.recipe, p, layer_index(p, layer_location), num_layers) if part != "vision"
                    else settings.bits)
            params["bits"] = bits
        if shape[-1] % settings.group_size or shape[-1] % params["group_size"]:
            return None
        return params

    items = []
    for n, f, info, start in tensors:
        if n not in parts:
            continue  # dropped (tied lm_head, --text-only vision)
        st, shape = info["dtype"], tuple(info["shape"])
        it = Item(src_name=n, file=f, st_dtype=st, shape=shape, data_start=start, name=names[n], part=parts[n])
        it.quant = quant_for(it.name, it.part, shape)
        float_out = dtype or ("F32" if st == "F64" else st)
        if it.quant is not None:
            q = it.quant
            rows, cols = shape
            sd = float_out if q["mode"] == "affine" else "U8"
            base = it.name[: -len(".weight")]
            it.outputs = [OutTensor(it.name, "U32", (rows, cols * q["bits"] // 32)),
                          OutTensor(base + ".scales", sd, (rows, cols // q["group_size"]))]
            if q["mode"] == "affine":
                it.outputs.append(OutTensor(base + ".biases", sd, (rows, cols // q["group_size"])))
            it.out_dtype = float_out
        elif st in _FLOAT_ST:
            it.out_dtype = float_out
            it.outputs = [OutTensor(it.name, float_out, shape)]
        else:
            it.outputs = [OutTensor(it.name, st, shape)]
        items.append(it)

    # shards: fill in plan order; a tensor's outputs stay together; a group larger than the limit gets its own shard
    shards: list[list[Item]] = []
    size = 0
    for it in items:
        if not shards or (shards[-1] and size + it.out_nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(it)
        it.shard = len(shards) - 1
        size += it.out_nbytes
    for shard in shards:
        off = 0
        for it in shard:
            for o in it.outputs:
                o.offset = off
                off += o.nbytes

    quantization = None
    if settings.quantize:
        quantization = dict(settings.global_params)
        for it in items:
            if it.quant is not None and (settings.recipe or it.quant != settings.global_params):
                quantization[it.name[: -len(".weight")]] = dict(it.quant)
        out_config["quantization"] = quantization
        out_config["quantization_config"] = quantization
    if dtype is not None:
        out_config["dtype"] = _ST_NAME[dtype]
        out_config.pop("torch_dtype", None)
        if isinstance(out_config.get("text_config"), dict):
            out_config["text_config"] = dict(out_config["text_config"], dtype=_ST_NAME[dtype])
    out_config.pop("_name_or_path", None)
    return Plan(src=path, src_arg=str(src), kind="drafter" if is_drafter else "target", raw_config=raw,
                out_config=out_config, items=items, settings=settings, dtype=_ST_NAME.get(dtype) if dtype else None,
                shards=shards, quantization=quantization, notes=notes)


def _num_mtp_layers(raw: dict) -> int:
    for d in (raw, raw.get("text_config") or {}):
        for k in ("num_mtp_layers", "num_nextn_predict_layers"):
            if d.get(k):
                return int(d[k])
    return 0


def _target_out_config(raw: dict, config, flat: bool) -> dict:
    """The source config with everything mlx-lm derives differently written out: explicit `layer_types` /
    `layer_rope_theta` (mlx-lm counts the pattern from layer 0 when they are absent), the resolved
    `rope_parameters`, and one `tie_word_embeddings` that top level and text_config agree on."""
    t = config.text
    explicit = {"layer_types": list(t.layer_types), "layer_rope_theta": list(t.layer_rope_theta),
                "rope_parameters": dict(t.rope_parameters), "tie_word_embeddings": bool(t.tie_word_embeddings),
                "head_dim": t.head_dim}
    if "text_config" in raw and not flat:
        out = dict(raw)
        out["text_config"] = dict(raw["text_config"], **explicit)
        out["tie_word_embeddings"] = bool(t.tie_word_embeddings)
        return out
    src = dict(raw.get("text_config") or raw)
    out = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config", "architectures")}
    out.update(src)
    out.update(explicit)
    out["model_type"] = "muse_glimmer"  # flat muse_glimmer = text-only, read by mlx-lm and by us
    for k in ("image_token_id", "video_token_id", "out_hidden_size", "projector_hidden_size", "projector_hidden_act"):
        out.pop(k, None)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Writing


def parse_size(s: str | int) -> int:
    """"5GB" / "500MB" / "64KB" / "123" (bytes) → bytes; GB/MB/KB are binary (GiB/MiB/KiB), as mlx-lm's 5 GB."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?)?\s*", str(s), re.I)
    if not m:
        raise ValueError(f"bad size {s!r}; use e.g. 5GB, 500MB, 64KB or a number of bytes")
    unit = (m.group(2) or "").upper()[:1]
    n = int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])
    if n <= 0:
        raise ValueError(f"shard size must be positive, got {s!r}")
    return n


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


class _RSSSampler:
    """Peak resident memory of this process while running (Linux: sampled from /proc every 5 ms; elsewhere the
    process' lifetime peak from getrusage)."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def current() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return r if sys.platform == "darwin" else r * 1024

    def __enter__(self):
        self.start = self.peak = self.current()

        def run():
            while not self._stop.wait(0.005):
                self.peak = max(self.peak, self.current())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def _read_rows(fh, it: Item, r0: int, r1: int) -> mx.array:
    """Rows r0..r1 of a source tensor (first axis), read from the file without touching the rest."""
    if not it.shape:
        fh.seek(it.data_start)
        return _from_raw(fh.read(it.nbytes), it.st_dtype, ())
    row = it.nbytes // it.shape[0] if it.shape[0] else 0
    fh.seek(it.data_start + r0 * row)
    buf = fh.read((r1 - r0) * row)
    if len(buf) != (r1 - r0) * row:
        raise ConvertError(f"{it.file}: short read in tensor '{it.src_name}' (file truncated or changed while "
                           "converting?)")
    return _from_raw(buf, it.st_dtype, (r1 - r0, *it.shape[1:]))


def _write_item(fh_in, fh_out, data_start: int, it: Item) -> None:
    """Stream one source tensor into its output tensor(s) in row chunks; records its relative error."""
    rows = it.shape[0] if it.shape else 1
    per_row = max(1, math.prod(it.shape[1:])) if it.shape else 1
    step = max(1, CHUNK_ELEMS // per_row)
    err = ref = 0.0
    out_dt = _ST[it.out_dtype][0] if it.out_dtype else None
    for r0 in range(0, max(rows, 1), step):
        r1 = min(rows, r0 + step) if it.shape else 1
        x = _read_rows(fh_in, it, r0, r1)
        if it.quant is not None:
            q = it.quant
            wq = x.astype(out_dt)
            outs = mx.quantize(wq, group_size=q["group_size"], bits=q["bits"], mode=q["mode"])
            deq = mx.dequantize(*outs, group_size=q["group_size"], bits=q["bits"], mode=q["mode"])
            x32 = x.astype(mx.float32)
            e, s = mx.sum(mx.square(deq.astype(mx.float32) - x32)), mx.sum(mx.square(x32))
            mx.eval(outs, e, s)
            err, ref = err + e.item(), ref + s.item()
            pieces = list(outs)
        elif it.out_dtype is not None and it.out_dtype != it.st_dtype:
            y = x.astype(out_dt)
            x32 = x.astype(mx.float32)
            e, s = mx.sum(mx.square(y.astype(mx.float32) - x32)), mx.sum(mx.square(x32))
            mx.eval(y, e, s)
            err, ref = err + e.item(), ref + s.item()
            pieces = [y]
        else:
            pieces = [x]
        for o, p in zip(it.outputs, pieces):
            row_bytes = o.nbytes // o.shape[0] if o.shape else o.nbytes
            arr = _to_numpy(p)
            if arr.dtype.itemsize * arr.size != (r1 - r0) * row_bytes and o.shape:
                raise ConvertError(f"internal error: '{o.name}' chunk has {arr.nbytes} bytes, planned "
                                   f"{(r1 - r0) * row_bytes}")
            fh_out.seek(data_start + o.offset + (r0 * row_bytes if o.shape else 0))
            fh_out.write(np.ascontiguousarray(arr).data)
        del x, pieces
    if it.quant is not None or (it.out_dtype is not None and it.out_dtype != it.st_dtype):
        it.rel_error = math.sqrt(err / ref) if ref > 0 else 0.0


def _shard_header(shard: list[Item]) -> bytes:
    header: dict = {"__metadata__": {"format": "mlx"}}
    for it in shard:
        for o in it.outputs:
            header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [o.offset, o.offset + o.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _write_shards(plan: Plan, tmp: Path, progress: Callable | None) -> list[dict]:
    done = 0
    total = plan.in_bytes
    handles: dict[Path, object] = {}
    written = []
    try:
        for k, shard in enumerate(plan.shards):
            name = plan.shard_name(k)
            head = _shard_header(shard)
            size = len(head) + sum(it.out_nbytes for it in shard)
            with open(tmp / name, "wb") as fo:
                fo.write(head)
                fo.truncate(size)
                for it in shard:
                    fh = handles.get(it.file)
                    if fh is None:
                        fh = handles[it.file] = open(it.file, "rb")
                    _write_item(fh, fo, len(head), it)
                    mx.clear_cache()
                    done += it.nbytes
                    if progress is not None:
                        progress(done, total, f"{name}: {it.name}")
            written.append({"file": name, "bytes": size, "tensors": sum(len(it.outputs) for it in shard)})
    finally:
        for fh in handles.values():
            fh.close()
    return written


_COPY_GLOBS = ("tokenizer*.json", "tokenizer.model", "*.tiktoken", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json", "*.jinja",
               "generation_config.json", "preprocessor_config.json", "processor_config.json",
               "video_preprocessor_config.json", "LICENSE*", "NOTICE*", "USE_POLICY*")


def _copy_side_files(plan: Plan, tmp: Path) -> list[str]:
    copied = []
    for pat in _COPY_GLOBS:
        for f in sorted(plan.src.glob(pat)):
            if f.is_file() and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
                copied.append(f.name)
    if not (tmp / "generation_config.json").exists() and plan.kind == "target":
        t = plan.raw_config.get("text_config") or plan.raw_config
        gen = {k: t.get(k, plan.raw_config.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        gen = {k: v for k, v in gen.items() if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        copied.append("generation_config.json (written)")
    return copied


# --------------------------------------------------------------------------------------------------------------------
# Quality

SAMPLE_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps out of habit. "
    "From the top he could see the harbour lights, the fishing boats returning, and the storm gathering in the west.\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Question: what is 17 times 23? Answer: 17 times 23 is 391, because 17 * 20 = 340 and 17 * 3 = 51.\n"
    "Les feuilles tombent doucement dans le jardin, et le chat regarde la pluie derrière la fenêtre."
)


def sample_ids(path: Path, vocab_size: int, n: int = 128) -> tuple[list[int], str]:
    """The built-in sample as token ids (the checkpoint's tokenizer), or fixed random ids when there is none."""
    tok = load_tokenizer(path) if (path / "tokenizer.json").exists() else None
    if tok is not None:
        ids = [i for i in tok.encode(SAMPLE_TEXT) if i < vocab_size][:n]
        if len(ids) >= 8:
            return ids, "built-in text sample (tokenizer)"
    lo = min(10, vocab_size - 1)
    rng = np.random.RandomState(0)
    return [int(x) for x in rng.randint(lo, vocab_size, size=n)], "fixed random token ids (no tokenizer)"


def _logit_metrics(ref: mx.array, q: mx.array, ids: list[int]) -> dict:
    ref, q = ref.astype(mx.float32), q.astype(mx.float32)
    lp, lq = ref - mx.logsumexp(ref, -1, keepdims=True), q - mx.logsumexp(q, -1, keepdims=True)
    kl = mx.sum(mx.exp(lp) * (lp - lq), -1)
    top1 = mx.mean((mx.argmax(ref, -1) == mx.argmax(q, -1)).astype(mx.float32))
    out = {"positions": int(ref.shape[0]), "kl_mean": float(mx.mean(kl).item()), "kl_max": float(mx.max(kl).item()),
           "top1_agreement": float(top1.item()),
           "max_abs_logit_diff": float(mx.max(mx.abs(ref - q)).item()),
           "logit_std": float(mx.std(ref).item())}
    if len(ids) > 1:
        tgt = mx.array(ids[1:])
        nll = lambda l: float(-mx.mean(mx.take_along_axis(l[:-1], tgt[:, None], -1)).item())  # noqa: E731
        out["nll_ref"], out["nll_quantized"] = nll(lp), nll(lq)
    return out


class _Reader:
    """Source tensors by output name, read straight from the files (fp32 for the reference stream)."""

    def __init__(self, plan: Plan):
        self.items = {it.name: it for it in plan.items}
        self.handles: dict[Path, object] = {}

    def _fh(self, it):
        if it.file not in self.handles:
            self.handles[it.file] = open(it.file, "rb")
        return self.handles[it.file]

    def full(self, name: str) -> mx.array:
        it = self.items[name]
        return _read_rows(self._fh(it), it, 0, it.shape[0] if it.shape else 1).astype(mx.float32)

    def rows(self, name: str, r0: int, r1: int) -> mx.array:
        it = self.items[name]
        return _read_rows(self._fh(it), it, r0, r1).astype(mx.float32)

    def close(self):
        for fh in self.handles.values():
            fh.close()


def _load_layer(module: nn.Module, prefix: str, get: Callable[[str], mx.array], names) -> None:
    pairs = [(k[len(prefix):], get(k)) for k in names if k.startswith(prefix)]
    module.load_weights(pairs, strict=True)


def eval_target(plan: Plan, out_dir: Path, ids: list[int], *, return_logits: bool = False):
    """Layer-by-layer forward of the source (fp32) and of the written output on `ids`; logit metrics.
    Peak memory: one layer of each plus row chunks of the embedding / lm_head. return_logits: also return
    (source logits, converted logits), each [len(ids), V]."""
    config = parse_config(plan.out_config)
    src = _Reader(plan)
    out_files = sorted(out_dir.glob("model-*.safetensors"))
    where = {}
    for f in out_files:
        for k in read_safetensors_header(f):
            where[k] = f

    def out_get(k):
        return mx.load(str(where[k]))[k]

    text_names = [it.name for it in plan.items if it.part == "text"]
    out_names = [k for k in where if not k.startswith(("vision_", "mtp.", "model.mtp."))]
    ref, q = Model(config), Model(config)
    if plan.quantization is not None:
        quantize_like(q, plan.quantization, set(where))
    x = mx.array([ids])
    try:
        t = config.text
        # embeddings: the reference reads only the sample's rows
        uniq = sorted(set(ids))
        emb_rows = mx.concatenate([src.rows("model.embed_tokens.weight", i, i + 1) for i in uniq])
        lut = {v: j for j, v in enumerate(uniq)}
        h_ref = rms(emb_rows[mx.array([[lut[i] for i in ids]])], t.rms_norm_eps)
        _load_layer(q.model.embed_tokens, "model.embed_tokens.", out_get, out_names)
        h_q = q.model.embed(x)
        mx.eval(h_ref, h_q)
        if not t.tie_word_embeddings:
            q.model.embed_tokens = nn.Embedding(1, 1)
        for i in range(t.num_hidden_layers):
            p = f"model.layers.{i}."
            _load_layer(ref.model.layers[i], p, src.full, text_names)
            _load_layer(q.model.layers[i], p, out_get, out_names)
            h_ref = ref.model.layers[i](h_ref, ref.rope, None)
            h_q = q.model.layers[i](h_q, q.rope, None)
            mx.eval(h_ref, h_q)
            ref.model.layers[i] = q.model.layers[i] = None
            mx.clear_cache()
        _load_layer(ref.model.norm, "model.norm.", src.full, text_names)
        _load_layer(q.model.norm, "model.norm.", out_get, out_names)
        h_ref, h_q = ref.model.norm(h_ref)[0], q.model.norm(h_q)
        head = "model.embed_tokens.weight" if t.tie_word_embeddings else "lm_head.weight"
        V = t.vocab_size
        step = max(1, CHUNK_ELEMS // t.hidden_size)
        zs = []  # the reference head in row chunks, each evaluated before the next is read (Model.logits, chunked)
        for r in range(0, V, step):
            zs.append(h_ref @ src.rows(head, r, min(V, r + step)).T)
            mx.eval(zs[-1])
        z = mx.concatenate(zs, -1) * t.output_multiplier
        if t.final_logit_softcapping:
            z = mx.tanh(z / t.final_logit_softcapping) * t.final_logit_softcapping
        if not t.tie_word_embeddings:
            _load_layer(q.lm_head, "lm_head.", out_get, out_names)
        zq = q.logits(h_q)[0]
        mx.eval(z, zq)
        metrics = _logit_metrics(z, zq, ids)
        return (metrics, (z, zq)) if return_logits else metrics
    finally:
        src.close()


def eval_drafter(src_path: Path, out_dir: Path, target, prompts: list[list[int]], sample: list[int],
                 max_tokens: int = 48) -> dict:
    """τ (greedy mean acceptance length) of the source and converted drafter on `prompts`, whether the output stayed
    identical to plain decoding, and draft-logit agreement over `sample`."""
    d_ref, d_q = load_drafter(src_path, target), load_drafter(out_dir, target)
    res: dict = {"prompts": len(prompts), "max_tokens": max_tokens}
    lossless = True
    for key, d in (("tau_source", d_ref), ("tau_converted", d_q)):
        taus = []
        for p in prompts:
            r = generate(target, p, max_tokens=max_tokens, drafter=d)
            taus.append(r.stats.extra["tau"])
            if key == "tau_converted":
                lossless &= r.tokens == generate(target, p, max_tokens=max_tokens).tokens
        res[key] = float(np.mean(taus))
    res["greedy_identical_to_plain"] = bool(lossless)
    # draft logits at a few anchors of the sample, context = everything before the anchor
    B = d_ref.block_size
    ids = mx.array([sample])
    _, taps = target(ids, taps=d_ref.taps)
    ctx = mx.concatenate(taps, -1)
    zr, zq = [], []
    for a in range(4, len(sample) - 1, max(1, (len(sample) - 5) // 8)):
        for d, acc in ((d_ref, zr), (d_q, zq)):
            acc.append(d.logits(d.draft_hidden(sample[a], ctx[:, :a], a, None, block=B)))
    res["draft_logits"] = _logit_metrics(mx.concatenate(zr), mx.concatenate(zq), [])
    return res


# --------------------------------------------------------------------------------------------------------------------
# Driver


@dataclass
class ConvertResult:
    out: Path
    summary: dict
    quality: dict


def _check_reservation(out: Path, reserved: tuple[int, int]) -> None:
    try:
        st = os.lstat(out)
        ok = (st.st_dev, st.st_ino) == reserved and sorted(os.listdir(out)) == [RESERVED_MARKER]
    except OSError:
        ok = False
    if not ok:
        raise ConvertError(f"{out} was changed by someone else while converting (it is no longer the empty folder "
                           "this conversion reserved); it is left as it is")


def _drop_reservation(out: Path, reserved: tuple[int, int]) -> None:
    """Remove the empty OUT this conversion created, and only that (not a folder someone put in its place, nor
    files someone put in it)."""
    try:
        st = os.lstat(out)
        if (st.st_dev, st.st_ino) != reserved:
            return
        if os.path.lexists(out / RESERVED_MARKER):
            os.unlink(out / RESERVED_MARKER)  # ours, in a folder of ours (even if someone added files to it)
        os.rmdir(out)  # fails (and keeps everything) unless empty
    except OSError:
        pass


def check_side_files(src: Path) -> None:
    """The files convert copies next to the weights, read as the loader reads them: tokenizer.json,
    tokenizer_config.json, chat templates (jinja2 syntax), generation_config.json and the other JSON side files.
    A broken one fails the conversion naming it (the output would not load)."""
    try:
        load_tokenizer(src)
        gen_eos_ids(src)
        for f in sorted(src.glob("*.jinja")):
            if present(f):
                check_chat_template(read_text(f), str(f))
        for pat in _COPY_GLOBS:
            for f in sorted(src.glob(pat)):
                if f.suffix == ".json" and present(f):
                    read_json_file(f)
    except (TokenizerError, FileFormatError) as e:
        raise CheckpointError(str(e)) from None


def _stale_temp_folders(out: Path) -> list[Path]:
    stale = []
    for p in out.parent.glob(f".{out.name}.glimmer-convert-*"):
        try:
            pid = int(p.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except (ValueError, IndexError):
            continue
        except ProcessLookupError:
            stale.append(p)
        except PermissionError:
            continue
    return stale


RESERVED_MARKER = ".glimmer-convert-reserved"  # the only entry of an OUT folder a running conversion reserved


def backup_name(out: Path) -> Path:
    """Where `--force` moves the existing OUT for the moment it swaps the new folder in: OUT.glimmer-old-<pid>."""
    return out.parent / f"{out.name}.glimmer-old-{os.getpid()}"


def _backups(out: Path) -> list[Path]:
    """Folders earlier `--force` conversions to `out` moved aside and did not delete (killed mid-swap)."""
    pat = re.compile(re.escape(out.name) + r"\.glimmer-old-\d+(?:-\d+)?")
    return sorted(p for p in out.parent.iterdir() if pat.fullmatch(p.name) and (p.is_dir() or p.is_symlink()))


class _OutLock:
    """Exclusive right to convert into `out` while held: an flock on the sibling `.OUT.glimmer-convert.lock` (the
    kernel releases it when the process dies, so a killed conversion never blocks the next one)."""

    def __init__(self, out: Path):
        import fcntl

        self.path = out.parent / f".{out.name}.glimmer-convert.lock"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                try:
                    pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
                finally:
                    os.close(fd)
                raise ConvertError(f"{out}: another conversion (pid {pid}) is writing it right now; wait for it to "
                                   "finish or choose another output folder") from None
            try:  # the previous holder may have unlinked the file between our open and our flock: retry on the new one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _recover_backups(out: Path, log: Callable[[str], None]) -> None:
    """(Holding the lock.) A backup left by a `--force` conversion killed between its two renames: restored when OUT
    is missing, else reported; never deleted."""
    backups = _backups(out)
    if not backups:
        return
    if not os.path.lexists(out):
        if len(backups) > 1:
            raise ConvertError(f"{out} is missing, and interrupted --force conversions left these earlier versions of "
                               f"it: {', '.join(map(str, backups))}; rename the one you want back to {out} and rerun")
        os.rename(backups[0], out)
        log(f"{out} was missing: an earlier --force conversion was killed while replacing it; your previous folder "
            f"was restored from {backups[0]}")
        return
    for b in backups:
        log(f"{b} holds what {out} held before an earlier --force conversion replaced it (that conversion was "
            "interrupted before deleting it); it is kept: delete it yourself if you do not need it")


def _is_stale_reservation(out: Path) -> bool:
    """(Holding the lock.) OUT is an empty folder reserved by a conversion that is gone (it held only our marker)."""
    try:
        return out.is_dir() and not out.is_symlink() and os.listdir(out) == [RESERVED_MARKER]
    except OSError:
        return False


def _layer_table(plan: Plan) -> list[dict]:
    """Relative weight error aggregated per layer (and per part outside layers)."""
    groups: dict[str, list[Item]] = {}
    for it in plan.items:
        if it.rel_error is None:
            continue
        m = _LAYER_RE.search(it.name)
        key = it.name[: m.end() - 1] if m else it.name.rsplit(".", 1)[0]
        if it.part == "vision" and m:
            key = "vision_tower.layers (all)"
        groups.setdefault(key, []).append(it)
    rows = []
    for k, its in groups.items():
        w = np.array([math.prod(i.shape) for i in its], dtype=np.float64)
        e = np.array([i.rel_error for i in its])
        bits = sorted({i.quant["bits"] for i in its if i.quant})
        rows.append({"group": k, "part": its[0].part, "tensors": len(its), "params": int(w.sum()),
                     "bits": bits, "rel_error_mean": float((w * e).sum() / w.sum()), "rel_error_max": float(e.max())})
    return rows


def convert(src, out, *, quantize: bool = False, q_bits: int | None = None, q_group_size: int | None = None,
            q_mode: str = "affine", dtype: str | None = None, recipe: str | None = None,
            quantize_vision: bool = False, text_only: bool = False, target=None, force: bool = False,
            evaluate: bool = True, eval_tokens: int = 128, eval_prompts: list[list[int]] | None = None,
            eval_max_tokens: int = 48, eval_ids: list[int] | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: Callable | None = None,
            log: Callable[[str], None] | None = None) -> ConvertResult:
    """Convert `src` (folder or Hub id) into an mlx-lm-layout folder `out`. See the module docstring.

    target: the drafter's target (folder, Hub id or a loaded model) for the τ check; ignored for targets.
    eval_ids / eval_prompts: token ids for the target's logit check / the drafter's τ prompts (default: the built-in
    sample, tokenized with the checkpoint's tokenizer, or fixed random ids); eval_max_tokens: tokens per τ prompt.
    progress(done_bytes, total_bytes, message) is called after every tensor; log(message) for notes.
    """
    log = log or (lambda s: None)
    out = Path(out).expanduser().absolute()
    settings = QuantSettings(quantize=quantize, bits=q_bits, group_size=q_group_size, mode=q_mode, recipe=recipe,
                             quantize_vision=quantize_vision)
    t0 = time.perf_counter()
    srcr = resolve_path(src).resolve()
    if out.resolve() == srcr or srcr in out.resolve().parents or out.resolve() in srcr.parents:
        raise ConvertError(f"{out}: the output folder must not be the source folder, inside it, or contain it")
    if os.path.lexists(out) and not out.is_dir():
        raise ConvertError(f"{out} exists and is not a folder; refusing to replace it")
    plan = build_plan(srcr, dtype, settings, text_only=text_only, max_shard_bytes=max_shard_bytes)
    plan.src_arg = str(src)
    check_side_files(plan.src)
    if plan.kind == "drafter" and evaluate and target is None:
        plan.notes.append("drafter τ not measured: pass --target (the drafter's target model)")
    for n in plan.notes:
        log(n)

    need = plan.out_bytes + (16 << 20)
    free = _free_bytes(out.parent)
    if free < need:
        raise ConvertError(f"not enough free disk space for {out}: the conversion writes {need / 1e9:.2f} GB, "
                           f"{free / 1e9:.2f} GB are free there")

    created_parent = None
    if not out.parent.exists():
        created_parent = next(p for p in [out.parent, *out.parent.parents] if p.parent.exists())
        out.parent.mkdir(parents=True)
    tmp = out.parent / f".{out.name}.glimmer-convert-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    old_handler = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        old_handler = signal.signal(signal.SIGTERM, on_term)
    stage = "reserving the output folder"
    lock = reserved = old = None
    try:
        lock = _OutLock(out)  # one conversion per OUT at a time; everything below holds it
        _recover_backups(out, log)
        for p in _stale_temp_folders(out):
            shutil.rmtree(p, ignore_errors=True)
            log(f"removed {p} left by an earlier conversion that was killed")
        if _is_stale_reservation(out):
            (out / RESERVED_MARKER).write_text(str(os.getpid()))
            st = out.stat()
            reserved = (st.st_dev, st.st_ino)
        elif os.path.lexists(out):
            if not force:
                raise ConvertError(f"{out} already exists; pass --force (force=True) to replace it")
            if not out.is_dir():
                raise ConvertError(f"{out} exists and is not a folder; refusing to replace it")
        else:
            try:  # the reservation: an empty OUT of our own, so nobody else's folder can appear there unnoticed
                out.mkdir()
            except FileExistsError:
                raise ConvertError(f"{out} was just created by someone else; it is left as it is") from None
            st = out.stat()
            reserved = (st.st_dev, st.st_ino)
            (out / RESERVED_MARKER).write_text(str(os.getpid()))
        stage = "planning"
        tmp.mkdir()
        stage = "writing shards"
        mx.reset_peak_memory()
        active0 = mx.get_active_memory()  # arrays alive before we start (peak = the increase over this)
        with _RSSSampler() as rss:
            t_write = time.perf_counter()
            written = _write_shards(plan, tmp, progress)
            t_write = time.perf_counter() - t_write
        conv_mlx_peak = max(0, mx.get_peak_memory() - active0)
        stage = "writing config and side files"
        index = {"metadata": {"total_size": plan.out_bytes,
                              "total_parameters": int(sum(math.prod(i.shape) for i in plan.items))},
                 "weight_map": {o.name: plan.shard_name(it.shard) for it in plan.items for o in it.outputs}}
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
        (tmp / "config.json").write_text(json.dumps(dict(sorted(plan.out_config.items())), indent=4) + "\n")
        copied = _copy_side_files(plan, tmp)

        stage = "quality check"
        quality: dict = {"source": plan.src_arg, "kind": plan.kind, "quantization": plan.settings.describe(),
                         "dtype": plan.dtype or "as source", "layers": _layer_table(plan),
                         "tensors": {it.name: {"part": it.part, "shape": list(it.shape), "quant": it.quant,
                                               "out_dtype": it.out_dtype, "rel_error": it.rel_error}
                                     for it in plan.items}}
        mx.reset_peak_memory()
        active0 = mx.get_active_memory()
        with _RSSSampler() as rss_eval:
            t_eval = time.perf_counter()
            if evaluate and plan.kind == "target":
                config = parse_config(plan.out_config)
                ids, how = sample_ids(plan.src, config.text.vocab_size, eval_tokens)
                if eval_ids is not None:
                    ids, how = list(eval_ids), "token ids given by the caller"
                quality["logits"] = dict(eval_target(plan, tmp, ids), sample=how)
            elif evaluate and plan.kind == "drafter" and target is not None:
                tmodel = load(target)[0] if not isinstance(target, nn.Module) else target
                tpath = Path(getattr(tmodel, "path", "") or ".")
                ids, how = sample_ids(tpath, tmodel.args.vocab_size, eval_tokens)
                prompts = eval_prompts or [ids[i: i + 12] for i in range(0, min(len(ids) - 12, 48) + 1, 16)]
                quality["drafter"] = dict(eval_drafter(plan.src, tmp, tmodel, prompts, ids, eval_max_tokens),
                                          sample=how,
                                          target=str(target) if not isinstance(target, nn.Module) else
                                          str(getattr(target, "path", "model")))
            t_eval = time.perf_counter() - t_eval
        eval_mlx_peak = max(0, mx.get_peak_memory() - active0)
        n_params = sum(math.prod(i.shape) for i in plan.items)
        summary = {
            "source": plan.src_arg, "out": str(out), "kind": plan.kind, "quantization": plan.settings.describe(),
            "dtype": plan.dtype or "as source", "tensors_in": len(plan.items),
            "tensors_quantized": sum(1 for i in plan.items if i.quant),
            "tensors_out": sum(len(i.outputs) for i in plan.items),
            "parts": {p: sum(1 for i in plan.items if i.part == p) for p in ("text", "vision", "mtp", "drafter")
                      if any(i.part == p for i in plan.items)},
            "bytes_in": plan.in_bytes, "bytes_out": plan.out_bytes,
            "bits_per_weight": plan.out_bytes * 8 / max(n_params, 1),
            "shards": written, "largest_shard_bytes": max(w["bytes"] for w in written),
            "seconds_convert": t_write, "seconds_eval": t_eval if evaluate else 0.0,
            "throughput_mb_s": plan.in_bytes / 1e6 / max(t_write, 1e-9),
            "peak_rss_convert_bytes": rss.peak, "rss_start_bytes": rss.start,
            "peak_mlx_convert_bytes": conv_mlx_peak,
            "peak_rss_eval_bytes": rss_eval.peak, "peak_mlx_eval_bytes": eval_mlx_peak,
            "copied": copied, "notes": plan.notes,
        }
        quality["conversion"] = {k: v for k, v in summary.items() if k not in ("copied",)}
        quality["versions"] = _versions()
        (tmp / "quality.json").write_text(json.dumps(quality, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(plan, summary, quality))

        stage = "moving the result into place"
        if reserved is not None:
            _check_reservation(out, reserved)
            os.unlink(out / RESERVED_MARKER)
            try:  # renaming a folder onto an empty folder replaces it; onto a non-empty one fails (nothing moves)
                os.rename(tmp, out)
            except OSError:
                raise ConvertError(f"{out} was changed by someone else while converting (it is no longer the empty "
                                   "folder this conversion reserved); it is left as it is") from None
            reserved = None
        else:  # --force over an existing OUT: move it aside under a predictable name, move the new one in
            old = backup_name(out)
            n = 1
            while os.path.lexists(old):
                old, n = backup_name(out).with_name(f"{backup_name(out).name}-{n}"), n + 1
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                old = None
                raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if reserved is not None:
            _drop_reservation(out, reserved)
        if lock is not None:
            lock.release()
        if created_parent is not None:
            shutil.rmtree(created_parent, ignore_errors=True) if not any(created_parent.rglob("*")) else None
        what = f"nothing was written to {out}" + (" (the existing folder is unchanged)" if out.exists() else "")
        if isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt(f"conversion interrupted while {stage}; {what}") from None
        if isinstance(e, ConvertError):
            raise ConvertError(f"{e}; {what}") from None
        raise ConvertError(f"conversion failed while {stage}: {type(e).__name__}: {e}; {what}") from e
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    try:
        if old is not None:  # the new folder is in place; the replaced one goes (the user asked for it: --force)
            if old.is_symlink():
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
            if os.path.lexists(old):
                log(f"could not delete {old} (what {out} held before); delete it yourself")
    finally:
        lock.release()
    summary["seconds_total"] = time.perf_counter() - t0
    return ConvertResult(out=out, summary=summary, quality=quality)


def _versions() -> dict:
    out = {}
    for p in ("glimmer-mlx", "mlx", "mlx-lm"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            pass
    return out


def _card_license(src: Path) -> dict:
    card = src / "README.md"
    meta = {}
    if card.exists():
        text = card.read_text(errors="replace")
        if text.startswith("---"):
            for line in text.split("---", 2)[1].splitlines():
                k, _, v = line.partition(":")
                if k.strip() in ("license", "license_name", "license_link") and v.strip():
                    meta[k.strip()] = v.strip()
    return meta


def model_card(plan: Plan, summary: dict, quality: dict) -> str:
    hub = not Path(plan.src_arg).expanduser().exists() and plan.src_arg.count("/") == 1
    front = ["---", "library_name: mlx", "tags:", "- mlx", "- glimmer-mlx", "- muse-glimmer"]
    if plan.settings.quantize:
        front.append("- quantized")
    if hub:
        front.append(f"base_model: {plan.src_arg}")
    for k, v in _card_license(plan.src).items():
        front.append(f"{k}: {v}")
    front.append("pipeline_tag: text-generation")
    front.append("---")
    lines = [*front, "", f"# {Path(summary['out']).name}", "",
             f"Converted from `{plan.src_arg}` with glimmer-mlx {quality['versions'].get('glimmer-mlx', '?')} "
             f"(mlx {quality['versions'].get('mlx', '?')}) by `glimmer convert`.", "",
             "| | |", "|---|---|",
             f"| kind | {'DFlash drafter (muse_glimmer_assistant)' if plan.kind == 'drafter' else 'Muse Glimmer target'} |",
             f"| quantization | {plan.settings.describe()} |",
             f"| dtype of unquantized tensors | {plan.dtype or 'as the source'} |",
             f"| bits per weight (all tensors) | {summary['bits_per_weight']:.3f} |",
             f"| size | {summary['bytes_out'] / 1e9:.3f} GB in {len(summary['shards'])} shard(s) |",
             f"| tensors | {summary['tensors_in']} in ({summary['parts']}), {summary['tensors_quantized']} quantized |"]
    if "vision" in summary["parts"]:
        lines.append(f"| vision tensors | {'quantized (linear weights)' if plan.settings.quantize_vision else 'kept unquantized'} |")
    if "mtp" in summary["parts"]:
        lines.append(f"| MTP tensors | kept ({summary['parts']['mtp']}), 2-D weights quantized like the text tower |")
    lines += ["", "## Measured quality", ""]
    if "logits" in quality:
        q = quality["logits"]
        lines += [f"Against the source weights in fp32 on {q['positions']} positions ({q['sample']}):", "",
                  "| KL mean | KL max | top-1 agreement | max abs logit diff |", "|---|---|---|---|",
                  f"| {q['kl_mean']:.3g} | {q['kl_max']:.3g} | {q['top1_agreement']:.3f} | "
                  f"{q['max_abs_logit_diff']:.3g} |"]
    if "drafter" in quality:
        d = quality["drafter"]
        lines += [f"τ (greedy mean acceptance length, {d['prompts']} prompts, target `{d['target']}`): "
                  f"{d['tau_source']:.3f} before, {d['tau_converted']:.3f} after; greedy output identical to plain "
                  f"decoding: {d['greedy_identical_to_plain']}. Draft logits: KL {d['draft_logits']['kl_mean']:.3g}, "
                  f"top-1 agreement {d['draft_logits']['top1_agreement']:.3f}."]
    errs = [i["rel_error_mean"] for i in quality["layers"]]
    if errs:
        lines += ["", f"Relative weight error (‖W − Ŵ‖/‖W‖, per layer): mean {np.mean(errs):.4f}, "
                      f"max {np.max(errs):.4f}; per tensor in `quality.json`."]
    lines += ["", "## Use", "", "```bash", f"glimmer generate --model {summary['out']} --prompt \"Hello\"",
              "```", ""]
    if plan.kind == "target" and "mtp" not in summary["parts"]:
        lines += ["The text tower also loads in mlx-lm (`mlx_lm.load`); mlx-lm ignores the vision tensors.", ""]
    return "\n".join(lines)
