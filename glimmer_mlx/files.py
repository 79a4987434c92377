"""Writing files so that a reader never sees half of one: a temporary file in the same folder, flushed to disk, then
renamed over the target (`os.replace` is atomic on one file system). A crash or a full disk leaves the old file as
it was; concurrent writers each rename a complete file of their own (the last one wins)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


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
