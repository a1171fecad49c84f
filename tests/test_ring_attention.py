"""The drafter's CUDA ring attention (compile/dflash/ring_attention.py), as generated CUDA run on the CPU
emulator, against the dense relax path it replaces (DFlashDrafter._ring_mask + _ring_attention built for llvm)
and a float64 reference: rings narrower than the context (wrap-around), a ring of two 64-slot splits, causal
and non-causal layers, a sequence younger than its ring (stale slots) and a ring_lo inside the window."""
from __future__ import annotations

import numpy as np
import pytest

from ninfer_mlc.compile.dflash.ring_attention import ring_attention
from ninfer_mlc.compile.kernels.cuda.emulate.ring import ring_case, ring_module, ring_reference
from ninfer_mlc.contract.drafter import DrafterConfig

N_RING, LANES = 2, 3
TINY = (4, 2, 32)  # (query heads, KV heads, head_dim) of tests/dflash_tiny.py
# (name, block, window, causal, heads): the tiny drafters' rings, rings of two splits (R = 108), and the 27B
# drafter's heads (32 / 8 of 128: the GPU's tiling) over a short ring
CASES = [("b4w16", 4, 16, False, TINY), ("b8w24", 8, 24, True, TINY), ("b8w100c", 8, 100, True, TINY),
         ("b8w100", 8, 100, False, TINY), ("q27heads", 8, 100, True, (32, 8, 128))]


def _cfg(block: int, window: int, heads: tuple) -> DrafterConfig:
    hq, hkv, dh = heads
    return DrafterConfig(kind="dflash", hidden_size=hq * dh, intermediate_size=256, num_hidden_layers=N_RING,
                         num_attention_heads=hq, num_key_value_heads=hkv, head_dim=dh, rms_norm_eps=1e-6,
                         vocab_size=64, layer_types=["sliding_attention"] * N_RING, sliding_window=window,
                         causal=[True] * N_RING, target_layer_ids=[0], num_target_layers=1, block_size=block,
                         mask_token_id=1)


def _dense(cfg: DrafterConfig, causal: bool, slot: int):
    """The dense path for ring layer `slot` on llvm: (case) -> out."""
    import tvm
    from tvm import relax

    mod = ring_module(cfg, slot, False, "float32", kinds=(causal,))
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    t = lambda a: tvm.runtime.tensor(a, tvm.cpu())  # noqa: E731
    fn = vm["dense_causal" if causal else "dense_full"]
    return lambda c: fn(*(t(c[k]) for k in ("q", "pool", "pos", "lanes", "lo"))).numpy()


@pytest.fixture(scope="module")
def emu():
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib

    funcs = {name: ring_attention(B, *heads, W + B, W, N_RING, causal, "float32").with_attr("global_symbol", name)
             for name, B, W, causal, heads in CASES}
    return EmuLib(funcs)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_ring_attention_is_the_dense_path(emu, case):
    name, block, window, causal, heads = CASES[case]
    cfg = _cfg(block, window, heads)
    R = cfg.ring_size
    c = ring_case(np.random.default_rng(case), cfg, [3 * R + 5, R // 2], [3, 0], LANES)
    slot = 1
    want = _dense(cfg, causal, slot)(c)
    assert np.abs(want - ring_reference(c, cfg, slot, causal)).max() < 1e-5  # (the reference is the dense path's)
    for layer in range(N_RING):
        out = np.full_like(c["q"], np.nan)
        emu(name, dict(q=c["q"], rp=c["pool"], pos=c["pos"], lane=c["lanes"], lo=c["lo"], out=out), dict(layer=layer))
        assert np.isfinite(out).all()
        ref = want if layer == slot else ring_reference(c, cfg, layer, causal)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{name} layer {layer}: rel err {err}"


def test_ring_attention_rejects_bad_geometry():
    """Geometries the tiling does not take are refused with the reason (and the CUDA drafter keeps the dense
    path for them: DFlashDrafter builds no ring kernel)."""
    from tvm.target import Target

    from ninfer_mlc.compile.dflash.model import DFlashDrafter

    with pytest.raises(ValueError, match="group"):
        ring_attention(8, 6, 4, 128, 2056, 2048, 4, True, "bfloat16")
    with pytest.raises(ValueError, match="head_dim"):
        ring_attention(8, 32, 8, 100, 2056, 2048, 4, True, "bfloat16")
    with pytest.raises(ValueError, match="exceed"):
        ring_attention(64, 32, 8, 128, 2056, 2048, 4, True, "bfloat16")
    with Target({"kind": "cuda", "arch": "sm_90"}):
        assert DFlashDrafter(_cfg(8, 24, TINY), "bfloat16", "cuda").ring_kernels
        assert not DFlashDrafter(_cfg(64, 24, (32, 2, 32)), "bfloat16", "cuda").ring_kernels
