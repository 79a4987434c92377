"""Run transformers' MuseGlimmerProcessor (image + video processors, real transformers code) on image files and
save what it produces. Used by tests/test_vision.py in a subprocess:

    python hf_processor_oracle.py SPEC.json OUT.npz

SPEC: {"tokenizer": folder, "cases": [{"text": str, "images": [png paths], "images_kwargs": {...}}, ...],
       "videos": [{"text": str, "frames": [png paths], "fps": float}]}

transformers' Muse Glimmer processors need torchvision. When it does not import (PyPI's wheels cannot load beside
the CPU torch build), `tv_shim/` next to this file is put first on sys.path: a minimal torchvision exposing
torchvision 0.28's CPU tensor kernels that these processors call (see tv_shim/torchvision/__init__.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _ensure_torchvision() -> str:
    try:
        import torchvision  # noqa: F401

        major, minor = (int(x) for x in torchvision.__version__.split(".")[:2])
        if (major, minor) < (0, 27):  # transformers would silently fall back to BICUBIC there
            raise ImportError("torchvision < 0.27 has no CPU LANCZOS")
        return f"torchvision {torchvision.__version__}"
    except Exception:
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        sys.path.insert(0, str(Path(__file__).parent / "tv_shim"))
        import torchvision  # noqa: F401

        return "tv_shim (torchvision 0.28 CPU kernels)"


def main(spec_path: str, out_path: str) -> None:
    backend = _ensure_torchvision()
    from PIL import Image
    from transformers import PreTrainedTokenizerFast
    from transformers.models.muse_glimmer import (MuseGlimmerImageProcessor, MuseGlimmerProcessor,
                                                  MuseGlimmerVideoProcessor)
    from transformers.video_utils import VideoMetadata

    spec = json.loads(Path(spec_path).read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(spec["tokenizer"]) / "tokenizer.json"))
    proc = MuseGlimmerProcessor(image_processor=MuseGlimmerImageProcessor(),
                                video_processor=MuseGlimmerVideoProcessor(), tokenizer=tok)
    out = {"backend": np.array(backend)}
    for i, case in enumerate(spec.get("cases", [])):
        images = [Image.open(p) for p in case["images"]]
        res = proc(text=[case["text"]], images=images, images_kwargs=case.get("images_kwargs", {}),
                   return_tensors="pt")
        out[f"case{i}_pixel_values"] = res["pixel_values"].numpy()
        out[f"case{i}_grid"] = res["image_grid_thw"].numpy()
        out[f"case{i}_ids"] = res["input_ids"][0].numpy()
    for i, vid in enumerate(spec.get("videos", [])):
        frames = [np.array(Image.open(p).convert("RGB")) for p in vid["frames"]]
        video = np.stack(frames)  # [T, H, W, 3]
        meta = VideoMetadata(total_num_frames=len(frames), fps=vid["fps"], frames_indices=list(range(len(frames))))
        res = proc(text=[vid["text"]], videos=[video], videos_kwargs={"do_sample_frames": False, "return_metadata": True,
                                                                       "video_metadata": [meta]},
                   return_tensors="pt")
        out[f"video{i}_pixel_values"] = res["pixel_values_videos"].numpy()
        out[f"video{i}_grid"] = res["video_grid_thw"].numpy()
        out[f"video{i}_ids"] = res["input_ids"][0].numpy()
        # frame sampling (reference doc §5.2), on metadata alone
    for i, (total, fps) in enumerate(spec.get("sampling", [])):
        vp = MuseGlimmerVideoProcessor()
        meta = VideoMetadata(total_num_frames=total, fps=fps)
        out[f"sampling{i}"] = vp.sample_frames(meta, temporal_patch_size=2).numpy()
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
