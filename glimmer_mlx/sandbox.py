"""The agent's jail: a workspace folder every file tool reaches through file descriptors, never path strings.

Every operation opens the workspace folder, then walks the path one component at a time with
`os.open(name, O_DIRECTORY | O_NOFOLLOW, dir_fd=parent)`, and opens the last one with `O_NOFOLLOW` (reads also
`O_NONBLOCK`, so a FIFO never blocks). A second process that swaps a folder or file for a symlink mid-call therefore
cannot redirect it: the kernel refuses the symlink. Policy:

- `..`, `~`, NUL bytes and absolute paths outside the workspace are refused before anything is opened;
- symlinks are never followed (not even ones that point inside): the tool result says the path is a symlink;
- only regular files are read; a file with more than one hard link (it may be an outside file's other name) or
  on another file system than the workspace (a mount point) is refused, and so is a folder on another one;
- writes create a temporary file in the parent folder's descriptor and `os.replace` it over the name (both
  relative to that descriptor): atomic, and a symlink at the name is replaced, never written through;
- reads take at most MAX_FILE_BYTES + 1 bytes from disk.

`visible` writes control characters as visible escapes wherever the user is asked to decide.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_BYTES = 2_000_000  # files larger than this are not read or searched (at most this + 1 bytes are read)
MAX_PATH = 4_096  # characters of a path argument
MAX_NAME = 255  # bytes of one file or folder name

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class ToolError(Exception):
    """A tool could not do what was asked; the message goes back to the model."""


class JailError(ToolError):
    """A path outside the workspace (or one the jail will not follow: a symlink, a hard link, a mount point)."""


class Missing(ToolError):
    """No such file or folder."""


# characters a terminal may act on (C0 but tab/newline, DEL, C1), bidi and zero-width controls, line separators and
# lone surrogates (undecodable bytes of a file name)
_BIDI = set("\u061c\u200b\u200c\u200d\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e"
            "\u2060\u2066\u2067\u2068\u2069\ufeff")


def _hidden(ch: str) -> bool:
    o = ord(ch)
    return o < 0x20 or 0x7f <= o < 0xa0 or ch in _BIDI or 0xd800 <= o < 0xe000


def visible(text: str, keep: str = "\n\t") -> str:
    """`text` with every control character a terminal could act on written as a visible escape (`\\x1b`, `\\r`,
    `\\u202e`): what the user sees is what is there. `keep`: characters left as they are (newline and tab; pass ""
    for one-line text such as a command or a path)."""
    if not any(_hidden(ch) for ch in text):
        return text
    out = []
    for ch in text:
        if ch in keep or not _hidden(ch):
            out.append(ch)
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        else:
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
    return "".join(out)


@dataclass
class Workspace:
    """The jail: a folder, opened by descriptor for every operation (see the module docstring)."""

    root: Path

    def __post_init__(self):
        given = os.path.abspath(os.fspath(self.root))
        root = Path(os.path.realpath(given))
        if not root.is_dir():
            raise NotADirectoryError(f"workspace {self.root} is not a folder")
        self.root = root
        self.aliases = sorted({str(root), given}, key=len, reverse=True)  # absolute spellings of the root
        st = os.stat(root)
        self.dev, self.ino = st.st_dev, st.st_ino

    # -- paths (no file system access) -------------------------------------------------------------------------
    def parts(self, path) -> list[str]:
        """The components of `path` (relative to the workspace, or absolute inside it); JailError for `..`, `~`,
        NUL bytes, an absolute path outside, a path longer than MAX_PATH."""
        if path is None:
            path = "."
        if not isinstance(path, str):
            raise JailError(f"a path must be a string, got {type(path).__name__}")
        if "\x00" in path:
            raise JailError("a path must not contain a NUL character")
        if len(path) > MAX_PATH:
            raise JailError(f"a path must be at most {MAX_PATH} characters, got {len(path)}")
        if path.strip() == "":
            path = "."
        if path.startswith("~"):
            raise JailError(f"{path!r}: '~' paths are outside the workspace; use paths relative to the workspace")
        if os.path.isabs(path):
            for alias in self.aliases:
                base = alias.rstrip("/")
                if path == alias or path.startswith(base + "/"):
                    path = path[len(base):]
                    break
            else:
                raise JailError(f"{path!r} is outside the workspace; only paths inside it are allowed")
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise JailError(f"{path!r}: '..' is not allowed in paths; use paths inside the workspace")
        for p in parts:
            if len(os.fsencode(p)) > MAX_NAME:
                raise ToolError(f"a file or folder name must be at most {MAX_NAME} bytes, got one of "
                                f"{len(os.fsencode(p))}")
        return parts

    def resolve(self, path) -> Path:
        """The absolute path `path` names in the workspace (lexically: symlinks are not resolved, the tools refuse
        them when they open it); JailError when it is not confined to the workspace."""
        return self.root.joinpath(*self.parts(path))

    def rel(self, real: Path) -> str:
        r = real.relative_to(self.root).as_posix()
        return r or "."

    # -- descriptors ---------------------------------------------------------------------------------------------
    def open_root(self) -> int:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            os.close(fd)
            raise JailError(f"the workspace folder {self.root} was replaced since the agent started; refused")
        return fd

    def _refusal(self, fd: int, name: str, shown: str, err: OSError, want: str) -> ToolError:
        """Why opening `name` in folder `fd` failed, as the message for the model."""
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            return JailError(f"{shown} is a symlink; the file tools never follow symlinks (use the path of the "
                             f"real file inside the workspace)")
        if isinstance(err, FileNotFoundError) or st is None:
            return Missing(f"{shown}: no such {want}")
        if err.errno == errno.ENOTDIR or not stat.S_ISDIR(st.st_mode) and want == "folder":
            return ToolError(f"{shown} is not a folder")
        return ToolError(f"{shown}: {err.strerror or err}")

    def check_dev(self, fd: int, shown: str) -> os.stat_result:
        st = os.fstat(fd)
        if st.st_dev != self.dev:
            os.close(fd)
            raise JailError(f"{shown} is on another file system than the workspace (a mount point); refused")
        return st

    def open_subdir(self, dir_fd: int, name: str) -> int:
        """Descriptor of folder `name` inside the folder `dir_fd`, never through a symlink (OSError otherwise)."""
        return os.open(name, _DIR, dir_fd=dir_fd)

    def open_dir(self, parts: list[str], *, create: bool = False) -> int:
        """A descriptor of the folder `parts` (the caller closes it), walked from the root without following any
        symlink; missing folders are made when `create`."""
        fd = self.open_root()
        try:
            for i, name in enumerate(parts):
                shown = "/".join(parts[:i + 1])
                try:
                    nfd = os.open(name, _DIR, dir_fd=fd)
                except FileNotFoundError as e:
                    if not create:
                        raise self._refusal(fd, name, shown, e, "folder") from None
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass
                    try:
                        nfd = os.open(name, _DIR, dir_fd=fd)
                    except OSError as e2:
                        raise self._refusal(fd, name, shown, e2, "folder") from None
                except OSError as e:
                    raise self._refusal(fd, name, shown, e, "folder") from None
                os.close(fd)
                fd = -1
                self.check_dev(nfd, shown)
                fd = nfd
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return fd

    def lstat(self, parts: list[str]) -> os.stat_result | None:
        """The entry `parts` names, not following a symlink there (None when it does not exist)."""
        if not parts:
            return os.stat(self.root)
        fd = self.open_dir(parts[:-1])
        try:
            return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def _check_file(self, st: os.stat_result, shown: str) -> None:
        if stat.S_ISLNK(st.st_mode):
            raise JailError(f"{shown} is a symlink; the file tools never follow symlinks (use the path of the real "
                            f"file inside the workspace)")
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{shown} is a folder, not a file (use list_files)")
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{shown} is not a regular file (a FIFO, socket or device); refused")
        if st.st_nlink > 1:
            raise JailError(f"{shown} has {st.st_nlink} hard links; a hard link can be another name of a file "
                            f"outside the workspace, so the file tools refuse it")
        if st.st_dev != self.dev:
            raise JailError(f"{shown} is on another file system than the workspace (a mount point); refused")

    def read_bytes(self, parts: list[str], dir_fd: int | None = None) -> tuple[bytes, os.stat_result]:
        """The content of regular file `parts` (at most MAX_FILE_BYTES; larger is a ToolError) and its stat.
        `dir_fd`: the open parent folder (then `parts` is [name])."""
        shown = "/".join(parts) or "."
        if not parts:
            raise ToolError(". is a folder, not a file (use list_files)")
        pfd = self.open_dir(parts[:-1]) if dir_fd is None else dir_fd
        try:
            name = parts[-1]
            try:
                pre = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except OSError as e:
                raise self._refusal(pfd, name, shown, e, "file") from None
            self._check_file(pre, shown)  # refuse FIFOs and devices before opening them
            try:
                fd = os.open(name, _READ, dir_fd=pfd)
            except OSError as e:
                raise self._refusal(pfd, name, shown, e, "file") from None
        finally:
            if dir_fd is None:
                os.close(pfd)
        try:
            st = os.fstat(fd)
            self._check_file(st, shown)  # what was opened, whatever was there a moment before
            if st.st_size > MAX_FILE_BYTES:
                raise ToolError(f"{shown} is {st.st_size} bytes, larger than the {MAX_FILE_BYTES}-byte limit")
            os.set_blocking(fd, True)
            chunks, n = [], 0
            while n <= MAX_FILE_BYTES:
                b = os.read(fd, min(1 << 20, MAX_FILE_BYTES + 1 - n))
                if not b:
                    break
                chunks.append(b)
                n += len(b)
            if n > MAX_FILE_BYTES:
                raise ToolError(f"{shown} is larger than the {MAX_FILE_BYTES}-byte limit")
            return b"".join(chunks), st
        finally:
            os.close(fd)

    def write_bytes(self, parts: list[str], data: bytes, mode: int | None = None) -> None:
        """Replace file `parts` by `data` atomically: a temporary file in the parent folder's descriptor, flushed,
        then renamed over the name (relative to that descriptor). `mode`: the permissions (None: a new file's,
        0o666 less the umask). Missing parent folders are made; a folder or symlink at the name is refused."""
        shown = "/".join(parts)
        pfd = self.open_dir(parts[:-1], create=True)
        try:
            name = parts[-1]
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise JailError(f"{shown} is a symlink; the file tools never follow or replace symlinks")
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise ToolError(f"{shown} is not a regular file" if not stat.S_ISDIR(st.st_mode)
                                else f"{shown} is a folder")
            tmp = f".glimmer-{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, _CREATE, 0o666 if mode is None else 0o600, dir_fd=pfd)
            except OSError as e:  # e.g. the folder was removed meanwhile
                raise ToolError(f"{shown}: cannot write there ({e.strerror}); nothing was written") from None
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    if mode is not None:
                        os.fchmod(fd, mode)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
            except BaseException as e:
                try:
                    os.unlink(tmp, dir_fd=pfd)
                except OSError:
                    pass
                if isinstance(e, OSError):
                    raise ToolError(f"{shown}: cannot write there ({e.strerror}); nothing was written") from None
                raise
        finally:
            os.close(pfd)


def is_text(data: bytes) -> bool:
    if b"\x00" in data[:8192]:
        return False
    try:
        data[:8192].decode("utf-8")
    except UnicodeDecodeError as e:
        return len(data) > 8192 and e.start > 8180  # a multi-byte character cut at the sample's end
    return True
