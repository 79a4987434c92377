"""Speculative decoding: drafters propose (`dflash`, `mtp`, `ngram`, `auto`), `verify` accepts, `engine` runs the
rounds; `protocol.Drafter` is the contract between them."""

from .dflash import DFlashDrafter
from .loader import load_drafter
from .mtp import MTPDrafter, load_mtp
from .ngram import NGramDrafter
from .protocol import Drafter

__all__ = ["DFlashDrafter", "Drafter", "MTPDrafter", "NGramDrafter", "load_drafter", "load_mtp"]
