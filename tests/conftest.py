"""Shared fixtures: tiny random Muse Glimmer checkpoints saved by transformers, and a tiny byte-level tokenizer."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every auto the suite builds starts cold, whatever an earlier run kept in the cache folder (the tests of keeping it
# turn it on: tests/test_auto_learned.py, test_cli_serve_subprocess, the quick bench's)
os.environ["GLIMMER_MLX_AUTO_LEARNED"] = "off"

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot|>", "<|start|>", "<|message|>", "<|patch|>",
                  "<|image_start|>", "<|image_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)
TRAIN_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. ",
    "Hello, world! Speculative decoding is lossless. ",
    "import os\nimport sys\nfor i in range(10):\n    print(i)\n",
    "Ünïcödé — ✓ 你好 😀 ",
] * 20


def save_tiny_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    """Byte-level BPE with the special tokens the runtime relies on (ids 0..8: BOS=0, EOS=1, EOT=2, …)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE}))
    return path


_CACHE: dict = {}

# GLIMMER_TEST_AUTO_CURVE=flat|steep bends what `auto` calibrates, so that a test's outcome cannot hang on which way
# this machine's timings fall (`.ci/run` runs the auto and batch tests both ways): flat — a verify as cheap as a plain
# step and free drafting, every model drafter pays; steep — a verify of L rows costs L plain steps and drafting is
# dear, none does. (A CI run once failed where the CI machine's calibration made MTP pay and this one's did not.)
AUTO_CURVE_ENV = "GLIMMER_TEST_AUTO_CURVE"


# GLIMMER_TEST_AUTO_LEDGER=barred: the process's shared autos (a session's `Drafters.auto()` and `batch_auto()`, which
# every test on that session shares) have ledgers that bar every option throughout — what the tests before one can
# leave them at, their wall times being this machine's. A test whose outcome needs speculation through a shared auto
# must pin what it needs; none may pass only because the ledger happened to be open. (A CI run once failed where the
# tests before one had left the shared batch auto barred or mid-check: `.ci/run` runs the auto tests this way too.)
AUTO_LEDGER_ENV = "GLIMMER_TEST_AUTO_LEDGER"


class _Everything(frozenset):
    """A barred set holding every ledger entry."""

    def __contains__(self, item) -> bool:
        return True

    def __bool__(self) -> bool:
        return True


def _bar_shared_autos() -> None:
    from glimmer_mlx import strategy
    from glimmer_mlx.speculative.auto.batch import BatchAuto

    solo, batch = strategy.Drafters.auto, strategy.Drafters.batch_auto
    barred = set()  # ids of the shared batch autos

    def auto(self, *a, **kw):
        out = solo(self, *a, **kw)
        ch = out.chooser
        if not isinstance(ch.barred, _Everything):
            ch._bar = lambda: None
            ch.barred = _Everything()
            ch._forget()
        return out

    def batch_auto(self):
        out = batch(self)
        barred.add(id(out))
        return out

    real = BatchAuto.barred
    strategy.Drafters.auto, strategy.Drafters.batch_auto = auto, batch_auto
    BatchAuto.barred = property(lambda self: id(self) in barred or real.fget(self))


def pytest_configure(config):
    ledger = os.environ.get(AUTO_LEDGER_ENV)
    if ledger:
        if ledger != "barred":
            raise pytest.UsageError(f"{AUTO_LEDGER_ENV} must be barred, got {ledger!r}")
        _bar_shared_autos()
    mode = os.environ.get(AUTO_CURVE_ENV)
    if not mode:
        return
    if mode not in ("flat", "steep"):
        raise pytest.UsageError(f"{AUTO_CURVE_ENV} must be flat or steep, got {mode!r}")
    from glimmer_mlx.speculative.auto import multiplex

    load, draft, catch_up = multiplex.load_or_calibrate, multiplex.measure_draft_costs, multiplex.measure_catch_up

    def bent_load(model, taps, max_len, **kw):
        costs, info = load(model, taps, max_len, **kw)  # the cache keeps what was measured
        c1 = costs[1]
        costs = {L: c1 if mode == "flat" else c1 * L for L in costs}
        if info.get("wide_forward_s"):
            rows = info["wide_forward_s"]["rows"]
            info = {**info, "wide_forward_s": {"rows": rows, "seconds": c1 * (1.5 if mode == "flat" else rows)}}
        return costs, info

    def bent_draft(*a, **kw):
        factor = 0.0 if mode == "flat" else 10.0
        return {n: (fixed * factor, per * factor) for n, (fixed, per) in draft(*a, **kw).items()}

    def bent_catch_up(*a, **kw):
        factor = 0.0 if mode == "flat" else 10.0
        return {n: (per * factor, quad * factor) for n, (per, quad) in catch_up(*a, **kw).items()}

    multiplex.load_or_calibrate, multiplex.measure_draft_costs = bent_load, bent_draft
    multiplex.measure_catch_up = bent_catch_up


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(seed=0, tokenizer=False, **text_overrides) -> (folder, hf_model). Cached per args."""
    from hf_fixtures import build_hf_model, save_hf_model

    def make(seed: int = 0, tokenizer: bool = False, drop_layer_lists: bool = False, **overrides):
        key = (seed, tokenizer, drop_layer_lists, tuple(sorted((k, json.dumps(v)) for k, v in overrides.items())))
        if key not in _CACHE:
            path = tmp_path_factory.mktemp("ckpt")
            hf = build_hf_model(overrides, seed=seed)
            save_hf_model(hf, path, drop_layer_lists=drop_layer_lists)
            if tokenizer:
                save_tiny_tokenizer(path)
            _CACHE[key] = (path, hf)
        return _CACHE[key]

    return make
