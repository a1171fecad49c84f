"""Host-tier round trip on the GPU: pages and state of a real sequence go to page-locked host memory
and back into other device pages/slots; the restored sequence must decode exactly like the original.

  python bench/host_tier_check.py ARTIFACT   (any compiled artifact; prints JSON, exit 1 on mismatch)
"""
from __future__ import annotations

import json
import sys

import numpy as np

from ninfer_mlc.runtime.kv.host_tier import HostTier
from ninfer_mlc.runtime.harness import Harness


def main(art: str) -> int:
    r = Harness(art, kv_capacity_tokens=2048, num_slots=4)
    host = HostTier(r, 64, 2, 0, meminfo_reader=lambda: 1 << 40)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, r.vocab_size, 200).tolist()
    ref = r.new_seq()
    r.prefill([(ref, toks[:150])])
    want = r.decode([ref], [toks[150]])[0]
    r.free_seq(ref)
    s = r.new_seq()
    r.prefill([(s, toks[:150])])
    alloc, hs = host.store_pages(s.pages), host.store_state(s.slot)
    n, length = len(s.pages), s.length
    r.free_seq(s)
    dirty = r.new_seq()  # reuse the freed pages and slot for something else
    r.prefill([(dirty, toks[50:200])])
    back = r.new_seq()
    back.pages = r.kv.pages.alloc(n)
    host.load_pages(alloc, back.pages)
    host.load_state(hs, back.slot)
    back.length = length
    got = r.decode([back], [toks[150]])[0]
    res = {"device": str(r.dev), "host_device": str(host.host_dev), "max_abs_diff": float(np.abs(got - want).max()),
           "transfers": host.stats}
    print(json.dumps(res, indent=1))
    return 0 if res["max_abs_diff"] == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
