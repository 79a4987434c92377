"""The agent's built-in tools, confined to a workspace folder (the jail).

The jail (`sandbox.Workspace`) works on file descriptors, not on path strings: no symlink is followed, hard links
and other file systems are refused, writes are atomic (see `sandbox`). Results are clipped per line and in total
(`max_chars`, which the agent lowers to fit a small model's context) with a visible "[clipped …]" marker.

There is no delete tool and no network tool. `write_file` and `patch_file` show a unified diff and ask before
writing (unless `yes`). `run` executes a shell command with cwd = the workspace and a timeout; it asks first unless
`yes` or an allowlist entry matches the whole command (exact argument vector; a trailing `*` word allows any further
arguments). Its output is read in chunks and capped (head + tail kept, the process killed far past the cap), and
nothing it starts outlives it: it runs under a small reaper process that is, on Linux, a child subreaper
(PR_SET_CHILD_SUBREAPER), so descendants that detach with setsid are still found and killed; elsewhere only the
command's process group is killed. A shell command can do anything the user can (network, deletion, paths outside
the workspace): the confirmation (or a narrow allowlist) is the guard, not the jail.

Tool results use the formats the embedded model was trained on (embedded/build/synthetic.py): `list_files` one name
per line (folders end with "/"), `read_file` numbered lines (`"{n:>4}  {line}"`), `search` `path:line:text`,
`run` `exit code N` then the output.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import re
import selectors
import shlex
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from .sandbox import JailError, Missing, ToolError, Workspace, is_text, visible

try:  # the `regex` package (an mlx-lm dependency in practice) can time a search out; `re` cannot
    import regex as _rx
except ImportError:  # pragma: no cover
    _rx = re

def _spec(name: str, description: str, required: list[str], **props: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": required}}}


# The tool schemas given to the model (identical to embedded/build/tools.json, which the embedded model saw).
TOOL_SPECS = [
    _spec("list_files", "List files and folders under a workspace path.", [], path="string", pattern="string"),
    _spec("read_file", "Read a text file, optionally a line range.", ["path"], path="string", start_line="integer",
          end_line="integer"),
    _spec("search", "Search text files for a regular expression.", ["pattern"], pattern="string", path="string"),
    _spec("write_file", "Create or replace a file (asks the user first).", ["path", "content"], path="string",
          content="string"),
    _spec("patch_file", "Replace the exact text `old` by `new` in a file (asks the user first).",
          ["path", "old", "new"], path="string", old="string", new="string"),
    _spec("run", "Run a shell command in the workspace (asks the user first).", ["command"], command="string"),
    _spec("final_answer", "Finish with the answer for the user.", ["answer"], answer="string"),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOL_SPECS]
# string parameters whose exact text matters (kept unstripped, never JSON-decoded)
EXACT_TEXT = {"content", "old", "new"}

MAX_LIST = 200  # entries listed
MAX_READ_CHARS = 60_000  # characters of one tool result (read_file, search, run): ToolBox.max_chars
MAX_LINE_CHARS = 2_000  # characters of one line read_file returns
MAX_MATCHES = 100  # search hits returned
MAX_LINE = 300  # characters of a matching line shown
MAX_OUTPUT = 16_000  # bytes of a command's output kept (head and tail)
OUTPUT_KILL_BYTES = 100_000_000  # a command that writes more than this is killed
MAX_DIFF = 12_000  # characters of a diff shown to the user
MAX_DEPTH = 64  # folder levels a search descends
SEARCH_SECONDS = 10.0  # time one search may take
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache", ".tox"}
SHELL_META = re.compile(r"[;&|`$<>(){}\n\r\\*?\[\]!~#]")
ANY_ARGS = "*"  # an allowlist entry's last word: any further arguments



def numbered(text: str, start: int = 1) -> str:
    return "\n".join(f"{i:>4}  {line}" for i, line in enumerate(text.splitlines(), start))


def clip_line(line: str, limit: int) -> str:
    """`line` cut to `limit` characters, with a visible marker saying how many were cut."""
    if len(line) <= limit:
        return line
    return f"{line[:limit]} … [clipped {len(line) - limit} characters]"


def clip_text(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters (head and tail kept), with a visible marker."""
    if len(text) <= limit:
        return text
    half = max(limit // 2, 1)
    return f"{text[:half]}\n... [clipped {len(text) - 2 * half} characters] ...\n{text[-half:]}"


def unified_diff(old: str, new: str, rel: str) -> str:
    a = "/dev/null" if old is None else f"a/{rel}"
    diff = "".join(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=a, tofile=f"b/{rel}"))
    if len(diff) > MAX_DIFF:
        diff = diff[:MAX_DIFF] + f"\n... diff truncated ({len(diff) - MAX_DIFF} more characters)\n"
    return diff


def allowed_by(command: str, allow: list[str]) -> bool:
    """Whether an allowlist entry permits `command` without asking. The command must hold no shell operators,
    substitutions, redirections, quotes or globs, and its words (shlex-split) must equal the entry's words exactly;
    an entry whose last word is a lone `*` (ANY_ARGS) allows any further arguments after the words before it (use
    with care: `git diff *` also allows `git diff --output=/elsewhere`). Never a prefix match."""
    if not allow or SHELL_META.search(command):
        return False
    try:
        words = shlex.split(command)
    except ValueError:
        return False
    if not words:
        return False
    for entry in allow:
        try:
            pw = shlex.split(entry)
        except ValueError:
            continue
        if not pw:
            continue
        if pw[-1] == ANY_ARGS:
            if len(pw) > 1 and words[:len(pw) - 1] == pw[:-1]:
                return True
        elif words == pw:
            return True
    return False


def _search_line(rx, line: str, deadline: float, pattern: str):
    left = deadline - time.monotonic()
    if left <= 0:
        raise ToolError(f"search for {pattern!r} took longer than {SEARCH_SECONDS:g}s; use a simpler pattern or a "
                        f"narrower path")
    if _rx is re:
        return rx.search(line)
    try:
        return rx.search(line, timeout=left)
    except TimeoutError:
        raise ToolError(f"search for {pattern!r} took longer than {SEARCH_SECONDS:g}s (the pattern backtracks "
                        f"catastrophically?); use a simpler pattern") from None


class _Capped:
    """A command's output as it streams: the first and last `cap // 2` bytes kept, the rest only counted."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk[-self.half:]
            if len(self.tail) > 2 * self.half:
                del self.tail[:-self.half]

    def text(self) -> str:
        tail = bytes(self.tail[-self.half:])
        cut = self.total - len(self.head) - len(tail)
        head = self.head.decode("utf-8", errors="replace")
        if cut <= 0:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", errors="replace")
        return f"{head}\n... [clipped {cut} bytes] ...\n{tail.decode('utf-8', errors='replace')}"


# The reaper `run` starts the shell under (python -I -S -c REAPER COMMAND): on Linux a child subreaper, so every
# descendant, even one that left the process group and the session (setsid), becomes its child once orphaned; when
# the shell ends (or on SIGTERM: timeout, too much output) it kills the shell's process group, then every child it
# has, level by level, until none is left. Exit status: the shell's (128 + N for signal N).
REAPER = r"""
import os, signal, subprocess, sys, time
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER (Linux)
except Exception:
    pass
shell, stopping = None, False
def stop(*_):
    global stopping
    stopping = True
    if shell is not None:
        try:
            os.killpg(shell.pid, signal.SIGKILL)
        except OSError:
            pass
signal.signal(signal.SIGTERM, stop)
shell = subprocess.Popen(sys.argv[1], shell=True, stdin=subprocess.DEVNULL, start_new_session=True)
if stopping:
    stop()
rc = shell.wait()
me = str(os.getpid()).encode()
def children():
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    out = []
    for d in names:
        if d.isdigit():
            try:
                with open("/proc/" + d + "/stat", "rb") as f:
                    s = f.read()
            except OSError:
                continue
            if s[s.rfind(b")") + 2:].split()[1:2] == [me]:
                out.append(int(d))
    return out
for _ in range(2000):
    try:
        os.killpg(shell.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in children():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        break
    time.sleep(0.005)
sys.exit(rc if rc >= 0 else 128 - rc)
"""


@dataclass
class ToolBox:
    """The tools bound to a workspace, with the user's consent policy.

    confirm(question) -> bool asks the user (typer.confirm at the terminal); show(kind, text) displays a diff or a
    command before the question ("diff" | "command" | "note"). Both get text with control characters escaped
    (`visible`). max_chars: the most characters of one read_file, search or run result."""

    workspace: Workspace
    yes: bool = False
    allow: list[str] = field(default_factory=list)
    confirm: Callable[[str], bool] | None = None
    show: Callable[[str, str], None] | None = None
    timeout: float = 120.0
    max_chars: int = MAX_READ_CHARS

    def _show(self, kind: str, text: str) -> None:
        if self.show is not None:
            self.show(kind, visible(text, keep="\n\t" if kind == "diff" else ""))

    def _ask(self, question: str) -> bool:
        if self.yes:
            return True
        if self.confirm is None:
            return False
        return bool(self.confirm(question))

    def _target(self, path) -> tuple[list[str], str]:
        parts = self.workspace.parts(path)
        return parts, "/".join(parts) or "."

    def _read_text(self, parts: list[str], rel: str) -> tuple[str, os.stat_result]:
        data, st = self.workspace.read_bytes(parts)
        if not is_text(data):
            raise ToolError(f"{rel} is a binary file (not UTF-8 text)")
        return data.decode("utf-8", errors="replace"), st

    # -- tools -------------------------------------------------------------------------------------------------
    def list_files(self, path: str = ".", pattern: str | None = None) -> str:
        parts, rel = self._target(path)
        st = self.workspace.lstat(parts)
        if st is None:
            raise ToolError(f"{rel}: no such folder")
        if stat.S_ISLNK(st.st_mode):
            raise JailError(f"{rel} is a symlink; the file tools never follow symlinks")
        if not stat.S_ISDIR(st.st_mode):
            return visible(rel, keep="")
        fd = self.workspace.open_dir(parts)
        try:
            with os.scandir(fd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        finally:
            os.close(fd)
        names = []
        for name, is_dir in entries:
            if name.startswith(".") or name in SKIP_DIRS:
                continue
            if pattern and not fnmatch.fnmatch(name, pattern):
                continue
            names.append(visible(name, keep="") + ("/" if is_dir else ""))
        names.sort()
        if not names:
            return "(empty)" if not pattern else f"(no entries match {pattern!r})"
        more = len(names) - MAX_LIST
        return "\n".join(names[:MAX_LIST]) + (f"\n... {more} more entries" if more > 0 else "")

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        parts, rel = self._target(path)
        lines = self._read_text(parts, rel)[0].splitlines()
        start = 1 if start_line is None else start_line
        if start < 1:
            raise ToolError(f"start_line must be >= 1, got {start}")
        if end_line is not None and end_line < start:
            raise ToolError(f"end_line ({end_line}) is before start_line ({start})")
        if not lines:
            return f"({rel} is empty)"
        if start > len(lines):
            raise ToolError(f"{rel} has {len(lines)} lines; start_line {start} is past the end")
        end = len(lines) if end_line is None else min(end_line, len(lines))
        limit = max(self.max_chars, 200)
        per_line = min(MAX_LINE_CHARS, limit - 100)
        out, size = [], 0
        for i in range(start, end + 1):
            line = f"{i:>4}  {clip_line(lines[i - 1], per_line)}"
            if size + len(line) > limit and out:
                out.append(f"... (cut at line {i - 1} of {len(lines)}; read on with start_line={i})")
                break
            out.append(line)
            size += len(line) + 1
        return "\n".join(out)

    def search(self, pattern: str, path: str = ".") -> str:
        """Regex search, bounded in output and (with the `regex` package) in time: a pattern that backtracks
        catastrophically fails after SEARCH_SECONDS instead of hanging the agent. Walks folders by descriptor,
        never following a symlink; skips what read_file would refuse."""
        try:
            rx = _rx.compile(pattern)
        except _rx.error as e:
            raise ToolError(f"invalid regular expression {pattern!r}: {e}") from None
        deadline = time.monotonic() + SEARCH_SECONDS
        parts, rel = self._target(path)
        st = self.workspace.lstat(parts)
        if st is None:
            raise ToolError(f"{rel}: no such file or folder")
        if stat.S_ISDIR(st.st_mode):
            files = self._walk(self.workspace.open_dir(parts), parts, 0, deadline)
        else:
            files = iter([(parts, self.workspace.read_bytes(parts)[0])])
        hits, n = [], 0
        try:
            for fparts, data in files:
                if not is_text(data):
                    continue
                shown = visible("/".join(fparts), keep="")
                for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                    if _search_line(rx, line[:4 * MAX_LINE], deadline, pattern):
                        n += 1
                        if len(hits) < MAX_MATCHES:
                            hits.append(f"{shown}:{i}:{clip_line(line, MAX_LINE)}")
        finally:
            close = getattr(files, "close", None)
            if close is not None:
                close()  # the walk's open folders
        if not hits:
            return f"no matches for {pattern!r}"
        text = "\n".join(hits) + (f"\n... {n - MAX_MATCHES} more matches" if n > MAX_MATCHES else "")
        return clip_text(text, max(self.max_chars, 200))

    def _walk(self, fd: int, parts: list[str], depth: int, deadline: float):
        """(parts, content) of the files under open folder `fd` (closed when done): hidden and cache folders
        skipped, symlinks, hard-linked and special files skipped, files before subfolders, by name."""
        try:
            with os.scandir(fd) as it:
                entries = sorted(((e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False))
                                  for e in it))
            for name, is_dir, is_file in entries:
                if is_file:
                    if time.monotonic() > deadline:
                        return
                    try:
                        data, _ = self.workspace.read_bytes(parts + [name], dir_fd=fd)
                    except (ToolError, OSError):
                        continue
                    yield parts + [name], data
            for name, is_dir, _ in entries:
                if not is_dir or name.startswith(".") or name in SKIP_DIRS or depth >= MAX_DEPTH:
                    continue
                try:
                    cfd = self.workspace.open_subdir(fd, name)
                except OSError:  # swapped for a symlink, gone
                    continue
                try:
                    self.workspace.check_dev(cfd, name)
                except JailError:
                    continue
                yield from self._walk(cfd, parts + [name], depth + 1, deadline)
        finally:
            os.close(fd)

    def _existing(self, parts: list[str], rel: str) -> tuple[str | None, int | None]:
        """(content, permissions) of the file to replace, (None, None) when there is none."""
        if not parts:
            raise ToolError(". is a folder")
        try:
            st = self.workspace.lstat(parts)
        except Missing:  # a parent folder is missing: write_file makes it
            return None, None
        if st is None:
            return None, None
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{rel} is a folder")
        text, st = self._read_text(parts, rel)
        return text, stat.S_IMODE(st.st_mode)

    def write_file(self, path: str, content: str) -> str:
        parts, rel = self._target(path)
        old, mode = self._existing(parts, rel)
        if old == content:
            return f"{rel} already has this content; nothing written"
        self._show("diff", unified_diff(old, content, rel))
        verb = "overwrite" if old is not None else "create"
        if not self._ask(visible(f"{verb} {rel}?", keep="")):
            raise ToolError(f"the user declined to {verb} {rel}; nothing was written")
        data = content.encode("utf-8")
        self.workspace.write_bytes(parts, data, mode)
        return f"wrote {rel} ({len(data)} bytes)"

    def patch_file(self, path: str, old: str, new: str) -> str:
        parts, rel = self._target(path)
        text, st = self._read_text(parts, rel)
        if old == "":
            raise ToolError("`old` is empty; give the exact text to replace (use write_file for a new file)")
        count = text.count(old)
        if count == 0:
            hint = ""
            if text.count(old.strip()) and old.strip():
                hint = " (it matches without its leading/trailing whitespace)"
            raise ToolError(f"`old` was not found in {rel}{hint}; read the file and copy the exact text")
        if count > 1:
            raise ToolError(f"`old` occurs {count} times in {rel}; include more surrounding text so it is unique")
        updated = text.replace(old, new, 1)
        if updated == text:
            return f"{rel} unchanged (`old` and `new` are the same)"
        self._show("diff", unified_diff(text, updated, rel))
        if not self._ask(visible(f"patch {rel}?", keep="")):
            raise ToolError(f"the user declined the patch to {rel}; nothing was written")
        self.workspace.write_bytes(parts, updated.encode("utf-8"), stat.S_IMODE(st.st_mode))
        return f"patched {rel}: 1 replacement"

    def run(self, command: str) -> str:
        if not command.strip():
            raise ToolError("empty command")
        if "\x00" in command:
            raise ToolError("a command must not contain a NUL character")
        self._show("command", command)
        question = visible(f"run `{command}` in {self.workspace.root}?", keep="")
        if not (allowed_by(command, self.allow) or self._ask(question)):
            raise ToolError(f"the user declined to run `{command}`")
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", REAPER, command], cwd=self.workspace.root,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        out, why = _Capped(MAX_OUTPUT), None
        deadline = time.monotonic() + self.timeout
        give_up = None  # when to stop reading: the reaper stuck, or an escaped process holding the pipe
        fd = proc.stdout.fileno()
        sel = selectors.DefaultSelector()  # epoll / kqueue: no FD_SETSIZE limit
        sel.register(fd, selectors.EVENT_READ)
        try:
            while True:
                now = time.monotonic()
                if why is None and now >= deadline:
                    why = f"timed out after {self.timeout:g}s (killed)"
                    proc.send_signal(signal.SIGTERM)  # the reaper kills the command and all it started
                if give_up is None and (why is not None or proc.poll() is not None):
                    give_up = now + 5.0
                if give_up is not None and now >= give_up:
                    break
                wait = min(0.1, max(deadline - now, 0.001)) if why is None else 0.1
                if not sel.select(wait):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                out.add(chunk)
                if why is None and out.total > OUTPUT_KILL_BYTES:
                    why = f"killed: the output passed {OUTPUT_KILL_BYTES} bytes"
                    proc.send_signal(signal.SIGTERM)
        finally:
            sel.close()
            proc.stdout.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
        text = clip_text(out.text(), max(self.max_chars, 200))
        head = why if why is not None else f"exit code {proc.returncode}"
        return f"{head}\n{text}".rstrip()

    # -- dispatch ----------------------------------------------------------------------------------------------
    def call(self, name: str, arguments: dict, raw_arguments: dict | None = None) -> str:
        """Validate the arguments against the tool's schema and run it. ToolError for anything the model got
        wrong (unknown tool or argument, missing/mistyped argument, refused path, declined consent)."""
        spec = next((t["function"] for t in TOOL_SPECS if t["function"]["name"] == name), None)
        if spec is None or name == "final_answer":
            if name == "final_answer":
                raise ToolError("final_answer ends the task; it is handled by the agent loop")
            raise ToolError(f"unknown tool {name!r}; available tools: {', '.join(TOOL_NAMES)}")
        kwargs = coerce_arguments(spec, arguments, raw_arguments or {})
        try:
            return getattr(self, name)(**kwargs)
        except OSError as e:  # the file system changed under the call, or refused it
            raise ToolError(f"{name}: {e.strerror or e}") from None


def coerce_arguments(spec: dict, arguments: dict, raw_arguments: dict) -> dict:
    """Check `arguments` against a tool spec and convert them: string parameters take the exact text written
    (raw_arguments, for content / old / new; stripped for the others), integer parameters accept "12"."""
    name = spec["name"]
    props = spec["parameters"]["properties"]
    required = spec["parameters"].get("required", [])
    if not isinstance(arguments, dict):
        raise ToolError(f"{name}: arguments must be an object")
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolError(f"{name}: unknown argument(s) {', '.join(map(repr, unknown))}; expected: "
                        f"{', '.join(props) or 'none'}")
    missing = [k for k in required if k not in arguments]
    if missing:
        raise ToolError(f"{name}: missing required argument(s) {', '.join(map(repr, missing))}")
    out = {}
    for k, v in arguments.items():
        typ = props[k].get("type")
        if typ == "string":
            if k in raw_arguments and isinstance(raw_arguments[k], str):
                v = raw_arguments[k] if k in EXACT_TEXT else raw_arguments[k].strip()
            elif v is None and k not in required:
                continue
            elif not isinstance(v, str):  # a JSON-decoded value (e.g. content "42"): back to its text
                v = json.dumps(v, ensure_ascii=False)
        elif typ == "integer":
            if v is None or v == "":
                if k in required:
                    raise ToolError(f"{name}: argument {k!r} must be an integer")
                continue
            if isinstance(v, bool) or not isinstance(v, (int, str, float)):
                raise ToolError(f"{name}: argument {k!r} must be an integer, got {v!r}")
            try:
                iv = int(str(v).strip()) if not isinstance(v, float) else int(v)
            except ValueError:
                raise ToolError(f"{name}: argument {k!r} must be an integer, got {v!r}") from None
            if isinstance(v, float) and v != iv:
                raise ToolError(f"{name}: argument {k!r} must be an integer, got {v!r}")
            v = iv
        out[k] = v
    return out
