"""Token sampling compiled into the model library (portable llvm kernels; CUDA: kernels/cuda/sampling.py).

The semantics are runtime/sampling.py's (the reference), computed where the logits are so only token ids
and requested logprobs leave the device. The calling convention (row-parameter table, flags, per-lane
penalty buffers) is ninfer_mlc/contract/sampler_abi.py. The prim_funcs:

  process(logits[n, V] f32, params[n, P] f64, mask[n, W] i32, counts[L, V] i32, prompt[L, W] i32,
          bias[L, V] f32, keys[n, V] u32)
      logit_bias -> repetition penalty (prompt bits | counts > 0) -> frequency / presence penalty (counts),
      with numpy's roundings, then the orderable key of each processed logit; masked tokens get key 0.
  select(keys, params, tokens[n] i32)
      greedy / non-finite max: argmax (lowest id on ties; -1 when every token is masked). Otherwise
      top_k: the k-th largest key by radix select (4 x 8 bits), kept: key >= it (ties kept, as HF);
      weights e = exp((x - max) / T) in fixed point (sampler_abi.weight_bits: integer sums are exact and
      order-free, so a row draws the same token on any thread count); top_p: the smallest key whose mass
      strictly above is < top_p of the kept mass, by a weighted radix select (exact, no sort);
      min_p: e >= min_p (p >= min_p * p_max of the renormalised distribution, p_max being e = 1);
      one inverse-CDF draw: the first kept id (ascending) whose inclusive prefix mass exceeds
      floor(u * total). After top_k the <= CAND_CAP candidates are gathered first, so the later passes
      run over them instead of the vocabulary. top_p alone first probes the CAND_CAP largest keys: when
      they hold top_p of the mass the nucleus is among them (every other key has at least that mass
      above it), otherwise the passes walk the vocabulary.
  logprobs(logits, keys, params, tokens, token_lp[n] f32, rank[n] i32, top_ids[n, K] i32, top_lp[n, K] f32)
      log-softmax of the raw logits (or, with F_LP_PROCESSED, of the processed ones / temperature): the
      sampled token's logprob and rank, and the K most likely (ties -> lower id). Rows without F_LOGPROBS
      are skipped.
  append(tokens, params, counts) / counts_add(lanes, tokens, delta, counts): the lanes' generated-token counts.
"""
from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

from ...contract.sampler_abi import (F_APPEND, F_BIAS, F_FREQ_PRES, F_LOGPROBS, F_LP_PROCESSED, F_MASK, F_REPETITION,
                                    KEY_NEG_INF, KEY_POS_INF, NUM_PARAMS, P_FLAGS, P_FREQUENCY, P_LANE, P_MIN_P,
                                    P_PRESENCE, P_REPETITION, P_TEMPERATURE, P_TOP_K, P_TOP_P, P_UNIFORM, mask_words,
                                    top_logprob_slots, weight_bits)

CAND_CAP = 1024  # candidates gathered after top_k (more, e.g. massive ties: the passes stay on the vocabulary)
SMALL_K = 64  # top_k up to this: one scan keeping the k largest keys instead of the radix select (llvm)
CHUNK = 64  # the scan skips chunks of keys whose max (a vectorised reduction) cannot enter the list


# ---- expressions shared with the CUDA kernels ------------------------------------------------------------
def u32(v: int):
    return T.uint32(v)


def key_of(x):
    """Orderable uint32 key of a float32: NaN ranks as -inf, -0 as +0 (sampling.py's comparisons)."""
    b = T.reinterpret("uint32", x)
    a = b & u32(0x7FFFFFFF)
    c = T.Select(a > u32(0x7F800000), u32(0xFF800000), T.Select(a == u32(0), u32(0), b))
    return T.Select(c >= u32(0x80000000), c ^ u32(0xFFFFFFFF), c | u32(0x80000000))


def value_of(key):
    """The float32 of a key (key_of's inverse; only meaningful above MASKED_KEY)."""
    return T.reinterpret("float32", T.Select(key >= u32(0x80000000), key & u32(0x7FFFFFFF), key ^ u32(0xFFFFFFFF)))


def prob_of(key, m, inv_t):
    """Unnormalised probability exp((x - max) / T) in float32; 0 for -inf and masked tokens."""
    return T.Select(key > u32(KEY_NEG_INF), T.exp((value_of(key) - m) * inv_t), T.float32(0))


def weight_of(e, bits: int):
    """Fixed-point weight of a probability e <= 1 (uint64, `bits` fraction bits)."""
    return T.Cast("uint64", e * T.float32(2.0 ** bits))


def bit_set(words, row, v):
    """Bit v of an xgrammar-layout int32 bitmask row."""
    return T.EQ(T.shift_right(words[row, v // 32], T.Cast("int32", v % 32)) & 1, 1)


def src_key(logits, keys, r, proc, v):
    """Key of a logprob source: the processed logits (masked -> -inf) or the raw ones."""
    return T.if_then_else(proc, T.max(keys[r, v], u32(KEY_NEG_INF)), key_of(logits[r, v]))


def level_mask(level):
    """High bits fixed before radix level `level` (0..3, 8 bits per level)."""
    return (u32(0xFFFFFFFF) >> T.Cast("uint32", 8 * level)) ^ u32(0xFFFFFFFF)


def level_shift(level):
    return T.Cast("uint32", 24 - 8 * level)


def param_int(params, r, col):
    return T.Cast("int32", params[r, col])


def has_flag(params, r, flag: int):
    return T.bitwise_and(param_int(params, r, P_FLAGS), flag) > 0


def repetition_penalized(x, rp, fdiv):
    """HF / llama.cpp repetition penalty of a float32 logit (rp: float64): negative ones multiplied."""
    return T.Select(x < T.float32(0), x * T.Cast("float32", rp), fdiv(x, T.Cast("float32", rp)))


def count_penalized(x, count, freq, pres, dmul):
    """OpenAI frequency / presence penalty in float64 (numpy's x.astype(f64) - (count * freq + pres))."""
    return T.Cast("float32", T.Cast("float64", x) - (dmul(T.Cast("float64", count), freq) + pres))


def seen(prompt, counts, lane, v):
    """Token v occurs in the lane's prompt or generated tokens (repetition penalty's set)."""
    return T.Or(bit_set(prompt, lane, v), counts[lane, v] > 0)


def masked(params, mask, r, v):
    return T.And(has_flag(params, r, F_MASK), T.Not(bit_set(mask, r, v)))


@T.macro
def chunk_max_into(dst, keys, r, c, vocab: int):
    """dst[0] = max of keys[r, c*CHUNK : (c+1)*CHUNK] (the tail clamped to the last key)."""
    dst[0] = u32(0)
    for i in range(CHUNK):
        dst[0] = T.max(dst[0], keys[r, T.min(c * CHUNK + i, vocab - 1)])


@T.macro
def top_insert(tk, ti, st, key, v, k, cap: int):
    """Keep tk[:k] (cap >= k slots) the k largest keys seen so far, descending; an equal key never displaces an
    earlier one (ids ascend in the scan: ties go to the lower id). ti: their ids (or None); st: int32 [2]
    local (filled slots, insert position). Few keys are inserted after the first k: the scan stays cheap."""
    if st[0] < k or key > tk[k - 1]:
        st[1] = 0
        for j in range(cap):
            if j < st[0] and tk[j] >= key:
                st[1] = st[1] + 1
        for jj in range(cap - 1):
            if cap - 1 - jj > st[1] and cap - 1 - jj <= st[0] and cap - 1 - jj < k:
                tk[cap - 1 - jj] = tk[cap - 2 - jj]
                if ti is not None:
                    ti[cap - 1 - jj] = ti[cap - 2 - jj]
        tk[st[1]] = key
        if ti is not None:
            ti[st[1]] = v
        st[0] = T.min(st[0] + 1, k)


@T.macro
def append_rows(n, tokens, params, counts):
    """counts[lane, token] += 1 for rows with F_APPEND, one row after the other (lanes may repeat)."""
    for r in range(n):
        if has_flag(params, r, F_APPEND) and tokens[r] >= 0:
            counts[param_int(params, r, P_LANE), tokens[r]] = counts[param_int(params, r, P_LANE), tokens[r]] + 1


def _f32(bits):
    return T.reinterpret("float32", bits)


def _bits(x):
    return T.reinterpret("uint32", x)


def _fmul_exact(a, b):
    # the product through a bit cast, so TVM's codegen cannot fuse it with the following add (llvm.fmuladd)
    return T.reinterpret("float64", T.reinterpret("uint64", a * b))


def process(vocab: int):
    """One stage per loop, flags tested per row (the loops stay branch-light and vectorise); the keys buffer
    holds the float32 bits of the processed logits until the last stage turns them into keys."""
    W = mask_words(vocab)

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
        for r in T.parallel(n):
            if has_flag(params, r, F_BIAS):
                for v in range(vocab):
                    keys[r, v] = _bits(logits[r, v] + bias[param_int(params, r, P_LANE), v])
            else:
                for v in range(vocab):
                    keys[r, v] = _bits(logits[r, v])
            if has_flag(params, r, F_REPETITION):
                for v in range(vocab):
                    if seen(prompt, counts, param_int(params, r, P_LANE), v):
                        keys[r, v] = _bits(repetition_penalized(_f32(keys[r, v]), params[r, P_REPETITION],
                                                                lambda a, b: a / b))
            if has_flag(params, r, F_FREQ_PRES):
                for v in range(vocab):
                    if counts[param_int(params, r, P_LANE), v] > 0:
                        keys[r, v] = _bits(count_penalized(_f32(keys[r, v]), counts[param_int(params, r, P_LANE), v],
                                                           params[r, P_FREQUENCY], params[r, P_PRESENCE], _fmul_exact))
            if has_flag(params, r, F_MASK):
                for v in range(vocab):
                    keys[r, v] = T.Select(bit_set(mask, r, v), key_of(_f32(keys[r, v])), u32(0))
            else:
                for v in range(vocab):
                    keys[r, v] = key_of(_f32(keys[r, v]))

    return sampler_process


def select(vocab: int):
    bits = weight_bits(vocab)
    cap = min(CAND_CAP, vocab)

    chunks = (vocab + CHUNK - 1) // CHUNK

    def small_k(params, r):
        """top_k on and at most SMALL_K (and below the vocabulary)."""
        k = param_int(params, r, P_TOP_K)
        return T.And(k > 0, T.And(k <= SMALL_K, k < vocab))

    # (TVM's llvm backend allocates an assigned scalar where it is declared: no assignments inside loops,
    # per-element values go through the row's scratch buffers)
    @T.prim_func
    def sampler_select(var_keys: T.handle, var_params: T.handle, var_tokens: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        keys = T.match_buffer(var_keys, (n, vocab), "uint32")
        params = T.match_buffer(var_params, (n, NUM_PARAMS), "float64")
        tokens = T.match_buffer(var_tokens, (n,), "int32")
        for r in T.parallel(n):
            hc = T.alloc_buffer((256,), "int32", scope="local")  # radix digit counts
            h0 = T.alloc_buffer((256,), "int32", scope="local")  # the first level's, from the argmax pass
            hw = T.alloc_buffer((256,), "uint64", scope="local")  # radix digit weights
            cand = T.alloc_buffer((cap,), "int32", scope="local")  # gathered candidate ids, ascending
            ku = T.alloc_buffer((5,), "uint32", scope="local")  # best key, threshold, radix prefix, digit, key
            # best id, count, rank left, done, drawn, id, ids to walk, gathered?, unmasked count, total known?
            ki = T.alloc_buffer((10,), "int32", scope="local")
            kw = T.alloc_buffer((6,), "uint64", scope="local")  # total, mass above, running, above(sel), weight, target
            kf = T.alloc_buffer((3,), "float32", scope="local")  # max logit, 1 / T, min_p
            kd = T.alloc_buffer((1,), "float64", scope="local")  # top_p mass limit
            pe = T.alloc_buffer((vocab,), "float32")  # probability of each walk position (one exp per id)
            tk = T.alloc_buffer((SMALL_K,), "uint32", scope="local")  # the k largest keys (small top_k)
            ks = T.alloc_buffer((2,), "int32", scope="local")
            cm = T.alloc_buffer((1,), "uint32", scope="local")  # a chunk's max key
            # argmax (lowest id on ties), the number of unmasked tokens and, for sampled rows, the first radix
            # level's histogram (top 8 key bits)
            ku[0] = u32(0)
            ki[0] = 0
            ki[1] = 0
            for d in range(256):
                h0[d] = 0
            for v in range(vocab):
                if keys[r, v] > ku[0]:
                    ku[0] = keys[r, v]
                    ki[0] = v
                if keys[r, v] > u32(0):
                    ki[1] = ki[1] + 1
                if params[r, P_TEMPERATURE] != T.float64(0) and not small_k(params, r):  # loop-invariant
                    h0[T.Cast("int32", keys[r, v] >> u32(24))] = h0[T.Cast("int32", keys[r, v] >> u32(24))] + 1
            if ku[0] == u32(0):
                tokens[r] = -1  # every token masked
            elif params[r, P_TEMPERATURE] == T.float64(0) or ku[0] >= u32(KEY_POS_INF) or ku[0] <= u32(KEY_NEG_INF):
                tokens[r] = ki[0]
            else:
                ki[8] = ki[1]
                ki[9] = 0
                kf[0] = value_of(ku[0])
                kf[1] = T.Cast("float32", T.float64(1) / params[r, P_TEMPERATURE])
                kf[2] = T.Cast("float32", params[r, P_MIN_P])
                ku[1] = u32(1)
                if small_k(params, r):
                    # the k largest keys in one scan; how many keys reach the k-th is counted by the gather
                    ks[0] = 0
                    for c in range(chunks):
                        chunk_max_into(cm, keys, r, c, vocab)
                        if ks[0] < param_int(params, r, P_TOP_K) or cm[0] > tk[param_int(params, r, P_TOP_K) - 1]:
                            for i in range(CHUNK):
                                if c * CHUNK + i < vocab:
                                    top_insert(tk, None, ks, keys[r, c * CHUNK + i], c * CHUNK + i,
                                               param_int(params, r, P_TOP_K), SMALL_K)
                    ku[1] = tk[param_int(params, r, P_TOP_K) - 1]
                    ki[1] = cap
                # top_k: the k-th largest key. top_p alone: probe the cap-th largest instead; if the keys above it
                # hold top_p of the mass, the nucleus is among them (any other key has at least that mass above)
                elif param_int(params, r, P_TOP_K) > 0 and param_int(params, r, P_TOP_K) < vocab \
                        or params[r, P_TOP_P] < T.float64(1) and ki[8] > cap:
                    # radix select; ki[1] becomes count(key >= it)
                    ku[2] = u32(0)
                    ki[2] = T.Select(param_int(params, r, P_TOP_K) > 0 and param_int(params, r, P_TOP_K) < vocab,
                                     param_int(params, r, P_TOP_K), cap)
                    ki[1] = 0
                    for level in range(4):
                        for d in range(256):
                            hc[d] = T.Select(level == 0, h0[d], 0)
                        if level > 0:
                            for v in range(vocab):
                                if keys[r, v] & level_mask(level) == ku[2]:
                                    ki[5] = T.Cast("int32", (keys[r, v] >> level_shift(level)) & u32(255))
                                    hc[ki[5]] = hc[ki[5]] + 1
                        ki[3] = 0
                        for dd in range(256):
                            if ki[3] == 0:
                                if hc[255 - dd] >= ki[2]:
                                    ku[2] = ku[2] | (T.Cast("uint32", 255 - dd) << level_shift(level))
                                    ki[3] = 1
                                    if level == 3:
                                        ki[1] = ki[1] + hc[255 - dd]
                                else:
                                    ki[2] = ki[2] - hc[255 - dd]
                                    ki[1] = ki[1] + hc[255 - dd]
                    ku[1] = ku[2]
                    if not (param_int(params, r, P_TOP_K) > 0 and param_int(params, r, P_TOP_K) < vocab):
                        kw[0] = T.uint64(0)  # the vocabulary's mass, and the probe's
                        kw[1] = T.uint64(0)
                        for v in range(vocab):
                            kw[4] = weight_of(prob_of(keys[r, v], kf[0], kf[1]), bits)
                            kw[0] = kw[0] + kw[4]
                            kw[1] = kw[1] + T.Select(keys[r, v] >= ku[1], kw[4], T.uint64(0))
                        ki[9] = 1
                        if ki[1] > cap or T.Cast("float64", kw[1]) < params[r, P_TOP_P] * T.Cast("float64", kw[0]):
                            ku[1] = u32(1)  # the probe failed: walk the vocabulary
                            ki[1] = ki[8]
                # gather the candidates when few (ascending ids); the passes below walk ki[6] ids
                ki[6] = vocab
                ki[7] = 0
                if ki[1] <= cap:
                    ki[6] = 0
                    ki[7] = 1
                    for v in range(vocab):
                        if keys[r, v] >= ku[1]:
                            cand[T.min(ki[6], cap - 1)] = v
                            ki[6] = ki[6] + 1
                    if ki[6] > cap:  # more ties than slots (small-k scan): walk the vocabulary
                        ki[6] = vocab
                        ki[7] = 0
                if ki[9] == 0:
                    kw[0] = T.uint64(0)
                for j in range(ki[6]):
                    ki[5] = T.Select(ki[7] == 1, cand[T.min(j, cap - 1)], j)
                    pe[j] = T.Select(keys[r, ki[5]] >= ku[1], prob_of(keys[r, ki[5]], kf[0], kf[1]), T.float32(0))
                    if ki[9] == 0:
                        kw[0] = kw[0] + weight_of(pe[j], bits)
                if params[r, P_TOP_P] < T.float64(1):
                    # weighted radix select: the smallest key whose mass strictly above is < top_p * total
                    kd[0] = params[r, P_TOP_P] * T.Cast("float64", kw[0])
                    ku[2] = u32(0)
                    kw[1] = T.uint64(0)
                    for level in range(4):
                        for d in range(256):
                            hc[d] = 0
                            hw[d] = T.uint64(0)
                        for j in range(ki[6]):
                            ki[5] = T.Select(ki[7] == 1, cand[T.min(j, cap - 1)], j)
                            ku[4] = keys[r, ki[5]]
                            if ku[4] >= ku[1] and ku[4] & level_mask(level) == ku[2]:
                                kw[4] = weight_of(pe[j], bits)
                                if kw[4] > T.uint64(0):
                                    ki[5] = T.Cast("int32", (ku[4] >> level_shift(level)) & u32(255))
                                    hc[ki[5]] = hc[ki[5]] + 1
                                    hw[ki[5]] = hw[ki[5]] + kw[4]
                        kw[2] = kw[1]
                        ki[3] = 0
                        for dd in range(256):
                            if ki[3] == 0 and hc[255 - dd] > 0:
                                if T.Cast("float64", kw[2]) < kd[0]:
                                    ku[3] = T.Cast("uint32", 255 - dd)
                                    kw[3] = kw[2]
                                    kw[2] = kw[2] + hw[255 - dd]
                                else:
                                    ki[3] = 1
                        ku[2] = ku[2] | (ku[3] << level_shift(level))
                        kw[1] = kw[3]
                    ku[1] = T.max(ku[1], ku[2])
                # min_p, then one inverse-CDF draw over the kept ids in ascending order
                kw[0] = T.uint64(0)
                for j in range(ki[6]):
                    ki[5] = T.Select(ki[7] == 1, cand[T.min(j, cap - 1)], j)
                    if keys[r, ki[5]] >= ku[1] and pe[j] >= kf[2]:
                        kw[0] = kw[0] + weight_of(pe[j], bits)
                kw[5] = T.Cast("uint64", params[r, P_UNIFORM] * T.Cast("float64", kw[0]))
                kw[2] = T.uint64(0)
                ki[3] = 0
                for j in range(ki[6]):
                    ki[5] = T.Select(ki[7] == 1, cand[T.min(j, cap - 1)], j)
                    if ki[3] == 0 and keys[r, ki[5]] >= ku[1]:
                        kw[4] = weight_of(pe[j], bits)
                        if pe[j] >= kf[2] and kw[4] > T.uint64(0):
                            kw[2] = kw[2] + kw[4]
                            ki[4] = ki[5]
                            if kw[2] > kw[5]:
                                ki[3] = 1
                tokens[r] = ki[4]  # the last kept id when rounding left the target unreached

    return sampler_select


def logprobs(vocab: int):
    K = top_logprob_slots(vocab)

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
        for r in T.parallel(n):
            tk = T.alloc_buffer((K,), "uint32", scope="local")  # top keys, descending (ties: ascending ids)
            ti = T.alloc_buffer((K,), "int32", scope="local")
            ku = T.alloc_buffer((3,), "uint32", scope="local")  # max key, key, sampled token's key
            ki = T.alloc_buffer((4,), "int32", scope="local")  # filled slots, rank, insert position, processed?
            kd = T.alloc_buffer((4,), "float64", scope="local")  # divisor (temperature or 1), max, sum, lse
            for j in range(K):
                top_ids[r, j] = -1
                top_lp[r, j] = T.float32(0)
            token_lp[r] = T.float32(0)
            rank[r] = 0
            if has_flag(params, r, F_LOGPROBS) and tokens[r] >= 0:
                ki[3] = T.Select(has_flag(params, r, F_LP_PROCESSED), 1, 0)
                kd[0] = T.Select(ki[3] == 1 and params[r, P_TEMPERATURE] != T.float64(0)
                                 and params[r, P_TEMPERATURE] != T.float64(1), params[r, P_TEMPERATURE], T.float64(1))
                ku[0] = u32(0)
                ki[0] = 0
                for v in range(vocab):
                    ku[1] = src_key(logits, keys, r, ki[3] == 1, v)
                    ku[0] = T.max(ku[0], ku[1])
                    if ki[0] < K or ku[1] > tk[K - 1]:
                        # insert into the sorted list; entries with an equal key (lower ids) stay ahead
                        ki[2] = 0
                        for j in range(K):
                            if j < ki[0] and tk[j] >= ku[1]:
                                ki[2] = ki[2] + 1
                        for jj in range(K - 1):
                            if K - 1 - jj > ki[2] and K - 1 - jj <= ki[0]:
                                tk[K - 1 - jj] = tk[K - 2 - jj]
                                ti[K - 1 - jj] = ti[K - 2 - jj]
                        tk[ki[2]] = ku[1]
                        ti[ki[2]] = v
                        ki[0] = T.min(ki[0] + 1, K)
                kd[1] = T.Cast("float64", value_of(ku[0])) / kd[0]
                kd[2] = T.float64(0)
                ku[2] = src_key(logits, keys, r, ki[3] == 1, tokens[r])
                ki[1] = 1
                for v in range(vocab):
                    ku[1] = src_key(logits, keys, r, ki[3] == 1, v)
                    kd[2] = kd[2] + T.exp(T.Cast("float64", value_of(ku[1])) / kd[0] - kd[1])
                    if ku[1] > ku[2]:
                        ki[1] = ki[1] + 1
                kd[3] = T.Select(ku[0] > u32(KEY_NEG_INF) and ku[0] < u32(KEY_POS_INF), kd[1] + T.log(kd[2]), kd[1])
                token_lp[r] = T.Cast("float32", T.Cast("float64", value_of(ku[2])) / kd[0] - kd[3])
                rank[r] = ki[1]
                for j in range(K):
                    top_ids[r, j] = ti[j]
                    top_lp[r, j] = T.Cast("float32", T.Cast("float64", value_of(tk[j])) / kd[0] - kd[3])

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
        append_rows(n, tokens, params, counts)

    return sampler_append


def counts_add(vocab: int):
    @T.prim_func
    def sampler_counts_add_kernel(var_lanes: T.handle, var_tokens: T.handle, var_delta: T.handle, var_counts: T.handle):
        T.func_attr({"tirx.noalias": True})
        m = T.int64()
        lanes = T.int64()
        lane_ids = T.match_buffer(var_lanes, (m,), "int32")
        tokens = T.match_buffer(var_tokens, (m,), "int32")
        delta = T.match_buffer(var_delta, (m,), "int32")
        counts = T.match_buffer(var_counts, (lanes, vocab), "int32")
        for i in range(m):
            counts[lane_ids[i], tokens[i]] = counts[lane_ids[i], tokens[i]] + delta[i]

    return sampler_counts_add_kernel


def sampler_kernels(vocab: int) -> SimpleNamespace:
    return SimpleNamespace(process=process(vocab), select=select(vocab), logprobs=logprobs(vocab),
                           append=append(vocab), counts_add=counts_add(vocab))
