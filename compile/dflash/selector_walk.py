"""DFlash2's greedy candidate walk on the device (runtime/spec/selector.py CandidateSelector.walk_greedy's rule).

  select_walk(top_ids[r, S] i32, top_vals[r, S] f32, hidden[r, rank] f32, anchors[b] i32,
              pred[V, rank], succ[V, rank]) -> drafts[r] i32
      b blocks of k = r / b rows each (block i's rows i*k .. i*k + k - 1, as the draft call returns them).
      Row j of block i: its candidates are the top_k best of the row's S slots (the device sampler's top
      logprobs; id -1 = an empty slot) by value, then lowest id; each scores value + <pred[prev] * h_j, succ[c]>
      (prev: the block's anchor, then the previous row's choice) and the best score wins, lowest id among equal
      scores. drafts[j * b + i] = row j's choice of block i: step-major, as the MTP chain's [k, b] drafts,
      so the verify takes both the same way.

Why on the device: with the walk on the host, a speculative round reads the drafter's candidates, walks, and only
then launches the verify, while the device idles (BENCHMARKS.md run 8: ~5 ms per DFlash2 round). Here the drafts
stay on the device and the round's one read is the verify's.

The dot products sum in rank order in fp32 (the host's matmul may associate differently: scores can differ in the
last bits, so near-ties may pick another candidate; either is a valid draft, and verification is lossless).
CUDA: a 32-thread block per draft block, a thread per slot for the ranking and per candidate for its dot; llvm: the
same steps as loops.
"""
from __future__ import annotations

from tvm.script import tirx as T

NEG_INF = -3.0e38


def select_walk(rank: int, top_k: int, slots: int, dtype: str, gpu: bool):
    """The prim_func for codebooks [V, rank] of `dtype`, S = slots top-logprob slots per row (CUDA: S <= 32,
    top_k <= S)."""
    if not 1 <= top_k <= slots:
        raise ValueError(f"the selector's top_k {top_k} must be within the {slots} candidate slots")
    if gpu and slots > 32:
        raise ValueError(f"the CUDA walk handles up to 32 candidate slots, got {slots}")
    return _gpu(rank, top_k, slots, dtype) if gpu else _cpu(rank, top_k, slots, dtype)


def _cpu(rank: int, top_k: int, S: int, dtype: str):
    @T.prim_func
    def dflash_select_walk(var_ids: T.handle, var_vals: T.handle, var_h: T.handle, var_anchors: T.handle,
                           var_pred: T.handle, var_succ: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        r, b, V = T.int64(), T.int64(), T.int64()
        ids = T.match_buffer(var_ids, (r, S), "int32")
        vals = T.match_buffer(var_vals, (r, S), "float32")
        h = T.match_buffer(var_h, (r, rank), "float32")
        anchors = T.match_buffer(var_anchors, (b,), "int32")
        pred = T.match_buffer(var_pred, (V, rank), dtype)
        succ = T.match_buffer(var_succ, (V, rank), dtype)
        out = T.match_buffer(var_out, (r,), "int32")
        a = T.alloc_buffer((rank,), "float32")
        prev = T.alloc_buffer((1,), "int32")
        best = T.alloc_buffer((1,), "float32")
        bid = T.alloc_buffer((1,), "int32")
        cnt = T.alloc_buffer((1,), "int32")
        dot = T.alloc_buffer((1,), "float32")
        for i in T.serial(b):
            prev[0] = anchors[i]
            for j in T.serial(r // b):
                row = i * (r // b) + j
                for t in T.serial(rank):
                    a[t] = T.Cast("float32", pred[prev[0], t]) * h[row, t]
                best[0] = T.float32(NEG_INF)
                bid[0] = -1
                for s in T.serial(S):
                    if ids[row, s] >= 0:
                        cnt[0] = 0
                        for m in T.serial(S):
                            if ids[row, m] >= 0 and (vals[row, m] > vals[row, s] or (
                                    vals[row, m] == vals[row, s] and ids[row, m] < ids[row, s])):
                                cnt[0] = cnt[0] + 1
                        if cnt[0] < top_k:
                            dot[0] = T.float32(0)
                            for t in T.serial(rank):
                                dot[0] = dot[0] + T.Cast("float32", succ[ids[row, s], t]) * a[t]
                            dot[0] = vals[row, s] + dot[0]
                            if bid[0] < 0 or dot[0] > best[0] or (dot[0] == best[0] and ids[row, s] < bid[0]):
                                best[0] = dot[0]
                                bid[0] = ids[row, s]
                if bid[0] >= 0:  # (no candidate at all: keep the anchor, a valid id the verify rejects)
                    prev[0] = bid[0]
                out[j * b + i] = prev[0]

    return dflash_select_walk.with_attr("global_symbol", "dflash_select_walk")


def _gpu(rank: int, top_k: int, S: int, dtype: str):
    NE = (rank + 31) // 32

    # No shared-memory access sits inside a condition (TVM's sync planning cannot place a barrier there): every
    # thread ranks its slot, scores it (clamped indices, the result masked) and takes the block's argmax itself.
    @T.prim_func
    def dflash_select_walk(var_ids: T.handle, var_vals: T.handle, var_h: T.handle, var_anchors: T.handle,
                           var_pred: T.handle, var_succ: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        r, b, V = T.int64(), T.int64(), T.int64()
        ids = T.match_buffer(var_ids, (r, S), "int32")
        vals = T.match_buffer(var_vals, (r, S), "float32")
        h = T.match_buffer(var_h, (r, rank), "float32")
        anchors = T.match_buffer(var_anchors, (b,), "int32")
        pred = T.match_buffer(var_pred, (V, rank), dtype)
        succ = T.match_buffer(var_succ, (V, rank), dtype)
        out = T.match_buffer(var_out, (r,), "int32")
        for i in T.thread_binding(b, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                a = T.alloc_buffer((NE * 32,), "float32", scope="shared")
                sid = T.alloc_buffer((32,), "int32", scope="shared")
                sval = T.alloc_buffer((32,), "float32", scope="shared")
                score = T.alloc_buffer((32,), "float32", scope="shared")
                cid = T.alloc_buffer((32,), "int32", scope="shared")
                pv = T.alloc_buffer((1,), "int32", scope="local")
                my_id = T.alloc_buffer((1,), "int32", scope="local")
                my_val = T.alloc_buffer((1,), "float32", scope="local")
                o_id = T.alloc_buffer((1,), "int32", scope="local")
                o_val = T.alloc_buffer((1,), "float32", scope="local")
                cnt = T.alloc_buffer((1,), "int32", scope="local")
                dot = T.alloc_buffer((1,), "float32", scope="local")
                best = T.alloc_buffer((1,), "float32", scope="local")
                bid = T.alloc_buffer((1,), "int32", scope="local")
                pv[0] = anchors[i]
                for j in T.serial(r // b):
                    sid[tx] = T.if_then_else(tx < S, ids[i * (r // b) + j, T.min(tx, S - 1)], -1)
                    sval[tx] = T.if_then_else(tx < S, vals[i * (r // b) + j, T.min(tx, S - 1)], T.float32(0))
                    for e in T.unroll(NE):
                        a[e * 32 + tx] = T.if_then_else(
                            e * 32 + tx < rank,
                            T.Cast("float32", pred[pv[0], T.min(e * 32 + tx, rank - 1)])
                            * h[i * (r // b) + j, T.min(e * 32 + tx, rank - 1)], T.float32(0))
                    T.tvm_storage_sync("shared")
                    my_id[0] = sid[tx]
                    my_val[0] = sval[tx]
                    cnt[0] = 0
                    for m in T.serial(S):
                        o_id[0] = sid[m]
                        o_val[0] = sval[m]
                        if o_id[0] >= 0 and (o_val[0] > my_val[0] or (o_val[0] == my_val[0] and o_id[0] < my_id[0])):
                            cnt[0] = cnt[0] + 1
                    dot[0] = T.float32(0)
                    for t in T.serial(rank):
                        dot[0] = dot[0] + T.Cast("float32", succ[T.max(my_id[0], 0), t]) * a[t]
                    score[tx] = T.if_then_else(my_id[0] >= 0 and cnt[0] < top_k, my_val[0] + dot[0], T.float32(NEG_INF))
                    cid[tx] = T.if_then_else(my_id[0] >= 0 and cnt[0] < top_k, my_id[0], -1)
                    T.tvm_storage_sync("shared")
                    best[0] = T.float32(NEG_INF)
                    bid[0] = -1
                    for c in T.serial(S):
                        o_id[0] = cid[c]
                        o_val[0] = score[c]
                        if o_id[0] >= 0 and (bid[0] < 0 or o_val[0] > best[0] or (o_val[0] == best[0] and o_id[0] < bid[0])):
                            best[0] = o_val[0]
                            bid[0] = o_id[0]
                    if bid[0] >= 0:
                        pv[0] = bid[0]
                    if tx == 0:
                        out[j * b + i] = pv[0]
                    T.tvm_storage_sync("shared")

    return dflash_select_walk.with_attr("global_symbol", "dflash_select_walk")
