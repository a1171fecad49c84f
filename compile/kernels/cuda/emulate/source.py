"""CUDA source of prim_funcs without nvcc: the text TVM's CUDA codegen hands to nvcc, and the host side."""
from __future__ import annotations


def cuda_source(funcs: dict, arch: str = "sm_90", cse: bool = True) -> tuple[str, str]:
    """(CUDA source, host TIR script) of {global symbol: prim_func} lowered for cuda:arch by TVM's default
    TIR pipeline, as a build would generate them. Nothing is compiled: TVM's nvcc callback is swapped for a
    no-op while the source is generated (whether or not this process loaded TVM's CUDA runtime)."""
    import tvm
    import tvm_ffi
    from tvm.target import Target
    from tvm.tirx.build import split_host_device_mods

    from ....targets import parse_target

    tgt = parse_target("cuda:" + arch).tvm_target()
    prev = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", lambda *_a: b"// source only\n", override=True)
    try:
        with tvm.transform.PassContext(config={"tirx.disable_cse_tir": not cse}):
            mod = tvm.tirx.transform.BindTarget(tgt)(tvm.IRModule(funcs))
            pipeline, _fh, fd = tvm.tirx.get_default_tir_pipeline(tgt)
            mod = pipeline(mod)
            host, dev_mods = split_host_device_mods(mod)
            (dtgt, dmod), = dev_mods.items()
            m = tvm.get_global_func("target.build.cuda")(fd()(dmod), Target(dtgt))
            src = m.inspect_source("cuda") or m.inspect_source()
    finally:
        if prev is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", prev, override=True)
        else:
            tvm_ffi.remove_global_func("tvm_callback_cuda_compile")
    return src, host.script()
