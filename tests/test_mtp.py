"""MTP layers (oracle: transformers' generic MtpModel on Muse Glimmer) and MTP speculative decoding (oracle: plain
decoding / the exact target distribution)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import mlx.core as mx
import pytest
import torch

import glimmer_mlx
from glimmer_mlx.loading import CheckpointError
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative import MTPDrafter
from glimmer_mlx.strategy import make_decoder
from hf_fixtures import build_hf_mtp, save_mtp_weights
from test_dflash import V_SMALL, _exact_joint, _marginal_tests, _spec_counts

MTP_TYPES = ["sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def mtp_pair(tiny_checkpoint):
    """(model, drafter, hf_target, hf_mtp, path): a tiny target with 2 random MTP layers in its own checkpoint."""
    path, hf = tiny_checkpoint(seed=4, num_mtp_layers=2, mtp_layer_types=MTP_TYPES)
    mtp = build_hf_mtp(hf, 2, seed=1)
    save_mtp_weights(mtp, path)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    drafter = glimmer_mlx.load_drafter(path, model)
    return model, drafter, hf, mtp, path


def _prompt(seed, n):
    return [int(x) for x in np.random.RandomState(seed).randint(10, 512, size=n)]


def test_load_drafter_returns_mtp(mtp_pair):
    model, drafter, _, _, _ = mtp_pair
    assert isinstance(drafter, MTPDrafter)
    assert drafter.depth == 2 and drafter.head.num_layers == 2
    assert len(model.mtp_weights) > 0  # carried by the target loader, not parameters of the text model


def test_mtp_layer_outputs_match_transformers(mtp_pair):
    """Depth 0 and 1 over a whole prompt, against MtpModel.forward_layer with an MtpCache."""
    from transformers.cache_utils import MtpCache

    model, drafter, hf, mtp, _ = mtp_pair
    ids = _prompt(1, 20)
    n = len(ids) - 1
    with torch.no_grad():
        h_main = hf(torch.tensor([ids]), output_hidden_states=-1).hidden_states[-1]  # final-normed
        cache = MtpCache(config=hf.config.get_mtp_config())
        x = torch.tensor([ids[1:]])
        pos = torch.arange(1, n + 1)[None]
        o0 = mtp.forward_layer(0, h_main[:, :n], pos, cache, input_ids=x)
        o1 = mtp.forward_layer(1, o0[:, :-1], pos[:, 1:], cache, input_ids=x[:, 1:])
        logits0 = mtp.shared_head(o0)
    L = model.args.num_hidden_layers
    _, (h,) = model(mx.array([ids]), taps=(L - 1,))
    np.testing.assert_allclose(np.array(h[0]), h_main[0].numpy(), atol=1e-4)
    caches = drafter.head.make_cache(2)
    e = model.embed_raw(mx.array([ids[1:]]))
    m0 = drafter.head.forward_depth(0, e, h[:, :n], caches[0])
    m1 = drafter.head.forward_depth(1, e[:, 1:], m0[:, :-1], caches[1])
    np.testing.assert_allclose(np.array(m0[0]), o0[0].numpy(), atol=2e-4)
    np.testing.assert_allclose(np.array(m1[0]), o1[0].numpy(), atol=2e-4)
    np.testing.assert_allclose(np.array(model.lm_head_raw(m0)[0]), logits0[0].numpy(), rtol=1e-4, atol=3e-4)


def test_per_round_drafts_equal_transformers_mtp(mtp_pair, monkeypatch):
    from transformers.generation.candidate_generator import MTPCandidateGenerator
    from transformers.modeling_layers import MtpModel

    model, drafter, hf, mtp, _ = mtp_pair
    # transformers finds no MTP weight pattern registered for Muse Glimmer checkpoints; hand it the module directly
    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(lambda cls, main, **kw: mtp))
    recorded = []
    orig = MTPCandidateGenerator.get_candidates

    def spy(self, input_ids, *a, **kw):
        cand, logits = orig(self, input_ids, *a, **kw)
        if logits is not None:
            recorded.append(cand[0, input_ids.shape[1]:].tolist())
        return cand, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", spy)
    ids = _prompt(3, 12)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), use_mtp=True, do_sample=False, max_new_tokens=30, eos_token_id=None,
                          pad_token_id=0)
    hf_tokens = out[0, len(ids):].tolist()
    dec = make_decoder(model, drafter, Sampler(SamplingParams()))
    dec.prefill(ids)
    ours, drafts = [], []
    while len(ours) < len(hf_tokens):
        ours += dec.step(len(hf_tokens) - len(ours))
        if dec.last_drafts:
            drafts.append(dec.last_drafts)
            dec.last_drafts = []
    assert ours == hf_tokens
    n = min(len(drafts), len(recorded))
    assert n >= 8
    for r in range(n):
        assert drafts[r] == recorded[r][: len(drafts[r])], f"round {r}"


@pytest.mark.parametrize("depth", [1, 2, 3, 4, "auto"])
def test_mtp_greedy_identity_past_window(mtp_pair, depth):
    model, drafter, _, _, _ = mtp_pair
    for seed, n in [(4, 2), (5, 9), (6, 25)]:
        ids = _prompt(seed, n)
        plain = glimmer_mlx.generate(model, ids, max_tokens=60)
        spec = glimmer_mlx.generate(model, ids, max_tokens=60, drafter=drafter, block_size=depth)
        assert spec.tokens == plain.tokens and len(spec.tokens) == 60
    drafter.set_depth(2)


def test_mtp_eos_and_max_tokens_inside_round(mtp_pair):
    model, drafter, _, _, _ = mtp_pair
    ids = _prompt(7, 10)
    plain = glimmer_mlx.generate(model, ids, max_tokens=40)
    model.eos_token_ids = {plain.tokens[11]}
    try:
        s = glimmer_mlx.generate(model, ids, max_tokens=40, drafter=drafter, block_size=3)
    finally:
        model.eos_token_ids = set()
    assert s.tokens == plain.tokens[: plain.tokens.index(plain.tokens[11])] and s.finish_reason == "stop"
    for m in (1, 2, 3, 7):
        assert glimmer_mlx.generate(model, ids, max_tokens=m, drafter=drafter, block_size=3).tokens == plain.tokens[:m]
    drafter.set_depth(2)


def test_mtp_depth_validation(mtp_pair):
    model, drafter, _, _, _ = mtp_pair
    for bad in (0, 17, "deep"):
        with pytest.raises(ValueError, match="MTP depth"):
            glimmer_mlx.generate(model, [5, 6], max_tokens=3, drafter=drafter, block_size=bad)
    drafter.set_depth(2)


def test_mtp_checkpoint_errors(mtp_pair, tmp_path):
    model, _, _, _, path = mtp_pair
    d = tmp_path / "no_types"
    shutil.copytree(path, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["text_config"]["mtp_layer_types"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mtp_layer_types is missing"):
        glimmer_mlx.load_drafter(d, model)
    d2 = tmp_path / "no_weights"
    shutil.copytree(path, d2)
    (d2 / "mtp.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing MTP tensor\(s\) \['mtp.layers.0"):
        glimmer_mlx.load_drafter(d2, model)


# -- sampling ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_mtp(tiny_checkpoint):
    path, hf = tiny_checkpoint(seed=3, vocab_size=V_SMALL, num_mtp_layers=2, mtp_layer_types=MTP_TYPES)
    save_mtp_weights(build_hf_mtp(hf, 2, seed=2), path)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    return model, glimmer_mlx.load_drafter(path, model)


def test_mtp_sampling_matches_target_distribution(small_vocab_mtp):
    model, drafter = small_vocab_mtp
    params = SamplingParams(temperature=1.0)
    prompt = [3, 7, 2, 9, 4]
    n = 2000
    counts = _spec_counts(model, drafter, prompt, params, n)
    assert _marginal_tests(counts, _exact_joint(model, prompt, params), n) < 1.0


# -- a trained MTP layer has real skill ---------------------------------------------------------------------------


def test_trained_mtp_layer_has_real_skill(tmp_path):
    from dflash_training import greedy_sequences, mean_tau, token_map_target
    from mtp_training import add_random_mtp, train_mtp

    token_map_target(tmp_path)
    add_random_mtp(tmp_path)
    model, _ = glimmer_mlx.load(tmp_path)
    model.eos_token_ids = set()
    drafter = glimmer_mlx.load_drafter(tmp_path, model)
    rng = np.random.RandomState(999)
    held = [[int(x) for x in rng.randint(10, 48, size=8)] for _ in range(6)]
    before = mean_tau(model, drafter, held)
    losses = train_mtp(model, drafter, greedy_sequences(model, 24, 8, 40, seed=0), steps=200)
    assert losses[-1] < 0.5 * losses[0]
    after = mean_tau(model, drafter, held)
    assert before < 1.2 and after > 1.6  # depth 1: at most 2 tokens per round
    for p in held[:3]:
        assert (glimmer_mlx.generate(model, p, max_tokens=40, drafter=drafter, block_size=3).tokens
                == glimmer_mlx.generate(model, p, max_tokens=40).tokens)


def test_cli_generate_with_mtp(tiny_checkpoint):
    from typer.testing import CliRunner

    from glimmer_mlx.cli import app

    path, hf = tiny_checkpoint(seed=5, tokenizer=True, num_mtp_layers=1, mtp_layer_types=["sliding_attention"])
    save_mtp_weights(build_hf_mtp(hf, 1, seed=3), path)
    runner = CliRunner()
    base = ["generate", "--model", str(path), "--prompt", "def add(a, b):", "-m", "12", "--raw"]
    plain = runner.invoke(app, base + ["--quiet"])
    assert plain.exit_code == 0, plain.output
    for extra in (["--mtp"], ["--mtp", "--mtp-depth", "3"], ["--mtp", "--mtp-depth", "auto"],
                  ["--draft-model", str(path)]):
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        assert r.stdout.startswith(plain.stdout.rstrip("\n"))  # greedy: same text as plain decoding
        assert "τ" in r.output
    bad = runner.invoke(app, base + ["--mtp-depth", "2"])
    assert bad.exit_code == 1 and "--mtp-depth needs --mtp" in bad.output
    bad = runner.invoke(app, base + ["--mtp", "--mtp-depth", "x"])
    assert bad.exit_code == 1 and "--mtp-depth must be an integer" in bad.output
    plain_path, _ = tiny_checkpoint(seed=6, tokenizer=True)
    bad = runner.invoke(app, ["generate", "--model", str(plain_path), "--prompt", "x", "--mtp"])
    assert bad.exit_code == 1 and "without MTP layers" in bad.output
