"""EmuLib: the generated CUDA of some prim_funcs, compiled with g++ against the emulator prelude and called
like the prim_funcs (numpy arrays by buffer name, modified in place; launches replayed from the host side)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from . import prelude
from .host import HostProgram
from .source import cuda_source

_KERNEL_SIG = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, *\d+)?\) (\w+)\((.*?)\) \{')
# device code of the kernels' own (prefill_source) lives in the preamble between these markers; inside it,
# inline-PTX helpers sit between the DEV markers and are replaced by the prelude's emulations
_OWN_SRC = re.compile(r"// NINFER_ATTN_SRC_BEGIN.*?// NINFER_ATTN_SRC_END", re.S)
_DEV_SRC = re.compile(r"// NINFER_ATTN_DEV_BEGIN.*?// NINFER_ATTN_DEV_END", re.S)
# blocks run one at a time: shared memory is static storage, fresh (0xff bytes) for every block;
# dynamic shared memory gets 256 KiB
_SHARED = re.compile(r"__shared__ (?:alignas\((\d+)\) )?(\w+) (\w+)\[(\d+)\];")
_DYN_SHARED = re.compile(r"extern __shared__ __align__\((\d+)\) (\w+) (\w+)\[\];")


def split_args(s: str) -> list[str]:
    """Top-level comma split of a C parameter list."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def emulator_source(cuda: str, extra_prelude: str = "") -> tuple[str, dict]:
    """(C++ for g++, {kernel: (threads per block, [(C type, parameter name)])}) from a module's CUDA source:
    the prelude (then extra_prelude), the kernels' own device code, the kernels, and one extern "C" launcher
    per kernel, emu_<kernel>(void** pointers, const int64_t* scalars, grid x, y, z, block x)."""
    start = cuda.index('extern "C"')
    own = dict.fromkeys(_OWN_SRC.findall(cuda[:start]))
    body = "\n".join(own) + "\n" + cuda[start:]
    body = _DEV_SRC.sub("", body)
    body = _DYN_SHARED.sub(r"alignas(\1) static \2 \3[1 << 18]; EMU_FRESH(\3);", body)
    body = _SHARED.sub(lambda m: f"{'alignas(%s) ' % m.group(1) if m.group(1) else ''}static {m.group(2)} "
                                 f"{m.group(3)}[{m.group(4)}]; EMU_FRESH({m.group(3)});", body)
    kernels, launchers = {}, []
    for nt, name, params in _KERNEL_SIG.findall(body):
        plist = []
        for p in split_args(params):
            p = p.replace("__restrict__", "").strip()
            ctype, pname = p.rsplit(" ", 1) if "*" not in p else (p[:p.rindex("*") + 1], p[p.rindex("*") + 1:])
            plist.append((ctype.strip(), pname.strip()))
        kernels[name] = (int(nt), plist)
        cargs = ", ".join(f"({t})a[{i}]" if t.endswith("*") else f"({t})s[{i}]" for i, (t, _) in enumerate(plist))
        launchers.append(f'extern "C" void emu_{name}(void** a, const int64_t* s, int gx, int gy, int gz, int bx) '
                         f'{{ emu_launch(gx, gy, gz, bx, [=] {{ {name}({cargs}); }}); }}')
    return prelude.source() + "\n" + extra_prelude + "\n" + body + "\n" + "\n".join(launchers) + "\n", kernels


def compile_shared(code: str, workdir: Path | None = None, name: str = "emu") -> ctypes.CDLL:
    """g++ `code` into a shared library and load it (NINFER_EMU_CFLAGS: optimisation flags, default -O1).
    With NINFER_LIB_CACHE set, libraries are kept under $NINFER_LIB_CACHE/emu by a digest of the code,
    the flags and the compiler version, and reused. Without workdir the build files live in a temporary
    folder removed once the library is loaded."""
    flags = ["-std=c++20", *os.environ.get("NINFER_EMU_CFLAGS", "-O1").split(), "-w", "-shared", "-fPIC"]
    cache = Path(os.environ["NINFER_LIB_CACHE"]) / "emu" if os.environ.get("NINFER_LIB_CACHE") else None
    if cache is not None:
        version = subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout
        digest = hashlib.sha256("\0".join([code, " ".join(flags), version]).encode()).hexdigest()[:24]
        cached = cache / f"{digest}.so"
        if cached.is_file():
            return ctypes.CDLL(str(cached))
    with tempfile.TemporaryDirectory(prefix="cuda_emu_") as tmp:
        d = Path(workdir or tmp)
        d.mkdir(parents=True, exist_ok=True)
        cpp, so = d / f"{name}.cpp", d / f"{name}.so"
        cpp.write_text(code)
        r = subprocess.run(["g++", *flags, "-o", str(so), str(cpp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError("g++ failed on the emulated kernels:\n" + r.stderr[-4000:])
        if cache is None:
            return ctypes.CDLL(str(so))
        cache.mkdir(parents=True, exist_ok=True)
        tmp_so = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy2(so, tmp_so)
        os.replace(tmp_so, cached)
        return ctypes.CDLL(str(cached))


def _signature(func) -> tuple[list, list]:
    """([(buffer name, [shape var name or None per dim])], [scalar parameter names]) of a prim_func."""
    from tvm import tirx
    from tvm.tirx.buffer import BufferType

    bufs, scalars = [], []
    for p in func.params:
        if isinstance(p.ty, BufferType):
            bufs.append((p.name, [d.name if isinstance(d, tirx.Var) else None for d in p.ty.shape]))
        else:
            scalars.append(p.name)
    return bufs, scalars


class EmuLib:
    """The CUDA kernels of {global symbol: prim_func}, generated for cuda:arch and compiled for the CPU.

    lib(func, arrays, scalars) runs prim_func `func` the way its host code would: arrays by buffer name
    (C-contiguous numpy arrays, modified in place), scalars by name (the shape variables are read from the
    arrays' shapes; scalars given as well must agree). Workspaces the host allocates are fresh 0xff-filled
    memory. cse=False lowers with TVM's common-subexpression elimination off (builds keep it on).
    extra_prelude: C++ emulating device helpers that kernels outside compile/kernels/cuda call (the prelude
    covers those of the package's kernel families)."""

    def __init__(self, funcs: dict, arch: str = "sm_90", workdir: Path | None = None, cse: bool = True,
                 extra_prelude: str = ""):
        src, host = cuda_source(funcs, arch, cse=cse)
        self.host = HostProgram(host)
        self.signatures = {name: _signature(f) for name, f in funcs.items()}
        code, self.kernels = emulator_source(src, extra_prelude)
        self.lib = compile_shared(code, workdir)

    def kernel_names(self, func: str) -> list[str]:
        """Every kernel prim_func `func`'s host code may launch (all branches), in source order."""
        return self.host.kernel_names(func)

    def _env(self, func: str, arrays: dict, scalars: dict) -> dict:
        bufs, params = self.signatures[func]
        env = dict(scalars)
        for name, dims in bufs:
            a = arrays.get(name)
            if a is None:
                continue
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise ValueError(f"{func}: array {name!r} must be a C-contiguous numpy array")
            if a.ndim != len(dims):
                continue  # a flat view of the buffer: its shape variables come from elsewhere
            for var, extent in zip(dims, a.shape, strict=True):
                if var is not None and env.setdefault(var, extent) != extent:
                    raise ValueError(f"{func}: {name}.shape gives {var} = {extent}, but {var} = {env[var]}")
        missing = [p for p in params if p not in env]
        if missing:
            raise ValueError(f"{func}: scalar parameter(s) {missing} not given")
        return env

    def __call__(self, func: str, arrays: dict, scalars: dict | None = None) -> dict:
        env = self._env(func, arrays, scalars or {})
        buffers = dict(arrays)
        for kname, vals, dims in self.host.launches(func, env, buffers):
            nt, plist = self.kernels[kname]
            if len(vals) != len(plist):
                raise RuntimeError(f"{kname}: host passes {len(vals)} arguments, the kernel takes {len(plist)}")
            ptrs = (ctypes.c_void_p * len(plist))()
            sc = (ctypes.c_int64 * len(plist))()
            for i, ((ctype, _), v) in enumerate(zip(plist, vals, strict=True)):
                if ctype.endswith("*"):
                    ptrs[i] = v.ctypes.data
                else:
                    sc[i] = int(v)
            gx, gy, gz = (int(dims.get(f"blockIdx.{c}", 1)) for c in "xyz")
            bx = int(dims.get("threadIdx.x", 1))
            if nt != bx:
                raise RuntimeError(f"{kname}: launch bounds {nt} != block {bx}")
            getattr(self.lib, f"emu_{kname}")(ptrs, sc, gx, gy, gz, bx)
        return arrays
