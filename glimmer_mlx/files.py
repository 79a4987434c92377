"""Writing files so that a reader never sees half of one: a temporary file in the same folder, flushed to disk, then
renamed over the target (`os.replace` is atomic on one file system). A crash or a full disk leaves the old file as
it was; concurrent writers each rename a complete file of their own (the last one wins).

Reading them so that every failure is one sentence naming the file: `present`, `read_text`, `read_json` raise
`FileFormatError` (a ValueError) for a folder where a file belongs, a dangling or looping symbolic link, a file that
cannot be opened (permissions), invalid UTF-8 or invalid JSON."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path


class FileFormatError(ValueError):
    """A file that cannot be read or parsed; the message starts with its path and says why."""


def _os_reason(e: OSError) -> str:
    if isinstance(e, IsADirectoryError):
        return "is a folder, expected a file"
    if isinstance(e, PermissionError):
        return "permission denied (cannot open it for reading)"
    if isinstance(e, FileNotFoundError):
        return "file not found"
    if e.errno == errno.ELOOP:
        return "symbolic link loop"
    return f"cannot read it ({e.strerror or e})"


def present(path: str | os.PathLike) -> bool:
    """Whether an optional file is there: False when nothing is at `path`, True for a file; FileFormatError for a
    folder, a dangling symbolic link or a symbolic-link loop (which `Path.exists` would report as absent)."""
    p = Path(path)
    try:
        p.stat()
    except FileNotFoundError:
        if os.path.islink(p):
            raise FileFormatError(f"{p}: dangling symbolic link (it points to {os.readlink(p)}, which does not "
                                  "exist)") from None
        return False
    except OSError as e:
        raise FileFormatError(f"{p}: {_os_reason(e)}") from None
    if p.is_dir():
        raise FileFormatError(f"{p}: {_os_reason(IsADirectoryError())}")
    return True


def open_binary(path: str | os.PathLike):
    """open(path, "rb"), failing as FileFormatError (a folder, permissions, a link loop…)."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise FileFormatError(f"{path}: {_os_reason(e)}") from None


def read_bytes(path: str | os.PathLike) -> bytes:
    with open_binary(path) as f:
        try:
            return f.read()
        except OSError as e:
            raise FileFormatError(f"{path}: {_os_reason(e)}") from None


def read_text(path: str | os.PathLike) -> str:
    """The file as UTF-8 text."""
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise FileFormatError(f"{path}: not valid UTF-8 (byte {e.start}, line {line}: {data[e.start:e.start + 1]!r})"
                              ) from None


def read_json(path: str | os.PathLike, expect: type | None = None):
    """The parsed JSON document; expect=dict/list also checks the top-level type."""
    text = read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise FileFormatError(f"{path}: invalid JSON ({e})") from None
    if expect is not None and not isinstance(value, expect):
        want = {dict: "a JSON object", list: "a JSON list"}.get(expect, expect.__name__)
        raise FileFormatError(f"{path}: expected {want}, got {type(value).__name__}")
    return value


def write_atomic(path: str | os.PathLike, content: str | bytes) -> None:
    """Replace `path` by `content` (text as UTF-8) atomically, keeping an existing file's permissions; a symlink at
    `path` is replaced itself, never written through. Creates missing parent folders."""
    real = Path(path)
    real.parent.mkdir(parents=True, exist_ok=True)
    if real.exists() and not real.is_symlink():
        mode = real.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask  # what open() would give a new file (mkstemp makes it 0600)
    data = content.encode("utf-8") if isinstance(content, str) else content
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
