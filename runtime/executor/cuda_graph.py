"""CUDA graphs for one VM function: capture a call once per input shape key and replay it.

Why: a decode step of the 27B model is about a thousand small kernel launches. Launched one by
one from the Relax VM they leave ~2 ms of gaps per step on an H200; a graph launches them all at
once.

How: TVM launches every kernel on the stream set for the device (tvm_ffi.use_raw_stream). We
record one VM call on our own stream with the driver API (cuStreamBeginCapture / EndCapture,
through ctypes: no torch, no cudart binding needed) and replay it with cuGraphLaunch. A graph
bakes in every pointer and scalar of the recorded call, hence the contract:
  - the small per-call inputs (token ids, positions, page table, slot ids) are views of the runner's
    persistent input buffers (executor/inputs.py): the same device addresses for the same shapes,
    overwritten in place before each call, so a replay reads the step's values;
  - the persistent arguments (KV/state pools, weights) must be the same objects on every call;
  - the recorded call's outputs are kept alive by the entry (their memory is never handed out
    again) and hold the results of each replay;
  - intermediates came from the VM's pooled allocator; after the capture they are back in the
    pool and may serve other calls as scratch. That is safe because all work is stream ordered,
    the pooled allocator never frees a block (short of running out of memory), and the runner
    copies every VM output to the host before its next call, so nothing outlives a call there;
  - kernel scratch from TVMBackendAllocWorkspace comes from a thread-local pool that frees and
    re-allocates its largest block when a bigger request arrives (a long prefill would move the
    memory a graph baked in). Captures therefore run on a dedicated thread whose pool is grown
    once, before the first capture, to WORKSPACE_BLOCKS blocks of WORKSPACE_BYTES: decode scratch
    (attention split partials, a few MB) always fits, so that pool never frees anything, and no
    eager call ever allocates from it.
Programmatic edges (programmatic=True, for libraries whose kernels all open with griddepcontrol.wait: manifest
extras.grid_dependency_wait, compile/grid_dependency.py): after capture, every kernel -> kernel edge becomes a
programmatic dependency, so each kernel is launched while its predecessor drains and waits for it on the device
instead of the graph launching it only after the predecessor completed. Other edges (copies, memsets) stay full
dependencies. Without the driver entry points (CUDA < 12.3) graphs keep their captured edges.
A key is first run eagerly (that call also sizes the allocator pools), captured the second time
it is seen (capture records without executing; the graph is then launched once to do the step),
and replayed afterwards. If capture fails the key is marked eager-only and the call runs eagerly.
"""
from __future__ import annotations

import ctypes
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from .cuda_driver import CudaError, Driver


_CAPTURE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED: the VM's allocator may cudaMalloc
_KDLCUDA = 2
_NODE_KERNEL = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_DEP_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: when every block of the upstream grid has triggered
WORKSPACE_BLOCKS = 3
WORKSPACE_BYTES = 64 << 20


class _EdgeData(ctypes.Structure):
    """CUgraphEdgeData (CUDA 12.3+)."""
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def programmatic_edges(kinds: list, edges: list) -> list:
    """Which captured edges (index pairs into the node list) become programmatic: kernel -> kernel only."""
    return [(a, b) for a, b in edges if kinds[a] == _NODE_KERNEL and kinds[b] == _NODE_KERNEL]


class _Driver(Driver):
    """The handful of CUDA driver calls graphs need."""

    def __init__(self):
        vp = ctypes.c_void_p
        ed = ctypes.POINTER(_EdgeData)
        super().__init__({
            "cuStreamCreate": [ctypes.POINTER(vp), ctypes.c_uint],
            "cuStreamSynchronize": [vp],
            "cuStreamBeginCapture_v2": [vp, ctypes.c_int],
            "cuStreamEndCapture": [vp, ctypes.POINTER(vp)],
            "cuGraphInstantiateWithFlags": [ctypes.POINTER(vp), vp, ctypes.c_ulonglong],
            "cuGraphLaunch": [vp, vp],
            "cuGraphExecDestroy": [vp],
            "cuGraphDestroy": [vp],
            "cuGraphGetNodes": [vp, ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_size_t)],
        }, optional={
            "cuGraphGetEdges_v2": [vp, ctypes.POINTER(vp), ctypes.POINTER(vp), ed, ctypes.POINTER(ctypes.c_size_t)],
            "cuGraphRemoveDependencies_v2": [vp, ctypes.POINTER(vp), ctypes.POINTER(vp), ed, ctypes.c_size_t],
            "cuGraphAddDependencies_v2": [vp, ctypes.POINTER(vp), ctypes.POINTER(vp), ed, ctypes.c_size_t],
            "cuGraphNodeGetType": [vp, ctypes.POINTER(ctypes.c_int)],
        })
        self.has_edge_data = not self.missing


class _Entry:
    __slots__ = ("statics", "outputs", "graph", "exec", "nodes")

    def __init__(self, statics, outputs, graph, exe, nodes):
        self.statics, self.outputs, self.graph, self.exec, self.nodes = statics, outputs, graph, exe, nodes


class GraphedFunction:
    """Wrap `func(*dynamic_inputs, *persistent)` with per-key CUDA graphs.

    dynamic inputs are device tensors at fixed addresses (views of persistent buffers) whose shapes
    are part of the key; persistent arguments are passed the same objects on every call. Returns the VM's output tuple (for a replay: the
    recorded call's outputs, now holding this step's results).
    """

    def __init__(self, tvm, dev, func, max_graphs: int = 48, programmatic: bool = False, stream=None):
        """stream: another GraphedFunction's stream, for functions launched back to back with nothing between them
        (two blocking streams are ordered with the legacy stream, not with each other)."""
        import tvm_ffi

        self.tvm, self.dev, self.func, self.max_graphs = tvm, dev, func, max_graphs
        self._use_stream = tvm_ffi.use_raw_stream
        self.drv = _Driver()
        dev.sync()  # makes TVM's (runtime API) primary context current on this thread
        if stream is None:
            stream = ctypes.c_void_p()
            self.drv.call("cuStreamCreate", ctypes.byref(stream), 0)  # blocking: ordered with the legacy stream
        self.stream = stream
        self._seen: set = set()
        self._eager_only: set = set()
        self._graphs: OrderedDict = OrderedDict()
        self._capture_thread = ThreadPoolExecutor(1, thread_name_prefix="cuda-graph-capture")
        self._thread_ready = False
        self.programmatic = programmatic and self.drv.has_edge_data
        self.stats = {"replays": 0, "captures": 0, "eager": 0, "capture_failures": 0, "evictions": 0,
                      "programmatic_edges": 0, "programmatic_failures": 0}
        self.last_error: str | None = None

    @staticmethod
    def key_of(inputs) -> tuple:
        return tuple(tuple(a.shape) for a in inputs)

    def __call__(self, inputs: list, persistent: list, wait: bool = True, tag: str = ""):
        """wait=False: a replay returns once launched (its stream is a blocking one, so TVM's later work on the
        legacy default stream, e.g. reading the outputs, runs after it); for chains of device calls.
        tag: callers whose inputs of the same shapes live at other addresses keep their own graphs under it."""
        key = (tag,) + self.key_of(inputs) if tag else self.key_of(inputs)
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            self._launch(entry, wait)
            self.stats["replays"] += 1
            return entry.outputs
        if key in self._seen and key not in self._eager_only:
            out = self._capture(key, inputs, persistent)
            if out is not None:
                return out
        self._seen.add(key)
        self.stats["eager"] += 1
        return self.func(*inputs, *persistent)

    def _launch(self, entry: _Entry, wait: bool = True) -> None:
        self.drv.call("cuGraphLaunch", entry.exec, self.stream)
        if wait:
            self.drv.call("cuStreamSynchronize", self.stream)

    def _prepare_capture_thread(self) -> None:
        """On the capture thread: make TVM's context current there and grow its workspace pool."""
        self.dev.sync()
        if self.dev.dlpack_device_type() != _KDLCUDA:
            return
        rt = self.tvm.base._LOADED_LIBS["tvm_runtime"]
        alloc, free = rt.TVMBackendAllocWorkspace, rt.TVMBackendFreeWorkspace
        alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_int, ctypes.c_uint64,
                                                          ctypes.c_int, ctypes.c_int]
        free.restype, free.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        idx = int(self.dev.index)
        ptrs = [alloc(_KDLCUDA, idx, WORKSPACE_BYTES, 2, 32) for _ in range(WORKSPACE_BLOCKS)]
        if not all(ptrs):
            raise CudaError("could not reserve the graph workspace pool")
        for p in reversed(ptrs):
            free(_KDLCUDA, idx, p)

    def _capture(self, key, inputs, persistent):
        """Record on the capture thread (see the module docstring), then launch once here."""
        if not self._thread_ready:
            try:
                self._capture_thread.submit(self._prepare_capture_thread).result()
            except Exception as e:  # noqa: BLE001 - no graphs then
                self._eager_only.add(key)
                self.stats["capture_failures"] += 1
                self.last_error = repr(e)[:300]
                return None
            self._thread_ready = True
        got = self._capture_thread.submit(self._record, key, inputs, persistent).result()
        if got is None:
            return None
        self._launch(got)  # capture recorded the step; this executes it
        self.stats["replays"] += 1
        return got.outputs

    def _record(self, key, inputs, persistent):
        statics = list(inputs)  # the graph reads these addresses on every replay
        graph = ctypes.c_void_p()
        assert self.stream.value is not None  # cuStreamCreate made it
        self.dev.sync()
        pdl = False
        try:
            with self._use_stream(self.dev, self.stream.value):
                self.drv.call("cuStreamBeginCapture_v2", self.stream, _CAPTURE_RELAXED)
                try:
                    outputs = self.func(*statics, *persistent)
                finally:
                    rc = self.drv.lib.cuStreamEndCapture(self.stream, ctypes.byref(graph))
                self.drv.check(rc, "cuStreamEndCapture")
            pdl = self.programmatic
            if pdl:
                self.stats["programmatic_edges"] += self._make_programmatic(graph)
            exe = ctypes.c_void_p()
            self.drv.call("cuGraphInstantiateWithFlags", ctypes.byref(exe), graph, 0)
        except Exception as e:  # noqa: BLE001 - any failure: this key runs eagerly from now on
            if graph.value:
                self.drv.lib.cuGraphDestroy(graph)
            self.last_error = repr(e)[:300]
            if pdl:  # the driver refused the programmatic edges: graphs keep their captured edges from now on
                self.programmatic = False
                self.stats["programmatic_failures"] += 1
                return self._record(key, inputs, persistent)
            self._eager_only.add(key)
            self.stats["capture_failures"] += 1
            return None
        n = ctypes.c_size_t(0)
        self.drv.lib.cuGraphGetNodes(graph, None, ctypes.byref(n))
        entry = _Entry(statics, outputs, graph, exe, int(n.value))
        self._graphs[key] = entry
        self.stats["captures"] += 1
        while len(self._graphs) > self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            self._destroy(old)
            self.stats["evictions"] += 1
        return entry

    def _make_programmatic(self, graph) -> int:
        """Turn the graph's kernel -> kernel edges into programmatic dependencies (see the module docstring);
        returns how many."""
        vp, drv = ctypes.c_void_p, self.drv
        n = ctypes.c_size_t(0)
        drv.call("cuGraphGetEdges_v2", graph, None, None, None, ctypes.byref(n))
        if not n.value:
            return 0
        src, dst, data = (vp * n.value)(), (vp * n.value)(), (_EdgeData * n.value)()
        drv.call("cuGraphGetEdges_v2", graph, src, dst, data, ctypes.byref(n))
        index: dict = {}
        kinds: list = []
        pairs = []
        for i in range(n.value):
            if data[i].type or data[i].from_port or data[i].to_port:
                continue  # not a plain captured edge: leave it
            ends = []
            for node in (src[i], dst[i]):
                if node not in index:
                    kind = ctypes.c_int(-1)
                    drv.call("cuGraphNodeGetType", vp(node), ctypes.byref(kind))
                    index[node] = len(kinds)
                    kinds.append(kind.value)
                ends.append(index[node])
            pairs.append((i, ends[0], ends[1]))
        chosen = set(programmatic_edges(kinds, [(a, b) for _, a, b in pairs]))
        picked = [i for i, a, b in pairs if (a, b) in chosen]
        if not picked:
            return 0
        k = len(picked)
        f, t = (vp * k)(*[src[i] for i in picked]), (vp * k)(*[dst[i] for i in picked])
        drv.call("cuGraphRemoveDependencies_v2", graph, f, t, None, k)
        new = (_EdgeData * k)()
        for e in new:
            e.from_port, e.type = _PORT_PROGRAMMATIC, _DEP_PROGRAMMATIC
        drv.call("cuGraphAddDependencies_v2", graph, f, t, new, k)
        return k

    def _destroy(self, entry: _Entry) -> None:
        self.drv.lib.cuGraphExecDestroy(entry.exec)
        self.drv.lib.cuGraphDestroy(entry.graph)

    def graph_nodes(self) -> dict:
        """{key: kernel/memcpy nodes in its graph} (how many launches one replay replaces)."""
        return {k: e.nodes for k, e in self._graphs.items()}

    def reset(self) -> None:
        """Forget every graph (the input buffers they read moved); keys start over: eager, capture, replay."""
        for e in self._graphs.values():
            self._destroy(e)
        self._graphs.clear()
        self._seen.clear()
        self._eager_only.clear()

    def close(self) -> None:
        self.reset()
        self._capture_thread.shutdown(wait=False)


def page_width_bucket(width: int, minimum: int = 4) -> int:
    """Page-table width used for a decode graph: the next power of two (fewer distinct graphs;
    the kernels read only the pages a sequence's position needs, so padding is never read)."""
    w = max(int(width), minimum, 1)
    return 1 << (w - 1).bit_length()
