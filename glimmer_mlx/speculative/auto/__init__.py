"""`auto`: per round, the fastest of a plain step and the drafters at hand (DFlash, MTP, n-gram lookup) at their
best width, on this machine. `chooser` is the pure cost model, `calibrate` measures the verify cost curve once per
machine and model, `multiplex.AutoDrafter` holds the drafters in sync behind one drafter; `engine.AutoDecoder` runs
it."""

from .calibrate import load_or_calibrate, measure_verify_costs, model_fingerprint
from .chooser import AcceptanceStats, AutoChooser, DraftCost, alpha_from_tau, robust_ema
from .multiplex import AutoDrafter, make_auto

__all__ = ["AcceptanceStats", "AutoChooser", "AutoDrafter", "DraftCost", "alpha_from_tau", "load_or_calibrate", "make_auto", "measure_verify_costs", "model_fingerprint", "robust_ema"]
