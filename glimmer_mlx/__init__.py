"""glimmer-mlx: an MLX-native runtime for Muse Glimmer with lossless speculative decoding."""

from .generate import GenerationResult, GenerationStats, generate, stream_generate
from .loading import CheckpointError, load
from .sampling import Sampler, SamplingParams
from .speculative import load_drafter, load_mtp
from .strategy import DecodeSpec, ModeError, load_drafters

__version__ = "0.1.0"

__all__ = ["load", "generate", "stream_generate", "GenerationResult", "GenerationStats", "CheckpointError",
           "SamplingParams", "Sampler", "load_drafter", "load_mtp", "load_drafters", "DecodeSpec", "ModeError",
           "__version__"]
