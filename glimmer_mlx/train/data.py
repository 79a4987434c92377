"""Training data for drafters: chat JSONL (OpenAI `messages`) and/or plain-text / code files → token sequences with a
loss mask on response tokens.

`regenerate` rewrites every assistant reply with the *target itself* (drafters must learn the target's
distribution, not the dataset's), through our runtime, resumably: each finished conversation is appended to a cache
JSONL in the output folder, and a rerun skips what is already there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..generate import generate

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rs", ".c", ".h", ".cpp", ".js", ".ts", ".go", ".java", ".sh", ".json",
                 ".toml", ".yaml", ".yml", ".html", ".css", ".rst"}


class DataError(ValueError):
    """Training data that cannot be used; the message names the file (and line)."""


@dataclass
class Sequence:
    ids: list[int]
    mask: list[bool]  # True where the token is a response token (trained on)


@dataclass
class DataReport:
    conversations: int = 0
    text_chunks: int = 0
    skipped: dict = field(default_factory=dict)  # reason -> count
    truncated: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def line(self) -> str:
        s = f"{self.conversations} conversations, {self.text_chunks} text chunks"
        if self.truncated:
            s += f", {self.truncated} truncated to --max-length"
        if self.skipped:
            s += "; skipped: " + ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items()))
        return s


def _valid_message(m) -> bool:
    """{"role", "content": str}, or an assistant turn with `tool_calls` (content may be null) whose arguments are
    mappings (the form chat templates render)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    if isinstance(m.get("content"), str):
        return True
    calls = m.get("tool_calls")
    return (m["role"] == "assistant" and m.get("content") is None and isinstance(calls, list) and bool(calls)
            and all(isinstance(c, dict) and isinstance(c.get("function", c).get("name"), str)
                    and isinstance(c.get("function", c).get("arguments", {}), dict) for c in calls))


@dataclass
class Tokenized:
    """A pre-tokenized line `{"prompt_ids": [...], "completion_ids": [...]}`: ids in the target's vocabulary, the loss
    on the completion only. For data the target produced itself (distillation): no re-tokenization, so the trained
    ids are exactly the ones it generated."""
    prompt_ids: list[int]
    completion_ids: list[int]


def _tokenized(obj) -> Tokenized | None:
    p, c = obj.get("prompt_ids"), obj.get("completion_ids")
    if isinstance(p, list) and isinstance(c, list) and all(type(t) is int and t >= 0 for t in p + c):
        return Tokenized(p, c)
    return None


def read_conversations(path: Path, report: DataReport) -> list:
    """Conversations from a JSONL file: one `{"messages": [{"role", "content"}, …], "tools": [...]?}` per line, as
    (messages, tools) pairs, or a pre-tokenized `{"prompt_ids", "completion_ids"}` line (`Tokenized`). Malformed
    lines and conversations without an assistant turn are skipped and counted, not fatal."""
    if not path.exists():
        raise DataError(f"{path}: no such file")
    convs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                report.skip("malformed JSON lines")
                continue
            if isinstance(obj, dict) and ("prompt_ids" in obj or "completion_ids" in obj):
                t = _tokenized(obj)
                if t is None:
                    report.skip("pre-tokenized lines without integer 'prompt_ids' and 'completion_ids' lists")
                else:
                    convs.append(t)
                continue
            msgs = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(msgs, list) or not all(_valid_message(m) for m in msgs):
                report.skip("lines without a valid 'messages' list")
                continue
            if not any(m["role"] == "assistant" for m in msgs):
                report.skip("conversations without an assistant turn")
                continue
            tools = obj.get("tools")
            if tools is not None and not isinstance(tools, list):
                report.skip("lines whose 'tools' is not a list")
                continue
            convs.append((msgs, tools))
    return convs


def read_text_files(paths: list[Path]) -> list[str]:
    files = []
    for p in paths:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        elif p.exists():
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or folder")
    texts = []
    for f in files:
        try:
            t = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if t.strip():
            texts.append(t)
    return texts


def tokenize_conversation(tokenizer, msgs: list[dict], tools: list | None = None) -> Sequence:
    """Chat-templated ids; the mask covers the assistant replies (each reply's tokens as the template renders them)."""
    ids, mask = [], []
    prev = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=True, tools=tools)
        full = tokenizer.apply_chat_template(msgs[: i + 1], add_generation_prompt=False, tokenize=True, tools=tools)
        if full[: len(prompt)] != prompt or full[: len(prev)] != prev:
            raise DataError("the chat template does not render conversations as prefixes of each other; cannot "
                            "place the loss mask")
        ids = full
        mask = mask + [False] * (len(prompt) - len(mask)) + [True] * (len(full) - len(prompt))
        prev = full
    return Sequence(ids, mask)


def regenerate(model, tokenizer, convs: list[tuple[list[dict], list | None]], cache_path: Path, *,
               max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
               progress=None) -> list[tuple[list[dict], list | None]]:
    """Replace every assistant reply by the target's own reply to the preceding turns. Resumable via `cache_path`.
    Conversations with tool calls are kept as they are (a regenerated reply is text; re-parsing it into tool calls
    is format-specific)."""
    done: dict[int, list[dict]] = {}
    if cache_path.exists():
        for line in cache_path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                done[int(rec["index"])] = (rec["messages"], rec.get("tools"))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut by an interruption: that conversation is regenerated
    out = []
    with open(cache_path, "a", encoding="utf-8") as f:
        for i, item in enumerate(convs):
            if isinstance(item, Tokenized):  # already the target's own tokens
                out.append(item)
                continue
            msgs, tools = item
            if i in done:
                out.append(done[i])
            elif tools or any(m.get("tool_calls") for m in msgs):
                out.append((msgs, tools))
            else:
                new = []
                for m in msgs:
                    if m["role"] == "assistant":
                        ids = tokenizer.apply_chat_template(new, add_generation_prompt=True, tokenize=True)
                        r = generate(model, ids, tokenizer=tokenizer, max_tokens=max_new_tokens,
                                     temperature=temperature, seed=seed + i)
                        new.append({"role": "assistant", "content": r.text})
                    else:
                        new.append(dict(m))
                f.write(json.dumps({"index": i, "messages": new}, ensure_ascii=False) + "\n")
                f.flush()
                out.append((new, None))
            if progress is not None:
                progress(i + 1, len(convs))
    return out


def build_sequences(tokenizer, *, chats: Path | None = None, texts: list[Path] = (), max_length: int = 1024,
                    min_length: int = 8, model=None, regen_cache: Path | None = None, regen_kwargs: dict | None = None,
                    progress=None) -> tuple[list[Sequence], DataReport]:
    if tokenizer is None:
        raise DataError("training data needs the target's tokenizer (tokenizer.json in the target folder)")
    report = DataReport()
    seqs: list[Sequence] = []
    if chats is not None:
        convs = read_conversations(Path(chats), report)
        if model is not None and regen_cache is not None:
            convs = regenerate(model, tokenizer, convs, regen_cache, progress=progress, **(regen_kwargs or {}))
        vocab = tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else None
        for item in convs:
            if isinstance(item, Tokenized):
                ids = item.prompt_ids + item.completion_ids
                if vocab is not None and ids and max(ids) >= vocab:
                    raise DataError(f"{chats}: token id {max(ids)} is outside the tokenizer's vocabulary "
                                    f"({vocab} tokens); pre-tokenized lines must use the target's tokenizer")
                s = Sequence(ids, [False] * len(item.prompt_ids) + [True] * len(item.completion_ids))
            else:
                s = tokenize_conversation(tokenizer, *item)
            if len(s.ids) > max_length:
                s = Sequence(s.ids[:max_length], s.mask[:max_length])
                report.truncated += 1
            if sum(s.mask) < 2:
                report.skip("conversations with < 2 response tokens (after truncation)")
                continue
            seqs.append(s)
            report.conversations += 1
    for text in read_text_files([Path(p) for p in texts]):
        ids = tokenizer.encode(text)
        for a in range(0, len(ids), max_length):
            chunk = ids[a : a + max_length]
            if len(chunk) < min_length:
                report.skip("text chunks shorter than the minimum length")
                continue
            seqs.append(Sequence(chunk, [True] * len(chunk)))
            report.text_chunks += 1
    if not seqs:
        raise DataError(f"no usable training sequences ({report.line()})")
    return seqs, report


def split(seqs: list[Sequence], val_fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    rng = np.random.RandomState(seed)
    order = rng.permutation(len(seqs))
    n_val = int(round(len(seqs) * val_fraction)) if len(seqs) > 1 else 0
    n_val = min(max(n_val, 1 if val_fraction > 0 and len(seqs) > 1 else 0), len(seqs) - 1)
    return [seqs[i] for i in order[n_val:]], [seqs[i] for i in order[:n_val]]


def pad_batch(seqs: list[Sequence], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids [B, T], response mask [B, T], lengths [B]) right-padded."""
    T = max(len(s.ids) for s in seqs)
    ids = np.full((len(seqs), T), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), T), dtype=bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = s.ids
        mask[i, : len(s.mask)] = s.mask
    return ids, mask, np.array([len(s.ids) for s in seqs])
