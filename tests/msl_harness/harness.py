"""MSL-on-CPU harness: run a `KernelCall` (glimmer_mlx.kernels._core) on the CPU, compiling the kernel text MLX
itself generates for it.

1. MLX's generated source — header + signature + the exact `.metal` body + template instantiation — is captured by
   tracing the call inside `mx.export_function` with `verbose=True` (MLX prints it; on a build without Metal the
   call is recorded instead of raising).
2. Minimal rewrite for C++: Metal attributes (`[[kernel]]`, `[[buffer(i)]]`, `[[thread_position_in_grid]]`, …) are
   dropped, `threadgroup T name[N];` declarations become references into a per-threadgroup arena, MLX's
   `template [[host_name(...)]]` instantiation line is replaced by a C entry point that calls the instantiated
   kernel once per thread. The body text is otherwise untouched; `msl_cpu.h` supplies the language subset.
3. g++/clang++ -std=c++20 compiles it into a shared library (cached by content hash), loaded with ctypes.
4. Buffers are laid out in MLX's order (inputs with their `_shape/_strides/_ndim` when the body names them, then
   outputs). Outputs start as 0xFF bytes (NaN / -1) unless `init_value` is given, and carry a trailing canary that
   must survive (out-of-bounds writes past the end are caught). For kernels built with ensure_row_contiguous=False,
   inputs of ndim >= 2 are passed as strided views into NaN-padded buffers (as MLX passes views on the GPU), so a
   body that ignores `*_strides` reads NaN.
5. Every buffer (inputs, their `_shape/_strides`, outputs with their canary) is copied into its own mapping that
   touches a PROT_NONE guard page: ending at it in one run, starting right after one in the other, so a read or
   write past the end or before the start faults; msl_cpu.h's fault handler records it and the launch fails naming
   the buffer and the offset (out-of-bounds reads are detected, not just writes).
6. `run` executes the grid twice: forward fiber schedule with the memory-flag model on (threadgroup writes are
   published only by barriers with mem_threadgroup, see msl_cpu.h) and reverse schedule with plain shared
   threadgroup memory, and requires identical bytes. When they differ, a third run (forward, plain memory) tells a
   schedule dependence (missing barrier / race) from a kernel relying on a barrier whose flags do not publish
   threadgroup memory (e.g. `mem_none`).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from glimmer_mlx.kernels._core import mlx_kernel

HERE = Path(__file__).resolve().parent
CANARY = 256  # bytes after each output buffer
CANARY_BYTE = 0xA5


class HarnessError(RuntimeError):
    pass


def find_compiler() -> str | None:
    """A C++20 compiler that can build the harness (g++ or clang++), or None."""
    for cc in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if not cc or not shutil.which(cc):
            continue
        probe = Path(tempfile.gettempdir()) / "glimmer_msl_probe.cpp"
        probe.write_text("#include <concepts>\nint main(){ _Float16 h = 1; return int(float(h)) - 1; }\n")
        r = subprocess.run([cc, "-std=c++20", "-fsyntax-only", str(probe)], capture_output=True)
        if r.returncode == 0:
            return cc
    return None


def cache_dir() -> Path:
    d = Path(os.environ.get("GLIMMER_MSL_CACHE", Path(tempfile.gettempdir()) / f"glimmer_msl_{os.getuid()}"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# -- 1. MLX's generated source ---------------------------------------------------------------------------------------
_GEN_CACHE: dict = {}


def _input_key(a: mx.array):
    # the address space (device / constant) and reference-ness depend on size and ndim
    return (str(a.dtype), a.ndim == 0, a.size < 8)


def generated_source(call) -> str:
    """The complete MSL source MLX generates for this launch (what the Metal compiler would see, minus MLX's
    `utils.h` prelude, for which msl_cpu.h stands in)."""
    key = (call.spec, call.spec.source, repr(call.template), tuple(_input_key(a) for a in call.inputs),
           tuple(str(d) for d in call.output_dtypes))
    if key in _GEN_CACHE:
        return _GEN_CACHE[key]
    kernel = mlx_kernel(call.spec)  # MLX's own builder, even where a test substitutes KernelSpec.build
    kw = call.kwargs()
    kw.pop("inputs")

    def fn(*inputs):
        return kernel(inputs=list(inputs), verbose=True, **kw)

    libc = ctypes.CDLL(None)
    with tempfile.TemporaryDirectory() as td:
        capture = Path(td) / "stdout.txt"
        sys.stdout.flush()
        libc.fflush(None)
        saved = os.dup(1)
        with open(capture, "wb") as fh:
            os.dup2(fh.fileno(), 1)
            try:
                mx.export_function(str(Path(td) / "trace.mlxfn"), fn, *call.inputs)
            finally:
                libc.fflush(None)
                os.dup2(saved, 1)
                os.close(saved)
        text = capture.read_text()
    m = re.search(r"```\n(.*?)\n```", text, re.S)
    if not m:
        raise HarnessError(f"MLX did not print the generated source for {call.spec.name}:\n{text[:2000]}")
    _GEN_CACHE[key] = m.group(1)
    return m.group(1)


# -- 2. rewrite for C++ -------------------------------------------------------------------------------------------------
_SIG = re.compile(r"\[\[kernel\]\] void (?P<fn>\w+)\((?P<params>.*?)\) \{\n", re.S)
_INST = re.compile(r"^template \[\[host_name\(\"[^\"]+\"\)\]\] \[\[kernel\]\] decltype\((?P<fn>\w+)(?P<targs><.*>)?\) "
                   r"[^\n]*;\s*$", re.M)
_TG_DECL = re.compile(r"^(?P<indent>[ \t]*)threadgroup\s+(?P<type>[A-Za-z_][\w:]*(?:\s*<[^;>]*>)?)\s+"
                      r"(?P<name>\w+)\s*(?P<dims>(?:\[[^\]\n]+\])+)\s*;", re.M)
_TG_SCALAR = re.compile(r"^[ \t]*threadgroup\s+[A-Za-z_][\w:]*(?:\s*<[^;>]*>)?\s+\w+\s*(=|;)", re.M)
_PARAM = re.compile(r"^\s*(?P<decl>.*?)\s*\[\[(?P<attr>\w+)(?:\((?P<idx>\d+)\))?\]\]\s*$", re.S)


def translate(src: str):
    """MLX-generated MSL → (C++ translation unit, parameter list). Parameters: (kind, name, c_type) with kind
    'buffer' (in buffer order) or 'attr'."""
    sig = _SIG.search(src)
    inst = _INST.search(src)
    if not sig:
        raise HarnessError("unexpected layout of MLX's generated source (kernel signature not found)")
    # a kernel without template parameters has no instantiation line
    fn, targs = sig.group("fn"), (inst.group("targs") or "") if inst else ""
    params = []
    for raw in sig.group("params").split(",\n"):
        pm = _PARAM.match(raw)
        if not pm:
            raise HarnessError(f"cannot parse kernel parameter {raw!r}")
        decl, attr = pm.group("decl"), pm.group("attr")
        name = re.search(r"(\w+)\s*$", decl).group(1)
        ctype = decl[: -len(name)].strip()
        params.append(("buffer" if attr == "buffer" else "attr", name, ctype))
    head = src[: sig.start()]
    body = src[sig.end(): inst.start() if inst else len(src)]
    for kind, name, ctype in params:  # the address spaces are empty macros in C++: check this one mismatch here
        if kind == "buffer" and re.search(r"\bconstant\b", ctype):
            bad = re.search(r"\bdevice\b[^;=(){}]*\*\s*\w+\s*=\s*\(?\s*" + name + r"\b", body)
            if bad:
                raise HarnessError(f"{name!r} is in the constant address space here (MLX passes inputs of fewer "
                                   f"than 8 elements so) but is assigned to a device pointer: {bad.group(0)!r} "
                                   f"(the Metal compiler refuses it; use `auto` or `constant`)")
    counter = iter(range(10**6))

    def tg(m):
        return (f"{m.group('indent')}auto& {m.group('name')} = "
                f"*msl_rt::tg_array<{m.group('type')}{m.group('dims')}>({next(counter)});")

    body = _TG_DECL.sub(tg, body)
    bad = _TG_SCALAR.search(body)
    if bad:
        raise HarnessError(f"the harness supports threadgroup *array* declarations only: {bad.group(0).strip()!r}")
    cparams = []
    for kind, name, ctype in params:
        cparams.append(f"{ctype} {name}")
    args = []
    bi = 0
    for kind, name, ctype in params:
        if kind == "attr":
            args.append(f"__t.{name}")
        else:
            if ctype.endswith("&"):
                args.append(f"*({ctype[:-1].strip()}*)__b[{bi}]")
            else:
                args.append(f"({ctype})__b[{bi}]")
            bi += 1
    tu = ["#include \"msl_cpu.h\"", head.rstrip(), f"void {fn}(" + ", ".join(cparams) + ") {", body.rstrip(), "",
          "static void __glimmer_thread(const msl_rt::ThreadIds& __t, void** __b) {",
          f"  {fn}{targs}(" + ", ".join(args) + ");", "}",
          "extern \"C\" int glimmer_msl_launch(void** b, msl_rt::LaunchSpec* s) {",
          "  return msl_rt::launch(s, b, &__glimmer_thread);", "}", ""]
    return "\n".join(tu), params


# -- 3. compile -----------------------------------------------------------------------------------------------------------
_LIBS: dict = {}


MAX_GUARDS = 128  # as msl_cpu.h


class _LaunchSpec(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("group", ctypes.c_uint32 * 3), ("reverse", ctypes.c_int32),
                ("error", ctypes.c_char * 512), ("strict_tg", ctypes.c_int32), ("n_guards", ctypes.c_int32),
                ("guard_lo", ctypes.c_uint64 * MAX_GUARDS), ("guard_hi", ctypes.c_uint64 * MAX_GUARDS),
                ("guard_buf", ctypes.c_int32 * MAX_GUARDS), ("fault_guard", ctypes.c_int32),
                ("fault_addr", ctypes.c_uint64)]


# -- guarded buffers ------------------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PAGE = mmap.PAGESIZE


class GuardedBuffer:
    """A copy of `data` (bytes) in its own mapping between two PROT_NONE pages, flush against the trailing one
    (at_end) or the leading one."""

    def __init__(self, name: str, data: np.ndarray, at_end: bool):
        self.name = name
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        self.nbytes = raw.size
        body = max(PAGE, -(-self.nbytes // PAGE) * PAGE)
        self.total = body + 2 * PAGE
        base = _libc.mmap(None, self.total, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                          -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise HarnessError(f"mmap failed (errno {ctypes.get_errno()})")
        self.base = base
        if _libc.mprotect(base, PAGE, 0) or _libc.mprotect(base + PAGE + body, PAGE, 0):
            self.free()
            raise HarnessError(f"mprotect failed (errno {ctypes.get_errno()})")
        self.start = base + PAGE + (body - self.nbytes if at_end else 0)
        if self.nbytes:
            ctypes.memmove(self.start, raw.ctypes.data, self.nbytes)
        self.guards = [(base, base + PAGE), (base + PAGE + body, base + self.total)]

    def read(self) -> np.ndarray:
        """The buffer's bytes now (a copy)."""
        return np.frombuffer(ctypes.string_at(self.start, self.nbytes), dtype=np.uint8).copy()

    def describe(self, addr: int) -> str:
        if addr >= self.start + self.nbytes:
            return f"past the end of {self.name} (byte +{addr - self.start - self.nbytes} after its last byte)"
        return f"before the start of {self.name} (byte -{self.start - addr})"

    def free(self):
        if self.base:
            _libc.munmap(self.base, self.total)
            self.base = 0


def compile_unit(tu: str):
    header = (HERE / "msl_cpu.h").read_text()
    digest = hashlib.sha256((tu + header).encode()).hexdigest()[:20]
    if digest in _LIBS:
        return _LIBS[digest]
    cc = find_compiler()
    if cc is None:
        raise HarnessError("no C++20 compiler (g++ or clang++) found")
    d = cache_dir()
    so = d / f"k_{digest}.so"
    if not so.exists():
        src = d / f"k_{digest}.cpp"
        src.write_text(tu)
        tmp = d / f"k_{digest}.{os.getpid()}.so"
        r = subprocess.run([cc, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", "-fno-strict-aliasing", "-I", str(HERE),
                            str(src), "-o", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise HarnessError(f"compiling {src} failed:\n{r.stderr[-4000:]}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.glimmer_msl_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_LaunchSpec)]
    lib.glimmer_msl_launch.restype = ctypes.c_int
    _LIBS[digest] = lib
    return lib


# -- 4. run ---------------------------------------------------------------------------------------------------------------
_NP = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32,
       mx.uint32: np.uint32, mx.int64: np.int64, mx.uint64: np.uint64, mx.int8: np.int8, mx.uint8: np.uint8,
       mx.int16: np.int16, mx.uint16: np.uint16, mx.bool_: np.bool_}


def to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def from_numpy(x: np.ndarray, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(x).view(mx.bfloat16)
    return mx.array(x)


def _ctype_numpy(ctype: str):
    base = re.sub(r"\b(const|constant|device)\b", "", ctype).replace("*", "").replace("&", "").strip()
    return {"int": np.int32, "int32_t": np.int32, "int64_t": np.int64, "size_t": np.uint64, "uint": np.uint32,
            "uint32_t": np.uint32}.get(base)


VIEW_PAD, VIEW_OFFSET, VIEW_COLS = 5, 2, 3  # extra rows around a strided input, rows before it, extra columns


def _as_view(a: np.ndarray):
    """Place `a` (ndim >= 2) inside a larger buffer, as a view into a cache would be: VIEW_OFFSET rows of padding
    before it and VIEW_PAD - VIEW_OFFSET after it along axis -2, VIEW_COLS extra columns along axis -1 (so every
    stride but the last differs from the contiguous one), padding bytes 0xFF (NaN). Returns (base buffer, byte
    offset of the view, element strides of the view)."""
    shape = a.shape[:-2] + (a.shape[-2] + VIEW_PAD, a.shape[-1] + VIEW_COLS)
    base = np.frombuffer(np.full(int(np.prod(shape)) * a.itemsize, 0xFF, np.uint8).tobytes(), dtype=a.dtype)
    base = base.copy().reshape(shape)
    base[..., VIEW_OFFSET: VIEW_OFFSET + a.shape[-2], : a.shape[-1]] = a
    strides = [s // a.itemsize for s in base.strides]
    return base, VIEW_OFFSET * strides[-2] * a.itemsize, strides


def run_once(call, reverse: bool = False, strict: bool = True, at_end: bool | None = None) -> list[np.ndarray]:
    """One execution. For a spec built with ensure_row_contiguous=False, inputs of ndim >= 2 are passed as strided
    views into padded buffers (so the body must honour `*_strides`, as it must for MLX views on the GPU).
    strict: the memory-flag model (msl_cpu.h); at_end: buffers flush against their trailing guard page (default:
    unless `reverse`)."""
    at_end = (not reverse) if at_end is None else at_end
    src = generated_source(call)
    tu, params = translate(src)
    lib = compile_unit(tu)
    ins = {name: a for name, a in zip(call.spec.input_names, call.inputs)}
    views = {}
    if not call.spec.ensure_row_contiguous:
        for name, a in ins.items():
            if a.ndim >= 2:
                views[name] = _as_view(to_numpy(a))
    outs_np, out_raw, keep = {}, {}, []
    for name, shape, dtype in zip(call.spec.output_names, call.output_shapes, call.output_dtypes):
        npdt = np.dtype(_NP[dtype])
        nbytes = int(np.prod(shape, dtype=np.int64)) * npdt.itemsize
        raw = np.full(nbytes + CANARY, CANARY_BYTE, dtype=np.uint8)
        if call.init_value is None:
            raw[:nbytes] = 0xFF
        else:
            raw[:nbytes].view(npdt)[:] = (to_numpy(mx.array(call.init_value, dtype=dtype)).item())
        out_raw[name] = (raw, nbytes)
        outs_np[name] = raw[:nbytes].view(npdt).reshape(shape)
    ptrs, bufs = [], []
    for kind, name, ctype in params:
        if kind != "buffer":
            continue
        offset = 0
        what_ = f"input {name!r}"
        if name in views:
            arr, offset, _ = views[name]
        elif name in ins:
            arr = to_numpy(ins[name])
        elif name in outs_np:
            arr = out_raw[name][0]
            what_ = f"output {name!r} (with its {CANARY}-byte canary)"
        else:
            base, _, what = name.rpartition("_")
            if base not in ins or what not in ("shape", "strides", "ndim"):
                raise HarnessError(f"kernel parameter {name!r} matches no input or output")
            a = ins[base]
            dt = _ctype_numpy(ctype) or np.int32
            if what == "shape":
                arr = np.array(a.shape, dtype=dt)
            elif what == "strides":
                if base in views:
                    st = views[base][2]
                else:
                    st, acc = [], 1
                    for s in reversed(a.shape):
                        st.append(acc)
                        acc *= s
                    st = st[::-1]
                arr = np.array(st, dtype=dt)
            else:
                arr = np.array([a.ndim], dtype=dt)
            what_ = f"{name!r} (of input {base!r})"
        if arr.size == 0:
            arr = np.zeros(1, dtype=arr.dtype)
        keep.append(arr)
        bufs.append(GuardedBuffer(what_, arr, at_end))
        ptrs.append(bufs[-1].start + offset)
    try:
        spec = _LaunchSpec()
        for i in range(3):
            spec.grid[i] = int(call.grid[i])
            spec.group[i] = int(call.threadgroup[i])
        spec.reverse = 1 if reverse else 0
        spec.strict_tg = 1 if strict else 0
        guards = [(lo, hi, b) for b, buf in enumerate(bufs) for lo, hi in buf.guards]
        if len(guards) > MAX_GUARDS:
            raise HarnessError(f"{call.spec.name}: more than {MAX_GUARDS // 2} buffers")
        spec.n_guards = len(guards)
        for i, (lo, hi, b) in enumerate(guards):
            spec.guard_lo[i], spec.guard_hi[i], spec.guard_buf[i] = lo, hi, b
        cptrs = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        rc = lib.glimmer_msl_launch(cptrs, ctypes.byref(spec))
        if spec.fault_guard >= 0:
            buf = bufs[guards[spec.fault_guard][2]]
            raise HarnessError(f"{call.spec.name}: out-of-bounds access {buf.describe(spec.fault_addr)}")
        if spec.fault_guard == -2:
            raise HarnessError(f"{call.spec.name}: out-of-bounds access at {spec.fault_addr:#x}, outside every "
                               f"buffer (a negative index in unsigned arithmetic?)")
        if rc != 0:
            raise HarnessError(f"{call.spec.name}: {spec.error.decode(errors='replace')}")
        out_bufs = {n: bufs[i] for i, n in enumerate(p[1] for p in params if p[0] == "buffer") if n in out_raw}
        for name, (raw, nbytes) in out_raw.items():
            raw[:] = out_bufs[name].read()
    finally:
        for buf in bufs:
            buf.free()
    result = []
    for name in call.spec.output_names:
        raw, nbytes = out_raw[name]
        if not np.all(raw[nbytes:] == CANARY_BYTE):
            raise HarnessError(f"{call.spec.name}: out-of-bounds write past the end of output {name!r}")
        result.append(outs_np[name].copy())
    return result


def _first_difference(names, xs, ys) -> str | None:
    for name, a, b in zip(names, xs, ys):
        if a.tobytes() != b.tobytes():
            return name
    return None


def run(call, check_races: bool = True) -> list[mx.array]:
    """Execute the launch on the CPU (forward schedule, memory flags modelled, buffers flush against their end
    guard); with check_races, also with the reverse schedule and plain shared memory (buffers flush against their
    start guard), requiring equal bytes."""
    fwd = run_once(call, reverse=False, strict=True)
    if check_races:
        rev = run_once(call, reverse=True, strict=False)
        name = _first_difference(call.spec.output_names, fwd, rev)
        if name is not None:
            plain = run_once(call, reverse=False, strict=False)
            if _first_difference(call.spec.output_names, plain, rev) is not None:
                raise HarnessError(f"{call.spec.name}: output {name!r} depends on the thread schedule "
                                   f"(missing barrier / threadgroup-memory race)")
            raise HarnessError(f"{call.spec.name}: output {name!r} depends on threadgroup memory that no barrier "
                               f"with mem_flags::mem_threadgroup published (a barrier with mem_none / mem_device "
                               f"does not make threadgroup writes visible to other threads)")
    return [from_numpy(a, dt) for a, dt in zip(fwd, call.output_dtypes)]
