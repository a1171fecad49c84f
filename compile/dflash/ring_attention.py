"""The drafter's windowed (ring) attention as one thread-bound CUDA prim_func (compile/dflash/model.py's
`_ring_attention` + `_ring_mask` for CUDA; llvm keeps the dense relax ops).

  ring_attention(q[n, Hq, D], ring[lanes, L, 2, Hkv, R, D], pos[n] i32, lane[b] i32, ring_lo[b] i32,
                 layer i32, out[n, Hq, D])      n = b * B (b blocks of B rows, as `draft` lays them out)
Sequence bi's M = B * G query rows of KV head h (row r = block row r // G, query head h * G + r % G) attend
the R slots of layer `layer` of ring lane[bi] with the dense path's mask: slot s holds position
p = hi - ((hi - s) mod R) (hi = the block's last position), visible iff p >= ring_lo[bi], p >= 0, q - p < W
and p <= q (causal) or p - q < W (non-causal), q = the row's position. Scores q.k * D^-0.5 in fp32,
softmax in fp32; P stays fp32 for P.V (the dense path rounds the normalized P to the activation dtype
first: this is at least as precise, and the splits below never see the normalized P anyway).

Why: the dense form is a DLight matmul of [b, Hkv, M, R] x [b, Hkv, R, D] plus copies of the ring (take),
the QK matmul, the mask and the softmax: ~175 us for the P.V matmul alone per layer on the H200 at the 27B
drafter shape (M = 32, R = 2056, D = 128), for ~8 MB of K/V.

Two launches (stream order is the barrier between them):
  1. attend: grid (NS = ceil(R / C), Hkv, b) x NT threads; block (split s, h, bi) takes ring slots
     s*C .. s*C + C - 1 (C = 64). Q rows of (bi, h) in shared memory (fp32). QK: thread t owns slot t % C
     and M / (NT / C) rows, holds the slot's K row in registers (16-byte loads) and reads Q as float4
     broadcasts, writes the masked scores to shared memory. Softmax: TPR threads per row (a power of two,
     shuffles within the group) find the chunk's max m and p = exp(s - m), sum l. P.V: thread t owns column
     t % D (D <= NT; columns t + NT*u for D > NT) of M / (NT / D) rows; its V column of the chunk is loaded
     (coalesced along the rows) right after QK, so the loads fly during the softmax; P as float4 broadcasts.
     The unnormalized partial rows and (m, l) go to a workspace. Loops over registers are unrolled (loads are
     issued together, one memory round trip per phase: a serial loop waits for each load in turn); at the
     27B shape 166 registers, no spills, 25 KB shared memory (ptxas, sm_90a).
  2. combine: grid (M, Hkv, b) x min(D, NT): out = sum_s e^(m_s - m) o_s / sum_s e^(m_s - m) l_s, cast to
     the activation dtype (loops over the NS splits unrolled up to 64). A chunk whose slots are all masked
     has m_s = MASKED (-1e30), so its weight is 0.
Work at the 27B drafter shape, b = 1: 264 attend blocks of 128 threads (2 per SM), 2 x 2048 fp32 FMA per
thread (QK and P.V); the FP32 pipes alone need ~4 us per layer at full rate. Tensor cores (mma.m16n8k16 for
QK and P.V, as the paged attention's split path does) would be the next step if this shows up in a round.
Checked against the dense relax path in the CPU emulation of the generated CUDA (tests/test_ring_attention.py)
and on the GPU (bench/ring_attn_gpu_check.py).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

MASKED = -1.0e30  # the dense path's additive mask (model.MASKED)
NT = 128  # threads of the attend launch
CHUNK = 64  # ring slots per attend block


def _pow2_floor(x: int) -> int:
    p = 1
    while p * 2 <= x:
        p *= 2
    return p


def unsupported(block: int, n_heads: int, n_kv: int, head_dim: int) -> str | None:
    """Why the kernel does not take this geometry (None: it does); the drafter then keeps the dense path."""
    if n_heads % n_kv:
        return f"{n_heads} query heads do not group over {n_kv} KV heads"
    if head_dim % 8 or not (head_dim <= NT and NT % head_dim == 0 or head_dim % NT == 0):
        return f"head_dim {head_dim} must be a multiple of 8 dividing {NT} or a multiple of it"
    if block * (n_heads // n_kv) > NT:
        return f"{block * (n_heads // n_kv)} query rows per KV head (block x group) exceed {NT}"
    return None


def ring_plan(block: int, n_heads: int, n_kv: int, head_dim: int, ring: int) -> dict:
    """Static tiling of the kernel for one geometry (also what the GPU check prints)."""
    why = unsupported(block, n_heads, n_kv, head_dim)
    if why:
        raise ValueError(f"ring attention: {why}")
    M = block * (n_heads // n_kv)
    C = CHUNK if M % (NT // CHUNK) == 0 else NT  # slot groups must split the rows evenly
    SG = NT // C
    TPR = min(32, _pow2_floor(max(1, NT // M)))
    DW = min(head_dim, NT)
    RG = NT // DW
    return dict(M=M, G=n_heads // n_kv, C=C, NS=(ring + C - 1) // C, SG=SG, MR=M // SG, TPR=TPR,
                RP=(M + NT // TPR - 1) // (NT // TPR), SS=C + max(TPR, 4), DW=DW, RG=RG, DPT=head_dim // DW,
                MR2=(M + RG - 1) // RG)


def ring_attention(block: int, n_heads: int, n_kv: int, head_dim: int, ring: int, window: int, n_layers: int,
                   causal: bool, dtype: str):
    """The prim_func for one drafter geometry (B = block rows per sequence, R = ring slots, W = window)."""
    pl = ring_plan(block, n_heads, n_kv, head_dim, ring)
    M, G, C, NS, SG, MR, TPR, RP, SS = (pl[k] for k in ("M", "G", "C", "NS", "SG", "MR", "TPR", "RP", "SS"))
    DW, RG, DPT, MR2 = pl["DW"], pl["RG"], pl["DPT"], pl["MR2"]
    D, B, R, W = head_dim, block, ring, window
    RPP = NT // TPR  # rows per softmax pass
    QI = (M * D // 8 + NT - 1) // NT  # 8-element Q loads per thread
    splits = T.unroll if NS <= 64 else T.serial  # the combine's loads in flight together (a short loop)
    scale = float(head_dim) ** -0.5

    def visible(p, qp):
        return tirx.all(qp - p < W, (p <= qp) if causal else (p - qp < W))

    @T.prim_func
    def dflash_ring_attention(var_q: T.handle, var_ring: T.handle, var_pos: T.handle, var_lane: T.handle,
                              var_lo: T.handle, layer: T.int32, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, b, lanes = T.int64(), T.int64(), T.int64()
        q = T.match_buffer(var_q, (n, n_heads, D), dtype)
        rp = T.match_buffer(var_ring, (lanes, n_layers, 2, n_kv, R, D), dtype)
        pos = T.match_buffer(var_pos, (n,), "int32")
        lane = T.match_buffer(var_lane, (b,), "int32")
        lo = T.match_buffer(var_lo, (b,), "int32")
        out = T.match_buffer(var_out, (n, n_heads, D), dtype)
        ws_o = T.alloc_buffer((b * (n_kv * NS * M * D),), "float32", scope="global")
        ws_ml = T.alloc_buffer((b * (n_kv * NS * M * 2),), "float32", scope="global")
        # ---- 1. attend: one block per (split, KV head, sequence) -----------------------------------
        for s in T.thread_binding(NS, thread="blockIdx.x"):
            for h in T.thread_binding(n_kv, thread="blockIdx.y"):
                for bi in T.thread_binding(b, thread="blockIdx.z"):
                    for t in T.thread_binding(NT, thread="threadIdx.x"):
                        qs = T.alloc_buffer((M * D,), "float32", scope="shared")
                        ps = T.alloc_buffer((M * SS,), "float32", scope="shared")  # scores
                        pe = T.alloc_buffer((M * SS,), "float32", scope="shared")  # e^(score - m)
                        acc = T.alloc_buffer((MR,), "float32", scope="local")
                        kr = T.alloc_buffer((D,), dtype, scope="local")
                        qb = T.alloc_buffer((QI * 8,), dtype, scope="local")
                        qv = T.alloc_buffer((4,), "float32", scope="local")
                        red = T.alloc_buffer((3,), "float32", scope="local")
                        sp = T.alloc_buffer((2,), "int32", scope="local")
                        vr = T.alloc_buffer((C * DPT,), dtype, scope="local")
                        acc2 = T.alloc_buffer((MR2 * DPT,), "float32", scope="local")
                        pv = T.alloc_buffer((4,), "float32", scope="local")
                        hi = pos[bi * B + (B - 1)]
                        # every load of the K row and of Q is issued before the first use (unrolled loops)
                        for dd in T.unroll(D // 8):
                            for e in T.vectorized(8):
                                kr[dd * 8 + e] = rp[lane[bi], layer, 0, h, T.min(s * C + t % C, R - 1), dd * 8 + e]
                        for e0 in T.unroll(QI):
                            if (e0 * NT + t) * 8 < M * D:
                                for e in T.vectorized(8):
                                    qb[e0 * 8 + e] = q[bi * B + (e0 * NT + t) * 8 // D // G,
                                                       h * G + (e0 * NT + t) * 8 // D % G, (e0 * NT + t) * 8 % D + e]
                        for e0 in T.unroll(QI):
                            if (e0 * NT + t) * 8 < M * D:
                                for e in T.unroll(8):
                                    qs[(e0 * NT + t) * 8 + e] = T.Cast("float32", qb[e0 * 8 + e])
                        T.tvm_storage_sync("shared")
                        # QK: slot s*C + t % C, rows (t // C) * MR ..
                        for j in T.unroll(MR):
                            acc[j] = T.float32(0)
                        for dd in T.unroll(D // 8):
                            for j in T.unroll(MR):
                                for hv in T.unroll(2):
                                    for e in T.vectorized(4):
                                        qv[e] = qs[((t // C) * MR + j) * D + dd * 8 + hv * 4 + e]
                                    for e in T.unroll(4):
                                        acc[j] = acc[j] + qv[e] * T.Cast("float32", kr[dd * 8 + hv * 4 + e])
                        # this thread's V column(s) of the chunk, in flight during the softmax
                        for c in T.unroll(C):
                            for u in T.unroll(DPT):
                                vr[c * DPT + u] = rp[lane[bi], layer, 1, h, T.min(s * C + c, R - 1), t % DW + NT * u]
                        # the slot's position; whether the ring holds it for this sequence
                        sp[0] = hi - T.floormod(hi - (s * C + t % C), R)
                        sp[1] = T.Select(s * C + t % C < R and sp[0] >= lo[bi] and sp[0] >= 0, 1, 0)
                        for j in T.unroll(MR):
                            ps[((t // C) * MR + j) * SS + t % C] = T.Select(
                                sp[1] == 1 and visible(sp[0], pos[bi * B + ((t // C) * MR + j) // G]),
                                acc[j] * T.float32(scale), T.float32(MASKED))
                        T.tvm_storage_sync("shared")
                        # softmax of the chunk: TPR threads per row, rows t // TPR + RPP * pass
                        for rpass in T.serial(RP):
                            red[0] = T.float32(MASKED)
                            for k in T.unroll(C // TPR):
                                red[0] = T.max(red[0], ps[T.min(rpass * RPP + t // TPR, M - 1) * SS + k * TPR + t % TPR])
                            for o in T.unroll(TPR.bit_length() - 1):
                                red[0] = T.max(red[0], T.tvm_warp_shuffle_xor(
                                    T.uint32(0xFFFFFFFF), red[0], TPR >> (o + 1), 32, 32))
                            red[1] = T.float32(0)
                            for k in T.unroll(C // TPR):
                                red[2] = T.Select(
                                    s * C + k * TPR + t % TPR < R,
                                    T.exp(ps[T.min(rpass * RPP + t // TPR, M - 1) * SS + k * TPR + t % TPR] - red[0]),
                                    T.float32(0))
                                red[1] = red[1] + red[2]
                                if rpass * RPP + t // TPR < M:
                                    pe[(rpass * RPP + t // TPR) * SS + k * TPR + t % TPR] = red[2]
                            for o in T.unroll(TPR.bit_length() - 1):
                                red[1] = red[1] + T.tvm_warp_shuffle_xor(
                                    T.uint32(0xFFFFFFFF), red[1], TPR >> (o + 1), 32, 32)
                            if rpass * RPP + t // TPR < M and t % TPR == 0:
                                ws_ml[(((bi * n_kv + h) * NS + s) * M + rpass * RPP + t // TPR) * 2] = red[0]
                                ws_ml[(((bi * n_kv + h) * NS + s) * M + rpass * RPP + t // TPR) * 2 + 1] = red[1]
                        T.tvm_storage_sync("shared")
                        # P.V: column t % DW (+ NT*u), rows t // DW + RG * j
                        for j in T.unroll(MR2 * DPT):
                            acc2[j] = T.float32(0)
                        for c4 in T.unroll(C // 4):
                            for j in T.unroll(MR2):
                                for e in T.vectorized(4):
                                    pv[e] = pe[T.min(t // DW + RG * j, M - 1) * SS + c4 * 4 + e]
                                for e in T.unroll(4):
                                    for u in T.unroll(DPT):
                                        acc2[j * DPT + u] = acc2[j * DPT + u] + pv[e] * T.Cast(
                                            "float32", vr[(c4 * 4 + e) * DPT + u])
                        for j in T.unroll(MR2):
                            if t // DW + RG * j < M:
                                for u in T.unroll(DPT):
                                    ws_o[(((bi * n_kv + h) * NS + s) * M + t // DW + RG * j) * D + t % DW + NT * u] = \
                                        acc2[j * DPT + u]
        # ---- 2. combine the splits: one block per (row, KV head, sequence) ----------------------------
        for r in T.thread_binding(M, thread="blockIdx.x"):
            for h in T.thread_binding(n_kv, thread="blockIdx.y"):
                for bi in T.thread_binding(b, thread="blockIdx.z"):
                    for t in T.thread_binding(DW, thread="threadIdx.x"):
                        cm = T.alloc_buffer((3,), "float32", scope="local")
                        co = T.alloc_buffer((DPT,), "float32", scope="local")
                        cm[0] = T.float32(MASKED)
                        for s2 in splits(NS):
                            cm[0] = T.max(cm[0], ws_ml[(((bi * n_kv + h) * NS + s2) * M + r) * 2])
                        cm[1] = T.float32(0)
                        for u in T.unroll(DPT):
                            co[u] = T.float32(0)
                        for s2 in splits(NS):
                            cm[2] = T.exp(ws_ml[(((bi * n_kv + h) * NS + s2) * M + r) * 2] - cm[0])
                            cm[1] = cm[1] + cm[2] * ws_ml[(((bi * n_kv + h) * NS + s2) * M + r) * 2 + 1]
                            for u in T.unroll(DPT):
                                co[u] = co[u] + cm[2] * ws_o[(((bi * n_kv + h) * NS + s2) * M + r) * D + t + NT * u]
                        for u in T.unroll(DPT):
                            out[bi * B + r // G, h * G + r % G, t + NT * u] = T.Cast(dtype, co[u] / cm[1])

    return dflash_ring_attention.with_attr("global_symbol", kernel_name(causal))


def kernel_name(causal: bool) -> str:
    return "dflash_ring_attention" + ("_causal" if causal else "")
