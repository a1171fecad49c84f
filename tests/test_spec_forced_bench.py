"""bench/spec_forced.py: the steady decode window (batch > 1 rows would otherwise mix other requests' prefill chunks
into a request's decode rate), and the forced run end to end on the CPU with the shortlisted-head rows."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from spec_forced import print_forced, run_forced, steady_decode_rate  # noqa: E402

from ninfer_mlc.paths import default_model_dir  # noqa: E402


def test_window_is_from_the_last_first_token_to_the_first_last_token():
    # request 0 decodes from t=0 (1 token per 0.1 s) to t=1.0; request 1 starts at t=0.5 (after its prefill), ends 1.5
    a = [[(0.1 * i, 1) for i in range(11)], [(0.5 + 0.1 * i, 1) for i in range(11)]]
    # window (0.5, 1.0]: request 0 has 5 tokens there (0.6 .. 1.0), request 1 has 5 (0.6 .. 1.0): 10 tokens in 0.5 s
    assert steady_decode_rate(a) == 10.0
    # the per-request rates from each one's own first token are 10 tok/s too, but the window excludes request 1's
    # prefill time entirely: a request that decoded alone for longer would not raise it
    a[0] = [(0.02 * i, 1) for i in range(51)]  # request 0 fast (50 tok/s) while alone, to t=1.0
    assert steady_decode_rate(a) == round((25 + 5) / 0.5 / 2, 2)


def test_no_window_when_one_request_ends_before_another_starts_decoding():
    assert steady_decode_rate([[(0.0, 1), (1.0, 1)], [(2.0, 1), (3.0, 1)]]) is None
    assert steady_decode_rate([[(0.0, 1)], [(0.0, 1), (1.0, 1)]]) is None
    assert steady_decode_rate([]) is None


def test_forced_run_with_the_shortlisted_head(capsys):
    """run_forced on the embedded tiny model (no DFlash2 drafter): every MTP profile also runs with the shortlisted
    head (--forced-lm-head-draft), labelled, its draft chains on the device and its output equal to host rounds'."""
    res = run_forced(default_model_dir(), None, ctx=24, gen=10, batches=[1], deadline=time.time() + 600,
                     device="cpu", log=lambda *_: None, lm_head_draft="600")
    rows = {r["profile"]: r for r in res["rows"]}
    assert set(rows) == {"none", "mtp3@3.18", "mtp3@3.18 host", "mtp3@3.18 head600", "mtp3@3.18 head600 host",
                         "mtp3@3.4", "mtp3@3.4 host", "mtp3@3.4 head600", "mtp3@3.4 head600 host"}
    assert res["lm_head_draft"] == "600" and not res["skipped"]
    for label in ("mtp3@3.18 head600", "mtp3@3.4 head600"):
        r, h = rows[label], rows[label + " host"]
        assert r["lm_head_draft"] == "600" and r["head_on_device"] and r["head_rows"] >= 600
        assert r["device_drafts"] > 0 and h["device_drafts"] == 0 and h["device_matches_host"]
        assert "lm_head_draft" not in rows[label.split()[0]]  # the full-head row beside it
    print_forced(res)
    out = capsys.readouterr().out
    assert "mtp3@3.18 head600" in out and "--lm-head-draft 600" in out and "on the device" in out
