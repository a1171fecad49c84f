"""CUDA-graph wrapper logic (runtime/executor/cuda_graph.py) with a recording fake driver.

The real capture/replay runs on the GPU machine (bench/gpu_bench.py check: graph decode logits
equal eager ones bit for bit); here: the per-key life cycle (eager, capture + launch, replay), inputs
that are views of persistent buffers (a replay reads what was written there for this step), failure
fallback and LRU eviction; the programmatic rewrite of a captured graph's kernel -> kernel edges (PDL).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ninfer_mlc.runtime.executor import cuda_graph
from ninfer_mlc.runtime.executor.cuda_graph import GraphedFunction, page_width_bucket
from ninfer_mlc.runtime.executor.inputs import _Buffer


class FakeLib:
    def __init__(self):
        self.calls = []
        self.fail_end = False
        self._next = 100

    def _handle(self, ptr):
        self._next += 1
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_void_p))[0] = self._next

    def cuStreamCreate(self, ptr, flags):
        self._handle(ptr)
        return 0

    def cuStreamBeginCapture_v2(self, s, mode):
        self.calls.append(("begin", mode))
        return 0

    def cuStreamEndCapture(self, s, ptr):
        self.calls.append(("end",))
        if self.fail_end:
            return 901  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        self._handle(ptr)
        return 0

    def cuGraphInstantiateWithFlags(self, ptr, g, flags):
        self._handle(ptr)
        return 0

    def cuGraphLaunch(self, exe, s):
        self.calls.append(("launch", exe.value if hasattr(exe, "value") else exe))
        return 0

    def cuStreamSynchronize(self, s):
        self.syncs = getattr(self, "syncs", 0) + 1
        return 0

    def cuGraphExecDestroy(self, e):
        self.calls.append(("destroy",))
        return 0

    def cuGraphDestroy(self, g):
        return 0

    def cuGraphGetNodes(self, g, nodes, n):
        ctypes.cast(n, ctypes.POINTER(ctypes.c_size_t))[0] = 7
        return 0

    def cuGetErrorString(self, rc, ptr):
        return 0

    # a captured chain of 5 nodes 1 -> 2 -> 3 -> 4 -> 5, node 3 a memcpy, the rest kernels (CUDA 12.3+ edge data)
    NODE_TYPES = {1: 0, 2: 0, 3: 2, 4: 0, 5: 0}
    EDGES = [(1, 2), (2, 3), (3, 4), (4, 5)]
    refuse_programmatic = False

    def cuGraphGetEdges_v2(self, g, src, dst, data, n):
        np_ = ctypes.cast(n, ctypes.POINTER(ctypes.c_size_t))
        if src:
            for i, (a, b) in enumerate(self.EDGES):
                src[i], dst[i] = a, b
        np_[0] = len(self.EDGES)
        return 0

    def cuGraphNodeGetType(self, node, t):
        ctypes.cast(t, ctypes.POINTER(ctypes.c_int))[0] = self.NODE_TYPES[node.value]
        return 0

    def cuGraphRemoveDependencies_v2(self, g, src, dst, data, k):
        self.calls.append(("remove", [(src[i], dst[i]) for i in range(k)], data))
        return 0

    def cuGraphAddDependencies_v2(self, g, src, dst, data, k):
        self.calls.append(("add", [(src[i], dst[i]) for i in range(k)],
                           [(data[i].from_port, data[i].to_port, data[i].type) for i in range(k)]))
        return 1 if self.refuse_programmatic else 0


class FakeDriver(cuda_graph._Driver):
    def __init__(self):
        self.lib = FakeLib()
        self.has_edge_data = True


@pytest.fixture
def graphed(monkeypatch, request):
    import tvm

    monkeypatch.setattr(cuda_graph, "_Driver", FakeDriver)
    seen = []

    def func(*args):
        seen.append([a.numpy().copy() for a in args[:2]] + list(args[2:]))
        return ("logits", len(seen))

    g = GraphedFunction(tvm, tvm.cpu(), func, max_graphs=2, programmatic=getattr(request, "param", False))
    bufs = [_Buffer(tvm, tvm.cpu(), 64), _Buffer(tvm, tvm.cpu(), 64)]

    def views(*arrays):
        """Stage arrays in the persistent buffers, as the runner's StepInputs does, and return the views."""
        out = []
        for b, a in zip(bufs, arrays):
            b.host[: a.size] = a.ravel()
            out.append(b.upload(a.shape))
        return out

    g.views = views
    return g, seen


def test_eager_then_capture_then_replay(graphed):
    g, seen = graphed
    persistent = ["pool"]
    a = g.views(np.array([1, 2], np.int32), np.zeros((2, 4), np.int32))
    out1 = g(a, persistent)  # first sight: eager
    assert g.stats == {"replays": 0, "captures": 0, "eager": 1, "capture_failures": 0, "evictions": 0,
                       "programmatic_edges": 0, "programmatic_failures": 0}
    out2 = g(g.views(np.array([3, 4], np.int32), np.ones((2, 4), np.int32)), persistent)  # capture + one launch
    assert g.stats["captures"] == 1 and g.stats["replays"] == 1
    assert [c[0] for c in g.drv.lib.calls] == ["begin", "end", "launch"]
    assert g.drv.lib.calls[0][1] == 2  # relaxed capture mode
    assert len(seen) == 2 and seen[1][2] == "pool"  # the VM ran once under capture (recording)
    np.testing.assert_array_equal(seen[1][0], [3, 4])
    out3 = g(g.views(np.array([5, 6], np.int32), np.full((2, 4), 9, np.int32)), persistent)  # replay: no VM call
    assert len(seen) == 2 and out3 is out2 and out1 != out2
    entry = g._graphs[g.key_of(a)]
    np.testing.assert_array_equal(entry.statics[0].numpy(), [5, 6])  # the recorded addresses hold this step
    np.testing.assert_array_equal(entry.statics[1].numpy(), np.full((2, 4), 9))
    assert g.graph_nodes() == {((2,), (2, 4)): 7}


def test_replay_without_wait_launches_only(graphed):
    """wait=False (a device chain: MTP draft steps, the verify after them) launches and returns unsynchronised."""
    g, _ = graphed
    a = g.views(np.array([1], np.int32), np.zeros((1, 4), np.int32))
    g(a, [])
    g(a, [])  # capture + launch (waited for)
    before = getattr(g.drv.lib, "syncs", 0)
    g(a, [], wait=False)
    assert g.drv.lib.calls[-1][0] == "launch" and getattr(g.drv.lib, "syncs", 0) == before
    g(a, [])
    assert g.drv.lib.syncs == before + 1
    eager = g.stats["eager"]
    g(a, [], tag="chain")  # same shapes, other input buffers: a key of its own (eager first)
    assert g.stats["eager"] == eager + 1


def test_capture_failure_falls_back_to_eager_for_good(graphed):
    g, seen = graphed
    g.drv.lib.fail_end = True
    a = g.views(np.array([1], np.int32), np.zeros((1, 4), np.int32))
    g(a, [])
    out = g(a, [])  # capture fails -> the same step runs eagerly (capture executed nothing)
    assert g.stats["capture_failures"] == 1 and g.stats["eager"] == 2 and out == ("logits", 3)
    assert "CUDA error 901" in g.last_error
    g(a, [])
    assert g.stats["eager"] == 3 and g.stats["captures"] == 0


def test_lru_eviction_destroys_old_graphs(graphed):
    g, _ = graphed
    for b in (1, 2, 3):
        a = g.views(np.zeros(b, np.int32), np.zeros((b, 4), np.int32))
        g(a, [])
        g(a, [])
    assert g.stats["captures"] == 3 and g.stats["evictions"] == 1
    assert len(g._graphs) == 2 and ((1,), (1, 4)) not in g._graphs
    assert sum(1 for c in g.drv.lib.calls if c[0] == "destroy") == 1


@pytest.mark.parametrize("graphed", [True], indirect=True)
def test_programmatic_edges_between_kernels_only(graphed):
    """programmatic=True: after capture, the kernel -> kernel edges (1->2, 4->5) are removed and added back as
    programmatic dependencies from the upstream kernel's programmatic port; edges to or from the copy stay."""
    g, _ = graphed
    a = g.views(np.array([1], np.int32), np.zeros((1, 4), np.int32))
    g(a, [])
    g(a, [])
    calls = [c for c in g.drv.lib.calls if c[0] in ("remove", "add")]
    assert calls[0][:2] == ("remove", [(1, 2), (4, 5)]) and not calls[0][2]  # default edge data
    assert calls[1] == ("add", [(1, 2), (4, 5)], [(1, 0, 1), (1, 0, 1)])  # PORT_PROGRAMMATIC, TYPE_PROGRAMMATIC
    assert g.stats["programmatic_edges"] == 2 and g.stats["captures"] == 1


@pytest.mark.parametrize("graphed", [True], indirect=True)
def test_refused_programmatic_edges_recapture_plain(graphed):
    """A driver that refuses the programmatic edges: the step is captured again with its plain edges, and later
    captures do not try again (the key still replays as a graph)."""
    g, _ = graphed
    g.drv.lib.refuse_programmatic = True
    a = g.views(np.array([1], np.int32), np.zeros((1, 4), np.int32))
    g(a, [])
    g(a, [])
    assert g.stats["programmatic_failures"] == 1 and g.stats["captures"] == 1 and not g.programmatic
    assert [c[0] for c in g.drv.lib.calls].count("begin") == 2
    g(a, [])
    assert g.stats["replays"] == 2


@pytest.mark.parametrize("w,want", [(1, 4), (4, 4), (5, 8), (128, 128), (129, 256), (4097, 8192)])
def test_page_width_bucket(w, want):
    assert page_width_bucket(w) == want


def test_cpu_runner_has_no_graphs():
    from pathlib import Path

    from ninfer_mlc.runtime.harness import Harness

    art = Path(__file__).resolve().parent.parent / "dist" / "qwen3x-tiny"
    r = Harness(art, kv_capacity_tokens=256, num_slots=1)
    assert r.decode_graphs is None
