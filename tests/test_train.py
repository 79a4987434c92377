"""`glimmer train dflash` / `glimmer train mtp`: loss goes down, τ rises, checkpoints round-trip through
transformers, resume continues, bad data is reported."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import glimmer_mlx
from glimmer_mlx.cli import app
from glimmer_mlx.speculative import DFlashDrafter, MTPDrafter

WORDS = "the quick brown fox jumps over lazy dog def return import print hello world".split()


def write_chats(path, n=24, seed=0, extra_lines=()):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            u = " ".join(rng.choice(WORDS) for _ in range(5))
            a = " ".join(rng.choice(WORDS) for _ in range(12))
            f.write(json.dumps({"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]})
                    + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint):
    path, hf = tiny_checkpoint(seed=7, tokenizer=True)
    return path, hf


DFLASH_ARGS = ["--layers", "1", "--block-size", "4", "--mask-token-id", "8", "--batch-size", "4", "--lr", "3e-3",
               "--eval-tokens", "12", "--anchors-per-seq", "4"]


def test_train_dflash_command(target_dir, tmp_path):
    path, hf = target_dir
    chats = write_chats(tmp_path / "chats.jsonl", extra_lines=["{not json", json.dumps(
        {"messages": [{"role": "user", "content": "no reply"}]})])
    out = tmp_path / "drafter"
    r = CliRunner().invoke(app, ["train", "dflash", "--model", str(path), "--out", str(out), "--data", str(chats),
                                 "--epochs", "12", "--save-every", "5", *DFLASH_ARGS])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "train_summary.json").read_text())
    assert s["final_loss"] < 0.8 * s["first_loss"]
    assert s["val_loss"] is not None and s["tokens_per_s"] > 0
    assert s["data"]["skipped"] == {"malformed JSON lines": 1, "conversations without an assistant turn": 1}
    ev = json.loads((out / "eval.json").read_text())
    assert ev["before"]["tau_greedy"] >= 1.0 and ev["after"]["tau_greedy"] >= 1.0
    # the output is the official layout: our loader and transformers read it and agree
    model, _ = glimmer_mlx.load(path)
    drafter = glimmer_mlx.load_drafter(out, model)
    assert isinstance(drafter, DFlashDrafter) and drafter.block_size == 4
    from transformers import MuseGlimmerAssistantModel
    from transformers.cache_utils import DFlashCache

    ref = MuseGlimmerAssistantModel.from_pretrained(out).eval()
    ctx = torch.randn(1, 10, 2 * 64)
    noise_ids = [[37, 8, 8, 8]]
    noise = hf.model.language_model.embed_tokens.weight[torch.tensor(noise_ids)].detach()
    cache = DFlashCache(config=ref.config)
    cache.set_previous_accepted_tokens(10)
    with torch.no_grad():
        want = ref(noise_embeds=noise, context_hidden_states=ctx, position_ids=torch.arange(14)[None],
                   cache=cache).last_hidden_state[0, 1:].numpy()
    got = drafter.draft_hidden(37, mx.array(ctx.numpy()), 10, drafter.make_cache())
    np.testing.assert_allclose(np.array(got), want, atol=1e-4)


def test_train_mtp_command_and_transformers_layout(target_dir, tmp_path):
    path, hf = target_dir
    chats = write_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "mtp"
    r = CliRunner().invoke(app, ["train", "mtp", "--model", str(path), "--out", str(out), "--data", str(chats),
                                 "--mtp-layers", "2", "--epochs", "8", "--batch-size", "4", "--lr", "3e-3",
                                 "--eval-tokens", "12"])
    assert r.exit_code == 0, r.output
    s = json.loads((out / "train_summary.json").read_text())
    assert s["final_loss"] < 0.8 * s["first_loss"]
    model, _ = glimmer_mlx.load(path)
    drafter = glimmer_mlx.load_drafter(out, model)
    assert isinstance(drafter, MTPDrafter) and drafter.head.num_layers == 2
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    assert cfg["num_mtp_layers"] == 2 and len(cfg["mtp_layer_types"]) == 2
    # transformers' MtpModel takes the weights as they are (names and shapes)
    from safetensors.torch import load_file
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration
    from transformers.modeling_layers import MtpModel

    main = MuseGlimmerForConditionalGeneration(MuseGlimmerConfig.from_pretrained(out)).eval()
    mtp = MtpModel(main, 2)
    sd = {k[len("mtp."):]: v for k, v in load_file(str(out / "mtp.safetensors")).items()}
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    assert not unexpected
    assert all(k.startswith(("embed_tokens", "shared_head")) for k in missing)


def test_resume_continues_from_saved_step(target_dir, tmp_path):
    path, _ = target_dir
    chats = write_chats(tmp_path / "chats.jsonl", n=40)
    out = tmp_path / "d"
    base = ["train", "dflash", "--model", str(path), "--out", str(out), "--data", str(chats), "--epochs", "4",
            *DFLASH_ARGS]
    r1 = CliRunner().invoke(app, base + ["--max-steps", "6", "--save-every", "3"])
    assert r1.exit_code == 0, r1.output
    st1 = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert st1["step"] == 6
    again = CliRunner().invoke(app, base + ["--max-steps", "6"])
    assert again.exit_code == 1 and "--resume" in again.output  # never overwrites a finished run silently
    r2 = CliRunner().invoke(app, base + ["--max-steps", "10", "--resume"])
    assert r2.exit_code == 0, r2.output
    st2 = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
    assert st2["step"] == 10 and st2["losses"][:6] == st1["losses"]


@pytest.mark.parametrize("content,message", [
    ("", "no usable training sequences"),
    ("{bad\n[1, 2]\n", "skipped: 1 lines without a valid 'messages' list, 1 malformed JSON lines"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n",
     "1 conversations without an assistant turn"),
])
def test_bad_data_is_reported(target_dir, tmp_path, content, message):
    path, _ = target_dir
    f = tmp_path / "data.jsonl"
    f.write_text(content)
    r = CliRunner().invoke(app, ["train", "dflash", "--model", str(path), "--out", str(tmp_path / "o"), "--data",
                                 str(f), *DFLASH_ARGS])
    assert r.exit_code == 1
    assert message in " ".join(r.output.split())


def test_long_sequences_are_truncated_and_counted(target_dir, tmp_path):
    from glimmer_mlx.train.data import build_sequences

    path, _ = target_dir
    _, tok = glimmer_mlx.load(path)
    chats = write_chats(tmp_path / "c.jsonl", n=5)
    full, _ = build_sequences(tok, chats=chats, max_length=10_000)
    limit = min(len(s.ids) for s in full) - 3  # cuts into every reply, keeps the replies' start
    seqs, report = build_sequences(tok, chats=chats, max_length=limit)
    assert report.truncated == 5 and len(seqs) == 5 and all(len(s.ids) == limit for s in seqs)
    missing = CliRunner().invoke(app, ["train", "mtp", "--model", str(path), "--out", str(tmp_path / "o"),
                                       "--data", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 1 and "nope.jsonl: no such file" in missing.output


def test_trained_drafter_beats_untrained_on_held_out(tmp_path):
    """The recipe itself (random anchors, weighted block loss): τ of the trained drafter clearly above the untrained
    one on held-out prompts of a target whose greedy continuations are learnable."""
    from dflash_training import greedy_sequences, token_map_target
    from glimmer_mlx.train.data import Sequence
    from glimmer_mlx.train.loop import TrainConfig
    from glimmer_mlx.train.recipes import acceptance, new_assistant_config, train_dflash
    from glimmer_mlx.models.assistant import Assistant

    token_map_target(tmp_path / "t")
    model, _ = glimmer_mlx.load(tmp_path / "t")
    model.eos_token_ids = set()
    seqs = [Sequence(list(map(int, s)), [False] * 8 + [True] * (len(s) - 8))
            for s in greedy_sequences(model, 24, 8, 40, seed=0)]
    assistant = Assistant(new_assistant_config(model, None, layers=2, block_size=4, target_layer_ids=[1, 3],
                                               mask_token_id=8))
    drafter = DFlashDrafter(assistant, model)
    rng = np.random.RandomState(999)
    held = [[int(x) for x in rng.randint(10, 48, size=8)] for _ in range(6)]
    before = acceptance(model, drafter, held, None, max_tokens=40)["tau_greedy"]
    s = train_dflash(model, None, seqs, [], tmp_path / "out", assistant=assistant,
                     cfg=TrainConfig(epochs=6, batch_size=16, lr=3e-3, save_every=0), anchors_per_seq=16)
    after = acceptance(model, drafter, held, None, max_tokens=40)["tau_greedy"]
    assert s["final_loss"] < 0.3 * s["first_loss"]
    assert before < 1.2 and after > 2.0


def test_tool_call_conversations_are_training_data(tmp_path):
    """Agent transcripts (assistant turns with tool_calls and null content, tool results, a `tools` list) render
    through the chat template; the loss mask covers exactly the assistant turns, tool results stay context."""
    from pathlib import Path

    from conftest import save_tiny_tokenizer
    from glimmer_mlx.tokenizer import load_tokenizer
    from glimmer_mlx.train.data import DataReport, read_conversations, tokenize_conversation

    folder = save_tiny_tokenizer(tmp_path / "tok")
    template = Path(__file__).resolve().parent.parent / "embedded" / "build" / "chat_template.jinja"
    (folder / "chat_template.jinja").write_text(template.read_text())
    tok = load_tokenizer(folder)
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    conv = [{"role": "user", "content": "read a.py"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
            {"role": "tool", "name": "read_file", "content": "x = 1"},
            {"role": "assistant", "content": "It sets x."}]
    bad = [{"role": "user", "content": "hi"},
           {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": conv, "tools": tools}) + "\n" + json.dumps({"messages": bad}) + "\n")
    report = DataReport()
    convs = read_conversations(path, report)
    assert len(convs) == 1 and convs[0][1] == tools
    assert report.skipped == {"lines without a valid 'messages' list": 1}  # arguments as a JSON string: skipped
    seq = tokenize_conversation(tok, *convs[0])
    text = tok.decode(seq.ids)
    trained = tok.decode([t for t, m in zip(seq.ids, seq.mask) if m])
    assert '"name": "read_file"' in text.split("<|start|>user")[0]  # the tools block is in the system turn
    assert trained == (' to=functions<|message|><atem:function_calls><atem:invoke name="read_file"><atem:parameter '
                       'name="path">a.py</atem:parameter></atem:invoke></atem:function_calls><|eot|>'
                       ' to=user<|message|>It sets x.<|eot|>')


def test_dflash_batch_context_trimmed_to_the_window_gives_the_same_loss_and_gradients(tmp_path):
    """Items carry only the context rows their block can see (the sliding window): loss and gradients equal those
    with the whole context before each anchor, and the context tensor is window-sized."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dflash_training import token_map_target
    from glimmer_mlx.models.assistant import Assistant
    from glimmer_mlx.train.data import Sequence
    from glimmer_mlx.train.recipes import dflash_batch, dflash_loss, new_assistant_config

    token_map_target(tmp_path / "t")
    model, _ = glimmer_mlx.load(tmp_path / "t")
    rng = np.random.RandomState(3)
    seqs = [Sequence([int(x) for x in rng.randint(10, 48, size=n)], [i > 2 for i in range(n)]) for n in (60, 45)]
    cfg = new_assistant_config(model, None, layers=2, block_size=4, target_layer_ids=[1, 3], mask_token_id=8,
                               window=7)
    mx.random.seed(0)
    assistant = Assistant(cfg)
    items = [(0, 50), (1, 30), (0, 5), (1, 40), (0, 12)]
    loss_fn = nn.value_and_grad(assistant, dflash_loss(model, 4.0))
    full = dflash_batch(model, cfg, seqs, items, trim=False)
    trimmed = dflash_batch(model, cfg, seqs, items)
    assert full["ctx"].shape[1] == 50 and trimmed["ctx"].shape[1] == 7
    (l_full, g_full), (l_trim, g_trim) = loss_fn(assistant, full), loss_fn(assistant, trimmed)
    assert abs(float(l_full) - float(l_trim)) < 1e-5
    for (k, a), (_, b) in zip(tree_flatten(g_full), tree_flatten(g_trim)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, err_msg=k)


def test_pre_tokenized_lines_train_on_the_completion_only(target_dir, tmp_path):
    """`{"prompt_ids", "completion_ids"}` lines: the ids are used as given, the mask covers the completion; malformed
    lines are skipped and counted; ids outside the vocabulary are an error naming the file."""
    from glimmer_mlx.train.data import DataError, build_sequences

    path, _ = target_dir
    _, tok = glimmer_mlx.load(path)
    f = tmp_path / "distill.jsonl"
    f.write_text("\n".join([json.dumps({"prompt_ids": [0, 40, 41], "completion_ids": [42, 43, 44, 2]}),
                            json.dumps({"prompt_ids": [0, 40], "completion_ids": ["x", 3]}),
                            json.dumps({"prompt_ids": [0], "completion_ids": [50, 51, 52]})]) + "\n")
    seqs, report = build_sequences(tok, chats=f, max_length=64)
    assert [s.ids for s in seqs] == [[0, 40, 41, 42, 43, 44, 2], [0, 50, 51, 52]]
    assert seqs[0].mask == [False] * 3 + [True] * 4 and seqs[1].mask == [False] + [True] * 3
    assert report.skipped == {"pre-tokenized lines without integer 'prompt_ids' and 'completion_ids' lists": 1}
    f.write_text(json.dumps({"prompt_ids": [0], "completion_ids": [tok.vocab_size, 1]}) + "\n")
    with pytest.raises(DataError, match="distill.jsonl: token id .* outside the tokenizer's vocabulary"):
        build_sequences(tok, chats=f, max_length=64)


def test_eval_measures_whole_prompts_pooled_and_per_phase(tmp_path):
    """eval.json's τ is what `auto` starts from, so it is measured as auto will count it: on whole prompts (not cut
    at 64 tokens), pooled over every round (tokens / rounds, not a mean of per-prompt τ) and per phase of a response
    at the chooser's bounds — each against the decoder's own rounds of the same generations, stepped here by hand."""
    from dflash_training import token_map_target
    from glimmer_mlx.sampling import Sampler, SamplingParams
    from glimmer_mlx.speculative.auto.chooser import PHASES
    from glimmer_mlx.speculative.ngram import NGramDrafter
    from glimmer_mlx.strategy import make_decoder
    from glimmer_mlx.train.data import Sequence
    from glimmer_mlx.train.recipes import acceptance, eval_prompts

    long = Sequence(list(range(10, 110)) + [5] * 8, [False] * 100 + [True] * 8)
    text = Sequence(list(range(10, 50)), [False] * 40)
    assert eval_prompts([long, text]) == [list(range(10, 110)), list(range(10, 26))]
    token_map_target(tmp_path / "t")
    model, _ = glimmer_mlx.load(tmp_path / "t")
    model.eos_token_ids = set()
    drafter = NGramDrafter(model.args.vocab_size, max_drafts=4)
    rng = np.random.RandomState(3)
    prompts = [[int(x) for x in rng.randint(10, 48, size=n)] for n in (6, 30, 80)]
    got = acceptance(model, drafter, prompts, 4, max_tokens=72)
    assert got["phases"] == list(PHASES)
    tokens, rounds, per_prompt = np.zeros(len(PHASES) + 1), np.zeros(len(PHASES) + 1), []
    for p in prompts:
        dec = make_decoder(model, drafter, Sampler(SamplingParams(temperature=0.0), 0), block_size=4)
        dec.prefill(p)
        made, t0, r0 = len(dec.step(72)), tokens.sum(), rounds.sum()
        while made < 72:
            new = dec.step(72 - made)
            ph = sum(made >= b for b in PHASES)
            tokens[ph] += len(new)
            rounds[ph] += 1
            made += len(new)
        per_prompt.append((tokens.sum() - t0) / (rounds.sum() - r0))
    assert rounds[-1] > 0 and len(set(np.round(per_prompt, 3))) > 1  # every phase reached; prompts unlike
    assert got["tau_greedy"] == pytest.approx(tokens.sum() / rounds.sum())
    assert got["tau_greedy"] != pytest.approx(np.mean(per_prompt))
    assert got["tau_greedy_by_phase"] == pytest.approx(list(tokens / rounds))
    assert got["tau_t1"] >= 1.0 and len(got["tau_t1_by_phase"]) == len(PHASES) + 1
