"""CUDA Gated DeltaNet kernels (thread-bound TIR).

Same prim_func signatures and buffer contracts as compile/kernels/gdn.py:
  conv(x[n,C], cu[b+1], slot[b], pool[S,L,C,K-1], w[C,K], layer, out[n,C])
  gdn_chunk(q[n,Hk,dk], k[n,Hk,dk], v[n,Hv,dv], g[n,Hv], beta[n,Hv], cu[b+1], slot[b],
            ssm[S,L,Hv,dk,dv], layer, o[n,Hv,dv])
  gdn_step(q[b,Hk,dk], k[b,Hk,dk], v[b,Hv,dv], g[b,Hv], beta[b,Hv], slot[b], ssm[S,L,Hv,dk,dv], layer,
           o[b,Hv,dv])
State (ssm) is fp32; all GDN math is fp32.

conv: two launches. (1) thread per (token, channel): every output is independent once the row
start is known (a scan over cu, b is small), reading the stored tail for the first K-1 inputs of a
row; (2) thread per (row, channel): new tail, read into registers before it is written.
gdn_step: block per (row, value head), thread per value column d; the state column S[:, d] lives
in registers (dk floats), k and q in shared memory. One read and one write of the state.
gdn_chunk: block per (row, value head, dv tile), thread per value column. Chunks run in order
inside the block; the state column stays in registers across chunks. Per chunk of C tokens:
  A[i,j] = b_i e^(g_i-g_j) k_i.k_j (j<i), M[i,j] = e^(g_i-g_j) q_i.k_j (j<=i)     (shared, all threads)
  R = b (V - e^g K S0), then R <- (I+A)^-1 R by forward substitution (column-private)
  O = e^g Q S0 + M R,   S = e^(g_last) S0 + (K e^(g_last-g))^T R
(this is the WY/UT form of the llvm kernel with W folded into R: (I+A)^-1 is linear).
"""
from __future__ import annotations

from tvm.script import tirx as T

CHUNK = 32


def causal_conv(conv_dim: int, kernel: int, n_layers: int, dtype: str, *, threads: int = 256):
    taps = kernel - 1
    CT = min(threads, ((conv_dim + 31) // 32) * 32)
    NCB = (conv_dim + CT - 1) // CT

    @T.prim_func
    def conv(
        var_x: T.handle, var_cu: T.handle, var_slot: T.handle, var_pool: T.handle, var_w: T.handle,
        layer: T.int32, var_out: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        bp1 = T.int64()
        s = T.int64()
        x = T.match_buffer(var_x, (n, conv_dim), dtype)
        cu = T.match_buffer(var_cu, (bp1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        pool = T.match_buffer(var_pool, (s, n_layers, conv_dim, taps), dtype)
        w = T.match_buffer(var_w, (conv_dim, kernel), dtype)
        out = T.match_buffer(var_out, (n, conv_dim), dtype)
        # (1) outputs
        for t in T.thread_binding(n, thread="blockIdx.x"):
            for cb in T.thread_binding(NCB, thread="blockIdx.y"):
                for tx in T.thread_binding(CT, thread="threadIdx.x"):
                    rowv = T.alloc_buffer((1,), "int32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    if cb * CT + tx < conv_dim:
                        rowv[0] = 0
                        for r in range(b - 1):
                            if T.Cast("int64", cu[r + 1]) <= t:
                                rowv[0] = rowv[0] + 1
                        acc[0] = T.float32(0)
                        for j in T.unroll(kernel):
                            if t - taps + j >= T.Cast("int64", cu[rowv[0]]):
                                acc[0] = acc[0] + T.Cast("float32", w[cb * CT + tx, j]) * T.Cast(
                                    "float32", x[t - taps + j, cb * CT + tx])
                            else:
                                acc[0] = acc[0] + T.Cast("float32", w[cb * CT + tx, j]) * T.Cast(
                                    "float32", pool[slot[rowv[0]], layer, cb * CT + tx,
                                                    t - T.Cast("int64", cu[rowv[0]]) + j])
                        out[t, cb * CT + tx] = T.Cast(dtype, acc[0] / (T.float32(1) + T.exp(-acc[0])))
        # (2) new tails = last K-1 entries of [old tail | row inputs]
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for cb in T.thread_binding(NCB, thread="blockIdx.y"):
                for tx in T.thread_binding(CT, thread="threadIdx.x"):
                    tail = T.alloc_buffer((taps,), dtype, scope="local")
                    if cb * CT + tx < conv_dim:
                        for m in T.unroll(taps):
                            if cu[bi + 1] - cu[bi] + m < taps:
                                tail[m] = pool[slot[bi], layer, cb * CT + tx, cu[bi + 1] - cu[bi] + m]
                            else:
                                tail[m] = x[cu[bi + 1] - taps + m, cb * CT + tx]
                        for m in T.unroll(taps):
                            pool[slot[bi], layer, cb * CT + tx, m] = tail[m]

    return conv


def recurrent_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int):
    r = hv // hk
    NT = dv
    NE = (dk + NT - 1) // NT

    @T.prim_func
    def gdn_step(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle, var_beta: T.handle,
        var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_o: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        b = T.int64()
        s = T.int64()
        q = T.match_buffer(var_q, (b, hk, dk), "float32")
        k = T.match_buffer(var_k, (b, hk, dk), "float32")
        v = T.match_buffer(var_v, (b, hv, dv), "float32")
        g = T.match_buffer(var_g, (b, hv), "float32")
        beta = T.match_buffer(var_beta, (b, hv), "float32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        o = T.match_buffer(var_o, (b, hv, dv), "float32")
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for h in T.thread_binding(hv, thread="blockIdx.y"):
                for d in T.thread_binding(NT, thread="threadIdx.x"):
                    ks = T.alloc_buffer((dk,), "float32", scope="shared")
                    qs = T.alloc_buffer((dk,), "float32", scope="shared")
                    col = T.alloc_buffer((dk,), "float32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    dl = T.alloc_buffer((1,), "float32", scope="local")
                    for e0 in range(NE):
                        if e0 * NT + d < dk:
                            ks[e0 * NT + d] = k[bi, h // r, e0 * NT + d]
                            qs[e0 * NT + d] = q[bi, h // r, e0 * NT + d]
                    T.tvm_storage_sync("shared")
                    acc[0] = T.float32(0)
                    for e in T.unroll(dk):
                        col[e] = ssm[slot[bi], layer, h, e, d] * T.exp(g[bi, h])
                        acc[0] = acc[0] + col[e] * ks[e]
                    dl[0] = (v[bi, h, d] - acc[0]) * beta[bi, h]
                    acc[0] = T.float32(0)
                    for e in T.unroll(dk):
                        col[e] = col[e] + ks[e] * dl[0]
                        acc[0] = acc[0] + col[e] * qs[e]
                        ssm[slot[bi], layer, h, e, d] = col[e]
                    o[bi, h, d] = acc[0]

    return gdn_step


def chunked_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int, chunk: int = CHUNK,
                       *, dv_tile: int = 64):
    r = hv // hk
    C = chunk
    DVT = min(dv_tile, dv)
    while dv % DVT:
        DVT -= 1
    NDT = dv // DVT
    DKP = dk + 1  # padded row: column reads of the staged K chunk hit distinct banks

    @T.prim_func
    def gdn_chunk(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle, var_beta: T.handle,
        var_cu: T.handle, var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_o: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        bp1 = T.int64()
        s = T.int64()
        q = T.match_buffer(var_q, (n, hk, dk), "float32")
        k = T.match_buffer(var_k, (n, hk, dk), "float32")
        v = T.match_buffer(var_v, (n, hv, dv), "float32")
        g = T.match_buffer(var_g, (n, hv), "float32")
        beta = T.match_buffer(var_beta, (n, hv), "float32")
        cu = T.match_buffer(var_cu, (bp1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        o = T.match_buffer(var_o, (n, hv, dv), "float32")
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for h in T.thread_binding(hv, thread="blockIdx.y"):
                for dt in T.thread_binding(NDT, thread="blockIdx.z"):
                    for tx in T.thread_binding(DVT, thread="threadIdx.x"):
                        ks = T.alloc_buffer((C * DKP,), "float32", scope="shared")
                        am = T.alloc_buffer((C, C), "float32", scope="shared")
                        mm = T.alloc_buffer((C, C), "float32", scope="shared")
                        rr = T.alloc_buffer((C,), "float32", scope="local")
                        gam = T.alloc_buffer((C,), "float32", scope="shared")
                        bet = T.alloc_buffer((C,), "float32", scope="shared")
                        col = T.alloc_buffer((dk,), "float32", scope="local")
                        acc = T.alloc_buffer((1,), "float32", scope="local")
                        acc2 = T.alloc_buffer((1,), "float32", scope="local")
                        d = dt * DVT + tx
                        for e in T.unroll(dk):
                            col[e] = ssm[slot[bi], layer, h, e, d]
                        for c in range((cu[bi + 1] - cu[bi] + C - 1) // C):
                            c0 = cu[bi] + c * C
                            ln = T.min(C, cu[bi + 1] - c0)
                            # stage K chunk, cumulative decay, beta
                            for e0 in range((C * dk + DVT - 1) // DVT):
                                if (e0 * DVT + tx) // dk < ln:
                                    ks[(e0 * DVT + tx) // dk * DKP + (e0 * DVT + tx) % dk] = k[
                                        c0 + (e0 * DVT + tx) // dk, h // r, (e0 * DVT + tx) % dk]
                            if tx == 0:
                                acc[0] = T.float32(0)
                                for t in range(ln):
                                    acc[0] = acc[0] + g[c0 + t, h]
                                    gam[t] = acc[0]
                                    bet[t] = beta[c0 + t, h]
                            T.tvm_storage_sync("shared")
                            # A (strictly lower) and M (lower incl. diagonal)
                            for e0 in range((C * C + DVT - 1) // DVT):
                                if e0 * DVT + tx < C * C:
                                    acc[0] = T.float32(0)
                                    acc2[0] = T.float32(0)
                                    if (e0 * DVT + tx) // C < ln:
                                        if (e0 * DVT + tx) % C <= (e0 * DVT + tx) // C:
                                            for e in range(dk):
                                                acc[0] = acc[0] + ks[(e0 * DVT + tx) // C * DKP + e] * ks[(e0 * DVT + tx) % C * DKP + e]
                                                acc2[0] = acc2[0] + q[c0 + (e0 * DVT + tx) // C, h // r, e] * ks[(e0 * DVT + tx) % C * DKP + e]
                                            acc[0] = acc[0] * bet[(e0 * DVT + tx) // C] * T.exp(
                                                gam[(e0 * DVT + tx) // C] - gam[(e0 * DVT + tx) % C])
                                            acc2[0] = acc2[0] * T.exp(gam[(e0 * DVT + tx) // C] - gam[(e0 * DVT + tx) % C])
                                    am[(e0 * DVT + tx) // C, (e0 * DVT + tx) % C] = T.Select(
                                        (e0 * DVT + tx) % C < (e0 * DVT + tx) // C, acc[0], T.float32(0))
                                    mm[(e0 * DVT + tx) // C, (e0 * DVT + tx) % C] = acc2[0]
                            # R = beta (V - e^g K S0);  O = e^g Q S0 (partial, into o)
                            for i in range(ln):
                                acc[0] = T.float32(0)
                                acc2[0] = T.float32(0)
                                for e in T.unroll(dk):
                                    acc[0] = acc[0] + ks[i * DKP + e] * col[e]
                                    acc2[0] = acc2[0] + q[c0 + i, h // r, e] * col[e]
                                rr[i] = bet[i] * (v[c0 + i, h, d] - T.exp(gam[i]) * acc[0])
                                o[c0 + i, h, d] = T.exp(gam[i]) * acc2[0]
                            T.tvm_storage_sync("shared")
                            # forward substitution (each thread owns its column of R)
                            for i in range(ln):
                                acc[0] = rr[i]
                                for j in range(i):
                                    acc[0] = acc[0] - am[i, j] * rr[j]
                                rr[i] = acc[0]
                            # O += M R
                            for i in range(ln):
                                acc[0] = o[c0 + i, h, d]
                                for j in range(i + 1):
                                    acc[0] = acc[0] + mm[i, j] * rr[j]
                                o[c0 + i, h, d] = acc[0]
                            # S = e^(g_last) S0 + sum_j e^(g_last - g_j) k_j R_j
                            for e in T.unroll(dk):
                                col[e] = col[e] * T.exp(gam[ln - 1])
                            for j in range(ln):
                                acc[0] = T.exp(gam[ln - 1] - gam[j]) * rr[j]
                                for e in T.unroll(dk):
                                    col[e] = col[e] + ks[j * DKP + e] * acc[0]
                            T.tvm_storage_sync("shared")
                        for e in T.unroll(dk):
                            ssm[slot[bi], layer, h, e, d] = col[e]

    return gdn_chunk
