"""The CPU emulator's host side (compile/kernels/cuda/emulate/host.py): launches replayed from a lowered
prim_func's host script. The kernels themselves run on it in test_cuda_build.py, test_cuda_attn_prefill.py,
test_cuda_gdn_prefill.py and test_cuda_gdn_prep.py."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer_mlc.compile.kernels.cuda.emulate.host import HostProgram, TEval

# the shape of TVM's host code: argument unpacking outside, the compute scope holding lets, buffer views,
# workspaces, host branches and kernel launches
HOST = '''
@I.ir_module
class Module:
    @T.prim_func
    def f(self_handle: T.handle, args: T.handle, num_args: T.int32, result: T.handle) -> T.int32:
        n: T.let[T.int64] = T.tvm_struct_get(args, 0, 15, "int64")
        with T.attr(x, "storage_alignment", 64):
            if not T.isnullptr(x_strides):
                T.evaluate(0)
            with T.attr({"compute_scope": "f_compute_"}):
                cse_v1: T.let[T.int64] = T.max(n, T.int64(1))
                ws = T.alloc_buffer((T.Select(T.int64(1) < n, cse_v1 * T.int64(4), T.int64(1)),), elem_offset=0)
                xu = T.decl_buffer((n * T.int64(2),), "uint32", data=x.data, elem_offset=0, layout=None)
                ws_1 = ws.view(T.int64(4))
                T.call_ffi_kernel("f_kernel", xu.data, ws_1.data, n, T.Div(n + T.int64(-9), T.int64(8)), 64,
                                  launch_params=["blockIdx.x", "threadIdx.x"], ret_ty="int32")
                if n <= T.int64(8):
                    T.call_ffi_kernel("f_kernel_1", out.data, ws.data, n, 1, 2, 32,
                                      launch_params=["blockIdx.x", "blockIdx.y", "threadIdx.x"], ret_ty="int32")
                else:
                    T.call_ffi_kernel("f_kernel_2", out.data, n, T.truncmod(n, 8) + 1, 128,
                                      launch_params=["blockIdx.x", "threadIdx.x"], ret_ty="int32")
'''


def test_host_program_replays_branches_views_and_workspaces():
    prog = HostProgram(HOST)
    assert prog.kernel_names("f") == ["f_kernel", "f_kernel_1", "f_kernel_2"]
    x, out = np.zeros((3, 2), np.float32), np.zeros(3, np.float32)
    buffers = {"x": x, "out": out}
    (k0, a0, d0), (k1, a1, d1) = prog.launches("f", {"n": 3}, buffers)
    assert (k0, k1) == ("f_kernel", "f_kernel_1")
    assert a0[0] is x and a0[2] == 3 and d0 == {"blockIdx.x": 0, "threadIdx.x": 64}  # C division: -6 / 8 == 0
    ws = buffers["ws"]
    assert a0[1] is ws and a1[1] is ws and ws.nbytes == 3 * 4 * 4 and (ws == 0xFF).all()
    assert a1[0] is out and d1 == {"blockIdx.x": 1, "blockIdx.y": 2, "threadIdx.x": 32}
    ((k2, a2, d2),) = [launch for launch in prog.launches("f", {"n": 13}, {"x": x, "out": out})
                       if launch[0] != "f_kernel"]
    assert k2 == "f_kernel_2" and a2[0] is out and a2[1:] == [13] and d2 == {"blockIdx.x": 6, "threadIdx.x": 128}
    with pytest.raises(KeyError, match="'x'"):
        prog.launches("f", {"n": 3}, {"out": out})


def test_host_expressions_follow_c_semantics():
    assert TEval.Div(-7, 2) == -3 and TEval.FloorDiv(-7, 2) == -4
    assert TEval.truncmod(-7, 2) == -1 and TEval.FloorMod(-7, 2) == 1
