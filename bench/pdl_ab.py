"""Programmatic dependent launch on and off, same artifacts, same call: harness decode steps and their outputs.

For each artifact, bench/serve_harness.py runs twice in its own process (so the two never share device memory):
with the graphs' kernel -> kernel edges made programmatic (EngineConfig programmatic_launch, where the library's
kernels wait for their predecessor, compile/grid_dependency.py) and without (the default). Same seeded inputs, greedy ids on the device:
equal `ids_sha` means the same outputs. Prints one line per (artifact, shape) and writes one JSON.

    python bench/pdl_ab.py ART [ART ...] --decode 8192x1,8192x8 --steps 30 -o pdl.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_mode(art: str, decode: str, steps: int, pdl: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "h.json"
        cmd = [sys.executable, str(HERE / "serve_harness.py"), art, "--decode", decode, "--steps", str(steps),
               "--device-argmax", "--verify", "none", "-o", str(out)] + (["--programmatic-launch"] if pdl else ["--no-rates"])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode or not out.exists():
            return {"error": f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}"}
        return json.loads(out.read_text())


def compare(art: str, on: dict, off: dict) -> list[dict]:
    """Rows of both runs by shape; the second run skips the device-rate measurement, so its floor comes from the
    first's."""
    rows = []
    for a, b in zip(on.get("decode", []), off.get("decode", [])):
        if b["fraction_of_floor"] is None and a["floor_ms"]:
            b["fraction_of_floor"] = round(a["floor_ms"] / b["step_ms"], 4)
        rows.append({"artifact": Path(art).name, "context": a["context"], "batch": a["batch"],
                     "pdl_step_ms": a["step_ms"], "plain_step_ms": b["step_ms"],
                     "pdl_fraction_of_floor": a["fraction_of_floor"], "plain_fraction_of_floor": b["fraction_of_floor"],
                     "speedup": round(b["step_ms"] / a["step_ms"], 4), "same_ids": a["ids_sha"] == b["ids_sha"],
                     "pdl_active": on.get("programmatic_launch"), "pdl_graphs": on.get("decode_graphs")})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--decode", default="8192x1,8192x8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per harness process")
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args(argv)
    doc: dict = {"decode": a.decode, "steps": a.steps, "rows": [], "runs": {}}
    for art in a.artifacts:
        on = run_mode(art, a.decode, a.steps, True, a.timeout)
        off = run_mode(art, a.decode, a.steps, False, a.timeout)
        doc["runs"][Path(art).name] = {"pdl": on, "plain": off}
        for e in (on, off):
            if "error" in e:
                print(f"{Path(art).name}: {e['error']}", flush=True)
        for r in compare(art, on, off):
            doc["rows"].append(r)
            print(f"{r['artifact']:<22} ctx={r['context']} b={r['batch']}: PDL {r['pdl_step_ms']:.3f} ms "
                  f"({r['pdl_fraction_of_floor']}) vs {r['plain_step_ms']:.3f} ms ({r['plain_fraction_of_floor']}) "
                  f"x{r['speedup']:.3f} same_ids={r['same_ids']} active={r['pdl_active']} graphs={r['pdl_graphs']}", flush=True)
    if a.output:
        Path(a.output).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
