"""`glimmer chat`: an interactive terminal chat on a `session.Session` (prompt-cache reuse across turns).

Input: one line per message; a line ending with `\\` continues on the next line, and a line holding only `\"\"\"`
opens a block that the next such line closes (for pasting). A message starting with `/` is a command (`/help`);
`//text` sends `/text` literally.

Ctrl-C while the model writes stops the generation at the next chunk boundary (the prompt cache stays valid) and
returns to the prompt; the partial answer is kept in the conversation, so the model sees what it already said (if
nothing was written yet, the question is dropped too). A second Ctrl-C aborts at once (the cache is then rebuilt on
the next turn). Ctrl-C or Ctrl-D at the prompt ends the chat.

The answer is shown without the model's message headers (` to=user<|message|>` in the Muse format): the tool-call
parser of the chat template (`tool_calls.get_parser`) gives the visible text while streaming, and the assistant
message is stored in the form the template renders (content, or tool_calls with arguments as a mapping).

Stats line per turn: tokens, tok/s, τ (tokens per target forward) and the speedup over the model's plain-decoding
rate, which comes from the latest plain (`ar`) turn of at least 8 tokens or, before there is one, from a short
calibration (32 greedy plain tokens on a scratch cache, the conversation's cache untouched), and the prompt tokens
prefilled vs reused from the cache.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .files import write_atomic
from .image_processing import ImageError, preprocess_image
from .multimodal import require_vision
from .runtime.loop import GenerationStats
from .runtime.request import ContextLengthError
from .sampling import RANGES, SamplingError
from .session import Session
from .strategy import MODES, DecodeSpec, ModeError, check_tree
from .tool_calls import assistant_message, get_parser

COMMANDS = [
    ("/help", "this list"),
    ("/clear", "start a new conversation (keeps the system prompt and settings)"),
    ("/image PATH", "attach an image to your next message (repeatable)"),
    ("/save FILE", "write the conversation and settings as JSON (asks before replacing an existing file)"),
    ("/load FILE", "replace the conversation by one saved with /save"),
    ("/mode [ar|dflash|mtp|auto] [WIDTH]", "show or switch the decoding mode (WIDTH: DFlash block size or MTP depth)"),
    ("/tree [N|off]", "token trees of N draft nodes per round (dflash, mtp, ngram; WIDTH: the deepest path), or off"),
    ("/temp [T]", "show or set the sampling temperature (0 = greedy)"),
    ("/stats", "session statistics: last turn in detail, totals, cache, plain-decoding rate"),
    ("/exit", "leave (also /quit, Ctrl-D, or Ctrl-C at the prompt)"),
]
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x9b]")


def printable(text: str) -> str:
    """Model text is data: control characters (terminal escape sequences included) are shown as �."""
    return _CONTROL.sub("\ufffd", text)


class ChatError(Exception):
    """A command's user-facing error (printed, the chat goes on)."""


class Chat:
    def __init__(self, session: Session, *, mode: str | None = None, block_size=None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                 seed: int | None = None, max_tokens: int = 1024, system_prompt: str | None = None,
                 calibrate: bool = True, show_stats: bool = True, console: Console | None = None,
                 input_fn=input, out=None, tree: int | None = None):
        if session.tokenizer is None:
            raise ValueError("chat needs a checkpoint with a tokenizer (tokenizer.json)")
        self.session = session
        self.console = console or Console(highlight=False)
        self.out = out or sys.stdout
        self.input = input_fn
        self.mode = mode or session.default_mode()
        self.block_size = block_size
        # a ModeError now, not at the first turn; `auto` is built (and calibrates, once per machine) before the prompt
        session.drafters.resolve(DecodeSpec(self.mode, block_size))
        if tree is not None:
            check_tree(self.mode, tree)
        self.tree = tree
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                             repetition_penalty=repetition_penalty)
        self.seed = seed
        self.max_tokens = max_tokens
        self.system_prompt = system_prompt
        self.messages: list[dict] = self._initial_messages()
        self.pending_images: list[str] = []
        self.calibrate = calibrate
        self.show_stats = show_stats
        self.last_stats: GenerationStats | None = None
        self.turn = 0
        self.parser = get_parser(session.tokenizer.chat_template)
        self._interrupts = 0
        color = hasattr(self.out, "isatty") and self.out.isatty()
        # \001 … \002 tell readline that the escape codes take no room on the line
        self.prompt = "\001\x1b[1;32m\002you ›\001\x1b[0m\002 " if color else "you › "
        self.more = "\001\x1b[2m\002  … \001\x1b[0m\002 " if color else "  … "

    def _initial_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    # -- output ------------------------------------------------------------------------------------------------------
    def info(self, msg: str) -> None:
        self.console.print(f"[dim]{escape(msg)}[/]", soft_wrap=True)

    def error(self, msg: str) -> None:
        self.console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)

    def write(self, text: str) -> None:
        self.out.write(printable(text))
        self.out.flush()

    # -- input -------------------------------------------------------------------------------------------------------
    def read_message(self) -> str:
        """One message (multi-line with a trailing backslash or a triple-quote block). EOFError/KeyboardInterrupt
        propagate (the caller ends the chat)."""
        line = self.input(self.prompt)
        if line.strip() == '"""':
            lines = []
            while True:
                line = self.input(self.more)
                if line.strip() == '"""':
                    return "\n".join(lines)
                lines.append(line)
        lines = []
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = self.input(self.more)
        lines.append(line)
        return "\n".join(lines)

    def run(self) -> int:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        s = self.session
        self.info(f"glimmer chat — {getattr(s, 'path', 'model')} · mode {self.mode_label()} · modes available: "
                  f"{', '.join(s.available_modes())} · context {s.max_context} tokens · /help for commands, "
                  f"Ctrl-D to leave")
        while True:
            try:
                text = self.read_message()
            except (EOFError, KeyboardInterrupt):
                self.out.write("\n")
                self.info("bye")
                return 0
            if not text.strip():
                continue
            try:
                if text.startswith("/") and not text.startswith("//"):
                    if self.command(text.strip()) == "exit":
                        self.info("bye")
                        return 0
                else:
                    self.send(text[1:] if text.startswith("//") else text)
            except ChatError as e:
                self.error(str(e))
            except KeyboardInterrupt:  # outside a generation (a command, the calibration): back to the prompt
                self.out.write("\n")
                self.info("interrupted")

    # -- commands ------------------------------------------------------------------------------------------------------
    def command(self, line: str):
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            t = Table(show_header=False, box=None, padding=(0, 2))
            for c, h in COMMANDS:
                t.add_row(f"[bold]{escape(c)}[/]", escape(h))
            self.console.print(t)
            self.info('multi-line input: end a line with \\ to continue it, or put """ on a line to open and close '
                      'a block; //text sends /text. Ctrl-C stops an answer (the partial answer is kept).')
        elif name == "/clear":
            self.messages = self._initial_messages()
            self.pending_images = []
            self.session.reset()
            self.info("new conversation")
        elif name == "/image":
            self.attach_image(arg)
        elif name == "/save":
            self.save(arg)
        elif name == "/load":
            self.load(arg)
        elif name == "/mode":
            self.set_mode(arg)
        elif name == "/tree":
            self.set_tree(arg)
        elif name == "/temp":
            self.set_temp(arg)
        elif name == "/stats":
            self.print_stats()
        else:
            raise ChatError(f"unknown command {name}; /help lists the commands (//text sends /text)")

    def mode_label(self) -> str:
        return (self.mode + ("" if self.block_size is None else f" {self.block_size}")
                + ("" if self.tree is None else f", trees of {self.tree} nodes"))

    def set_tree(self, arg: str) -> None:
        if not arg:
            self.info(f"mode {self.mode_label()}")
            return
        tree = None
        if arg != "off":
            try:
                tree = int(arg)
            except ValueError:
                raise ChatError("usage: /tree N (draft nodes per round, 1..64) | off") from None
            try:
                check_tree(self.mode, tree)
            except ModeError as e:
                raise ChatError(str(e)) from None
        self.tree = tree
        self.info(f"mode {self.mode_label()}")

    def set_mode(self, arg: str) -> None:
        if not arg:
            self.info(f"mode {self.mode_label()}; available: {', '.join(self.session.available_modes())}")
            return
        parts = arg.split()
        if len(parts) > 2 or parts[0] not in MODES:
            raise ChatError(f"usage: /mode {'|'.join(MODES)} [WIDTH]")
        try:
            spec = DecodeSpec.parse(parts[0], parts[1] if len(parts) == 2 else None, what="WIDTH")
            self.session.check_mode(spec.mode, spec.width)
            if self.tree is not None:
                check_tree(spec.mode, self.tree)
        except ModeError as e:
            raise ChatError(f"{e} (/tree off first)" if self.tree is not None else str(e)) from None
        self.mode, self.block_size = spec.mode, spec.width
        self.info(f"mode {self.mode_label()}")

    def set_temp(self, arg: str) -> None:
        if not arg:
            self.info(f"temperature {self.sampling['temperature']}")
            return
        try:
            t = float(arg)
        except ValueError:
            raise ChatError(f"temperature must be a number, got {arg!r}") from None
        if not RANGES["temperature"].contains(t):
            raise ChatError(str(SamplingError("temperature", t)))
        self.sampling["temperature"] = t
        self.info(f"temperature {t}" + (" (greedy)" if t == 0 else ""))

    def attach_image(self, arg: str) -> None:
        if not arg:
            raise ChatError("usage: /image PATH")
        try:
            require_vision(self.session.model)
            item = preprocess_image(arg)
        except (ImageError, ValueError) as e:
            raise ChatError(str(e)) from None
        path = str(Path(arg).expanduser().resolve())
        self.pending_images.append(path)
        self.info(f"image attached to your next message: {path} ({item.num_tokens} tokens)")

    def save(self, arg: str) -> None:
        if not arg:
            raise ChatError("usage: /save FILE")
        data = {"format": "glimmer-chat", "version": 1, "messages": self.messages, "mode": self.mode,
                "block_size": self.block_size, "sampling": self.sampling, "system_prompt": self.system_prompt}
        path = Path(arg).expanduser()
        if path.is_dir():
            raise ChatError(f"cannot write {arg}: it is a folder; give a file name")
        if os.path.lexists(path) and not self.confirm(f"{arg} exists; replace it? [y/N] "):
            self.info(f"not saved ({arg} is unchanged)")
            return
        try:  # a temporary file renamed over the target: a full disk or a crash leaves the old file as it was
            write_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ChatError(f"cannot write {arg}: {e.strerror or e}; nothing was saved"
                            + (" (the existing file is unchanged)" if os.path.lexists(path) else "")) from None
        self.info(f"saved {len(self.messages)} messages to {arg}")

    def confirm(self, question: str) -> bool:
        """Ask a yes/no question on the input; only y / yes is a yes (Ctrl-D or Ctrl-C: no)."""
        try:
            answer = self.input(question)
        except (EOFError, KeyboardInterrupt):
            self.out.write("\n")
            return False
        return answer.strip().lower() in ("y", "yes")

    def load(self, arg: str) -> None:
        if not arg:
            raise ChatError("usage: /load FILE")
        try:
            data = json.loads(Path(arg).expanduser().read_text())
        except OSError as e:
            raise ChatError(f"cannot read {arg}: {e.strerror or e}") from None
        except ValueError as e:
            raise ChatError(f"{arg} is not JSON: {e}") from None
        msgs = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in msgs):
            raise ChatError(f"{arg}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} with roles "
                            "system/user/assistant/tool")
        for m in msgs:
            for p in _image_parts(m):
                if not Path(p).exists():
                    raise ChatError(f"{arg}: the conversation refers to an image that is gone: {p}")
        self.messages = msgs
        self.pending_images = []
        if isinstance(data, dict):
            if isinstance(data.get("system_prompt"), (str, type(None))):
                self.system_prompt = data.get("system_prompt")
        self.info(f"loaded {len(msgs)} messages from {arg} (the next turn reuses whatever the cache shares with it)")

    def print_stats(self) -> None:
        s = self.session
        t = Table(show_header=False, box=None, padding=(0, 2))
        t.add_row("mode", self.mode_label())
        t.add_row("sampling", ", ".join(f"{k} {v}" for k, v in self.sampling.items()))
        t.add_row("conversation", f"{len(self.messages)} messages, {s.cached_tokens} tokens in the prompt cache, "
                                  f"context limit {s.max_context}")
        tot = s.totals
        t.add_row("totals", f"{tot['turns']} turns, {tot['generated_tokens']} tokens generated, "
                            f"{tot['prefilled_tokens']} of {tot['prompt_tokens']} prompt tokens prefilled")
        if s.plain_rate is not None:
            t.add_row("plain rate", f"{s.plain_rate.tokens_per_s:.1f} tok/s ({s.plain_rate.source})")
        if self.last_stats is not None:
            for k, v in self.last_stats.as_dict().items():
                t.add_row(f"last: {k}", escape(f"{v:.4g}" if isinstance(v, float) else str(v)))
        self.console.print(t)

    # -- a turn --------------------------------------------------------------------------------------------------------
    def send(self, text: str) -> None:
        images = self.pending_images
        if images:
            content = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": text}]
        else:
            content = text
        self.messages.append({"role": "user", "content": content})
        all_images = [p for m in self.messages for p in _image_parts(m)]
        try:
            ids = self.session.encode_messages(self.messages)
        except ValueError as e:
            self.messages.pop()
            self.error(str(e))
            return
        self.pending_images = []
        stats = GenerationStats()
        raw, shown = "", ""
        self._interrupts = 0
        interrupted = aborted = False
        old = signal.signal(signal.SIGINT, self._on_sigint)
        it = None
        try:
            trees = {} if self.tree is None else {"tree": self.tree}
            it = self.session.stream(ids, mode=self.mode, block_size=self.block_size, images=all_images or None,
                                     max_tokens=self.max_tokens, seed=self.seed, stats=stats, **trees,
                                     **self.sampling)
            for chunk in it:
                raw += chunk.text
                vis = self.parser.visible(raw)
                if vis.startswith(shown) and len(vis) > len(shown):
                    self.write(vis[len(shown):])
                    shown = vis
                if self._interrupts:
                    interrupted = True
                    break
        except ContextLengthError as e:
            self.messages.pop()
            self.pending_images = images
            self.error(f"context full: {e} (/clear starts a new conversation; --max-context raises the limit up to "
                       f"the model's {getattr(self.session.model.args, 'max_position_embeddings', '?')})")
            return
        except (ModeError, ValueError) as e:
            self.messages.pop()
            self.pending_images = images
            self.error(str(e))
            return
        except KeyboardInterrupt:
            aborted = True
        finally:
            if it is not None:
                it.close()
            signal.signal(signal.SIGINT, old)
        parsed = self.parser.parse(raw)
        final = parsed.content
        if final.startswith(shown) and len(final) > len(shown):
            self.write(final[len(shown):])
        self.out.write("\n")
        self.out.flush()
        if parsed.tool_calls:
            self.info(f"(the model called {', '.join(c.name for c in parsed.tool_calls)}; chat has no tools — use "
                      "`glimmer agent`)")
        if interrupted or aborted:
            self.info("[stopped" + (": aborted mid-step, the prompt cache will be rebuilt" if aborted else "") +
                      ("; the partial answer is kept]" if (final or parsed.tool_calls) else
                       "; nothing was written, the question is dropped]"))
        if final or parsed.tool_calls:
            self.messages.append(assistant_message(parsed.tool_calls, final))
        elif interrupted or aborted:
            self.messages.pop()
        else:  # an empty answer: keep the turn so the conversation stays as the model saw it
            self.messages.append({"role": "assistant", "content": ""})
        self.turn += 1
        self.last_stats = stats
        if "max_tokens_clamped" in stats.extra and stats.generation_tokens >= stats.extra["max_tokens_clamped"]:
            self.error(f"the answer was cut at the context limit ({self.session.max_context} tokens): /clear or "
                       "/save then /clear to go on")
        if self.show_stats and not aborted:
            self.console.print(f"[dim]{escape(self.stats_line(stats))}[/]", soft_wrap=True)

    def _on_sigint(self, signum, frame):
        self._interrupts += 1
        if self._interrupts > 1:
            raise KeyboardInterrupt

    def stats_line(self, stats: GenerationStats) -> str:
        s = self.session
        n, tps = stats.generation_tokens, stats.generation_tps
        parts = [f"{n} tok", f"{tps:.1f} tok/s"]
        spec = "tau" in stats.extra
        if spec:
            parts.append(f"τ {stats.extra['tau']:.2f}")
        if spec and s.plain_rate is None and self.calibrate:
            s.calibrate_plain_rate()
        if spec and s.plain_rate is not None and s.plain_rate.tokens_per_s > 0:
            parts.append(f"×{tps / s.plain_rate.tokens_per_s:.2f} vs plain {s.plain_rate.tokens_per_s:.1f} tok/s "
                         f"({s.plain_rate.source})")
        elif spec:
            parts.append("speedup n/a (no plain-rate measurement yet: run an ar turn)")
        parts.append(f"{stats.mode}")
        parts.append(f"prompt {stats.extra.get('prefilled_tokens', stats.prompt_tokens)} new + "
                     f"{stats.extra.get('cached_tokens', 0)} cached tok")
        return " · ".join(parts)


def _image_parts(message: dict) -> list[str]:
    c = message.get("content")
    if not isinstance(c, list):
        return []
    return [p.get("image") for p in c if isinstance(p, dict) and p.get("type") == "image" and p.get("image")]
