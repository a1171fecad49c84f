"""Cut the CUDA fatbin(s) out of a compiled library (.so) for `cuobjdump -sass`.

    python3 bench/extract_fatbin.py dist/NAME/NAME.so OUT_DIR
    cuobjdump -sass OUT_DIR/NAME.0.fatbin | grep -oE 'OMMA[A-Z0-9_.]*' | sort | uniq -c

Prints one line per fatbin entry (ELF cubin or PTX, SM arch, size, whether ptxas recorded an
arch-specific "-arch sm_XXXa" target). A cuda:sm_120 library built with the FP4 MMA path should
show one ELF entry for arch 120 with sm_120a, and its SASS should hold
`OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X` (the block-scaled FP4 MMA; grep OMMA). The parsing is
ninfer_mlc.compile.fatbin (standard library only): on the GPU machine put the package on PYTHONPATH
as bench/README.md does (/tmp/pkg).
"""
from __future__ import annotations

import sys
from pathlib import Path

from ninfer_mlc.compile.fatbin import fatbin_entries, find_fatbins


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
