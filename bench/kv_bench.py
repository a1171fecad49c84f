"""KV-cache bytes per token and tokens per GiB for every --kv-dtype, for a compiled artifact.

Sizes come from the page layout the compiler and the runtime use (compile/kernels/attention_quant.py:
f32/bf16 pages hold head_dim elements per (token, KV head); fp8 rows are head_dim + 4 bytes; nvfp4
rows head_dim/2 + head_dim/16 bytes), over the full-attention layers, K and V. With --measure the
artifact is loaded and its own pool's page size is checked against the arithmetic. Without an
artifact the Qwen3.x-27B geometry of bench/kv_memory.py is used.

Usage: python bench/kv_bench.py [dist/NAME] [--out kv_bench.json] [--measure] [--budget-gib 12]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_memory import GEOMETRY, gdn_state_bytes  # noqa: E402

from ninfer_mlc.contract.pool_layout import kv_row  # noqa: E402

GIB = 1 << 30
KV_DTYPES = {"f32": "float32", "bf16": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4"}
PAGE_SIZE = 64


def geometry_from_manifest(art: Path) -> dict:
    from ninfer_mlc.contract.manifest import read_manifest

    m = read_manifest(art, verify="none")
    c = m.config
    conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
        c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return dict(name=m.name, kv_dtype=m.kv_dtype, dtype=m.dtype, page_size=m.page_size, max_context=m.max_context,
                attn_layers=c["layer_types"].count("full_attention"), kv_heads=c["num_key_value_heads"],
                head_dim=c["head_dim"], gdn_layers=c["layer_types"].count("linear_attention"),
                gdn_v_heads=c["linear_num_value_heads"], gdn_dk=c["linear_key_head_dim"],
                gdn_dv=c["linear_value_head_dim"], conv_taps=c["linear_conv_kernel_dim"] - 1, conv_dim=conv_dim)


def kv_bytes_per_token(g: dict, kv_dtype: str) -> int:
    storage, row = kv_row(kv_dtype, g["head_dim"])
    itemsize = np.dtype(ml_dtypes.bfloat16 if storage == "bfloat16" else storage).itemsize
    return g["attn_layers"] * 2 * g["kv_heads"] * row * itemsize


def report(g: dict, contexts=(262_144, 1_010_000), budget_gib: float | None = None) -> dict:
    ps = g.get("page_size", PAGE_SIZE)
    kv = {}
    for flag, dt in KV_DTYPES.items():
        if dt == "nvfp4" and g["head_dim"] % 16:
            continue
        b = kv_bytes_per_token(g, dt)
        kv[flag] = dict(kv_dtype=dt, bytes_per_token=b,
                        bytes_per_token_per_layer_head=b // (g["attn_layers"] * g["kv_heads"]),
                        page_bytes=b * ps, tokens_per_gib=GIB // b,
                        vs_bf16=round(kv_bytes_per_token(g, "bfloat16") / b, 3),
                        **{f"gib_at_{n}": round(n * b / GIB, 6) for n in contexts})
        if budget_gib:
            kv[flag][f"tokens_in_{budget_gib:g}_gib"] = int(budget_gib * GIB) // b
    return dict(geometry=g, contexts=list(contexts), kv=kv, gdn_state_per_sequence=gdn_state_bytes(g))


def measure(art: Path) -> dict:
    """Load the artifact and read its pool's actual page size (its own kv dtype only)."""
    from ninfer_mlc.runtime.harness import Harness

    r = Harness(art, kv_capacity_tokens=1, num_slots=1, verify="none")
    return dict(kv_dtype=r.manifest.kv_dtype, kv_shape=list(r.kv_shape), page_bytes=r.page_bytes,
                bytes_per_token=r.page_bytes // r.page_size)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", nargs="?", help="compiled model directory (default: the 27B geometry)")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--measure", action="store_true", help="load the artifact and check its pool's page size")
    ap.add_argument("--budget-gib", type=float, default=None, help="also report tokens that fit in this many GiB")
    ap.add_argument("--context", type=int, action="append", help="contexts to size (repeatable)")
    args = ap.parse_args(argv)
    g = geometry_from_manifest(Path(args.artifact)) if args.artifact else dict(GEOMETRY, name="qwen3.x-27b")
    contexts = tuple(args.context or ([g["max_context"]] if "max_context" in g else []) + [262_144, 1_010_000])
    r = report(g, contexts, args.budget_gib)
    if args.measure:
        if not args.artifact:
            ap.error("--measure needs an artifact")
        m = r["measured"] = measure(Path(args.artifact))
        own = next(v for v in r["kv"].values() if v["kv_dtype"] == m["kv_dtype"])
        if own["bytes_per_token"] != m["bytes_per_token"]:
            raise SystemExit(f"pool mismatch: runner {m['bytes_per_token']} B/token vs {own['bytes_per_token']}")
    print(f"{g['name']}: {g['attn_layers']} attention layers x {g['kv_heads']} KV heads x head_dim {g['head_dim']}"
          + (f" (artifact kv_dtype {g['kv_dtype']})" if "kv_dtype" in g else ""))
    print(f"{'kv':6} {'B/token':>9} {'tok/GiB':>10} {'x bf16':>7} "
          + " ".join(f"{'GiB@' + str(n):>12}" for n in contexts))
    for flag, v in r["kv"].items():
        print(f"{flag:6} {v['bytes_per_token']:9d} {v['tokens_per_gib']:10d} {v['vs_bf16']:7.2f} "
              + " ".join(f"{v[f'gib_at_{n}']:12.3f}" for n in contexts))
    s = r["gdn_state_per_sequence"]
    print(f"GDN state/sequence: {s['total_bytes']} B ({s['total_mib']:.2f} MiB)")
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
