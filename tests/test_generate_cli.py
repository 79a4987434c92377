"""Generation behaviour (greedy/sampled equal to a manual full-forward loop, max_tokens, EOS, stop strings,
streaming, stats, streaming detokenization) and `glimmer` CLI smoke tests."""

from __future__ import annotations

import importlib
import shutil
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

import glimmer_mlx
from glimmer_mlx import Sampler, SamplingParams, generate, stream_generate
from glimmer_mlx.generate import GenerationChunk, GenerationStats

PROMPT = [366, 20, 382, 9, 17, 250, 3]
N_LONG = 30  # well past the sliding window (8): exercises the rotating caches during decoding


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    path, hf = tiny_checkpoint(tokenizer=True)
    model, tok = glimmer_mlx.load(path)
    return SimpleNamespace(path=path, hf=hf, model=model, tok=tok)


@pytest.fixture
def tok(loaded):
    """A per-test tokenizer view whose eos_token_ids may be mutated freely."""
    t = loaded.tok
    saved = set(t.eos_token_ids)
    yield t
    t.eos_token_ids = saved


def manual_loop(model, ids, n, params=SamplingParams(), seed=None, stop_ids=()):
    """Reference decoding: a full forward over the whole sequence for every token (no cache)."""
    seq, out = list(ids), []
    sampler = Sampler(params, seed=seed if seed is not None else 0)
    for _ in range(n):
        logits = model(mx.array([seq]))[:, -1]
        hist = None
        if params.repetition_penalty != 1.0:
            hist = mx.array(seq[-params.repetition_context_size :], dtype=mx.int32)
        t = int(sampler(logits, hist).item())
        if t in stop_ids:
            break
        out.append(t)
        seq.append(t)
    return out


@pytest.fixture(scope="module")
def greedy_ref(loaded):
    return manual_loop(loaded.model, PROMPT, N_LONG)


# -- greedy / sampled equal the reference loop ---------------------------------------------------------------------


def test_greedy_equals_full_forward_loop(loaded, greedy_ref):
    # the unconditional argmax, to be sure nothing below depends on the stop ids
    seq = list(PROMPT)
    for _ in range(N_LONG):
        seq.append(int(loaded.model(mx.array([seq]))[0, -1].argmax().item()))
    assert seq[len(PROMPT) :] == greedy_ref
    assert len(set(greedy_ref)) > 10  # not a degenerate repeat
    res = generate(loaded.model, PROMPT, max_tokens=N_LONG)
    assert res.tokens == greedy_ref
    assert res.finish_reason == "length" and res.text is None


def test_greedy_with_long_prompt_and_small_prefill_steps(loaded):
    prompt = (PROMPT * 4)[:25]  # 25 > window: prefill crosses the window in chunks of 3
    ref = manual_loop(loaded.model, prompt, 12)
    for step in (3, 8, 512):
        assert generate(loaded.model, prompt, max_tokens=12, prefill_step_size=step).tokens == ref


def test_prefill_with_taps_runs_the_lm_head_over_the_last_position_only(loaded, monkeypatch):
    """A prefill that collects the drafters' taps returns the same last logits and the taps of every position, and
    (like one without) projects only its last position onto the vocabulary: over a 500-token prompt the embedded
    model's LM head over every position made a prefill with taps 14 % slower."""
    from glimmer_mlx.runtime.prefill import prefill

    model = loaded.model
    prompt = (PROMPT * 4)[:25]
    rows = []
    head = type(model).logits
    monkeypatch.setattr(type(model), "logits", lambda self, h: rows.append(h.shape[1]) or head(self, h))
    plain = prefill(model, model.make_cache(), prompt, 8)
    with_taps, taps = prefill(model, model.make_cache(), prompt, 8, taps=(0, 1))
    assert np.allclose(np.array(plain), np.array(with_taps), atol=1e-5)
    assert [t.shape[1] for t in taps] == [25, 25]
    assert rows == [1] * 8  # four chunks each way, one position each


def test_greedy_with_repetition_penalty_equals_reference(loaded):
    """penalty < 1 rewards repeats, so it changes this random model's output; the context window matters too."""
    outs = {}
    for ctx in (5, 64):
        params = SamplingParams(repetition_penalty=0.5, repetition_context_size=ctx)
        outs[ctx] = manual_loop(loaded.model, PROMPT, 20, params)
        res = generate(loaded.model, PROMPT, max_tokens=20, repetition_penalty=0.5, repetition_context_size=ctx)
        assert res.tokens == outs[ctx]
    assert outs[5] != outs[64] and outs[5] != manual_loop(loaded.model, PROMPT, 20)


def test_sampled_equals_reference_with_same_seed(loaded):
    """The decoder draws one key per token from the seeded chain, exactly as a manual loop does."""
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)
    ref = manual_loop(loaded.model, PROMPT, 20, params, seed=7)
    res = generate(loaded.model, PROMPT, max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    assert res.tokens == ref


def test_seeded_sampling_reproducible(loaded):
    kw = dict(max_tokens=25, temperature=1.0, min_p=0.02)
    a = generate(loaded.model, PROMPT, seed=11, **kw).tokens
    b = generate(loaded.model, PROMPT, seed=11, **kw).tokens
    c = generate(loaded.model, PROMPT, seed=12, **kw).tokens
    assert a == b and len(a) == 25
    assert a != c


# -- max_tokens, EOS, stop strings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_tokens_respected(loaded, greedy_ref, n):
    res = generate(loaded.model, PROMPT, max_tokens=n)
    assert res.tokens == greedy_ref[:n] and res.finish_reason == "length"
    assert res.stats.generation_tokens == n


@pytest.mark.parametrize("n", [0, -3])
def test_max_tokens_must_be_positive(loaded, n):
    with pytest.raises(ValueError, match="max_tokens"):
        generate(loaded.model, PROMPT, max_tokens=n)


def _first_new(seq, k):
    """An index >= k whose token does not occur earlier in seq."""
    for i in range(k, len(seq)):
        if seq[i] not in seq[:i]:
            return i
    raise AssertionError("no fresh token")


def test_eos_stops_and_is_excluded_without_tokenizer(loaded, greedy_ref, monkeypatch):
    k = _first_new(greedy_ref, 5)
    monkeypatch.setattr(loaded.model, "eos_token_ids", {greedy_ref[k]})
    res = generate(loaded.model, PROMPT, max_tokens=N_LONG)
    assert res.tokens == greedy_ref[:k] and res.finish_reason == "stop"
    assert res.stats.generation_tokens == k


def test_eos_stops_and_is_excluded_with_tokenizer(loaded, greedy_ref, tok):
    k = _first_new(greedy_ref, 9)
    tok.eos_token_ids = {1, 2, greedy_ref[k]}
    res = generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG)
    assert res.tokens == greedy_ref[:k] and res.finish_reason == "stop"
    assert res.text == tok.decode(greedy_ref[:k])
    chunks = list(stream_generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG))
    assert sum((c.tokens for c in chunks), []) == greedy_ref[:k]
    assert chunks[-1].finish_reason == "stop" and all(c.finish_reason is None for c in chunks[:-1])


def test_eos_as_first_token(loaded, greedy_ref, tok):
    tok.eos_token_ids = {greedy_ref[0]}
    res = generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=10)
    assert res.tokens == [] and res.text == "" and res.finish_reason == "stop"


def _clean_substring(text: str, start: int, length: int = 3) -> str:
    for i in range(start, len(text) - length):
        s = text[i : i + length]
        if "\ufffd" not in s and s.strip() and text.find(s) == i:
            return s
    raise AssertionError("no clean substring")


def test_stop_string_cuts_text_and_stops(loaded, tok):
    full = generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG)
    assert full.finish_reason == "length" and len(full.text) > 20
    stop = _clean_substring(full.text, 10)
    cut = full.text.find(stop)
    res = generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG, stop=[stop])
    assert res.text == full.text[:cut]
    assert res.finish_reason == "stop"
    assert len(res.tokens) < len(full.tokens) and res.tokens == full.tokens[: len(res.tokens)]
    assert stop in tok.decode(res.tokens)  # generation ran exactly up to the token that completed the stop string
    assert stop not in tok.decode(res.tokens[:-1])
    # the earliest of several stop strings wins; a stop string that never occurs changes nothing
    later = _clean_substring(full.text, cut + len(stop) + 2)
    assert generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG, stop=[later, stop]).text == res.text
    never = generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG, stop=["\x00never\x00"])
    assert never.text == full.text and never.finish_reason == "length"


def test_stop_strings_need_a_tokenizer(loaded):
    with pytest.raises(ValueError, match="tokenizer"):
        generate(loaded.model, PROMPT, max_tokens=3, stop=["x"])


@pytest.mark.parametrize("stop", [None, "mid"], ids=["no-stop", "stop"])
def test_stream_chunks_concatenate_to_generate_text(loaded, tok, stop):
    full = generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG)
    stops = [_clean_substring(full.text, 15)] if stop else None
    res = generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG, stop=stops)
    chunks = list(stream_generate(loaded.model, PROMPT, tokenizer=tok, max_tokens=N_LONG, stop=stops))
    assert len(chunks) > 3
    assert "".join(c.text for c in chunks) == res.text
    assert sum((c.tokens for c in chunks), []) == res.tokens
    assert chunks[-1].finish_reason == res.finish_reason
    assert all(isinstance(c, GenerationChunk) for c in chunks)


def test_text_prompt_equals_token_prompt(loaded, tok):
    a = generate(loaded.model, "Hello, world!", tokenizer=tok, max_tokens=8)
    b = generate(loaded.model, tok.encode("Hello, world!"), tokenizer=tok, max_tokens=8)
    assert a.tokens == b.tokens and a.text == b.text


def test_bad_prompts(loaded):
    with pytest.raises(ValueError, match="tokenizer"):
        generate(loaded.model, "text without tokenizer", max_tokens=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(loaded.model, [1, 512], max_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(loaded.model, [], max_tokens=2)


# -- stats ---------------------------------------------------------------------------------------------------------


def test_stats(loaded):
    res = generate(loaded.model, PROMPT, max_tokens=12)
    s = res.stats
    assert s.prompt_tokens == len(PROMPT) and s.generation_tokens == 12
    assert s.prompt_time > 0 and s.generation_time > 0 and s.prompt_tps > 0 and s.generation_tps > 0
    assert s.peak_memory_gb > 0 and s.mode == "ar"
    line = s.line()
    assert isinstance(line, str) and "prompt: 7 tok" in line and "generation: 12 tok" in line
    d = s.as_dict()
    assert d["generation_tokens"] == 12 and d["prompt_tps"] == s.prompt_tps


def test_stream_stats_filled_in(loaded):
    stats = GenerationStats()
    n = sum(len(c.tokens) for c in stream_generate(loaded.model, PROMPT, max_tokens=5, stats=stats))
    assert n == 5 and stats.generation_tokens == 5 and stats.prompt_tokens == len(PROMPT)


# -- streaming detokenization --------------------------------------------------------------------------------------

MULTIBYTE = "Hi 你好 😀 🚀 日本語 ñ 𝄞\nÜnïcödé — ✓ 🎉🎉 end"


def test_fixture_tokenizer_splits_characters(tok):
    """Guard: the text really has characters split across tokens (else the tests below prove nothing)."""
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 8
    assert tok.decode(ids) == MULTIBYTE


def test_detokenizer_never_emits_replacement_char(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    d = tok.detokenizer()
    pieces = [d.add(i) for i in ids]
    pieces.append(d.finalize())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == MULTIBYTE == d.text
    assert sum(1 for p in pieces if p) > 5  # it streams; it does not hold everything to the end


class ScriptedModel:
    """Emits a fixed token script through one-hot logits: just enough of the model interface for PlainDecoder."""

    def __init__(self, script, vocab):
        self.script, self.calls = list(script), 0
        self.args = SimpleNamespace(vocab_size=vocab, eos_token_ids=[1])
        self.eos_token_ids = {1}

    def make_cache(self):
        return []

    def __call__(self, ids, cache=None, taps=None, last=None):
        t = self.script[self.calls] if self.calls < len(self.script) else 1
        self.calls += 1
        return mx.where(mx.arange(self.args.vocab_size) == t, 10.0, -10.0)[None, None]


def test_stream_generate_never_emits_replacement_char(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    chunks = list(stream_generate(ScriptedModel(ids, tok.vocab_size), [5], tokenizer=tok, max_tokens=200))
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == MULTIBYTE
    assert chunks[-1].finish_reason == "stop"


def test_stream_generate_multibyte_with_stop_string(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    chunks = list(stream_generate(ScriptedModel(ids, tok.vocab_size), [5], tokenizer=tok, max_tokens=200,
                                  stop=["語 ñ"]))
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == MULTIBYTE[: MULTIBYTE.find("語 ñ")]
    assert chunks[-1].finish_reason == "stop"


def test_stream_generate_multibyte_cut_by_max_tokens(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    n = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))  # stops mid-character
    chunks = list(stream_generate(ScriptedModel(ids, tok.vocab_size), [5], tokenizer=tok, max_tokens=n))
    assert "".join(c.text for c in chunks) == tok.decode(ids[:n])  # the partial character comes out at the end
    assert chunks[-1].finish_reason == "length"


def test_eos_after_partial_character_flushes_held_text(tok):
    ids = tok.encode("ab 🚀", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    res = generate(ScriptedModel(ids[:cut] + [1], tok.vocab_size), [5], tokenizer=tok, max_tokens=50)
    assert res.finish_reason == "stop" and res.tokens == ids[:cut]
    assert res.text == tok.decode(ids[:cut])  # as with finish_reason "length": "ab " + the lone bytes, not "ab"


# -- CLI -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def cli(runner, *args, input=None):
    from glimmer_mlx.cli import app

    return runner.invoke(app, [str(a) for a in args], input=input)


def chat_ids(tok, prompt):
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)


def test_cli_help(runner):
    res = cli(runner, "--help")
    assert res.exit_code == 0
    assert "generate" in res.stdout and "info" in res.stdout


def test_cli_generate(runner, loaded):
    res = cli(runner, "generate", "--model", loaded.path, "--prompt", "Hello", "-m", 5)
    assert res.exit_code == 0, res.output
    want = generate(loaded.model, chat_ids(loaded.tok, "Hello"), tokenizer=loaded.tok, max_tokens=5)
    assert len(want.text) > 0
    assert res.stdout == want.text + "\n"  # the text, verbatim
    assert "prompt:" in res.stderr and "generation: 5 tok" in res.stderr and "tok/s" in res.stderr


def test_cli_generate_prompt_from_stdin(runner, loaded):
    a = cli(runner, "generate", "--model", loaded.path, "--prompt", "-", "-m", 6, "--quiet", input="Hello")
    b = cli(runner, "generate", "--model", loaded.path, "--prompt", "Hello", "-m", 6, "--quiet")
    c = cli(runner, "generate", "--model", loaded.path, "--prompt", "Goodbye", "-m", 6, "--quiet")
    assert a.exit_code == b.exit_code == c.exit_code == 0, a.output
    assert a.stdout == b.stdout and a.stdout != c.stdout
    assert "tok/s" not in a.stderr


def test_cli_generate_raw_and_sampling_options(runner, loaded):
    res = cli(runner, "generate", "--model", loaded.path, "--prompt", "Hello", "-m", 8, "--raw", "--temp", 0.8,
              "--top-k", 40, "--seed", 3, "--quiet")
    assert res.exit_code == 0, res.output
    want = generate(loaded.model, loaded.tok.encode("Hello"), tokenizer=loaded.tok, max_tokens=8, temperature=0.8,
                    top_k=40, seed=3)
    assert res.stdout == want.text + "\n"


def test_cli_prints_model_text_verbatim(runner, loaded, monkeypatch):
    """Generated text is data: no rich markup, emoji codes or control-character stripping."""
    text = "[bold]x[/bold] :smile: \x07 \r back\\slash 😀"

    def fake_stream(*a, **kw):
        kw["stats"].generation_tokens = 3
        yield GenerationChunk([5], text[:10])
        yield GenerationChunk([6, 7], text[10:], "length")

    monkeypatch.setattr(importlib.import_module("glimmer_mlx.cli.generate"), "stream_generate", fake_stream)
    res = cli(runner, "generate", "--model", loaded.path, "--prompt", "Hello", "--quiet")
    assert res.exit_code == 0, res.output
    assert res.stdout == text + "\n"


@pytest.mark.parametrize("args,fragment", [
    (["--top-p", "0"], "top_p"),
    (["--temp", "-1"], "temperature"),
    (["--dtype", "int8"], "unknown dtype"),
    (["--block-size", "abc"], "block-size"),
])
def test_cli_generate_bad_options(runner, loaded, args, fragment):
    res = cli(runner, "generate", "--model", loaded.path, "--prompt", "Hello", "-m", 2, *args)
    assert res.exit_code == 1, res.output
    assert fragment in res.stderr and "Traceback" not in res.output
    assert isinstance(res.exception, SystemExit)


def _total(output: str) -> int:
    line = next(ln for ln in output.splitlines() if "total" in ln)
    return int("".join(ch for ch in line if ch.isdigit()))


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}, {"tie_word_embeddings": True},
                                       {"num_key_value_heads": 1, "head_dim": 32}],
                         ids=["default", "attention_bias", "text_tie_flag", "gqa4_hd32"])
def test_cli_info_total_matches_hf(runner, tiny_checkpoint, overrides):
    path, hf = tiny_checkpoint(**overrides)
    res = cli(runner, "info", path)
    assert res.exit_code == 0, res.output
    assert "parameters" in res.stdout and "embedding" in res.stdout and "vision" in res.stdout
    assert _total(res.stdout) == sum(p.numel() for p in hf.parameters())
    assert "memory" in res.stdout and "bf16" in res.stdout


def test_cli_info_parts_match_hf(tiny_checkpoint):
    from glimmer_mlx.info import model_info

    path, hf = tiny_checkpoint()
    parts = model_info(path)["parameters"]
    lm = hf.model.language_model
    assert parts["embedding"] == lm.embed_tokens.weight.numel()
    assert parts["layers"] == sum(p.numel() for p in lm.layers.parameters())
    assert parts["final_norm"] == lm.norm.weight.numel()
    assert parts["lm_head"] == hf.lm_head.weight.numel()
    vision = sum(p.numel() for n, p in hf.named_parameters() if "vision" in n)
    assert parts["vision"] == vision


@pytest.mark.parametrize("command", ["generate", "info"])
def test_cli_missing_model_folder(runner, tmp_path, command):
    missing = tmp_path / "no-such-model"
    args = ["generate", "--model", missing, "--prompt", "hi"] if command == "generate" else ["info", missing]
    res = cli(runner, *args)
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit)
    assert "error:" in res.stderr and "no-such-model" in res.stderr and "no such folder" in res.stderr
    assert "Traceback" not in res.output


def test_cli_generate_without_tokenizer(runner, tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint()
    path = tmp_path / "notok"
    shutil.copytree(src, path)
    res = cli(runner, "generate", "--model", path, "--prompt", "hi")
    assert res.exit_code == 1 and "no tokenizer.json" in res.stderr


def test_cli_generate_stop_string(runner, loaded):
    full = generate(loaded.model, chat_ids(loaded.tok, "Hello"), tokenizer=loaded.tok, max_tokens=20)
    stop = _clean_substring(full.text, 5, 2)
    res = cli(runner, "generate", "--model", loaded.path, "--prompt", "Hello", "-m", 20, "--stop", stop, "--quiet")
    assert res.exit_code == 0, res.output
    assert res.stdout == full.text[: full.text.find(stop)] + "\n"
