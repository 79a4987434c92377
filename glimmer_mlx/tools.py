"""The agent's built-in tools, confined to a workspace folder (the jail).

Every path argument is resolved against the workspace with symlinks followed (realpath) and refused when it lands
outside: `..` components, absolute paths outside, symlinks pointing out and symlinked parent folders all fail with a
`ToolError` whose message goes back to the model. There is no delete tool and no network tool. `write_file` and
`patch_file` show a unified diff and ask before writing (unless `yes`), and write atomically (temp file + rename).
`run` executes a shell command with cwd = the workspace and a timeout; it asks first unless `yes` or an allowlist
prefix permits it. A shell command can do anything the user can (network, deletion, paths outside the workspace):
the confirmation (or a narrow allowlist) is the guard, not the jail.

Tool results use the formats the embedded model was trained on (embedded/build/synthetic.py): `list_files` one name
per line (folders end with "/"), `read_file` numbered lines (`"{n:>4}  {line}"`), `search` `path:line:text`,
`run` `exit code N` then the output.
"""

from __future__ import annotations

import difflib
import json
import fnmatch
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .files import write_atomic

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
MAX_READ_CHARS = 60_000  # characters returned by one read_file
MAX_FILE_BYTES = 2_000_000  # files larger than this are not read or searched
MAX_MATCHES = 100  # search hits returned
MAX_LINE = 300  # characters of a matching line shown
MAX_OUTPUT = 16_000  # characters of a command's output returned (head and tail)
MAX_DIFF = 12_000  # characters of a diff shown to the user
SEARCH_SECONDS = 10.0  # time one search may take
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache", ".tox"}
SHELL_META = re.compile(r"[;&|`$<>(){}\n\\*?\[\]!~]")


class ToolError(Exception):
    """A tool could not do what was asked; the message goes back to the model."""


class JailError(ToolError):
    """A path outside the workspace."""


@dataclass
class Workspace:
    root: Path

    def __post_init__(self):
        root = Path(os.path.realpath(os.fspath(self.root)))
        if not root.is_dir():
            raise NotADirectoryError(f"workspace {self.root} is not a folder")
        self.root = root

    def resolve(self, path) -> Path:
        """The real path of `path` (relative to the workspace, or absolute inside it); JailError when it is not
        confined to the workspace. The file need not exist; its existing parents are resolved through symlinks."""
        if path is None:
            path = "."
        if not isinstance(path, str):
            raise JailError(f"a path must be a string, got {type(path).__name__}")
        if "\x00" in path:
            raise JailError("a path must not contain a NUL character")
        if path.strip() == "":
            path = "."
        if path.startswith("~"):
            raise JailError(f"{path!r}: '~' paths are outside the workspace; use paths relative to the workspace")
        p = Path(path)
        if ".." in p.parts:
            raise JailError(f"{path!r}: '..' is not allowed in paths; use paths inside the workspace")
        full = p if p.is_absolute() else self.root / p
        real = Path(os.path.realpath(full))
        if real != self.root and self.root not in real.parents:
            how = "is a symlink (or has a symlinked parent) pointing" if not p.is_absolute() else "is"
            raise JailError(f"{path!r} {how} outside the workspace; only paths inside it are allowed")
        return real

    def rel(self, real: Path) -> str:
        r = real.relative_to(self.root).as_posix()
        return r or "."


def _is_text(data: bytes) -> bool:
    if b"\x00" in data[:8192]:
        return False
    try:
        data[:8192].decode("utf-8")
    except UnicodeDecodeError as e:
        return len(data) > 8192 and e.start > 8180  # a multi-byte character cut at the sample's end
    return True


def _read_text(real: Path, rel: str) -> str:
    if not real.exists():
        raise ToolError(f"{rel}: no such file")
    if real.is_dir():
        raise ToolError(f"{rel} is a folder, not a file (use list_files)")
    if not real.is_file():  # a FIFO or device would block or never end
        raise ToolError(f"{rel} is not a regular file")
    size = real.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ToolError(f"{rel} is {size} bytes, larger than the {MAX_FILE_BYTES}-byte limit")
    data = real.read_bytes()
    if not _is_text(data):
        raise ToolError(f"{rel} is a binary file (not UTF-8 text)")
    return data.decode("utf-8", errors="replace")


def numbered(text: str, start: int = 1) -> str:
    return "\n".join(f"{i:>4}  {line}" for i, line in enumerate(text.splitlines(), start))


def unified_diff(old: str, new: str, rel: str) -> str:
    a = "/dev/null" if old is None else f"a/{rel}"
    diff = "".join(difflib.unified_diff((old or "").splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=a, tofile=f"b/{rel}"))
    if len(diff) > MAX_DIFF:
        diff = diff[:MAX_DIFF] + f"\n... diff truncated ({len(diff) - MAX_DIFF} more characters)\n"
    return diff


def allowed_by(command: str, allow: list[str]) -> bool:
    """Whether an allowlist prefix permits `command` without asking: the command's words start with the prefix's
    words and it holds no shell operators, substitutions, redirections or globs (so `ls; rm -rf x` or `ls $(rm x)`
    never pass as `ls`)."""
    if not allow or SHELL_META.search(command):
        return False
    try:
        words = shlex.split(command)
    except ValueError:
        return False
    for prefix in allow:
        try:
            pw = shlex.split(prefix)
        except ValueError:
            continue
        if pw and words[:len(pw)] == pw:
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


def _clip_output(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    half = MAX_OUTPUT // 2
    return f"{text[:half]}\n... [{len(text) - MAX_OUTPUT} characters cut] ...\n{text[-half:]}"


@dataclass
class ToolBox:
    """The tools bound to a workspace, with the user's consent policy.

    confirm(question) -> bool asks the user (typer.confirm at the terminal); show(kind, text) displays a diff or a
    command before the question ("diff" | "command" | "note")."""

    workspace: Workspace
    yes: bool = False
    allow: list[str] = field(default_factory=list)
    confirm: Callable[[str], bool] | None = None
    show: Callable[[str, str], None] | None = None
    timeout: float = 120.0

    def _show(self, kind: str, text: str) -> None:
        if self.show is not None:
            self.show(kind, text)

    def _ask(self, question: str) -> bool:
        if self.yes:
            return True
        if self.confirm is None:
            return False
        return bool(self.confirm(question))

    # -- tools -------------------------------------------------------------------------------------------------
    def list_files(self, path: str = ".", pattern: str | None = None) -> str:
        real = self.workspace.resolve(path)
        rel = self.workspace.rel(real)
        if not real.exists():
            raise ToolError(f"{rel}: no such folder")
        if not real.is_dir():
            return rel
        names = []
        for p in real.iterdir():
            if p.name.startswith(".") or p.name in SKIP_DIRS:
                continue
            if pattern and not fnmatch.fnmatch(p.name, pattern):
                continue
            names.append(p.name + ("/" if p.is_dir() else ""))
        names.sort()
        if not names:
            return "(empty)" if not pattern else f"(no entries match {pattern!r})"
        more = len(names) - MAX_LIST
        return "\n".join(names[:MAX_LIST]) + (f"\n... {more} more entries" if more > 0 else "")

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        real = self.workspace.resolve(path)
        rel = self.workspace.rel(real)
        lines = _read_text(real, rel).splitlines()
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
        out, size = [], 0
        for i in range(start, end + 1):
            line = f"{i:>4}  {lines[i - 1]}"
            if size + len(line) > MAX_READ_CHARS and out:
                out.append(f"... (cut at line {i - 1} of {len(lines)}; read on with start_line={i})")
                break
            out.append(line)
            size += len(line) + 1
        return "\n".join(out)

    def search(self, pattern: str, path: str = ".") -> str:
        """Regex search, bounded in output and (with the `regex` package) in time: a pattern that backtracks
        catastrophically fails after SEARCH_SECONDS instead of hanging the agent."""
        try:
            rx = _rx.compile(pattern)
        except _rx.error as e:
            raise ToolError(f"invalid regular expression {pattern!r}: {e}") from None
        deadline = time.monotonic() + SEARCH_SECONDS
        real = self.workspace.resolve(path)
        if not real.exists():
            raise ToolError(f"{self.workspace.rel(real)}: no such file or folder")
        files = [real] if real.is_file() else self._walk(real)
        hits, n = [], 0
        for f in files:
            try:
                if not f.is_file() or f.stat().st_size > MAX_FILE_BYTES:
                    continue
                data = f.read_bytes()
            except OSError:
                continue
            if not _is_text(data):
                continue
            rel = self.workspace.rel(f)
            for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                if _search_line(rx, line[:4 * MAX_LINE], deadline, pattern):
                    n += 1
                    if len(hits) < MAX_MATCHES:
                        hits.append(f"{rel}:{i}:{line[:MAX_LINE]}")
        if not hits:
            return f"no matches for {pattern!r}"
        return "\n".join(hits) + (f"\n... {n - MAX_MATCHES} more matches" if n > MAX_MATCHES else "")

    def _walk(self, real: Path):
        """Files under `real` (inside the workspace): hidden and cache folders skipped, symlinks not followed."""
        for dirpath, dirnames, filenames in os.walk(real, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
            for name in sorted(filenames):
                p = Path(dirpath) / name
                if p.is_symlink():
                    try:
                        self.workspace.resolve(self.workspace.rel(p))
                    except JailError:
                        continue
                yield p

    def write_file(self, path: str, content: str) -> str:
        real = self.workspace.resolve(path)
        rel = self.workspace.rel(real)
        if real.is_dir():
            raise ToolError(f"{rel} is a folder")
        old = _read_text(real, rel) if real.exists() else None
        if old == content:
            return f"{rel} already has this content; nothing written"
        self._show("diff", unified_diff(old, content, rel))
        verb = "overwrite" if old is not None else "create"
        if not self._ask(f"{verb} {rel}?"):
            raise ToolError(f"the user declined to {verb} {rel}; nothing was written")
        write_atomic(real, content)
        return f"wrote {rel} ({len(content.encode('utf-8'))} bytes)"

    def patch_file(self, path: str, old: str, new: str) -> str:
        real = self.workspace.resolve(path)
        rel = self.workspace.rel(real)
        text = _read_text(real, rel)
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
        if not self._ask(f"patch {rel}?"):
            raise ToolError(f"the user declined the patch to {rel}; nothing was written")
        write_atomic(real, updated)
        return f"patched {rel}: 1 replacement"

    def run(self, command: str) -> str:
        if not command.strip():
            raise ToolError("empty command")
        self._show("command", command)
        if not (allowed_by(command, self.allow) or self._ask(f"run `{command}` in {self.workspace.root}?")):
            raise ToolError(f"the user declined to run `{command}`")
        proc = subprocess.Popen(command, shell=True, cwd=self.workspace.root, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: the shell and its children
            out, _ = proc.communicate()
            text = _clip_output(out.decode("utf-8", errors="replace"))
            return f"timed out after {self.timeout:g}s (killed)\n{text}".rstrip()
        text = _clip_output(out.decode("utf-8", errors="replace"))
        return f"exit code {proc.returncode}\n{text}".rstrip()

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
        return getattr(self, name)(**kwargs)


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
