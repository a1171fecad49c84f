"""Programmatic dependent launch: every generated kernel opens with the grid-dependency wait (compile/
grid_dependency.py), and only kernel -> kernel graph edges become programmatic (runtime/executor/cuda_graph.py)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from ninfer_mlc.compile import grid_dependency as gd
from ninfer_mlc.runtime.executor.cuda_graph import programmatic_edges

SRC = '''#include <cuda.h>
extern "C" __global__ void __launch_bounds__(96) a_kernel(float* __restrict__ x, int64_t n);
extern "C" __global__ void __launch_bounds__(64, 2) b_kernel(float* __restrict__ y);
extern "C" __global__ void __launch_bounds__(96) a_kernel(float* __restrict__ x, int64_t n) {
  if (n > 0) { x[threadIdx.x] = 1.f; }
}

extern "C" __global__ void __launch_bounds__(64, 2) b_kernel(float* __restrict__ y) {
  y[0] = 2.f;
}
'''


def test_every_kernel_definition_waits_first():
    out = gd.inject(SRC)
    assert gd.count_waiting_kernels(out) == 2
    assert out.count(gd.WAIT_FUNC + "();") == 2  # the declarations are left alone
    assert out.index("__device__ __forceinline__ void " + gd.WAIT_FUNC) < out.index('extern "C" __global__')
    body = out.split("a_kernel(float* __restrict__ x, int64_t n) {", 1)[1]
    assert body.lstrip().startswith(gd.WAIT_FUNC + "();")  # before the kernel's first statement
    assert gd.inject("// no kernels\n") == "// no kernels\n"


def test_trigger_modes():
    """exit (default): only the wait; entry: the wait, then the trigger, except kernels named in exit_kernels."""
    plain = SRC.replace("__launch_bounds__(96) ", "")  # kernels without launch bounds are named too
    assert gd.TRIGGER_FUNC + "();" not in gd.inject(plain)
    out = gd.inject(plain, "entry", ("b_",))
    a_body = out.split("a_kernel(float* __restrict__ x, int64_t n) {", 1)[1].split("}", 1)[0]
    b_body = out.split("b_kernel(float* __restrict__ y) {", 1)[1]
    assert a_body.split()[:2] == [gd.WAIT_FUNC + "();", gd.TRIGGER_FUNC + "();"]
    assert gd.TRIGGER_FUNC + "();" not in b_body
    with pytest.raises(gd.GridDependencyError):
        gd.inject(SRC, "early")


def test_a_kernel_that_waits_itself_is_left_alone():
    own = SRC.replace("y[0] = 2.f;", "float v = 1.f;\n  " + gd.WAIT_FUNC + "();\n  y[0] = v;")
    out = gd.inject(own)
    b_body = out.split("b_kernel(float* __restrict__ y) {", 1)[1]
    assert b_body.count(gd.WAIT_FUNC + "();") == 1 and gd.count_waiting_kernels(out) == 2


def test_unrecognised_kernels_and_double_injection_are_refused():
    with pytest.raises(gd.GridDependencyError):
        gd.inject(SRC + "\n#define K(n) __global__ void n() {}\nK(c_kernel)\n")
    with pytest.raises(gd.GridDependencyError):
        gd.inject(gd.inject(SRC))


def test_arch_gate():
    assert gd.arch_supports("sm_90") and gd.arch_supports("sm_90a") and gd.arch_supports("sm_120a")
    assert not gd.arch_supports("sm_89") and not gd.arch_supports("") and not gd.arch_supports("llvm")


def test_only_kernel_to_kernel_edges_become_programmatic():
    kernel, memcpy, memset = 0, 2, 3
    kinds = [kernel, kernel, memcpy, kernel, memset, kernel]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (3, 5)]
    assert programmatic_edges(kinds, edges) == [(0, 1), (3, 5)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_generated_kernels_with_the_wait_assemble_for_sm90a(tmp_path):
    """TVM's CUDA source of real kernels (a conv and the paged attention), injected, passes ptxas for sm_90a."""
    from ninfer_mlc.compile.kernels.cuda.emulate.source import cuda_source
    from ninfer_mlc.compile.kernels.registry import kernel_set

    from ninfer_mlc.compile.kernels.cuda import gemv

    cuda = kernel_set("cuda")
    funcs = {"conv": cuda.causal_conv(96, 4, 2, "bfloat16").with_attr("global_symbol", "conv"),
             "attn": cuda.paged_attention(4, 2, 32, 64, 1, "bfloat16", 0.1).with_attr("global_symbol", "attn"),
             "gq": gemv.gemv_nvfp4(1024, 256, "bfloat16").with_attr("global_symbol", "gq")}
    src, _ = cuda_source(funcs)
    out = gd.inject(src, "entry", ("gq",))
    n = out.count('extern "C" __global__') - len(gd._DECL.findall(out))
    assert n >= 4 and gd.count_waiting_kernels(out) == n
    assert out.count(gd.WAIT_FUNC + "();") == n  # no kernel waits twice
    (tmp_path / "k.cu").write_text(out)
    r = subprocess.run(["nvcc", "-cubin", "-gencode", "arch=compute_90a,code=sm_90a", "-o", str(tmp_path / "k.cubin"),
                        str(tmp_path / "k.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
