"""The CUDA fatbins inside a compiled library: what nvcc / ptxas produced for which arch.

A CUDA build leaves one fatbin blob per device module in the library's data (no CUDA source). Layout
(reverse-engineered; as cuobjdump reads it): header <I magic 0xBA55ED50, <H version, <H header size,
<Q payload size>; then entries <H kind (1 PTX, 2 ELF), <H, <I entry header size, <Q payload size,
<I compressed size, <I, <H, <H, <I arch ...>. Standard library only (bench/extract_fatbin.py uses it on
the GPU machine, where cuobjdump shows the SASS).
"""
from __future__ import annotations

import struct

MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little endian


def find_fatbins(data: bytes) -> list[bytes]:
    """Every fatbin blob in `data` (a shared library or object file)."""
    out, i = [], data.find(MAGIC)
    while i >= 0:
        _, _, hsz, fsz = struct.unpack_from("<IHHQ", data, i)
        out.append(data[i:i + hsz + fsz])
        i = data.find(MAGIC, i + hsz + fsz)
    return out


def fatbin_entries(fatbin: bytes) -> list[dict]:
    """[{kind: 'elf'|'ptx'|int, arch: int, size, compressed: bool, arch_specific: bool|None, payload}];
    arch_specific: whether ptxas recorded an "-arch sm_XXXa" / "sm_XXXf" target (None when compressed)."""
    _, _, hsz, fsz = struct.unpack_from("<IHHQ", fatbin, 0)
    off, end, out = hsz, hsz + fsz, []
    while off + 32 <= end:
        kind, _, ehsz, psz, csz, _, _, _, arch = struct.unpack_from("<HHIQIIHHI", fatbin, off)
        payload = fatbin[off + ehsz:off + ehsz + psz]
        compressed = csz != 0
        spec = None if compressed else (f"sm_{arch}a".encode() in payload or f"sm_{arch}f".encode() in payload)
        out.append({"kind": {1: "ptx", 2: "elf"}.get(kind, kind), "arch": arch, "size": psz,
                    "compressed": compressed, "arch_specific": spec, "payload": payload})
        off += ehsz + psz
    return out
