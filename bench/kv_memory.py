"""KV-cache and GDN-state memory for the Qwen3.x-27B geometry (bf16 / fp8 / nvfp4 KV).

Pure arithmetic from compile/nvfp4.py's layout: used to size KV pools and to justify NVFP4 KV.
Usage: python bench/kv_memory.py [--out kv_memory.json]
"""
from __future__ import annotations

import argparse
import json

from ninfer_mlc.compile.nvfp4 import kv_bytes_per_token, nvfp4_row_bytes

GIB = 1 << 30
GEOMETRY = dict(attn_layers=16, kv_heads=4, head_dim=256,        # full-attention layers
                gdn_layers=48, gdn_v_heads=48, gdn_dk=128, gdn_dv=128, conv_taps=3, conv_dim=10240)
CONTEXTS = (262_144, 1_010_000)


def gdn_state_bytes(g=GEOMETRY) -> dict:
    """Fixed per-sequence recurrent state: fp32 S [Hv, dk, dv] + bf16 conv history (K-1 taps)."""
    rec = g["gdn_layers"] * g["gdn_v_heads"] * g["gdn_dk"] * g["gdn_dv"] * 4
    conv = g["gdn_layers"] * g["conv_taps"] * g["conv_dim"] * 2
    return dict(recurrent_bytes=rec, conv_bytes=conv, total_bytes=rec + conv, total_mib=(rec + conv) / (1 << 20))


def report(g=GEOMETRY) -> dict:
    kv = {}
    for dt in ("bf16", "fp8", "nvfp4"):
        b = kv_bytes_per_token(g["attn_layers"], g["kv_heads"], g["head_dim"], dt)
        kv[dt] = dict(bytes_per_token=b,
                      bytes_per_token_per_layer_head=b // (g["attn_layers"] * g["kv_heads"]),
                      tokens_per_gib=GIB // b,
                      **{f"gib_at_{n}": round(n * b / GIB, 3) for n in CONTEXTS})
    return dict(geometry=g, nvfp4_row_bytes=nvfp4_row_bytes(g["head_dim"]), kv=kv,
                gdn_state_per_sequence=gdn_state_bytes(g))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args(argv)
    r = report()
    print(f"{'dtype':6} {'B/token':>8} {'tok/GiB':>8} " + " ".join(f"{'GiB@' + str(n):>12}" for n in CONTEXTS))
    for dt, v in r["kv"].items():
        print(f"{dt:6} {v['bytes_per_token']:8d} {v['tokens_per_gib']:8d} "
              + " ".join(f"{v[f'gib_at_{n}']:12.3f}" for n in CONTEXTS))
    s = r["gdn_state_per_sequence"]
    print(f"GDN state/sequence: {s['total_bytes']} B ({s['total_mib']:.1f} MiB; "
          f"recurrent {s['recurrent_bytes']}, conv {s['conv_bytes']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
