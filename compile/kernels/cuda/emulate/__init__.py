"""Run the generated CUDA of the hand-written kernels on the CPU: a verification tool of the compiler.

The thread-bound TIR kernels (compile/kernels/cuda/) carry their own launch and fragment logic (splits,
warp shuffles, mma.sync fragment layouts, shared-memory staging) that no CPU build of the TIR can run.
EmuLib takes the CUDA source TVM generates for cuda:sm_XX (source.cuda_source: no nvcc, no GPU),
compiles it with g++ against prelude.py (one fiber per CUDA thread, barriers and warp collectives,
CPU versions of the inline-PTX helpers) and replays the host side of each prim_func (host.py: which
kernels, which grid, which host branch, workspaces). The case builders and references of the kernel
checks live next to it (attention.py, gdn.py, gemv.py); tests/ and the GPU check scripts in bench/
both use them. Module level imports stay light (numpy): bench scripts import the case builders on
the GPU machine, which has the TVM runtime only.
"""
from .lib import EmuLib
from .source import cuda_source

__all__ = ["EmuLib", "cuda_source"]
