"""Process memory across prefill calls of many distinct lengths (the VM allocator's pool growth).

The Relax VM's pooled allocator keeps a freed block per distinct size; a compiled function whose
intermediates are sized by the token count n allocates new blocks for every new n. With the row
bound compiled in (compile/memory_bounds.py) each function has one storage of its maximum size and
the process stays flat once every function has run.

    .venv/bin/python bench/prefill_memory.py [ARTIFACT] [--lengths 50] [--device cpu]

Prints RSS (and on CUDA the device's free memory) after a warm-up call at the largest length and
after prefills of N distinct lengths. GPU check (on the GPU machine, a CUDA artifact):
    python3 bench/prefill_memory.py ARTIFACT --device cuda --lengths 30 --max-len 2048
before the fix device_growth_mib is hundreds of MiB on a 27B artifact, after it ~0.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import numpy as np


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def distinct_lengths(count: int, top: int) -> list[int]:
    """count distinct lengths spread over [1, top], in an order that is not monotone."""
    lens = np.unique(np.linspace(1, top, count).astype(int))
    return list(np.random.default_rng(0).permutation(lens))


def measure(art: str, count: int, device: str, top: int | None = None) -> dict:
    from ninfer_mlc.runtime.harness import Harness

    from ninfer_mlc.contract.manifest import read_manifest

    m = read_manifest(Path(art), verify="size")
    top = top or min(m.max_context, int(m.extras.get("max_prefill_chunk") or 512))
    h = Harness(art, device=device, kv_capacity_tokens=top + 2 * m.page_size, num_slots=2, max_batch=2)
    dev = h.runner.dev

    def device_free_mib() -> float:
        if h.runner.device_kind != "cuda":
            return 0.0
        dev.sync()
        return int(getattr(dev, "available_global_memory", 0) or 0) / 2**20

    vocab = h.manifest.config["vocab_size"]
    rng = np.random.default_rng(1)

    def run(n: int) -> None:
        seq = h.new_seq()
        h.prefill([(seq, rng.integers(0, vocab, n).tolist())])
        h.free_seq(seq)

    run(top)  # every function's storage at its largest: what a bounded build costs once
    run(1)
    gc.collect()
    base, dev_base = rss_mib(), device_free_mib()
    lens = distinct_lengths(count, top)
    for n in lens:
        run(int(n))
    gc.collect()
    after, dev_after = rss_mib(), device_free_mib()
    return {"lengths": len(lens), "max_len": top, "rss_base_mib": round(base, 1), "rss_after_mib": round(after, 1),
            "growth_mib": round(after - base, 1), "device_growth_mib": round(dev_base - dev_after, 1),
            "max_prefill_chunk": h.runner.max_prefill_chunk}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", nargs="?", default=str(Path(__file__).resolve().parent.parent / "dist" / "qwen3x-tiny"))
    ap.add_argument("--lengths", type=int, default=50)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    print(measure(a.artifact, a.lengths, a.device, a.max_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
