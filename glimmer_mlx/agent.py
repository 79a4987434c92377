"""`glimmer agent`: an offline tool-using loop over a workspace.

Each step the backend (the model) gets the conversation and the tool schemas and writes a reply; the reply is parsed
in the model's own tool-call format (`tool_calls.get_parser(chat_template)`), the calls run through the jailed
`tools.ToolBox`, and their results go back as `{"role": "tool", ...}` messages. Malformed calls, unknown tools and
bad arguments become error messages to the model and the loop goes on. The loop ends on `final_answer` (or a plain
answer with no call), or at the step limit.

Every message and event is appended to a JSONL transcript as it happens, so a run can be resumed exactly
(`Agent.resume`): the conversation is rebuilt from the `message` records, and calls the model made but that never
ran (an interrupted run) are run first. The workspace is never taken from a transcript: `run_command` refuses one
recorded in another folder than the command line's (or the current one).

Everything shown before a consent question, and every line of the terminal UI, has its control characters escaped
(`sandbox.visible`): a file, a command or the model cannot rewrite the screen.

A backend is any callable `backend(messages, tools, on_text=None) -> str` with a `chat_template` attribute
(str | None: selects the tool-call format); `MLXBackend` runs a glimmer-mlx model.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax

from .runtime.loop import GenerationStats
from .sandbox import ToolError, Workspace, visible
from .session import load_session
from .strategy import check_tree
from .tool_calls import (ToolCall, ToolParser, assistant_message, get_parser, neutralize_special_tokens,
                         tool_result_message)
from .tools import TOOL_SPECS, ToolBox, coerce_arguments

# The system prompt the embedded model was trained with (embedded/build/agent_system.txt).
DEFAULT_SYSTEM = ("You are glimmer, a coding agent working in a local workspace. Use the tools to look at and change "
                  "files, one step at a time, and finish with final_answer.")
TRANSCRIPT_VERSION = 1
ERROR_TOOL = "error"  # the name of the tool message that carries parse errors back to the model


class Backend(Protocol):
    chat_template: str | None

    def __call__(self, messages: list[dict], tools: list[dict], on_text: Callable[[str], None] | None = None) -> str:
        ...


class AgentUI:
    """What the loop reports while it runs; the base class shows nothing (library use, tests)."""

    def step(self, n: int, max_steps: int) -> None:
        pass

    def text(self, delta: str) -> None:  # streamed user-visible model text
        pass

    def end_text(self) -> None:
        pass

    def tool_call(self, call: ToolCall) -> None:
        pass

    def tool_result(self, call: ToolCall, result: str, ok: bool) -> None:
        pass

    def error(self, message: str) -> None:  # malformed output sent back to the model
        pass

    def show(self, kind: str, text: str) -> None:  # a diff or command before a confirmation
        pass

    def final(self, answer: str) -> None:
        pass

    def stopped(self, reason: str) -> None:
        pass


@dataclass
class AgentResult:
    status: str  # "answered" | "step_limit"
    answer: str | None
    steps: int  # model steps taken in this run
    messages: list[dict] = field(default_factory=list)
    reason: str = ""


class Transcript:
    """Append-only JSONL: one record per message or event, flushed as written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        record = {"t": round(time.time(), 3), **record}
        # backslashreplace: a lone surrogate (from a JSON-decoded argument) is written as its JSON escape
        with self.path.open("a", encoding="utf-8", errors="backslashreplace") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    @staticmethod
    def load(path: str | Path) -> list[dict]:
        """The records of a transcript. A torn last line (a run killed mid-write) is skipped; any other bad line
        is a ValueError naming it."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"transcript {path} does not exist")
        lines = path.read_text(encoding="utf-8").splitlines()
        records = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                if i == len(lines):
                    break
                raise ValueError(f"{path}:{i}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or "type" not in rec:
                raise ValueError(f"{path}:{i}: not a transcript record (no 'type')")
            records.append(rec)
        if not records or records[0].get("type") != "start":
            raise ValueError(f"{path}: not a glimmer agent transcript (no 'start' record first)")
        if records[0].get("version") != TRANSCRIPT_VERSION:
            raise ValueError(f"{path}: transcript version {records[0].get('version')!r}, this glimmer reads "
                             f"version {TRANSCRIPT_VERSION}")
        return records


def _error_report(errors: list[str]) -> str:
    lines = "\n".join(f"- {e}" for e in errors)
    return (f"Your last reply could not be used as written:\n{lines}\nFix the call and try again, or call "
            f"final_answer to finish.")


class Agent:
    def __init__(self, backend: Backend, toolbox: ToolBox, *, parser: ToolParser | None = None,
                 max_steps: int = 20, transcript: Transcript | None = None, ui: AgentUI | None = None,
                 system: str | None = DEFAULT_SYSTEM, tools: list[dict] | None = None):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.backend = backend
        self.toolbox = toolbox
        self.tools = tools if tools is not None else TOOL_SPECS
        self.parser = parser or get_parser(getattr(backend, "chat_template", None), tools=self.tools)
        self.max_steps = max_steps
        self.transcript = transcript
        self.ui = ui or AgentUI()
        self.system = system
        self.messages: list[dict] = []
        if self.toolbox.show is None:
            self.toolbox.show = self.ui.show
        context = getattr(backend, "max_context", None)
        if isinstance(context, int) and context > 0:  # one tool result must fit a small model's context: at most
            # half of it in characters (a token is at least one character of ASCII text), so that a long line or
            # file is clipped, not the end of the run
            self.toolbox.max_chars = min(self.toolbox.max_chars, max(context // 2, 500))

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def _record(self, record: dict) -> None:
        if self.transcript is not None:
            self.transcript.write(record)

    def _add(self, message: dict) -> None:
        self.messages.append(message)
        self._record({"type": "message", "message": message})

    # -- entry points ------------------------------------------------------------------------------------------
    def run(self, task: str, *, meta: dict | None = None) -> AgentResult:
        """A new conversation on `task`."""
        if not task or not task.strip():
            raise ValueError("the task is empty")
        self.messages = []
        self._record({"type": "start", "version": TRANSCRIPT_VERSION, "workspace": str(self.toolbox.workspace.root),
                      **(meta or {})})
        if self.system:
            self._add({"role": "system", "content": self.system})
        self._add({"role": "user", "content": task})
        return self._loop()

    def resume(self, records: list[dict], task: str | None = None) -> AgentResult:
        """Continue a transcript's conversation: run calls left pending, then loop. A finished conversation needs
        a follow-up `task`. New records go to this agent's transcript (usually the same file)."""
        self.messages = [r["message"] for r in records if r.get("type") == "message"]
        if not self.messages:
            raise ValueError("the transcript holds no messages to resume")
        finished = any(r.get("type") == "final" for r in records[self._last_user_index(records):])
        if finished and not task:
            raise ValueError("this conversation already ended with a final answer; give a follow-up task to go on")
        self._record({"type": "resume", "task": task})
        if not finished:
            pending = self._pending_calls()
            if pending:
                answer = self._execute(pending)
                if answer is not None:
                    result = self._finish(answer, 0)
                    if not task:
                        return result
        if task:
            self._add({"role": "user", "content": task})
        return self._loop()

    @staticmethod
    def _last_user_index(records: list[dict]) -> int:
        idx = 0
        for i, r in enumerate(records):
            if r.get("type") == "message" and r["message"].get("role") == "user":
                idx = i
        return idx

    def _pending_calls(self) -> list[ToolCall]:
        """Calls of the last assistant message that have no result yet (a run stopped between the two)."""
        for i in range(len(self.messages) - 1, -1, -1):
            m = self.messages[i]
            if m.get("role") == "assistant":
                done = {r.get("tool_call_id") for r in self.messages[i + 1:] if r.get("role") == "tool"}
                calls = []
                for tc in m.get("tool_calls") or []:
                    if tc["id"] in done:
                        continue
                    args = tc["function"]["arguments"]
                    calls.append(ToolCall(name=tc["function"]["name"], arguments=args, id=tc["id"],
                                          raw_arguments={k: v for k, v in args.items() if isinstance(v, str)}))
                return calls
            if m.get("role") == "user":
                return []
        return []

    # -- the loop ------------------------------------------------------------------------------------------------
    def _loop(self) -> AgentResult:
        for step in range(1, self.max_steps + 1):
            self.ui.step(step, self.max_steps)
            text = self._generate()
            self._record({"type": "model_output", "step": step, "text": text})
            parsed = self.parser.parse(text)
            calls, errors = parsed.tool_calls, list(parsed.errors)
            if calls or parsed.content.strip():
                msg = assistant_message(calls, parsed.content or None)
                for tc, c in zip(msg.get("tool_calls", []), calls):
                    # the exact text the model wrote: the template renders strings as they are, so the next prompt
                    # holds the call exactly as generated (decoded JSON would re-render `"x"` as `x`)
                    tc["function"]["arguments"] = {**c.arguments, **c.raw_arguments}
                self._add(msg)
            if not calls and not errors:
                if parsed.content.strip():  # a plain answer, no tool: that is the answer
                    return self._finish(parsed.content.strip(), step)
                errors = ["the reply was empty: call a tool, or final_answer to finish"]
            answer = self._execute(calls) if calls else None
            if errors:
                for e in errors:
                    self.ui.error(e)
                self._add(tool_result_message(ERROR_TOOL, _error_report(errors)))
            if answer is not None:
                return self._finish(answer, step)
        reason = (f"stopped after {self.max_steps} step(s) without a final answer (raise --max-steps, or resume "
                  f"the transcript to go on)")
        self._record({"type": "stop", "reason": reason})
        self.ui.stopped(reason)
        return AgentResult("step_limit", None, self.max_steps, self.messages, reason)

    def _generate(self) -> str:
        shown = ""
        chunks: list[str] = []

        def on_text(delta: str) -> None:
            nonlocal shown
            chunks.append(delta)
            vis = self.parser.visible("".join(chunks))
            if vis.startswith(shown) and len(vis) > len(shown):
                self.ui.text(vis[len(shown):])
                shown = vis

        text = self.backend(self.messages, self.tools, on_text=on_text)
        if shown:
            self.ui.end_text()
        return text

    def _execute(self, calls: list[ToolCall]) -> str | None:
        """Run the calls in order; the final answer when one is `final_answer` (later calls are skipped)."""
        for i, call in enumerate(calls):
            self.ui.tool_call(call)
            if call.name == "final_answer":
                spec = next(t["function"] for t in self.tools if t["function"]["name"] == "final_answer")
                try:
                    answer = coerce_arguments(spec, call.arguments, call.raw_arguments)["answer"]
                except ToolError as e:
                    self._tool_result(call, f"error: {e}", ok=False)
                    continue
                skipped = [c.name for c in calls[i + 1:]]
                if skipped:
                    self._record({"type": "skipped", "calls": skipped, "reason": "after final_answer"})
                return answer
            try:
                result, ok = self.toolbox.call(call.name, call.arguments, call.raw_arguments), True
            except (ToolError, OSError, ValueError) as e:  # ValueError: e.g. text that cannot be encoded
                result, ok = f"error: {e}", False
            self._tool_result(call, result, ok)
        return None

    def _tool_result(self, call: ToolCall, result: str, ok: bool) -> None:
        self.ui.tool_result(call, result, ok)
        self._record({"type": "tool", "id": call.id, "name": call.name, "ok": ok})
        self._add(tool_result_message(call, neutralize_special_tokens(result)))

    def _finish(self, answer: str, steps: int) -> AgentResult:
        self._record({"type": "final", "answer": answer})
        self.ui.final(answer)
        return AgentResult("answered", answer, steps, self.messages)


# ------------------------------------------------------------------------------------------------ MLX backend

class MLXBackend:
    """A glimmer-mlx model as an agent backend, through a `session.Session`: the prompt cache is reused across
    steps (each step prefills only the new tool results), in any decoding mode the session has drafters for
    ("ar", "dflash", "mtp", "auto"; speculative modes give the same text), with token trees (`tree` draft nodes per
    round: dflash, mtp, ngram) as `glimmer chat --tree`."""

    def __init__(self, session, *, mode: str = "ar", block_size=None, max_tokens: int = 1024,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, tree: int | None = None):
        tok = session.tokenizer
        if tok is None or not tok.chat_template:
            raise ValueError("the agent needs a model with a tokenizer and a chat template")
        session.check_mode(mode, block_size)  # ModeError (a ValueError) now, not at the first step
        if tree is not None:
            check_tree(mode, tree, block_size)  # the same check a step's `Session.prepare` makes, before the first
        self.session, self.mode, self.block_size, self.tree = session, mode, block_size, tree
        self.max_tokens, self.temperature, self.top_p, self.seed = max_tokens, temperature, top_p, seed
        self.chat_template = tok.chat_template
        self.max_context = session.max_context  # the agent sizes tool results to it
        self.last_stats = None

    def __call__(self, messages, tools, on_text=None) -> str:
        ids = self.session.encode_messages(messages, tools=tools)
        stats = GenerationStats()
        parts = []
        for chunk in self.session.stream(ids, mode=self.mode, block_size=self.block_size, max_tokens=self.max_tokens,
                                         temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                                         stats=stats, tree=self.tree):
            parts.append(chunk.text)
            if on_text is not None and chunk.text:
                on_text(chunk.text)
        self.last_stats = stats
        return "".join(parts)


def load_backend(model: str | None, *, mode: str | None = None, block_size=None, draft_model: str | None = None,
                 mtp_model: str | None = None, announce=None, **kwargs) -> MLXBackend:
    """Load the target (the embedded model, with its drafters, when `model` is None) into a Session
    (`session.load_session`: draft_model a DFlash drafter or MTP layers, mtp_model MTP layers) and check the mode
    (None: the session's default, `auto` when a drafter is loaded)."""
    session = load_session(model, draft_model=draft_model, mtp_model=mtp_model, announce=announce)
    return MLXBackend(session, mode=mode or session.default_mode(), block_size=block_size, **kwargs)


# ----------------------------------------------------------------------------------------------------- rich UI

class RichUI(AgentUI):
    """Compact terminal output on `console` (stderr): streamed model text, one line per tool call and a clipped
    result; the final answer goes to `out` (stdout): a panel on a terminal, the bare text otherwise."""

    def __init__(self, console, out=None, verbose: bool = False):
        self.console, self.verbose = console, verbose
        self.out = out or console

    def step(self, n, max_steps):
        if self.verbose:
            self.console.print(f"[dim]step {n}/{max_steps}[/]")

    def text(self, delta):
        self.console.out(visible(delta), end="", highlight=False)

    def end_text(self):
        self.console.out("")

    def tool_call(self, call):
        if call.name == "final_answer":  # shown as the answer
            return

        args = ", ".join(f"{visible(str(k), keep='')}={_clip(json.dumps(v, ensure_ascii=False), 60)}"
                         for k, v in call.arguments.items())
        self.console.print(f"[bold cyan]→ {escape(visible(call.name, keep=''))}[/]({escape(visible(args, keep=''))})",
                           soft_wrap=True)

    def tool_result(self, call, result, ok):
        lines = result.splitlines() or [""]
        head = "\n".join(lines[:8]) + (f"\n… {len(lines) - 8} more lines" if len(lines) > 8 else "")
        style = "dim" if ok else "red"
        self.console.print(f"[{style}]{escape(visible(_indent(head)))}[/]", soft_wrap=True)

    def error(self, message):
        self.console.print(f"[yellow]! malformed reply: {escape(visible(message))}[/]", soft_wrap=True)

    def show(self, kind, text):  # before a consent question: control characters shown escaped, never acted on
        if kind == "diff":
            self.console.print(Syntax(visible(text), "diff", theme="ansi_dark", background_color="default"))
        else:
            self.console.print(f"[bold]$ {escape(visible(text, keep=''))}[/]", soft_wrap=True)

    def final(self, answer):
        if self.out.is_terminal:
            self.out.print(Panel(escape(visible(answer)), title="answer", border_style="green"))
        else:
            self.out.out(answer, highlight=False)

    def stopped(self, reason):
        self.console.print(f"[bold yellow]{escape(visible(reason))}[/]", soft_wrap=True)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def _indent(s: str) -> str:
    return "\n".join("  " + line for line in s.splitlines())


# ----------------------------------------------------------------------------------------------- command line

def default_transcript_path() -> Path:
    """~/.cache/glimmer-mlx/agent/<time>.jsonl (not in the workspace: the agent's own files stay out of it)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "glimmer-mlx" / "agent"
    return base / time.strftime("%Y%m%d-%H%M%S.jsonl")


def terminal_confirm(question: str) -> bool:
    """Ask on the terminal (default no); end of input (no terminal) declines. The question is shown with its
    control characters escaped (the toolbox escapes them already; this holds for any caller)."""
    question = visible(question, keep="")
    aborts = (typer.Abort,)
    try:
        import click

        aborts += (click.exceptions.Abort,)
    except ImportError:  # typer >= 0.29 vendors click
        pass
    try:
        return typer.confirm(question, default=False)
    except aborts:
        return False


def run_command(task: str | None, *, backend_factory: Callable[[], Backend], workspace: str | None, yes: bool,
                allow: list[str], max_steps: int, transcript: str | None, resume: str | None, timeout: float,
                console, out=None, confirm: Callable[[str], bool] = terminal_confirm,
                meta: dict | None = None) -> AgentResult:
    """`glimmer agent`: check the options, build the toolbox and the agent, run or resume. ValueError /
    FileNotFoundError / NotADirectoryError for bad options (the CLI prints them)."""
    if task is None and resume is None:
        raise ValueError("give a TASK, or --resume TRANSCRIPT to continue a run")
    if max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {max_steps}")
    if timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {timeout}")
    records = Transcript.load(resume) if resume is not None else None
    ws = Workspace(Path(workspace or os.getcwd()))  # always the command line's (or the current folder), never the
    if records is not None:                         # transcript's: a transcript must not choose the jail
        recorded = records[0].get("workspace")
        if recorded is not None and (not isinstance(recorded, str)
                                     or os.path.realpath(recorded) != str(ws.root)):
            raise ValueError(f"transcript {resume} was recorded in workspace {visible(str(recorded), keep='')!r}, "
                             f"not {str(ws.root)!r}; run it from that folder or pass --workspace to resume it")
    path = Path(transcript) if transcript else Path(resume) if resume else default_transcript_path()
    fork = resume is not None and path.resolve() != Path(resume).resolve()
    if (resume is None or fork) and path.exists() and path.stat().st_size > 0:
        raise ValueError(f"transcript {path} already exists; use --resume {path} to continue it, or another path")
    if fork:  # resume into another file: it starts as a copy, so that it can be resumed on its own
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8",
                        errors="backslashreplace")
    ui = RichUI(console, out=out)
    box = ToolBox(ws, yes=yes, allow=list(allow), confirm=confirm, timeout=timeout)
    backend = backend_factory()
    agent = Agent(backend, box, max_steps=max_steps, transcript=Transcript(path), ui=ui)
    console.print(f"[dim]workspace {escape(str(ws.root))} | transcript {escape(str(path))}[/]", soft_wrap=True,
                  highlight=False)
    if not yes and confirm is terminal_confirm and not os.isatty(0):
        console.print("[yellow]stdin is not a terminal: confirmations are read from it (and declined at its end)[/]")
    try:
        result = agent.resume(records, task) if records is not None else agent.run(task, meta=meta)
    except KeyboardInterrupt:
        agent._record({"type": "stop", "reason": "interrupted"})
        console.print(f"\n[yellow]interrupted; resume with: glimmer agent --resume {escape(str(path))}[/]",
                      soft_wrap=True, highlight=False)
        raise SystemExit(130) from None
    console.print(f"[dim]{result.steps} step(s); resume with: glimmer agent --resume {escape(str(path))} "
                  f"{escape('[TASK]')}[/]", soft_wrap=True, highlight=False)
    return result
