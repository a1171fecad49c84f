"""Cut the CUDA fatbin(s) out of a compiled library (.so) for `cuobjdump -sass`.

    python3 bench/extract_fatbin.py dist/NAME/NAME.so OUT_DIR
    cuobjdump -sass OUT_DIR/NAME.0.fatbin | grep -oE 'OMMA[A-Z0-9_.]*' | sort | uniq -c

Prints one line per fatbin entry (ELF cubin or PTX, SM arch, size, whether ptxas recorded an
arch-specific "-arch sm_XXXa" target). A cuda:sm_120 library built with the FP4 MMA path should
show one ELF entry for arch 120 with sm_120a, and its SASS should hold
`OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X` (the block-scaled FP4 MMA; grep OMMA). Pure standard
library (runs with the system python3 on the GPU machine).

Fatbin layout (reverse-engineered, as used by bench/README.md): header <I magic 0xBA55ED50,
<H version, <H header size, <Q payload size>; then entries <H kind (1 PTX, 2 ELF), <H, <I entry
header size, <Q payload size, <I compressed size, <I, <H, <H, <I arch ...>.
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

MAGIC = b"\x50\xed\x55\xba"


def find_fatbins(data: bytes) -> list[bytes]:
    """Every fatbin blob in `data` (a shared library or object file)."""
    out, i = [], data.find(MAGIC)
    while i >= 0:
        _, _, hsz, fsz = struct.unpack_from("<IHHQ", data, i)
        out.append(data[i:i + hsz + fsz])
        i = data.find(MAGIC, i + hsz + fsz)
    return out


def fatbin_entries(fatbin: bytes) -> list[dict]:
    """[{kind: 'elf'|'ptx'|int, arch: int, size, compressed: bool, arch_specific: bool|None}]."""
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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    lib, out_dir = Path(argv[0]), Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    blobs = find_fatbins(lib.read_bytes())
    if not blobs:
        print(f"{lib}: no fatbin (CUDA source left for JIT, or not a CUDA library)", file=sys.stderr)
        return 1
    for k, blob in enumerate(blobs):
        dst = out_dir / f"{lib.stem}.{k}.fatbin"
        dst.write_bytes(blob)
        print(f"{dst}: {len(blob)} bytes")
        for e in fatbin_entries(blob):
            print(f"  {e['kind']} sm_{e['arch']} {e['size']} bytes compressed={e['compressed']} "
                  f"arch_specific={e['arch_specific']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
