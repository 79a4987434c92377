"""Prepare MLX's CUDA back-end for a lent NVIDIA H200 (the workplace's `device` machine), where nothing can be
fetched and at most 64 MiB travel with the working tree: mlx-cuda-13's wheel is 90 MB, its libmlx.so 146 MB.

Downloads mlx, mlx-cuda-13 (the local mlx's version) and mlx-lm (the local one's) for CPython 3.12, strips libmlx.so's symbols,
zeroes the payload of every CUDA fatbin entry that is not sm_90 machine code (sm_75/80/100/120/121 cubins and
sm_120 PTX; the H200 runs sm_90's, and the loader reads only the entry it picks), and writes into DEST (ignored by
git): libmlx.sm90.so.xz (~15 MB), rest.tar.xz (the wheel's other files, ~5 MB) and the two small wheels.
benchmarks/device/issue23_trees.sh installs them there.

    python benchmarks/device/mlx_cuda_slim.py [DEST=.dev]
"""
import os
import struct
import subprocess
import sys
import tempfile
import zipfile

from importlib.metadata import version

import mlx.core as mx

DEST = sys.argv[1] if len(sys.argv) > 1 else ".dev"
FATBIN_MAGIC, KEEP = 0xBA55ED50, (2, 90)  # (kind: 2 = ELF cubin, 1 = PTX; arch)


def pip_download(spec: str, where: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_35_x86_64",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "-d", where, spec],
                   check=True)
    name = spec.split("==")[0].replace("-", "_")
    return next(os.path.join(where, f) for f in os.listdir(where) if f.lower().startswith(name.lower() + "-"))


def fatbin_section(path: str) -> tuple[int, int]:
    out = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if " .nv_fatbin " in line + " ":
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    sys.exit(f"{path}: no .nv_fatbin section")


def keep_only_sm90(path: str) -> dict:
    """Zero every fatbin entry's payload but sm_90 cubins' (headers and sizes stay); returns bytes kept/zeroed."""
    data = bytearray(open(path, "rb").read())
    off, size = fatbin_section(path)
    pos, end, kept, zeroed = off, off + size, 0, 0
    while pos < end:
        magic, _, header, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # the fatbins are 8-byte aligned inside the section
            pos += 8
            continue
        p, stop = pos + header, pos + header + body
        while p < stop:
            kind, _, eheader, payload = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            if (kind, arch) == KEEP:
                kept += payload
            else:
                data[p + eheader:p + eheader + payload] = bytes(payload)
                zeroed += payload
            p += eheader + payload
        pos = stop
    if not kept:
        sys.exit(f"{path}: no sm_90 cubin in its fatbin")
    open(path, "wb").write(data)
    return {"kept": kept, "zeroed": zeroed}


def main() -> None:
    os.makedirs(DEST, exist_ok=True)
    v = mx.__version__
    with tempfile.TemporaryDirectory() as tmp:
        cuda = pip_download(f"mlx-cuda-13=={v}", tmp)
        for spec in (f"mlx=={v}", f"mlx-lm=={version('mlx-lm')}"):
            w = pip_download(spec, tmp)
            os.replace(w, os.path.join(DEST, os.path.basename(w)))
        tree = os.path.join(tmp, "x")
        zipfile.ZipFile(cuda).extractall(tree)
        lib = os.path.join(tree, "mlx", "lib", "libmlx.so")
        subprocess.run(["strip", "--strip-unneeded", lib], check=True)
        print("libmlx.so fatbin:", keep_only_sm90(lib))
        with open(os.path.join(DEST, "libmlx.sm90.so.xz"), "wb") as f:
            subprocess.run(["xz", "-6", "-T2", "-c", lib], stdout=f, check=True)
        os.remove(lib)
        subprocess.run(["tar", "-cJf", os.path.abspath(os.path.join(DEST, "rest.tar.xz")), "-C", tree, "."],
                       check=True)
    for f in sorted(os.listdir(DEST)):
        print(f"{os.path.getsize(os.path.join(DEST, f)):>12,d}  {DEST}/{f}")


if __name__ == "__main__":
    main()
