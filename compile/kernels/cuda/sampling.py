"""The device sampler for CUDA (thread-bound TIR): kernels/sampling.py's contract and arithmetic.

  process   grid (ceil(V / 256), n) x 256: one thread per logit (the llvm kernel's element code; the
            penalty division and product use __fdiv_rn / __dmul_rn so nvcc's fast math and FMA
            contraction cannot change numpy's roundings).
  select    a block of `threads` per row. Every pass strides the row's keys (coalesced); reductions
            are warp shuffles + one shared step. Radix levels histogram 8 key bits with shared-memory
            atomics (integer counts and fixed-point uint64 weights: exact and order-free, so the
            result does not depend on scheduling); warp 0 walks the 256 digits (8 per lane, a shuffle
            scan across lanes). After top_k, when <= `threads` keys remain, their ids are gathered
            (atomic slots) and bitonic-sorted ascending in shared memory, and every later pass runs
            over them. The draw: each warp sums its contiguous share of the candidates, the warp
            holding floor(u * total) walks its share 32 ids at a time (shuffle scan).
  logprobs  a block per row that asks: max, log-sum-exp (fp64 sum) and rank in two passes; the K-th
            largest key by radix select, ties at it broken towards lower ids by a second radix
            select over the ids; the K entries are gathered and sorted by thread 0.
  append / counts_add  one thread (a handful of rows).
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from ....contract.sampler_abi import (F_BIAS, F_FREQ_PRES, F_LOGPROBS, F_LP_PROCESSED, F_REPETITION, KEY_NEG_INF,
                                     KEY_POS_INF, NUM_PARAMS, P_FREQUENCY, P_LANE, P_MIN_P, P_PRESENCE, P_REPETITION,
                                     P_TEMPERATURE, P_TOP_K, P_TOP_P, P_UNIFORM, mask_words, top_logprob_slots,
                                     weight_bits)
from ..sampling import (append_rows, count_penalized, has_flag, key_of, level_mask, level_shift, masked, param_int,
                        prob_of, repetition_penalized, seen, src_key, u32, value_of, weight_of)

FULL = 0xFFFFFFFF


def _fdiv_rn(a, b):
    return T.call_pure_extern("float32", "__fdiv_rn", a, b)


def _dmul_rn(a, b):
    return T.call_pure_extern("float64", "__dmul_rn", a, b)


def _shfl(v, lane):
    return T.tvm_warp_shuffle(u32(FULL), v, lane, 32, 32)


def _shfl_xor(v, m):
    return T.tvm_warp_shuffle_xor(u32(FULL), v, m, 32, 32)


def _add(a, b):
    return a + b


def _max(a, b):
    return T.max(a, b)


def _min(a, b):
    return T.min(a, b)


def _process_elem_macro(fdiv, dmul):
    """The process kernel's element code (fdiv / dmul: rounding-exact intrinsics)."""

    @T.macro
    def process_elem(logits, params, mask, counts, prompt, bias, keys, r, v, x):
        """x: a float32 local scratch [1]."""
        x[0] = logits[r, v]
        if has_flag(params, r, F_BIAS):
            x[0] = x[0] + bias[param_int(params, r, P_LANE), v]
        if has_flag(params, r, F_REPETITION):
            if seen(prompt, counts, param_int(params, r, P_LANE), v):
                x[0] = repetition_penalized(x[0], params[r, P_REPETITION], fdiv)
        if has_flag(params, r, F_FREQ_PRES):
            if counts[param_int(params, r, P_LANE), v] > 0:
                x[0] = count_penalized(x[0], counts[param_int(params, r, P_LANE), v], params[r, P_FREQUENCY],
                                       params[r, P_PRESENCE], dmul)
        keys[r, v] = T.Select(masked(params, mask, r, v), u32(0), key_of(x[0]))

    return process_elem


def uniform(cond):
    """A condition every thread of the block evaluates alike (syncs may sit inside its branches)."""
    return T.tvm_thread_invariant(cond)


def walk_id(walk, cand, j):
    """The id at position j of a walk: the gathered candidates (walk[1] == 1) or the vocabulary."""
    return T.if_then_else(T.EQ(walk[1], 1), cand[T.min(j, cand.shape[0] - 1)], j)


def _block_macros(NT: int):
    """Warp / block collectives of a block of NT threads (NT a multiple of 32, at least 256).

    TVM's shared-memory access analysis accepts shared loads only in stores and calls (not in `if`
    conditions, let bindings or loop extents), so shared values are first copied into locals."""
    NW = NT // 32

    @T.macro
    def warp_allreduce(buf, f):
        for o in T.unroll(5):
            buf[0] = f(buf[0], _shfl_xor(buf[0], 16 >> o))

    @T.macro
    def warp_scan(buf, lane):
        """Inclusive prefix sum of buf[0] over the lanes of the warp."""
        for o in T.unroll(5):
            up = _shfl(buf[0], T.max(lane - (1 << o), 0))
            if lane >= (1 << o):
                buf[0] = buf[0] + up

    @T.macro
    def block_allreduce(buf, red, f, tx):
        """buf[0] (local) reduced by f over the block, in every thread; red: shared [NW] of buf's dtype."""
        warp_allreduce(buf, f)
        if tx % 32 == 0:
            red[tx // 32] = buf[0]
        T.tvm_storage_sync("shared")
        buf[0] = red[0]
        for w in range(1, NW):
            buf[0] = f(buf[0], red[w])
        T.tvm_storage_sync("shared")

    @T.macro
    def zero_digits(hc, hwl, hwh, tx):
        if tx < 256:
            hc[tx] = 0
            if hwl is not None:
                hwl[tx] = u32(0)
                hwh[tx] = u32(0)
        T.tvm_storage_sync("shared")

    @T.macro
    def add_weight(lo, hi, d, w):
        """hi:lo[d] += w (uint64) with two native 32-bit shared atomics and the low half's carry."""
        old = T.alloc_buffer((1,), "uint32", scope="local")
        old[0] = T.cuda.atomic_add(T.address_of(lo[d]), T.Cast("uint32", w & T.uint64(FULL)))
        T.cuda.atomic_add(T.address_of(hi[d]), T.Cast("uint32", T.shift_right(w, T.uint64(32))) + T.Select(
            old[0] + T.Cast("uint32", w & T.uint64(FULL)) < old[0], u32(1), u32(0)))

    @T.macro
    def hist_add(hc, hwl, hwh, valid, digit, w, lane, level):
        """Warp-collective (every lane calls it): bin `digit` of the lanes with `valid` += 1 (and += w). At the
        first radix level, where a row's keys fall into few bins (their sign and exponent), the lanes sharing
        lane 0's digit add through one atomic; deeper levels spread over the bins and add directly."""
        agg = T.alloc_buffer((1,), "int32", scope="local")
        aggw = T.alloc_buffer((1,), "uint64", scope="local")
        d0 = _shfl(digit, 0)
        if uniform(level == 0):
            agg[0] = T.Select(valid and digit == d0, 1, 0)
            warp_allreduce(agg, _add)
            if hwl is not None:
                aggw[0] = T.Select(valid and digit == d0, w, T.uint64(0))
                warp_allreduce(aggw, _add)
            if lane == 0 and agg[0] > 0:
                T.cuda.atomic_add(T.address_of(hc[d0]), agg[0])
                if hwl is not None:
                    add_weight(hwl, hwh, d0, aggw[0])
            if valid and digit != d0:
                T.cuda.atomic_add(T.address_of(hc[digit]), 1)
                if hwl is not None:
                    add_weight(hwl, hwh, digit, w)
        elif valid:
            T.cuda.atomic_add(T.address_of(hc[digit]), 1)
            if hwl is not None:
                add_weight(hwl, hwh, digit, w)

    @T.macro
    def radix_kth(kf, ok, ext, rank, hc, st, tx):
        """rank-th largest of the uint32 kf(j) over j < ext with ok(j), by 4 levels of 8 bits: st[0] = it,
        st[1] = count(> it), st[2] = count(== it) (st: shared int64 [4]). Callers copy st out and sync before
        writing it again."""
        cur = T.alloc_buffer((3,), "int64", scope="local")  # prefix, count above, rank left
        if tx == 0:
            st[0] = T.int64(0)
            st[1] = T.int64(0)
            st[3] = T.Cast("int64", rank)
        for level in range(4):
            zero_digits(hc, None, None, tx)
            cur[0] = st[0]
            cur[1] = st[1]
            cur[2] = st[3]
            for i in range((ext + NT - 1) // NT):
                key = kf(T.min(i * NT + tx, ext - 1))
                hist_add(hc, None, None, i * NT + tx < ext and ok(T.min(i * NT + tx, ext - 1))
                         and key & level_mask(level) == T.Cast("uint32", cur[0]),
                         T.Cast("int32", (key >> level_shift(level)) & u32(255)), T.uint64(0), tx % 32, level)
            T.tvm_storage_sync("shared")
            if tx < 32:  # warp 0: lane l owns digits 255 - 8l .. 248 - 8l
                hl = T.alloc_buffer((8,), "int64", scope="local")
                acc = T.alloc_buffer((1,), "int64", scope="local")
                acc[0] = T.int64(0)
                for q in range(8):
                    hl[q] = T.Cast("int64", hc[255 - 8 * tx - q])
                    acc[0] = acc[0] + hl[q]
                own = acc[0]
                warp_scan(acc, tx)
                acc[0] = acc[0] - own  # count above this lane's digits
                for q in range(8):
                    if acc[0] < cur[2] and cur[2] <= acc[0] + hl[q]:
                        st[0] = cur[0] | T.shift_left(T.Cast("int64", 255 - 8 * tx - q), T.int64(24) - 8 * level)
                        st[1] = cur[1] + acc[0]
                        st[2] = hl[q]
                        st[3] = cur[2] - acc[0]
                    acc[0] = acc[0] + hl[q]
            T.tvm_storage_sync("shared")

    return SimpleNamespace(warp_allreduce=warp_allreduce, warp_scan=warp_scan, block_allreduce=block_allreduce,
                           zero_digits=zero_digits, hist_add=hist_add, radix_kth=radix_kth)


def process(vocab: int, threads: int = 256):
    W = mask_words(vocab)
    elem = _process_elem_macro(_fdiv_rn, _dmul_rn)
    NB = (vocab + threads - 1) // threads

    @T.prim_func
    def sampler_process(var_logits: T.handle, var_params: T.handle, var_mask: T.handle, var_counts: T.handle,
                        var_prompt: T.handle, var_bias: T.handle, var_keys: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        lanes = T.int64()
        logits = T.match_buffer(var_logits, (n, vocab), "float32")
        params = T.match_buffer(var_params, (n, NUM_PARAMS), "float64")
        mask = T.match_buffer(var_mask, (n, W), "int32")
        counts = T.match_buffer(var_counts, (lanes, vocab), "int32")
        prompt = T.match_buffer(var_prompt, (lanes, W), "int32")
        bias = T.match_buffer(var_bias, (lanes, vocab), "float32")
        keys = T.match_buffer(var_keys, (n, vocab), "uint32")
        for r in T.thread_binding(n, thread="blockIdx.y"):
            for b in T.thread_binding(NB, thread="blockIdx.x"):
                for tx in T.thread_binding(threads, thread="threadIdx.x"):
                    x = T.alloc_buffer((1,), "float32", scope="local")
                    if b * threads + tx < vocab:
                        elem(logits, params, mask, counts, prompt, bias, keys, r, b * threads + tx, x)

    return sampler_process


def select(vocab: int, threads: int = 1024):
    NT = threads
    NW = NT // 32
    bits = weight_bits(vocab)
    LOG_NT = NT.bit_length() - 1
    if NT != 1 << LOG_NT or NT < 256:
        raise ValueError(f"sampler threads must be a power of two >= 256, got {NT}")
    M = _block_macros(NT)

    @T.prim_func
    def sampler_select(var_keys: T.handle, var_params: T.handle, var_tokens: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        keys = T.match_buffer(var_keys, (n, vocab), "uint32")
        params = T.match_buffer(var_params, (n, NUM_PARAMS), "float64")
        tokens = T.match_buffer(var_tokens, (n,), "int32")
        for r in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                hc = T.alloc_buffer((256,), "int32", scope="shared")  # radix digit counts
                hwl = T.alloc_buffer((256,), "uint32", scope="shared")  # radix digit weights: low halves
                hwh = T.alloc_buffer((256,), "uint32", scope="shared")  # high halves (+ the low halves' carries)
                cand = T.alloc_buffer((NT,), "int32", scope="shared")  # gathered candidate ids
                red = T.alloc_buffer((NW,), "uint64", scope="shared")
                st = T.alloc_buffer((4,), "int64", scope="shared")  # radix state
                sw = T.alloc_buffer((2,), "uint64", scope="shared")  # mass above the radix prefix, draw base
                tok = T.alloc_buffer((2,), "int32", scope="shared")  # drawn token, drawing warp
                gcnt = T.alloc_buffer((1,), "int32", scope="shared")
                acc = T.alloc_buffer((1,), "uint64", scope="local")
                cnt = T.alloc_buffer((1,), "uint64", scope="local")
                thr = T.alloc_buffer((1,), "uint32", scope="local")  # kept: key >= thr
                probe = T.alloc_buffer((1,), "uint64", scope="local")  # count(key >= thr) after the radix select
                known = T.alloc_buffer((1,), "int32", scope="local")  # acc holds the top_p reference mass
                walk = T.alloc_buffer((2,), "int32", scope="local")  # ids to walk (candidates or vocab), gathered?
                vid = T.alloc_buffer((1,), "int32", scope="local")  # the id at walk position j
                pair = T.alloc_buffer((2,), "int32", scope="local")
                wsum = T.alloc_buffer((1,), "uint64", scope="local")
                lastv = T.alloc_buffer((1,), "uint64", scope="local")
                cur = T.alloc_buffer((2,), "uint64", scope="local")  # radix prefix, mass above it
                # argmax (max of key << 32 | ~id: lowest id on ties) and the unmasked count
                acc[0] = T.uint64(0)
                cnt[0] = T.uint64(0)
                for i in range((vocab + NT - 1) // NT):
                    if i * NT + tx < vocab:
                        acc[0] = T.max(acc[0], T.shift_left(T.Cast("uint64", keys[r, i * NT + tx]), T.uint64(32))
                                       | T.Cast("uint64", u32(FULL) - T.Cast("uint32", i * NT + tx)))
                        if keys[r, i * NT + tx] > u32(0):
                            cnt[0] = cnt[0] + T.uint64(1)
                M.block_allreduce(acc, red, _max, tx)
                M.block_allreduce(cnt, red, _add, tx)
                best = T.Cast("uint32", T.shift_right(acc[0], T.uint64(32)))
                t = params[r, P_TEMPERATURE]
                if uniform(best == u32(0)):
                    if tx == 0:
                        tokens[r] = -1
                elif uniform(t == T.float64(0) or best >= u32(KEY_POS_INF) or best <= u32(KEY_NEG_INF)):
                    if tx == 0:
                        tokens[r] = T.Cast("int32", u32(FULL) - T.Cast("uint32", acc[0] & T.uint64(FULL)))
                else:
                    k = param_int(params, r, P_TOP_K)
                    m = value_of(best)
                    inv_t = T.Cast("float32", T.float64(1) / t)
                    thr[0] = u32(1)
                    known[0] = 0
                    # top_k: the k-th largest key. top_p alone: probe the NT-th largest instead; if the keys above
                    # it hold top_p of the mass, the nucleus is among them (any other key has that mass above)
                    if uniform(k > 0 and k < vocab or params[r, P_TOP_P] < T.float64(1) and cnt[0] > T.uint64(NT)):
                        M.radix_kth(lambda j: keys[r, j], lambda j: T.bool(True), vocab,
                                    T.Select(k > 0 and k < vocab, k, NT), hc, st, tx)
                        thr[0] = T.Cast("uint32", st[0])
                        probe[0] = T.Cast("uint64", st[1] + st[2])
                        T.tvm_storage_sync("shared")
                        if uniform(not (k > 0 and k < vocab)):
                            acc[0] = T.uint64(0)  # the vocabulary's mass, and the probe's
                            wsum[0] = T.uint64(0)
                            for i in range((vocab + NT - 1) // NT):
                                if i * NT + tx < vocab:
                                    key = keys[r, i * NT + tx]
                                    w = weight_of(prob_of(key, m, inv_t), bits)
                                    acc[0] = acc[0] + w
                                    if key >= thr[0]:
                                        wsum[0] = wsum[0] + w
                            M.block_allreduce(acc, red, _add, tx)
                            M.block_allreduce(wsum, red, _add, tx)
                            known[0] = 1
                            if probe[0] > T.uint64(NT) or \
                                    T.Cast("float64", wsum[0]) < params[r, P_TOP_P] * T.Cast("float64", acc[0]):
                                thr[0] = u32(1)  # the probe failed: walk the vocabulary
                                probe[0] = cnt[0]
                        cnt[0] = probe[0]
                    walk[0] = vocab
                    walk[1] = 0
                    if uniform(cnt[0] <= T.uint64(NT)):
                        # gather the candidate ids (atomic slots), then sort them ascending (bitonic; pad = vocab)
                        if tx == 0:
                            gcnt[0] = 0
                        cand[tx] = vocab
                        T.tvm_storage_sync("shared")
                        for i in range((vocab + NT - 1) // NT):
                            if i * NT + tx < vocab:
                                if keys[r, i * NT + tx] >= thr[0]:
                                    cand[T.cuda.atomic_add(T.address_of(gcnt[0]), 1)] = i * NT + tx
                        T.tvm_storage_sync("shared")
                        for a in range(LOG_NT):
                            for b in range(a + 1):
                                # the pair (tx, tx ^ j) of a run of 2 << a sorted up when tx & (2 << a) == 0:
                                # the lower index keeps the min then
                                pair[0] = cand[tx]
                                pair[1] = cand[T.bitwise_xor(tx, T.shift_right(2 << a, b + 1))]
                                T.tvm_storage_sync("shared")
                                cand[tx] = T.Select((T.bitwise_and(tx, T.shift_right(2 << a, b + 1)) == 0)
                                                    == (T.bitwise_and(tx, 2 << a) == 0),
                                                    T.min(pair[0], pair[1]), T.max(pair[0], pair[1]))
                                T.tvm_storage_sync("shared")
                        walk[0] = T.Cast("int32", cnt[0])
                        walk[1] = 1
                    if uniform(known[0] == 0):
                        acc[0] = T.uint64(0)
                        for i in range((walk[0] + NT - 1) // NT):
                            if i * NT + tx < walk[0]:
                                vid[0] = walk_id(walk, cand, i * NT + tx)
                                if keys[r, vid[0]] >= thr[0]:
                                    acc[0] = acc[0] + weight_of(prob_of(keys[r, vid[0]], m, inv_t), bits)
                        M.block_allreduce(acc, red, _add, tx)
                    if uniform(params[r, P_TOP_P] < T.float64(1)):
                        # weighted radix select: the smallest key whose mass strictly above is < top_p * total
                        lim = params[r, P_TOP_P] * T.Cast("float64", acc[0])
                        if tx == 0:
                            st[0] = T.int64(0)
                            sw[0] = T.uint64(0)
                        for level in range(4):
                            M.zero_digits(hc, hwl, hwh, tx)
                            cur[0] = T.Cast("uint64", st[0])
                            cur[1] = sw[0]
                            for i in range((walk[0] + NT - 1) // NT):
                                vid[0] = walk_id(walk, cand, T.min(i * NT + tx, walk[0] - 1))
                                key = keys[r, vid[0]]
                                w = weight_of(prob_of(key, m, inv_t), bits)
                                M.hist_add(hc, hwl, hwh, i * NT + tx < walk[0] and key >= thr[0] and w > T.uint64(0)
                                           and key & level_mask(level) == T.Cast("uint32", cur[0]),
                                           T.Cast("int32", (key >> level_shift(level)) & u32(255)), w, tx % 32,
                                           level)
                            T.tvm_storage_sync("shared")
                            if tx < 32:  # warp 0: lane l owns digits 255 - 8l .. 248 - 8l
                                hl = T.alloc_buffer((8,), "int32", scope="local")
                                wl = T.alloc_buffer((8,), "uint64", scope="local")
                                above = T.alloc_buffer((3,), "uint64", scope="local")  # running, -, selected
                                sel = T.alloc_buffer((1,), "int32", scope="local")
                                low = T.alloc_buffer((1,), "int32", scope="local")
                                above[2] = cur[1]
                                above[0] = T.uint64(0)
                                for q in range(8):
                                    hl[q] = hc[255 - 8 * tx - q]
                                    wl[q] = T.shift_left(T.Cast("uint64", hwh[255 - 8 * tx - q]), T.uint64(32)) | \
                                        T.Cast("uint64", hwl[255 - 8 * tx - q])
                                    above[0] = above[0] + wl[q]
                                own = above[0]
                                M.warp_scan(above, tx)
                                above[0] = above[0] - own + above[2]
                                sel[0] = 256
                                for q in range(8):
                                    if hl[q] > 0 and T.Cast("float64", above[0]) < lim:
                                        sel[0] = 255 - 8 * tx - q
                                        above[2] = above[0]
                                    above[0] = above[0] + wl[q]
                                low[0] = sel[0]
                                M.warp_allreduce(low, _min)
                                if sel[0] == low[0] and sel[0] < 256:
                                    st[0] = T.Cast("int64", cur[0] | T.shift_left(
                                        T.Cast("uint64", sel[0]), T.Cast("uint64", 24 - 8 * level)))
                                    sw[0] = above[2]
                            T.tvm_storage_sync("shared")
                        thr[0] = T.max(thr[0], T.Cast("uint32", st[0]))
                    # min_p, then the draw: warp w sums walk positions [w * cw, (w + 1) * cw), the warp holding
                    # floor(u * total) walks its share in order
                    min_p = T.Cast("float32", params[r, P_MIN_P])
                    cw = ((walk[0] + 31) // 32 + NW - 1) // NW * 32
                    wsum[0] = T.uint64(0)
                    lastv[0] = T.uint64(0)
                    for i in range(cw // 32):
                        if (tx // 32) * cw + i * 32 + tx % 32 < walk[0]:
                            vid[0] = walk_id(walk, cand, (tx // 32) * cw + i * 32 + tx % 32)
                            e = prob_of(keys[r, vid[0]], m, inv_t)
                            if keys[r, vid[0]] >= thr[0] and e >= min_p and weight_of(e, bits) > T.uint64(0):
                                wsum[0] = wsum[0] + weight_of(e, bits)
                                lastv[0] = T.max(lastv[0], T.Cast("uint64", vid[0]) + T.uint64(1))
                    acc[0] = wsum[0]
                    M.block_allreduce(acc, red, _add, tx)  # the kept total
                    M.block_allreduce(lastv, red, _max, tx)  # 1 + the last kept id
                    M.warp_allreduce(wsum, _add)  # this warp's share
                    target = T.Cast("uint64", params[r, P_UNIFORM] * T.Cast("float64", acc[0]))
                    if tx % 32 == 0:
                        red[tx // 32] = wsum[0]
                    T.tvm_storage_sync("shared")
                    if tx == 0:
                        pick = T.alloc_buffer((1,), "int32", scope="local")
                        part = T.alloc_buffer((1,), "uint64", scope="local")
                        pick[0] = NW
                        cnt[0] = T.uint64(0)
                        for w in range(NW):
                            part[0] = red[w]
                            if pick[0] == NW:
                                if cnt[0] + part[0] > target:
                                    pick[0] = w
                                else:
                                    cnt[0] = cnt[0] + part[0]
                        tok[0] = T.Cast("int32", lastv[0]) - 1  # if rounding leaves the target unreached
                        tok[1] = pick[0]
                        sw[1] = cnt[0]
                    T.tvm_storage_sync("shared")
                    pair[0] = tok[1]
                    if tx // 32 == pair[0]:
                        run = T.alloc_buffer((1,), "uint64", scope="local")
                        x = T.alloc_buffer((1,), "uint64", scope="local")
                        found = T.alloc_buffer((1,), "int32", scope="local")
                        first = T.alloc_buffer((1,), "int32", scope="local")  # first lane past the target
                        run[0] = sw[1]
                        found[0] = 0
                        for i in range(cw // 32):
                            x[0] = T.uint64(0)
                            vid[0] = 0
                            if (tx // 32) * cw + i * 32 + tx % 32 < walk[0]:
                                vid[0] = walk_id(walk, cand, (tx // 32) * cw + i * 32 + tx % 32)
                                e = prob_of(keys[r, vid[0]], m, inv_t)
                                if keys[r, vid[0]] >= thr[0] and e >= min_p:
                                    x[0] = weight_of(e, bits)
                            M.warp_scan(x, tx % 32)
                            first[0] = T.Select(found[0] == 0 and run[0] + x[0] > target, tx % 32, 32)
                            M.warp_allreduce(first, _min)
                            if found[0] == 0 and first[0] < 32:
                                found[0] = 1
                                if tx % 32 == first[0]:
                                    tok[0] = vid[0]
                            run[0] = run[0] + _shfl(x[0], 31)
                    T.tvm_storage_sync("shared")
                    if tx == 0:
                        tokens[r] = tok[0]

    return sampler_select


def logprobs(vocab: int, threads: int = 1024):
    NT = threads
    NW = NT // 32
    K = top_logprob_slots(vocab)
    M = _block_macros(NT)

    @T.prim_func
    def sampler_logprobs(var_logits: T.handle, var_keys: T.handle, var_params: T.handle, var_tokens: T.handle,
                         var_lp: T.handle, var_rank: T.handle, var_ids: T.handle, var_lps: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(var_logits, (n, vocab), "float32")
        keys = T.match_buffer(var_keys, (n, vocab), "uint32")
        params = T.match_buffer(var_params, (n, NUM_PARAMS), "float64")
        tokens = T.match_buffer(var_tokens, (n,), "int32")
        token_lp = T.match_buffer(var_lp, (n,), "float32")
        rank = T.match_buffer(var_rank, (n,), "int32")
        top_ids = T.match_buffer(var_ids, (n, K), "int32")
        top_lp = T.match_buffer(var_lps, (n, K), "float32")
        for r in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                hc = T.alloc_buffer((256,), "int32", scope="shared")
                st = T.alloc_buffer((4,), "int64", scope="shared")
                red = T.alloc_buffer((NW,), "uint64", scope="shared")
                redf = T.alloc_buffer((NW,), "float64", scope="shared")
                gk = T.alloc_buffer((K,), "uint32", scope="shared")
                gi = T.alloc_buffer((K,), "int32", scope="shared")
                gcnt = T.alloc_buffer((1,), "int32", scope="shared")
                acc = T.alloc_buffer((1,), "uint64", scope="local")
                cnt = T.alloc_buffer((1,), "uint64", scope="local")
                se = T.alloc_buffer((1,), "float64", scope="local")
                sel = T.alloc_buffer((4,), "int64", scope="local")  # K-th key, count above, count at, id limit
                slot = T.alloc_buffer((1,), "int32", scope="local")
                if tx < K:
                    top_ids[r, tx] = -1
                    top_lp[r, tx] = T.float32(0)
                if tx == 0:
                    token_lp[r] = T.float32(0)
                    rank[r] = 0
                if uniform(has_flag(params, r, F_LOGPROBS) and tokens[r] >= 0):
                    proc = has_flag(params, r, F_LP_PROCESSED)
                    t = params[r, P_TEMPERATURE]
                    div = T.Select(proc and t != T.float64(0) and t != T.float64(1), t, T.float64(1))
                    tk = src_key(logits, keys, r, proc, tokens[r])
                    acc[0] = T.uint64(0)
                    for i in range((vocab + NT - 1) // NT):
                        if i * NT + tx < vocab:
                            acc[0] = T.max(acc[0], T.Cast("uint64", src_key(logits, keys, r, proc, i * NT + tx)))
                    M.block_allreduce(acc, red, _max, tx)
                    m = T.Cast("float64", value_of(T.Cast("uint32", acc[0]))) / div
                    se[0] = T.float64(0)
                    cnt[0] = T.uint64(0)
                    for i in range((vocab + NT - 1) // NT):
                        if i * NT + tx < vocab:
                            key = src_key(logits, keys, r, proc, i * NT + tx)
                            se[0] = se[0] + T.Cast("float64", T.exp(
                                T.Cast("float32", T.Cast("float64", value_of(key)) / div - m)))
                            if key > tk:
                                cnt[0] = cnt[0] + T.uint64(1)
                    M.block_allreduce(se, redf, _add, tx)
                    M.block_allreduce(cnt, red, _add, tx)
                    lse = T.Select(acc[0] > T.uint64(KEY_NEG_INF) and acc[0] < T.uint64(KEY_POS_INF),
                                   m + T.log(se[0]), m)
                    # the K most likely: the K-th largest key, ties at it -> the lowest ids (a second radix
                    # select over ~id among the tied keys)
                    M.radix_kth(lambda v: src_key(logits, keys, r, proc, v), lambda v: T.bool(True), vocab, K,
                                hc, st, tx)
                    sel[0] = st[0]
                    sel[1] = st[1]
                    sel[2] = st[2]
                    sel[3] = T.int64(vocab)
                    T.tvm_storage_sync("shared")
                    if uniform(sel[1] + sel[2] > T.int64(K)):
                        M.radix_kth(lambda v: u32(FULL) - T.Cast("uint32", v),
                                    lambda v: T.EQ(src_key(logits, keys, r, proc, v), T.Cast("uint32", sel[0])),
                                    vocab, T.int64(K) - sel[1], hc, st, tx)
                        sel[3] = T.int64(FULL) - st[0]
                    if tx == 0:
                        gcnt[0] = 0
                    T.tvm_storage_sync("shared")
                    for i in range((vocab + NT - 1) // NT):
                        if i * NT + tx < vocab:
                            key = src_key(logits, keys, r, proc, i * NT + tx)
                            if key > T.Cast("uint32", sel[0]) or \
                                    key == T.Cast("uint32", sel[0]) and T.Cast("int64", i * NT + tx) <= sel[3]:
                                slot[0] = T.cuda.atomic_add(T.address_of(gcnt[0]), 1)
                                gk[slot[0]] = key
                                gi[slot[0]] = i * NT + tx
                    T.tvm_storage_sync("shared")
                    if tx == 0:
                        lk = T.alloc_buffer((K,), "uint32", scope="local")
                        li = T.alloc_buffer((K,), "int32", scope="local")
                        ins = T.alloc_buffer((3,), "int32", scope="local")
                        for j in range(K):
                            lk[j] = gk[j]
                            li[j] = gi[j]
                        for a in range(1, K):  # insertion sort: key descending, id ascending
                            ins[0] = a
                            for b in range(a):
                                if ins[0] > 0:
                                    if lk[ins[0]] > lk[ins[0] - 1] or \
                                            lk[ins[0]] == lk[ins[0] - 1] and li[ins[0]] < li[ins[0] - 1]:
                                        ins[1] = li[ins[0]]
                                        li[ins[0]] = li[ins[0] - 1]
                                        li[ins[0] - 1] = ins[1]
                                        pfx = lk[ins[0]]
                                        lk[ins[0]] = lk[ins[0] - 1]
                                        lk[ins[0] - 1] = pfx
                                        ins[0] = ins[0] - 1
                                    else:
                                        ins[0] = 0
                        token_lp[r] = T.Cast("float32", T.Cast("float64", value_of(tk)) / div - lse)
                        rank[r] = T.Cast("int32", cnt[0]) + 1
                        for j in range(K):
                            top_ids[r, j] = li[j]
                            top_lp[r, j] = T.Cast("float32", T.Cast("float64", value_of(lk[j])) / div - lse)

    return sampler_logprobs


def append(vocab: int):
    @T.prim_func
    def sampler_append(var_tokens: T.handle, var_params: T.handle, var_counts: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        lanes = T.int64()
        tokens = T.match_buffer(var_tokens, (n,), "int32")
        params = T.match_buffer(var_params, (n, NUM_PARAMS), "float64")
        counts = T.match_buffer(var_counts, (lanes, vocab), "int32")
        for b in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                if tx == 0:  # rows one after the other: lanes may repeat
                    append_rows(n, tokens, params, counts)

    return sampler_append


def counts_add(vocab: int):
    @T.prim_func
    def sampler_counts_add_kernel(var_lanes: T.handle, var_tokens: T.handle, var_delta: T.handle,
                                  var_counts: T.handle):
        T.func_attr({"tirx.noalias": True})
        m = T.int64()
        lanes = T.int64()
        lane_ids = T.match_buffer(var_lanes, (m,), "int32")
        tokens = T.match_buffer(var_tokens, (m,), "int32")
        delta = T.match_buffer(var_delta, (m,), "int32")
        counts = T.match_buffer(var_counts, (lanes, vocab), "int32")
        for b in T.thread_binding(1, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                if tx == 0:
                    for i in range(m):
                        counts[lane_ids[i], tokens[i]] = counts[lane_ids[i], tokens[i]] + delta[i]

    return sampler_counts_add_kernel


def sampler_kernels(vocab: int, threads: int = 1024, process_threads: int = 256) -> SimpleNamespace:
    return SimpleNamespace(process=process(vocab, process_threads), select=select(vocab, threads),
                           logprobs=logprobs(vocab, threads), append=append(vocab), counts_add=counts_add(vocab))
