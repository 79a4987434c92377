"""Speculative decoding: drafters propose (DFlash, MTP), `verify` accepts, `engine` runs the rounds."""

from .drafter import DFlashDrafter, load_drafter
from .mtp import MTPDrafter, load_mtp

__all__ = ["DFlashDrafter", "MTPDrafter", "load_drafter", "load_mtp"]
