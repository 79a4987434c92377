"""DFlash drafter conformance (oracle: transformers) and the speculative engine (oracle: plain decoding)."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest
import torch

import glimmer_mlx
from glimmer_mlx.loading import CheckpointError
from glimmer_mlx.sampling import Sampler, SamplingParams
from glimmer_mlx.speculative import load_drafter
from glimmer_mlx.strategy import make_decoder
from hf_fixtures import build_hf_drafter
from chi_square import chi2, chi2_critical

DRAFTER_CACHE: dict = {}


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tmp_path_factory):
    """Factory: (model, drafter, hf_target, hf_drafter) for drafter config overrides (target: tiny, window 8)."""
    path, hf = tiny_checkpoint()
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()  # random weights: let every generation run to max_tokens

    def make(**overrides):
        key = tuple(sorted((k, str(v)) for k, v in overrides.items()))
        if key not in DRAFTER_CACHE:
            dr = build_hf_drafter(overrides)
            d = tmp_path_factory.mktemp("drafter")
            dr.save_pretrained(d)
            DRAFTER_CACHE[key] = (d, dr)
        d, dr = DRAFTER_CACHE[key]
        return model, load_drafter(d, model), hf, dr

    return make


def _prompt(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.RandomState(seed).randint(10, 512, size=n)]


def _hf_drafter_hidden(hf, dr, ids, anchor, n_ctx_chunks):
    """transformers' drafter over a context fed to its DFlashCache in chunks, as the DFlash loop does."""
    from transformers.cache_utils import DFlashCache

    B = dr.config.block_size
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    ctx = torch.cat([out.hidden_states[i + 1] for i in dr.config.target_layer_ids], -1)
    emb = hf.model.language_model.embed_tokens.weight
    cache = DFlashCache(config=dr.config)
    cache.activate_past_recording()
    bounds = np.linspace(0, len(ids), n_ctx_chunks + 1).astype(int)
    first = True
    for a, b in zip(bounds[:-1], bounds[1:]):
        cache.set_previous_accepted_tokens(int(b - a))
        if not first:
            cache.crop(-B)
        noise = emb[torch.tensor([[anchor] + [dr.config.mask_token_id] * (B - 1)])].detach()
        pos = torch.cat([torch.arange(a, b), torch.arange(B) + b])[None]
        with torch.no_grad():
            h = dr(noise_embeds=noise, context_hidden_states=ctx[:, a:b], position_ids=pos, cache=cache)
        first = False
    return ctx, h.last_hidden_state[0].numpy(), bounds


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 100}, {"layer_types": ["full_attention"] * 2},
                                       {"block_size": 8, "sliding_window": 5}])
def test_drafter_matches_transformers(pair, overrides):
    model, drafter, hf, dr = pair(**overrides)
    ids = _prompt(1, 27)
    ctx, ref, bounds = _hf_drafter_hidden(hf, dr, ids, anchor=77, n_ctx_chunks=3)
    cache = drafter.make_cache()
    for a, b in zip(bounds[:-1], bounds[1:]):
        h = drafter.draft_hidden(77, mx.array(ctx[:, a:b].numpy()), int(b), cache)
    np.testing.assert_allclose(np.array(h), ref[1:], atol=2e-5, rtol=0)
    # draft logits: transformers uses the raw lm_head (no multiplier, no softcap)
    raw = hf.lm_head(torch.tensor(ref[1:])).detach().numpy()
    drafter.draft_logits = "raw"
    np.testing.assert_allclose(np.array(drafter.logits(h)), raw, atol=1e-4, rtol=0)
    drafter.draft_logits = "target"  # the default: the target's multiplier + softcap on the same raw logits
    cap, m = model.args.final_logit_softcapping, model.args.output_multiplier
    np.testing.assert_allclose(np.array(drafter.logits(h)), cap * np.tanh(raw * m / cap), atol=1e-4, rtol=0)


def test_drafter_window_is_inclusive(pair):
    """|q - k| <= W: breaking the window by one must change the result (guards the off-by-one trap)."""
    model, drafter, hf, dr = pair(block_size=8, sliding_window=5)
    ids = _prompt(2, 20)
    ctx, ref, _ = _hf_drafter_hidden(hf, dr, ids, anchor=33, n_ctx_chunks=1)
    for layer in drafter.assistant.layers:
        layer.self_attn.window -= 1
    try:
        h = drafter.draft_hidden(33, mx.array(ctx.numpy()), len(ids), drafter.make_cache())
        assert np.abs(np.array(h) - ref[1:]).max() > 1e-3
    finally:
        for layer in drafter.assistant.layers:
            layer.self_attn.window += 1


def test_per_round_drafts_equal_transformers_dflash(pair, monkeypatch):
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    model, drafter, hf, dr = pair()
    ids = _prompt(3, 12)
    recorded = []
    orig = DFlashTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, *a, **kw):
        cand, logits = orig(self, input_ids, *a, **kw)
        if logits is not None:
            recorded.append(cand[0, input_ids.shape[1]:].tolist())
        return cand, logits

    monkeypatch.setattr(DFlashTokenCandidateGenerator, "get_candidates", spy)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), assistant_model=dr, speculation_type="dflash", do_sample=False,
                          max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    hf_tokens = out[0, len(ids):].tolist()

    dec = make_decoder(model, drafter, Sampler(SamplingParams()))
    dec.prefill(ids)
    ours, drafts = [], []
    while len(ours) < len(hf_tokens):
        ours += dec.step(len(hf_tokens) - len(ours))
        if dec.last_drafts and dec.rounds:
            drafts.append(list(dec.last_drafts))
            dec.last_drafts = []
    assert ours == hf_tokens
    n = min(len(drafts), len(recorded))
    assert n >= 5
    for r in range(n):
        k = len(drafts[r])
        assert drafts[r] == recorded[r][:k], f"round {r}"


@pytest.mark.parametrize("block_size", [2, 4, "auto"])
def test_greedy_identity_past_window(pair, block_size):
    model, drafter, _, _ = pair()
    for seed, n in [(4, 3), (5, 9), (6, 30)]:
        ids = _prompt(seed, n)
        plain = glimmer_mlx.generate(model, ids, max_tokens=70)
        spec = glimmer_mlx.generate(model, ids, max_tokens=70, drafter=drafter, block_size=block_size)
        assert spec.tokens == plain.tokens
        assert len(spec.tokens) == 70  # far past the target's window of 8 and the drafter's of 6


def test_greedy_identity_with_eos_inside_block(pair):
    model, drafter, _, _ = pair(sliding_window=100)
    ids = _prompt(7, 10)
    plain = glimmer_mlx.generate(model, ids, max_tokens=40)
    stop = plain.tokens[17]
    saved = model.eos_token_ids
    model.eos_token_ids = {stop}
    try:
        p = glimmer_mlx.generate(model, ids, max_tokens=40)
        s = glimmer_mlx.generate(model, ids, max_tokens=40, drafter=drafter)
    finally:
        model.eos_token_ids = saved
    assert s.tokens == p.tokens == plain.tokens[: plain.tokens.index(stop)]
    assert s.finish_reason == p.finish_reason == "stop"
    for m in (1, 2, 5, 13):  # max_tokens cutting inside a block
        assert glimmer_mlx.generate(model, ids, max_tokens=m, drafter=drafter).tokens == plain.tokens[:m]


def test_block_size_validation(pair):
    model, drafter, _, _ = pair()
    for bad in (1, 5, 0, "big"):
        with pytest.raises(ValueError, match="block_size"):
            glimmer_mlx.generate(model, [5, 6], max_tokens=3, drafter=drafter, block_size=bad)


def test_drafter_fit_errors(pair, tiny_checkpoint, tmp_path):
    model, _, _, _ = pair()
    for overrides, msg in [({"hidden_size": 32, "head_dim": 8}, "hidden_size 32 != target hidden_size 64"),
                           ({"target_layer_ids": [1, 9]}, r"target_layer_ids \[9\] outside"),
                           ({"mask_token_id": 600}, "mask_token_id 600 outside")]:
        d = tmp_path / msg[:8].replace(" ", "_")
        build_hf_drafter(overrides).save_pretrained(d)
        with pytest.raises(CheckpointError, match=msg):
            load_drafter(d, model)


# ---------------------------------------------------------------------------------------------------------------
# Sampling is lossless: the speculative token distribution equals the target's exact distribution.

V_SMALL = 12


def _exact_joint(model, prompt, params, tokens=3):
    """P(t1..t_tokens) of plain sampling, by enumerating every continuation (vocab 12): an array [V_SMALL] * tokens."""
    from glimmer_mlx.sampling import process

    joint, seqs = np.ones(()), [[]]
    for i in range(tokens):
        logits = model(mx.array([prompt + q for q in seqs], dtype=mx.int32))[:, -1]
        joint = joint[..., None] * np.exp(np.array(process(logits, params))).reshape((V_SMALL,) * (i + 1))
        seqs = [q + [a] for q in seqs for a in range(V_SMALL)]
    return joint


def _spec_counts(model, drafter, prompt, params, n, tokens=3, verified=1):
    """Counts of n seeded generations of `tokens` tokens; asserts that at least `verified` of them ran a verified
    round (what a distribution test of a speculative mode tests: n-gram lookup drafts only where its context matched,
    auto only where it chose to)."""
    counts, ran = np.zeros((V_SMALL,) * tokens), 0
    for seed in range(n):
        r = glimmer_mlx.generate(model, prompt, max_tokens=tokens, temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, min_p=params.min_p, seed=seed, drafter=drafter)
        assert r.stats.extra["rounds"] >= 1  # token 1 from the prefill; the rest from verified round(s)
        ran += r.stats.extra["rounds"] > r.stats.extra["plain_rounds"]
        counts[tuple(r.tokens)] += 1
    assert ran >= verified, ran
    return counts


@pytest.fixture(scope="module")
def small_vocab_pair(tiny_checkpoint, tmp_path_factory):
    path, _ = tiny_checkpoint(seed=3, vocab_size=V_SMALL)
    model, _ = glimmer_mlx.load(path)
    model.eos_token_ids = set()
    d = tmp_path_factory.mktemp("drafter_v12")
    build_hf_drafter({"mask_token_id": V_SMALL - 1}, seed=5).save_pretrained(d)
    return model, load_drafter(d, model)


def _marginal_tests(counts, joint, n, pairs_from=1):
    """Chi-square on each token's marginal and on each pair of consecutive tokens from token `pairs_from` (0-based: the
    first a verified round gives; 3 tokens, 1: t1, t2, t3 and (t2, t3)); returns the worst stat/critical."""
    dims, worst = counts.ndim, 0.0
    for keep in [(i,) for i in range(dims)] + [(i, i + 1) for i in range(pairs_from, dims - 1)]:
        axes = tuple(a for a in range(dims) if a not in keep)
        stat, df = chi2(counts.sum(axis=axes).ravel(), joint.sum(axis=axes).ravel(), n)
        worst = max(worst, stat / chi2_critical(df))
    return worst


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6)])
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, params):
    model, drafter = small_vocab_pair
    prompt = [3, 7, 2, 9, 4]
    joint = _exact_joint(model, prompt, params)
    n = 2000
    counts = _spec_counts(model, drafter, prompt, params, n)
    assert _marginal_tests(counts, joint, n) < 1.0


def test_broken_verifier_is_detected(small_vocab_pair, monkeypatch):
    """The same test fails for a classic bug: resampling from p instead of the residual max(0, p − q)."""
    from glimmer_mlx.speculative import engine

    def broken(p_logprobs, q_logprobs, drafts, sampler):
        k = len(drafts)
        d = mx.array(drafts, dtype=mx.int32)[:, None]
        lp = mx.take_along_axis(p_logprobs[:k], d, axis=-1)[:, 0]
        lq = mx.take_along_axis(q_logprobs, d, axis=-1)[:, 0]
        accept = mx.log(sampler.uniform((k,))) <= lp - lq
        n = int(mx.sum(mx.cumprod(accept.astype(mx.int32))).item())
        return n, int(mx.random.categorical(p_logprobs[n], key=sampler.next_key()).item())  # bug: p, not residual

    monkeypatch.setattr(engine, "verify_sampling", broken)
    model, drafter = small_vocab_pair
    params = SamplingParams(temperature=1.0)
    prompt = [3, 7, 2, 9, 4]
    joint = _exact_joint(model, prompt, params)
    n = 2000
    counts = _spec_counts(model, drafter, prompt, params, n)
    assert _marginal_tests(counts, joint, n) > 1.0


def test_sampling_is_seeded(small_vocab_pair):
    model, drafter = small_vocab_pair
    a = glimmer_mlx.generate(model, [3, 7, 2], max_tokens=20, temperature=1.0, seed=11, drafter=drafter)
    b = glimmer_mlx.generate(model, [3, 7, 2], max_tokens=20, temperature=1.0, seed=11, drafter=drafter)
    c = glimmer_mlx.generate(model, [3, 7, 2], max_tokens=20, temperature=1.0, seed=12, drafter=drafter)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_trained_drafter_has_real_skill(tmp_path):
    """A drafter trained (DFlash loss, target frozen) on the target's own greedy outputs reaches τ well above 1 on
    held-out prompts, with output still identical to plain decoding."""
    from dflash_training import mean_tau, trained_pair

    model, drafter, held, before = trained_pair(tmp_path)
    after = mean_tau(model, drafter, held)
    assert before < 1.2
    assert after > 2.5  # block 4: at most 4 tokens per round
    for p in held[:3]:
        assert (glimmer_mlx.generate(model, p, max_tokens=40, drafter=drafter).tokens
                == glimmer_mlx.generate(model, p, max_tokens=40).tokens)
