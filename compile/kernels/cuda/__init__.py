"""Thread-bound TIR kernels for CUDA targets (sm_90, sm_120); see registry.kernel_set."""
