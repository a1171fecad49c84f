"""The llvm fast paths on their own: the SIMD exp, the tiled matmul schedule (bit-identical to the
plain loop nest) and the blocked paged attention against numpy on a ragged batch whose token
blocks mix sequences and cross pages."""
import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from ninfer_mlc.compile.cpu_pipeline import schedule_matmul
from ninfer_mlc.compile.kernels.attention import QUERY_BLOCK, exp_nonpos, paged_attention

LLVM = tvm.target.Target({"kind": "llvm"})


def _build(func):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=LLVM)["main"]


def test_exp_nonpos_matches_expf():
    @T.prim_func
    def f(x: T.Buffer((4096,), "float32"), y: T.Buffer((4096,), "float32")):
        for i0 in range(512):
            for l in T.vectorized(8):
                y[i0 * 8 + l] = exp_nonpos(x[i0 * 8 + l])

    x = np.concatenate([np.linspace(-87.0, 0.0, 4000), [0.0, -1e-8, -0.5, -0.6931472, -86.9, -200.0, 3.0]])
    x = np.pad(x, (0, 4096 - len(x))).astype(np.float32)
    y = tvm.runtime.tensor(np.zeros(4096, np.float32))
    _build(f)(tvm.runtime.tensor(x), y)
    ref = np.exp(np.minimum(np.maximum(x.astype(np.float64), -87.0), 0.0))
    rel = np.abs(y.numpy() - ref) / ref
    assert rel.max() < 2e-7


@T.prim_func(s_tir=True)
def _matmul(a: T.handle, w: T.Buffer((64, 12), "float32"), c: T.handle):
    T.func_attr({"tirx.noalias": True})
    n = T.int64()
    A = T.match_buffer(a, (n, 64), "float32")
    C = T.match_buffer(c, (n, 12), "float32")
    for i0, i1, k in T.grid(n, 12, 64):
        with T.sblock("matmul"):
            vi, vj, vk = T.axis.remap("SSR", [i0, i1, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * w[vk, vj]


def test_matmul_schedule_is_bit_identical_on_ragged_shapes():
    tiled = schedule_matmul(_matmul)
    assert tiled is not None and "parallel" in tiled.script() and "vectorized" in tiled.script()
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 12)).astype(np.float32)
    for rows in (1, 5, 37):  # not multiples of the 4-row tile; 12 columns -> 4 lanes
        a = rng.standard_normal((rows, 64)).astype(np.float32)
        out = []
        for f in (_matmul, tiled):
            c = tvm.runtime.tensor(np.zeros((rows, 12), np.float32))
            _build(f)(tvm.runtime.tensor(a), tvm.runtime.tensor(w), c)
            out.append(c.numpy())
        assert np.array_equal(out[0], out[1])
        np.testing.assert_allclose(out[1], a @ w, rtol=1e-5, atol=1e-5)


def _attention_ref(q, pool, pos, tseq, pt, layer, group, scale, page):
    n, hq, d = q.shape
    out = np.zeros_like(q)
    for i in range(n):
        keys = np.arange(pos[i] + 1)
        pages = pt[tseq[i], keys // page]
        for h in range(hq):
            k = pool[pages, layer, 0, h // group, keys % page]
            v = pool[pages, layer, 1, h // group, keys % page]
            s = (k.astype(np.float64) @ q[i, h]) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p @ v) / p.sum()
    return out


def test_blocked_attention_matches_numpy_on_a_ragged_batch():
    hq, hkv, d, page, layers, scale = 4, 2, 64, 64, 2, 0.125
    rng = np.random.default_rng(2)
    # two sequences: 37 tokens continuing at position 100 (crossing a page), then 5 tokens at 3;
    # the second 16-token block holds tokens of both
    lens, starts = (37, 5), (100, 3)
    n = sum(lens)
    assert QUERY_BLOCK < lens[0] < 3 * QUERY_BLOCK
    pos = np.concatenate([np.arange(s, s + m) for s, m in zip(starts, lens)]).astype(np.int32)
    tseq = np.repeat(np.arange(2), lens).astype(np.int32)
    npages = 8
    pt = np.array([[5, 2, 7], [1, 0, 0]], np.int32)
    pool = rng.standard_normal((npages, layers, 2, hkv, page, d)).astype(np.float32)
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    expect_pool = pool.copy()
    for i in range(n):
        pg, off = pt[tseq[i], pos[i] // page], pos[i] % page
        expect_pool[pg, 1, 0, :, off], expect_pool[pg, 1, 1, :, off] = k[i], v[i]
    ref = _attention_ref(q, expect_pool, pos, tseq, pt, 1, hq // hkv, scale, page)
    f = _build(paged_attention(hq, hkv, d, page, layers, "float32", scale))
    pool_t = tvm.runtime.tensor(pool)
    out = tvm.runtime.tensor(np.zeros_like(q))
    f(*(tvm.runtime.tensor(x) for x in (q, k, v, pos, tseq, pt)), pool_t, 1, out)
    np.testing.assert_array_equal(pool_t.numpy(), expect_pool)
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("n", [1, 3])
def test_blocked_attention_decode_rows(n):
    """Decode shape: one token per sequence, the block holding rows of different sequences."""
    hq, hkv, d, page, scale = 4, 2, 64, 64, 0.125
    rng = np.random.default_rng(3)
    pos = np.array([70, 0, 130][:n], np.int32)
    tseq = np.arange(n, dtype=np.int32)
    pt = np.array([[0, 1, 2], [3, 0, 0], [4, 5, 6]], np.int32)[:n]
    pool = rng.standard_normal((7, 1, 2, hkv, page, d)).astype(np.float32)
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    exp_pool = pool.copy()
    for i in range(n):
        exp_pool[pt[i, pos[i] // page], 0, 0, :, pos[i] % page] = k[i]
        exp_pool[pt[i, pos[i] // page], 0, 1, :, pos[i] % page] = v[i]
    out = tvm.runtime.tensor(np.zeros_like(q))
    _build(paged_attention(hq, hkv, d, page, 1, "float32", scale))(
        *(tvm.runtime.tensor(x) for x in (q, k, v, pos, tseq, pt)), tvm.runtime.tensor(pool), 0, out)
    np.testing.assert_allclose(out.numpy(), _attention_ref(q, exp_pool, pos, tseq, pt, 0, 2, scale, page),
                               rtol=2e-5, atol=2e-6)
