"""Shared test setup.

Compiled tiny-model libraries are cached under build/libcache (keyed by geometry, dtype,
target, TVM version and the compiler sources), so a suite run compiles each geometry once.
"""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("NINFER_LIB_CACHE", str(ROOT / "build" / "libcache"))
os.environ.setdefault("TVM_NUM_THREADS", "2")

# Property tests draw the same examples on every run (a CI failure replays anywhere, none appears at random);
# NINFER_HYPOTHESIS=explore draws fresh ones and keeps hypothesis' example database.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("suite", derandomize=True, database=None)
_hypothesis_settings.register_profile("explore")
_hypothesis_settings.load_profile("explore" if os.environ.get("NINFER_HYPOTHESIS") == "explore" else "suite")


# ---- HTTP server (tests/test_server_*.py) ---------------------------------------------------
# One real engine on the embedded tiny model, shared by every server test; the servers are
# uvicorn on loopback in a background thread, built from `ninfer serve` flags by load_state.
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def server_engine():
    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.paths import default_model_dir
    from ninfer_mlc.runtime.config import EngineConfig

    eng = open_engine(default_model_dir(), EngineConfig(max_concurrency=4, max_context=1024, host_kv_mib=64))
    yield eng
    eng.stop()


def start_test_server(engine, *flags):
    """(ServerThread, ServerState) for `ninfer serve` flags, sharing `engine`."""
    import argparse

    from ninfer_mlc.server.app import ServerThread, create_app, load_state
    from ninfer_mlc.server.options import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    state = load_state(p.parse_args(["--max-context", "1024", *flags]), engine=engine)
    return ServerThread(create_app(state)).start(), state


@pytest.fixture(scope="session")
def server(server_engine):
    """Open server: --max-request-mib 1."""
    srv, state = start_test_server(server_engine, "--max-request-mib", "1")
    srv.state = state
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def secured_server(server_engine):
    """--api-key sekret --cors."""
    srv, state = start_test_server(server_engine, "--api-key", "sekret", "--cors", "--model-id", "tiny")
    srv.state = state
    yield srv
    srv.stop()


# ---- speculative rollback (tests/test_spec_rollback.py, test_spec_device.py) ------------------------
@pytest.fixture
def without_gdn_replay(monkeypatch):
    """Engines opened while it is active behave as with a library that has no gdn_replay: the verify keeps no
    GDN rows and a rejected round re-feeds its kept tokens (the fallback for older libraries)."""
    from ninfer_mlc.runtime.executor.model_runner import ModelRunner

    run = ModelRunner.run_verify

    def run_verify(self, *a, **kw):
        out = run(self, *a, **kw)
        self.verify_gdn_rows = None
        return out

    monkeypatch.setattr(ModelRunner, "run_verify", run_verify)
