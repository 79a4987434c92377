"""Speculative decoding: drafters propose, `verify` accepts, `engine` runs the rounds."""

from .drafter import DFlashDrafter, load_drafter

__all__ = ["DFlashDrafter", "load_drafter"]
