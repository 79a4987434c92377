"""What `glimmer bench` runs: modes, prompt sets, sizes; presets (`--profile quick | default | m5-max`)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources

from ..strategy import DecodeSpec

PROFILES = {
    # a first look, under 3 min on a 2-core CPU (a fresh calibration included): every category, at least 3 repeats
    # (a median and a spread; with 2 the 32-token runs put one repeat's jitter into every ratio) and more while the
    # sitting fits in 150 s (at most 12: on a machine where 3 take 40 s, one repeat's × plain swung 0.8–1.3 and the
    # median of 3 by ±10 %), one fixed DFlash block and MTP depth next to their auto widths
    "quick": dict(prompts_per_category=1, max_tokens=32, repeats=3, budget_s=150.0, max_repeats=12, warmup_tokens=8,
                  dflash_blocks=[8, "auto"], mtp_depths=[1]),
    # this CPU: enough repeats for a median and a spread
    "default": dict(prompts_per_category=2, max_tokens=96, repeats=3, warmup_tokens=16),
    # the published comparison on Apple silicon (M5 Max): every prompt, long generations, 5 repeats
    "m5-max": dict(prompts_per_category=4, max_tokens=256, repeats=5, warmup_tokens=32),
}
DEFAULT_MODES = ("ar", "dflash", "mtp", "ngram", "auto", "mlx-lm", "mlx-lm-draft")  # also every mode family
# plain decoding run a second time in every sitting that runs another mode: its × plain is how far two identical
# modes drift apart in this sitting, what every other ratio is read against (`report.verdict`: a mode below plain by
# less than that is within the sitting's noise). On this repository's 2-core VM the A/A pair of a sitting moved by
# 2-9 %, and the first command's table showed auto 0.95-0.98x plain with nothing to tell a user whether that was auto
# or the sitting
CONTROL = "ar-again"
DEFAULT_BLOCKS = (4, 8, 16, "auto")
DEFAULT_DEPTHS = (1, 2, 3)


def load_prompts() -> dict[str, list[str]]:
    """The shipped prompt sets by category (package data `bench/prompts/prompts.json`)."""
    text = resources.files("glimmer_mlx.bench").joinpath("prompts/prompts.json").read_text(encoding="utf-8")
    data = json.loads(text)
    if not isinstance(data, dict) or not all(isinstance(v, list) and v for v in data.values()):
        raise ValueError("bench/prompts/prompts.json must map each category to a non-empty list of prompts")
    return data


def _csv(s, conv, what):
    if s is None:
        return None
    items = [x.strip() for x in str(s).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{what}: empty list")
    try:
        return [conv(x) for x in items]
    except ValueError:
        raise ValueError(f"{what}: cannot parse {s!r}") from None


TREE_MODES = ("dflash", "mtp", "ngram")


def _block(x: str):
    return "auto" if x == "auto" else int(x)


def split_tree(mode: str) -> tuple[str, int | None]:
    """`dflash-b8-t15` → ("dflash-b8", 15): a `-t<N>` suffix asks for token trees of N draft nodes per round (paths
    at most the base mode's drafts deep); (mode, None) without one."""
    base, sep, nodes = mode.rpartition("-t")
    if sep and base and nodes.isdigit() and base.split("-")[0] in TREE_MODES:
        return base, int(nodes)
    return mode, None


def expand_modes(modes: list[str], blocks, depths) -> list[str]:
    """`dflash` → dflash-b<B> per block size (and dflash-auto), `mtp` → mtp-d<D> per depth; variants pass through
    (a variant of dflash / mtp / ngram may end in `-t<N>`: token trees, `split_tree`); `ar` first if not listed, and
    its control (`CONTROL`) after it where any other mode runs."""
    out = []
    for m in modes:
        base, nodes = split_tree(m)
        if nodes is not None:
            if base == "dflash-auto" or not 1 <= nodes <= 64:
                raise ValueError(f"mode {m!r}: token trees need 1..64 nodes and a fixed width (dflash-b<N>-t<T>, "
                                 f"dflash-t<T>, mtp-d<N>-t<T>, mtp-t<T>, ngram-t<T>)")
            if base not in TREE_MODES:
                expand_modes([base], blocks, depths)  # the base must be a valid variant (raises otherwise)
            out.append(m)
        elif m == "dflash":
            out += [f"dflash-{'auto' if b == 'auto' else f'b{b}'}" for b in blocks]
        elif m == "mtp":
            out += [f"mtp-d{d}" for d in depths]
        elif m in DEFAULT_MODES or m == CONTROL:
            out.append(m)
        elif m.startswith("dflash-") and (m == "dflash-auto" or (m[7:8] == "b" and m[8:].isdigit())):
            out.append(m)
        elif m.startswith("mtp-d") and m[5:].isdigit():
            out.append(m)
        else:
            raise ValueError(f"unknown mode {m!r}: choose from {', '.join(DEFAULT_MODES)} or variants dflash-b<N>, "
                             "dflash-auto, mtp-d<N>, and token trees <variant>-t<nodes> (dflash-b16-t15, ngram-t8)")
    if "ar" not in out:
        out.insert(0, "ar")  # the baseline every speedup is measured against, in the same run
    if CONTROL not in out and any(m != "ar" for m in out):
        out.insert(out.index("ar") + 1, CONTROL)  # ... and its control
    return list(dict.fromkeys(out))


def decode_spec(mode: str) -> DecodeSpec | None:
    """An expanded mode of ours → how it decodes: ar, ngram, auto as such (`CONTROL`: ar), dflash-b<N> → ("dflash", N),
    dflash-auto →
    ("dflash", "auto"), mtp-d<N> → ("mtp", N), a `-t<T>` suffix → the same with trees of T nodes; None for mlx-lm's
    own modes."""
    if mode.startswith("mlx-lm"):
        return None
    if mode == CONTROL:
        return DecodeSpec("ar")
    base, nodes = split_tree(mode)
    if nodes is not None:
        spec = decode_spec(base)
        return DecodeSpec(spec.mode, spec.width, tree=nodes)
    if mode == "dflash-auto":
        return DecodeSpec("dflash", "auto")
    if mode.startswith("dflash-b"):
        return DecodeSpec("dflash", int(mode[len("dflash-b"):]))
    if mode.startswith("mtp-d"):
        return DecodeSpec("mtp", int(mode[len("mtp-d"):]))
    return DecodeSpec(mode)


def variant_label(mode: str, dflash_variant: str | None) -> str:
    """An expanded mode's label in results and reports: `dflash-b16` → `dflash2-b16` (`dflash-auto` →
    `dflash2-auto`) when the loaded DFlash drafter is a DFlash 2 one (`DFlashDrafter.variant`), which serves mode
    dflash; every other mode as it is."""
    if dflash_variant and dflash_variant != "dflash" and mode.startswith("dflash-"):
        return dflash_variant + mode[len("dflash"):]
    return mode


@dataclass
class BenchSettings:
    profile: str = "default"
    modes: list = field(default_factory=lambda: list(DEFAULT_MODES))
    categories: list | None = None
    prompts_per_category: int = 2
    max_tokens: int = 96
    temps: list = field(default_factory=lambda: [0.0, 1.0])
    repeats: int = 3
    # more repeats after `repeats` while the whole sitting (loading and calibration included) still fits in this many
    # seconds, at most `max_repeats` in all (None: exactly `repeats`)
    budget_s: float | None = None
    max_repeats: int | None = None
    warmup_tokens: int = 16
    dflash_blocks: list = field(default_factory=lambda: list(DEFAULT_BLOCKS))
    mtp_depths: list = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    num_draft_tokens: int = 3
    seed: int = 0

    @classmethod
    def from_profile(cls, profile: str = "default", *, modes=None, categories=None, prompts_per_category=None,
                     max_tokens=None, temps=None, repeats=None, budget_s=None, dflash_blocks=None, mtp_depths=None,
                     num_draft_tokens: int = 3, seed: int = 0) -> "BenchSettings":
        """A preset, with any given value overriding it (strings are comma-separated lists). `repeats` given alone
        runs exactly that many (the preset's time budget dropped); `budget_s` given: repeats after `repeats` while
        the sitting fits in it (0: none), at most `max_repeats` (the preset's, else 4 × `repeats`)."""
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}; one of {', '.join(PROFILES)}")
        s = cls(profile=profile, seed=seed, num_draft_tokens=num_draft_tokens, **PROFILES[profile])
        lists = {"modes": (modes, str), "categories": (categories, str), "temps": (temps, float),
                 "dflash_blocks": (dflash_blocks, _block), "mtp_depths": (mtp_depths, int)}
        for field_name, (value, parse) in lists.items():
            if isinstance(value, str):
                value = _csv(value, parse, "--" + field_name.replace("_", "-"))
            if value is not None:
                setattr(s, field_name, list(value))
        for field_name, value in (("prompts_per_category", prompts_per_category), ("max_tokens", max_tokens),
                                  ("repeats", repeats)):
            if value is not None:
                setattr(s, field_name, value)
        if repeats is not None and budget_s is None:
            s.budget_s = s.max_repeats = None
        if budget_s is not None:
            s.budget_s = float(budget_s) or None
            s.max_repeats = max(s.max_repeats or 4 * s.repeats, s.repeats) if s.budget_s else None
        s.validate()
        return s

    def validate(self) -> None:
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be >= 2 (speed is measured from the first to the last token)")
        if self.repeats < 1 or self.prompts_per_category < 1:
            raise ValueError("repeats and prompts per category must be >= 1")
        if self.budget_s is not None and not (self.budget_s > 0 and math.isfinite(self.budget_s)):
            raise ValueError(f"--budget must be a finite number of seconds >= 0, got {self.budget_s}")
        if self.budget_s is not None and (self.max_repeats is None or self.max_repeats < self.repeats):
            raise ValueError(f"max_repeats must be >= repeats ({self.repeats}) with a time budget, got "
                             f"{self.max_repeats}")
        if any(t < 0 for t in self.temps):
            raise ValueError(f"temperatures must be >= 0, got {self.temps}")
        if any(b != "auto" and (not isinstance(b, int) or b < 2) for b in self.dflash_blocks):
            raise ValueError(f"DFlash block sizes must be ints >= 2 or 'auto', got {self.dflash_blocks}")
        if any(d < 1 for d in self.mtp_depths):
            raise ValueError(f"MTP depths must be >= 1, got {self.mtp_depths}")
        if self.num_draft_tokens < 1:
            raise ValueError("--num-draft-tokens must be >= 1")
        prompts = load_prompts()
        if self.categories is not None:
            bad = [c for c in self.categories if c not in prompts]
            if bad:
                raise ValueError(f"unknown categories {bad}; shipped: {', '.join(prompts)}")
        self.expanded_modes()

    def expanded_modes(self) -> list[str]:
        return expand_modes(self.modes, self.dflash_blocks, self.mtp_depths)

    def as_dict(self) -> dict:
        return asdict(self)
