"""Pack fp32 safetensors files small enough to travel to a lent device (its working tree may carry 64 MiB; the
embedded target, its DFlash 2 drafter and MTP layers are 46 MB and compress by 2 % with xz as they are): the header
as is, the tensor bytes split into their four byte planes (the sign/exponent plane compresses to a third, the
mantissa planes barely), each xz-compressed. Unpacking restores the files byte for byte (checked by SHA-256).

    python benchmarks/device/planes.py pack DEST FILE...      DEST/<n>.planes per file + DEST/index.json
    python benchmarks/device/planes.py unpack DEST            writes every file back to its path (relative to cwd)
"""
import hashlib
import json
import lzma
import struct
import sys
from pathlib import Path

import numpy as np


def pack(dest: Path, files: list[str]) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    index = []
    for i, f in enumerate(files):
        b = Path(f).read_bytes()
        n = struct.unpack("<Q", b[:8])[0]
        head, body = b[:8 + n], b[8 + n:]
        cut = len(body) // 4 * 4
        planes = np.frombuffer(body[:cut], dtype=np.uint8).reshape(-1, 4)
        parts = [head, body[cut:]] + [planes[:, j].tobytes() for j in range(4)]
        blobs = [lzma.compress(p, preset=6) for p in parts]
        out = dest / f"{i}.planes"
        out.write_bytes(struct.pack("<6Q", *map(len, blobs)) + b"".join(blobs))
        index.append({"path": f, "sha256": hashlib.sha256(b).hexdigest(), "blob": out.name})
        print(f"{f}: {len(b)} -> {out.stat().st_size} bytes")
    (dest / "index.json").write_text(json.dumps(index, indent=1))


def unpack(dest: Path) -> None:
    for e in json.loads((dest / "index.json").read_text()):
        raw = (dest / e["blob"]).read_bytes()
        sizes = struct.unpack("<6Q", raw[:48])
        parts, at = [], 48
        for s in sizes:
            parts.append(lzma.decompress(raw[at:at + s]))
            at += s
        head, tail = parts[0], parts[1]
        planes = np.stack([np.frombuffer(p, dtype=np.uint8) for p in parts[2:]], axis=1)
        b = head + planes.tobytes() + tail
        if hashlib.sha256(b).hexdigest() != e["sha256"]:
            sys.exit(f"{e['path']}: unpacked bytes differ from the packed file's")
        Path(e["path"]).parent.mkdir(parents=True, exist_ok=True)
        Path(e["path"]).write_bytes(b)
        print(f"unpacked {e['path']} ({len(b)} bytes)")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "pack":
        pack(Path(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) == 3 and sys.argv[1] == "unpack":
        unpack(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
