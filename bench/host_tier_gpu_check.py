"""Host-tier page copies on the GPU against the pinned copy rate: the real HostTier (arena, copy plan, driver
copier) over bare device pools of the 27B geometry with NVFP4 KV (main page 1.18 MB + the MTP head's page),
no compiled model.

For N = 1, 16, 256 pages, with contiguous and with fragmented page lists (device ids in short shuffled runs,
a host arena whose free space is scattered), pages of random bytes go device -> host -> other device pages;
the main and MTP pages must come back bit-exact. Store (d2h) and load (h2d) GB/s come from the host tier's
own counters (copy seconds, the drain apart), set against torch's pinned copy rate measured in this process
(1 GiB, as bench/agent_replay.py measures it, and the same bytes as the transfer). Also: a 27B state slot
(conv + SSM, 154 MB) the same way; the previous path (a TVM copyto per page and part) at 256 pages; a spill
queued behind ~50 ms of torch compute, whose drain must land in kv_d2h_wait_seconds, not in the copy time.

    python3 bench/host_tier_gpu_check.py [-o out.json]   (bench/gpu_driver.sh's environment: runtime-only TVM + torch)
    python3 bench/host_tier_gpu_check.py --cpu           (a small smoke run of the same code on the CPU target)

Prints the JSON document, then a few summary lines; exit 1 when a round trip is not bit-exact.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ninfer_mlc.contract.pool_layout import PoolLayout  # noqa: E402
from ninfer_mlc.runtime.executor.bulk_copy import TvmBulkCopy  # noqa: E402
from ninfer_mlc.runtime.kv.copy_plan import PageRun, page_runs, plan_copies  # noqa: E402
from ninfer_mlc.runtime.kv.host_tier import HostTier  # noqa: E402
from ninfer_mlc.runtime.tvm_loader import device_for, import_tvm  # noqa: E402

SIZES = (1, 16, 256)
REPS = {1: 40, 16: 16, 256: 6}


def q27b_layout() -> PoolLayout:
    from gpu_bench import Q27B  # the full-size geometry the GPU benchmarks use

    cfg = dict(Q27B)
    n, k = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    cfg["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    return PoolLayout.of(cfg, "bfloat16", "nvfp4")


class PoolRunner:
    """What the host tier reads from a ModelRunner (pools on the page ids, state pools, the device); no library."""

    def __init__(self, tvm, dev, kind: str, lay: PoolLayout, num_pages: int, num_slots: int):
        self.tvm, self.dev, self.device_kind = tvm, dev, kind
        empty = tvm.runtime.empty
        self.num_pages = num_pages
        self.kv_pool = empty((num_pages,) + lay.kv_page, lay.kv_dtype, dev)
        self.mtp_kv_pool = empty((num_pages,) + lay.mtp_page, lay.kv_dtype, dev)
        self.conv_pool = empty((num_slots,) + lay.conv_slot, lay.state_dtype, dev)
        self.ssm_pool = empty((num_slots,) + lay.ssm_slot, "float32", dev)
        self.page_pools: dict = {}
        self.page_bytes, self.mtp_page_bytes = lay.page_bytes, lay.mtp_page_bytes
        self.conv_slot_bytes, self.ssm_slot_bytes = lay.conv_slot_bytes, lay.ssm_slot_bytes
        self.kv_shape = (num_pages,) + lay.kv_page
        self.mtp_kv_shape = (num_pages,) + lay.mtp_page
        self.lay = lay

    def sync(self) -> None:
        self.dev.sync()

    def state_views(self, slot: int):
        lay = self.lay
        return (self.conv_pool._create_view(lay.conv_slot, lay.state_dtype, slot * lay.conv_slot_bytes),
                self.ssm_pool._create_view(lay.ssm_slot, "float32", slot * lay.ssm_slot_bytes))


def page_bytes_view(pool, page: int, nbytes: int):
    return pool._create_view((nbytes,), "uint8", page * nbytes)


def fill_random(rng, pool, pages, nbytes: int) -> None:
    for p in pages:
        page_bytes_view(pool, p, nbytes).copyfrom(np.frombuffer(rng.bytes(nbytes), np.uint8))


def read_pages(pool, pages, nbytes: int) -> np.ndarray:
    return np.stack([page_bytes_view(pool, p, nbytes).numpy() for p in pages])


def fragmented_ids(rng, pool_ids: list, n: int) -> list:
    """n device ids from pool_ids in shuffled runs of 1-8 consecutive ids."""
    runs, i = [], 0
    while i < len(pool_ids):
        k = int(rng.integers(1, 9))
        runs.append(pool_ids[i:i + k])
        i += k
    order = rng.permutation(len(runs))
    return [p for j in order for p in runs[j]][:n]


def scatter_arena(host: HostTier, rng) -> list:
    """Fill the arena (one chunk so far) with allocations of 1-24 pages and free every other: its free space
    becomes holes of 1-24 pages, so a large allocation takes many extents. Returns the allocations kept."""
    arena, held = host.arena, []
    assert len(arena.chunks()) == 1
    while arena.stats()["free_pages"] >= 24:
        held.append(arena.alloc_pages(int(rng.integers(1, 25))))
    assert len(arena.chunks()) == 1
    for x in held[::2]:
        arena.free(x)
    return held[1::2]


def transfer_stats(host: HostTier, fn) -> dict:
    before = dict(host.stats)
    fn()
    return {k: host.stats[k] - before[k] for k in host.stats}


def torch_rates(nbytes: int):
    """torch's pinned host<->device copy (CUDA events) over nbytes: (h2d, d2h) bytes/s, or None without torch."""
    try:
        import torch
        from gpu_common import cuda_median_s
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), torch.empty(nbytes, dtype=torch.uint8, device="cuda")]
    reps = 20 if nbytes < (64 << 20) else 5
    out = (nbytes / cuda_median_s(torch, lambda: bufs[1].copy_(bufs[0], non_blocking=True), reps=reps, warm=2),
           nbytes / cuda_median_s(torch, lambda: bufs[0].copy_(bufs[1], non_blocking=True), reps=reps, warm=2))
    bufs.clear()
    torch.cuda.empty_cache()
    return out


def gbps(x) -> float | None:
    return None if x is None else round(x / 1e9, 2)


def run_case(host, r, rng, n: int, layout: str, free_ids: list, reps: int, pinned) -> dict:
    pb, mb = r.page_bytes, r.mtp_page_bytes
    half = len(free_ids) // 2
    if layout == "contiguous":
        src, dst = free_ids[:n], free_ids[half:half + n]
    else:
        src, dst = fragmented_ids(rng, free_ids[:half], n), fragmented_ids(rng, free_ids[half:], n)
    fill_random(rng, r.kv_pool, src + dst, pb)
    fill_random(rng, r.mtp_kv_pool, src + dst, mb)
    want_kv, want_mtp = read_pages(r.kv_pool, src, pb), read_pages(r.mtp_kv_pool, src, mb)
    d2h, h2d, extents, exact = [], [], 0, None
    for rep in range(reps):
        got: list = []
        s = transfer_stats(host, lambda: got.append(host.store_pages(src)))
        alloc = got[0]
        assert alloc is not None, "the host tier has no room"
        t = transfer_stats(host, lambda: host.load_pages(alloc, dst))
        if rep == 0:
            exact = bool(np.array_equal(read_pages(r.kv_pool, dst, pb), want_kv)
                         and np.array_equal(read_pages(r.mtp_kv_pool, dst, mb), want_mtp))
            extents = len(alloc.extents)
        host.free_pages(alloc)
        d2h.append(s)
        h2d.append(t)
    moved = n * (pb + mb)
    med = lambda rows, k: float(np.median([x[k] for x in rows]))  # noqa: E731
    store_s, load_s = med(d2h, "kv_d2h_seconds"), med(h2d, "kv_h2d_seconds")
    same = torch_rates(moved)
    out = {"pages": n, "layout": layout, "bytes": moved, "bit_exact": exact, "host_extents": extents,
           "device_runs": {"src": len(page_runs(src, [(0, 0, n)])), "dst": len(page_runs(dst, [(0, 0, n)]))},
           "copies": {"store": int(d2h[0]["kv_d2h_copies"]), "load": int(h2d[0]["kv_h2d_copies"])},
           "store_s": round(store_s, 6), "load_s": round(load_s, 6),
           "store_wait_s": round(med(d2h, "kv_d2h_wait_seconds"), 6), "load_wait_s": round(med(h2d, "kv_h2d_wait_seconds"), 6),
           "store_GBps": gbps(moved / store_s), "load_GBps": gbps(moved / load_s),
           "torch_same_bytes_GBps": None if same is None else {"d2h": gbps(same[1]), "h2d": gbps(same[0])}}
    if pinned:
        out["store_vs_pinned"] = round(moved / store_s / pinned[1], 3)
        out["load_vs_pinned"] = round(moved / load_s / pinned[0], 3)
    return out


def per_page_plan(host: HostTier):
    """The previous host tier's copies: one per page and part (runs of one page)."""
    def plan(pages, alloc):
        runs = page_runs(pages, [(ci, off // host.host_page_bytes, n // host.host_page_bytes)
                                 for ci, off, n in host.arena.chunk_ranges(alloc)])
        ones = [PageRun(x.dev_page + k, x.chunk, x.host_page + k, 1) for x in runs for k in range(x.n)]
        return plan_copies(ones, host.parts, host._chunk_pages)
    return plan


def state_case(host, r, rng, pinned) -> dict:
    fill_random(rng, r.conv_pool, [0, 1], r.conv_slot_bytes)
    fill_random(rng, r.ssm_pool, [0, 1], r.ssm_slot_bytes)
    want = (read_pages(r.conv_pool, [0], r.conv_slot_bytes), read_pages(r.ssm_pool, [0], r.ssm_slot_bytes))
    rows = []
    for rep in range(4):
        got: list = []
        s = transfer_stats(host, lambda: got.append(host.store_state(0)))
        t = transfer_stats(host, lambda: host.load_state(got[0], 1))
        if rep == 0:
            exact = bool(np.array_equal(read_pages(r.conv_pool, [1], r.conv_slot_bytes), want[0])
                         and np.array_equal(read_pages(r.ssm_pool, [1], r.ssm_slot_bytes), want[1]))
        host.free_state(got[0])
        rows.append((s["state_d2h_seconds"], t["state_h2d_seconds"]))
    nbytes = host.state_bytes
    st, lt = float(np.median([x[0] for x in rows])), float(np.median([x[1] for x in rows]))
    out = {"bytes": nbytes, "bit_exact": exact, "store_GBps": gbps(nbytes / st), "load_GBps": gbps(nbytes / lt)}
    if pinned:
        out["store_vs_pinned"], out["load_vs_pinned"] = round(nbytes / st / pinned[1], 3), round(nbytes / lt / pinned[0], 3)
    return out


def drain_case(host, r, free_ids) -> dict | None:
    """A spill queued behind torch compute: the drain is waited for and counted apart from the copy."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        a @ a
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 4
    k = max(1, int(0.05 / per))
    src = free_ids[:256]
    for _ in range(k):  # ~50 ms queued on torch's stream, not waited for
        a @ a
    got: list = []
    s = transfer_stats(host, lambda: got.append(host.store_pages(src)))
    host.free_pages(got[0])
    moved = len(src) * (r.page_bytes + r.mtp_page_bytes)
    del a
    torch.cuda.empty_cache()
    return {"queued_compute_s": round(k * per, 4), "wait_s": round(s["kv_d2h_wait_seconds"], 4),
            "copy_s": round(s["kv_d2h_seconds"], 6), "copy_GBps": gbps(moved / s["kv_d2h_seconds"]),
            "drain_counted_apart": bool(s["kv_d2h_wait_seconds"] >= 0.5 * k * per)}


def main(a) -> int:
    kind = "cpu" if a.cpu else "cuda"
    tvm = import_tvm(kind)
    dev = device_for(tvm, kind, 0)
    lay = q27b_layout()
    sizes = (1, 16) if a.cpu else SIZES
    num_pages = 2 * max(sizes) + 16
    r = PoolRunner(tvm, dev, kind, lay, num_pages, 2)
    host = HostTier(r, a.host_mib, 2, 0, meminfo_reader=lambda: 1 << 42)
    rng = np.random.default_rng(0)
    doc: dict = {"device": kind, "tvm": tvm.__version__, "copier": type(host.copier).__name__,
                 "geometry": {"kv_page_bytes": lay.page_bytes, "mtp_page_bytes": lay.mtp_page_bytes,
                              "state_slot_bytes": host.state_bytes, "kv_page": list(lay.kv_page)}}
    try:
        import torch
        if torch.cuda.is_available():
            doc["device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    pinned = None
    if not a.cpu:
        from serve_common import device_rates

        rates = device_rates(("pinned",))
        if rates.get("pinned_h2d_Bps"):
            pinned = (rates["pinned_h2d_Bps"], rates["pinned_d2h_Bps"])
        doc["torch_pinned_1GiB_GBps"] = {"h2d": gbps(rates.get("pinned_h2d_Bps")), "d2h": gbps(rates.get("pinned_d2h_Bps")),
                                         "torch": rates.get("torch"), "why_null": rates.get("why_null")}
    free_ids = list(range(num_pages))
    held = []
    doc["cases"] = []
    for layout in ("contiguous", "fragmented"):
        if layout == "fragmented":
            held = scatter_arena(host, rng)
        for n in sizes:
            doc["cases"].append(run_case(host, r, rng, n, layout, free_ids, 2 if a.cpu else REPS[n], pinned))
    # the previous path at the largest size: a TVM copyto per page and part
    copier, plan = host.copier, host._plan
    host.copier, host._plan = TvmBulkCopy(r.sync), per_page_plan(host)
    before = run_case(host, r, rng, max(sizes), "fragmented", free_ids, 2 if a.cpu else 3, pinned)
    host.copier, host._plan = copier, plan
    doc["before_tvm_copy_per_page"] = {k: before[k] for k in ("pages", "copies", "bit_exact", "store_GBps", "load_GBps",
                                                               "store_s", "load_s") if k in before}
    for x in held:
        host.free_pages(x)
    doc["state_slot"] = state_case(host, r, rng, pinned)
    doc["drain"] = None if a.cpu else drain_case(host, r, free_ids)
    doc["arena"] = {k: v for k, v in host.arena.stats().items() if isinstance(v, (int, float))}
    ok = all(c["bit_exact"] for c in doc["cases"]) and doc["state_slot"]["bit_exact"] and before["bit_exact"]
    doc["ok"] = ok
    text = json.dumps(doc, indent=1)
    if a.output:
        Path(a.output).write_text(text)
    print(text)
    pr = doc.get("torch_pinned_1GiB_GBps") or {}
    print(f"== host tier copies on {doc['device']} ({doc['copier']}); torch pinned 1 GiB: h2d {pr.get('h2d')} "
          f"d2h {pr.get('d2h')} GB/s")
    for c in doc["cases"]:
        ts = c["torch_same_bytes_GBps"] or {}
        print(f"{c['layout']:>10} {c['pages']:>4} pages: store {c['store_GBps']} GB/s ({c.get('store_vs_pinned')} of pinned, "
              f"torch same bytes {ts.get('d2h')}), load {c['load_GBps']} GB/s ({c.get('load_vs_pinned')}, torch {ts.get('h2d')}); "
              f"copies {c['copies']['store']}/{c['copies']['load']}, host extents {c['host_extents']}, exact {c['bit_exact']}")
    b = doc["before_tvm_copy_per_page"]
    print(f"before (TVM copyto per page and part) {b['pages']} pages: store {b['store_GBps']} GB/s, load {b['load_GBps']} GB/s")
    s = doc["state_slot"]
    print(f"state slot {s['bytes']} B: store {s['store_GBps']} GB/s ({s.get('store_vs_pinned')}), load {s['load_GBps']} GB/s "
          f"({s.get('load_vs_pinned')}), exact {s['bit_exact']}")
    if doc["drain"]:
        d = doc["drain"]
        print(f"spill behind {d['queued_compute_s']} s of compute: wait {d['wait_s']} s, copy {d['copy_GBps']} GB/s, "
              f"counted apart {d['drain_counted_apart']}")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", help="write the JSON document here too")
    ap.add_argument("--cpu", action="store_true", help="smoke run on the CPU target (small sizes, TVM copies)")
    ap.add_argument("--host-mib", type=float, default=4096, help="host tier ceiling (MiB)")
    sys.exit(main(ap.parse_args()))
