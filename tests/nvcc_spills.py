"""nvcc a generated CUDA source for sm_90 and read ptxas' report of one kernel (tests that need nvcc)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path


def spill_stores(src: str, tmp_path: Path, kernel: str) -> tuple[int | None, str]:
    """(bytes of spill stores ptxas reports for `kernel`, None if it reports none for it; ptxas' report)."""
    (tmp_path / "k.cu").write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "--ptxas-options=-v",
                        str(tmp_path / "k.cu"), "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                       check=True)
    m = re.search(rf"Function properties for {kernel}\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores", r.stderr)
    return (int(m.group(2)) if m else None), r.stderr
