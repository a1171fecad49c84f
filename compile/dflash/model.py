"""DFlash / DFlash2 drafters in tvm.relax.frontend.nn (semantics of the PyPI `dflash` package).

The drafter has no embedding and no lm_head: `draft` takes the target's embedding table and lm_head
as arguments (the same device tensors the target uses, so nothing is duplicated). Exported:

  ctx(taps[n, T*D], positions[n], token_seq[n], page_table[b,p], lanes[b], ring_keep[b], pools...)
      -> pools.  Context K/V of n committed target rows: c = hidden_norm(fc(taps)); per layer
      K = rope(k_norm(k_proj(c))), V = v_proj(c), written at the rows' positions (paged layers
      through the target's page table, windowed layers into the sequence's ring; rows below
      ring_keep[seq] skip the ring).
  draft(tokens[n], positions[n], attn_pos[n], kv_rows[n], token_seq[n], page_table[b,p], lanes[b],
        ring_lo[b], logit_rows[r], embed[V,D], lm_head[V,D], pools...)
      -> (logits[r,V] f32, [selector hidden[r, rank] f32 (DFlash2)], pools...).
      One pass over blocks of B rows per sequence ([last committed token, MASK x (B-1)] at
      positions start..start+B-1): x = embed * input_embedding_scale; each layer's queries attend
      the sequence's context plus the whole block (non-causal layers) or the block up to
      themselves (causal ones). Logits of the rows in logit_rows: lm_head(norm(x)) *
      output_multiplier, soft-capped. DFlash2 wraps every attention and MLP sublayer in a grouped
      dynamic causal convolution over the block and returns the candidate selector's projection.

Pools (runtime-owned, updated in place; either may be absent when no layer uses it):
  paged_pool [num_pages, n_paged, 2, kv_heads, PAGE, head_dim]  full layers, the TARGET's page ids
  ring_pool  [lanes, n_ring, 2, kv_heads, R, head_dim]          windowed layers, R = window + B
Block K/V are written too (paged: positions start.., ring: start.. mod R): harmless, since context
reads stop below start and committed positions are rewritten by `ctx` before they are read.
Attention: paged layers through the kernel set's paged attention (non-causal blocks: every row of a
block attends up to the block's last position, attn_pos; the kernel's own append then rewrites that
position with the same K/V, kv_rows); windowed layers over the sequence's ring with a mask from the ring
slot's position (slot s holds hi - ((hi - s) mod R), hi = the block's last position): visible iff
>= ring_lo[seq] (what the ring holds), within the window, and causal if the layer is. llvm: dense relax
ops (the reference form); CUDA: one thread-bound kernel with the same semantics (ring_attention.py; the
dense ops cost ~0.2 ms per layer on the H200 at the 27B drafter shape, a DLight matmul for P.V alone
~175 us).
"""
from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ...contract.pool_layout import PAGE_SIZE
from ..kernels.registry import kernel_set
from ..kernels.rope import apply_rope
from ..model import _NORM, MLP, Linear, RMSNorm, Weight, _gemv, _i32, decode_gemv_scope, prefill_gemm_scope
from ...contract.drafter import DrafterConfig
from ...contract.sampler_abi import top_logprob_slots
from .kernels import paged_append, ring_append
from .ring_attention import kernel_name, ring_attention
from .ring_attention import unsupported as ring_unsupported
from .selector_walk import select_walk

MASKED = -1.0e30


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, dtype: str):
        d, hq, hkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(d, hq * dh, dtype)
        self.kv_proj = Linear(d, 2 * hkv * dh, dtype)  # k_proj; v_proj (fused by the converter)
        self.o_proj = Linear(hq * dh, d, dtype)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)


class GroupedDynamicConv(nn.Module):
    """DFlash2: out[i, c] = sum_t (base[s, t, c] + dyn[i, s, t, c // group]) x[i - t, c] within the block
    (s = 0 before the sublayer, 1 after it; dyn = kernel_projection of the sublayer's input)."""

    def __init__(self, cfg: DrafterConfig, dtype: str):
        d = cfg.hidden_size
        self.kc, self.gs, self.groups = cfg.conv_kernel_size, cfg.conv_group_size, d // cfg.conv_group_size
        self.block = cfg.block_size
        self.base_kernel = nn.Parameter((2, self.kc, d), dtype)
        self.kernel_projection = Linear(d, 2 * self.kc * self.groups, dtype)

    def apply(self, x: nn.Tensor, dyn: nn.Tensor, half: int) -> nn.Tensor:
        kc, gs, groups, block, dtype = self.kc, self.gs, self.groups, self.block, x.dtype

        def compute(xt: te.Tensor, dt: te.Tensor, bt: te.Tensor):
            def elem(i, c):
                acc = tirx.const(0.0, "float32")
                for t in range(kc):
                    w = bt[half, t, c].astype("float32") + dt[i, half * kc * groups + t * groups + c // gs].astype(
                        "float32")
                    prev = xt[tirx.max(i - t, 0), c].astype("float32")
                    acc = acc + tirx.if_then_else(tirx.floormod(i, block) >= t, w * prev, tirx.const(0.0, "float32"))
                return acc.astype(dtype)

            return te.compute(xt.shape, elem, name="dflash_conv")

        return nn.tensor_expr_op(compute, "dflash_conv", [x, dyn, self.base_kernel])


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, dtype: str, conv: bool):
        self.self_attn = DrafterAttention(cfg, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if conv:
            self.attention_conv = GroupedDynamicConv(cfg, dtype)
            self.mlp_conv = GroupedDynamicConv(cfg, dtype)


class CandidateSelector(nn.Module):
    """DFlash2's selector: hidden_projection runs in `draft`; the walk over the candidates runs on the host
    (runtime/spec/selector.py) or, for plainly greedy rounds, in `select_walk` (selector_walk.py)."""

    def __init__(self, cfg: DrafterConfig, dtype: str):
        self.hidden_projection = Linear(cfg.hidden_size, cfg.selector_rank, dtype)
        self.predecessor_codebook = Weight((cfg.vocab_size, cfg.selector_rank), dtype)
        self.successor_codebook = Weight((cfg.vocab_size, cfg.selector_rank), dtype)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, dtype: str, target_kind: str = "llvm"):
        self.cfg, self.dtype = cfg, dtype
        kernels = kernel_set(target_kind, None)
        gpu = target_kind == "cuda"
        # CUDA: projections through the hand-written GEMV (a block's few rows) / prefill GEMM (context rows)
        self._gemv_factory, self._gemm_factory = getattr(kernels, "gemv", None), getattr(kernels, "gemm", None)
        token = _NORM.set(getattr(kernels, "rms_norm", None))
        try:
            d = cfg.hidden_size
            self.layers = nn.ModuleList([DrafterLayer(cfg, dtype, cfg.kind == "dflash2")
                                         for _ in range(cfg.num_hidden_layers)])
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.fc = Linear(cfg.num_taps * d, d, dtype)
            self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
            if cfg.kind == "dflash2":
                self.candidate_selector = CandidateSelector(cfg, dtype)
        finally:
            _NORM.reset(token)
        self.rope_inv_freq = nn.Parameter((cfg.head_dim // 2,), "float32")
        self.rope_attn_factor = nn.Parameter((1,), "float32")
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.paged, self.ring = cfg.paged_layers, cfg.ring_layers
        if self.paged:
            self.attn_kernel = kernels.paged_attention(hq, hkv, dh, PAGE_SIZE, len(self.paged), dtype, dh ** -0.5)
            self.paged_append = paged_append(hkv, dh, PAGE_SIZE, len(self.paged), dtype, gpu)
        if self.ring:
            self.ring_append = ring_append(hkv, dh, cfg.ring_size, len(self.ring), dtype, gpu)
            # CUDA: the whole windowed attention in one prim_func per causality (ring_attention.py) where its
            # tiling takes the geometry; llvm (and other geometries): dense ops
            assert cfg.sliding_window is not None  # ring layers exist only with a window
            fused = gpu and ring_unsupported(cfg.block_size, hq, hkv, dh) is None
            self.ring_kernels = {c: ring_attention(cfg.block_size, hq, hkv, dh, cfg.ring_size, cfg.sliding_window,
                                                   len(self.ring), c, dtype)
                                 for c in sorted({cfg.causal[i] for i in self.ring})} if fused else {}
        if cfg.kind == "dflash2":
            self.walk_slots = top_logprob_slots(cfg.vocab_size)  # the device sampler's top-logprob slots
            self.walk_kernel = select_walk(cfg.selector_rank, cfg.selector_top_k, self.walk_slots, dtype, gpu) \
                if cfg.selector_top_k <= self.walk_slots else None

    # ---- pieces ----------------------------------------------------------------------------
    def _kv(self, attn: DrafterAttention, x: nn.Tensor, positions: nn.Tensor):
        cfg = self.cfg
        n, hkv, dh = x.shape[0], cfg.num_key_value_heads, cfg.head_dim
        k, v = op.split(attn.kv_proj(x), 2, axis=1)
        k = apply_rope(attn.k_norm(op.reshape(k, (n, hkv, dh))), positions, self.rope_inv_freq,
                       self.rope_attn_factor, dh, "rope_k")
        return k, op.reshape(v, (n, hkv, dh))

    def _write(self, i: int, k, v, positions, token_seq, page_table, lanes, keep, pools: dict) -> None:
        if i in self.paged:
            pools["paged"] = op.tensor_ir_inplace_op(
                self.paged_append, "dflash_paged_append",
                [k, v, positions, token_seq, page_table, pools["paged"], _i32(self.paged.index(i))], 5,
                nn.Tensor.placeholder(pools["paged"].shape, pools["paged"].dtype))
        else:
            pools["ring"] = op.tensor_ir_inplace_op(
                self.ring_append, "dflash_ring_append",
                [k, v, positions, token_seq, lanes, keep, pools["ring"], _i32(self.ring.index(i))], 6,
                nn.Tensor.placeholder(pools["ring"].shape, pools["ring"].dtype))

    def _ring_mask(self, positions: nn.Tensor, ring_lo: nn.Tensor, causal: bool) -> nn.Tensor:
        """Additive mask [b, B, R] over ring slots (see the module docstring)."""
        assert self.cfg.sliding_window is not None  # ring layers exist only with a window
        B, R, W = self.cfg.block_size, self.cfg.ring_size, int(self.cfg.sliding_window)

        def compute(pos: te.Tensor, lo: te.Tensor):
            def elem(bi, i, s):
                q = pos[bi * B + i]
                hi = pos[bi * B + (B - 1)]
                p = hi - tirx.floormod(hi - s.astype("int32"), R)
                ok = tirx.all(p >= lo[bi], p >= 0, q - p < W, (p <= q) if causal else (p - q < W))
                return tirx.if_then_else(ok, tirx.const(0.0, "float32"), tirx.const(MASKED, "float32"))

            return te.compute((lo.shape[0], B, R), elem, name="dflash_ring_mask")

        return nn.tensor_expr_op(compute, "dflash_ring_mask", [positions, ring_lo])

    def _ring_attention(self, q, pool, slot: int, lanes, mask):
        """q [b*B, hq, dh] over the ring of each sequence's lane (layer `slot` of the ring pool)."""
        cfg = self.cfg
        B, R = cfg.block_size, cfg.ring_size
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = hq // hkv
        b = mask.shape[0]
        n_ring = len(self.ring)
        flat = op.reshape(pool, (pool.shape[0] * (2 * n_ring), hkv, R, dh))
        base = lanes * (2 * n_ring) + 2 * slot
        keys = op.take(flat, base, axis=0)  # [b, hkv, R, dh]
        vals = op.take(flat, base + 1, axis=0)
        qh = op.permute_dims(op.reshape(q, (b, B, hkv, g, dh)), [0, 2, 1, 3, 4])
        qh = op.reshape(qh, (b, hkv, B * g, dh))
        s = op.matmul(qh, op.permute_dims(keys, [0, 1, 3, 2]), out_dtype="float32") * (dh ** -0.5)
        s = op.reshape(s, (b, hkv, B, g, R)) + op.reshape(mask, (b, 1, B, 1, R))
        p = op.reshape(op.softmax(s, axis=-1), (b, hkv, B * g, R)).astype(q.dtype)
        o = op.matmul(p, vals, out_dtype="float32").astype(q.dtype)  # [b, hkv, B*g, dh]
        o = op.permute_dims(op.reshape(o, (b, hkv, B, g, dh)), [0, 2, 1, 3, 4])
        return op.reshape(o, (b * B, hq, dh))

    def _attention(self, i: int, layer: DrafterLayer, h, positions, attn_pos, kv_rows, token_seq, page_table,
                   lanes, ring_lo, masks: dict, pools: dict):
        cfg = self.cfg
        attn = layer.self_attn
        n, hq, dh = h.shape[0], cfg.num_attention_heads, cfg.head_dim
        q = apply_rope(attn.q_norm(op.reshape(attn.q_proj(h), (n, hq, dh))), positions, self.rope_inv_freq,
                       self.rope_attn_factor, dh, "rope_q")
        k, v = self._kv(attn, h, positions)
        causal = cfg.causal[i]
        if i in self.paged:
            if not causal:  # the block's own K/V, then every row attends up to the block's last position
                self._write(i, k, v, positions, token_seq, page_table, lanes, ring_lo, pools)
                k, v, positions = op.take(k, kv_rows, axis=0), op.take(v, kv_rows, axis=0), attn_pos
            pools["paged"], o = op.tensor_ir_inplace_op(
                self.attn_kernel, "paged_attention",
                [q, k, v, positions, token_seq, page_table, pools["paged"], _i32(self.paged.index(i))], [6, -1],
                [pools["paged"], nn.Tensor.placeholder((n, hq, dh), self.dtype)])
        elif self.ring_kernels:
            self._write(i, k, v, positions, token_seq, page_table, lanes, ring_lo, pools)
            o = op.tensor_ir_op(self.ring_kernels[causal], kernel_name(causal),
                                [q, pools["ring"], positions, lanes, ring_lo, _i32(self.ring.index(i))],
                                nn.Tensor.placeholder((n, hq, dh), self.dtype))
        else:
            self._write(i, k, v, positions, token_seq, page_table, lanes, ring_lo, pools)
            if causal not in masks:
                masks[causal] = self._ring_mask(positions, ring_lo, causal)
            o = self._ring_attention(q, pools["ring"], self.ring.index(i), lanes, masks[causal])
        return attn.o_proj(op.reshape(o, (n, hq * dh)))

    # ---- exported functions -------------------------------------------------------------------
    def _pools_out(self, pools: dict) -> tuple:
        return tuple(pools[k] for k in ("paged", "ring") if k in pools)

    def _pools_in(self, paged_pool, ring_pool) -> dict:
        pools = {}
        if self.paged:
            pools["paged"] = paged_pool
        if self.ring:
            pools["ring"] = ring_pool
        return pools

    def ctx(self, taps, positions, token_seq, page_table, lanes, ring_keep, paged_pool=None, ring_pool=None):
        with prefill_gemm_scope(self._gemm_factory):
            pools = self._pools_in(paged_pool, ring_pool)
            c = self.hidden_norm(self.fc(taps))
            for i, layer in enumerate(self.layers):
                k, v = self._kv(layer.self_attn, c, positions)
                self._write(i, k, v, positions, token_seq, page_table, lanes, ring_keep, pools)
            return self._pools_out(pools)

    def draft(self, tokens, positions, attn_pos, kv_rows, token_seq, page_table, lanes, ring_lo, logit_rows,
              embed, lm_head, paged_pool=None, ring_pool=None):
        with decode_gemv_scope(self._gemv_factory):
            return self._draft(tokens, positions, attn_pos, kv_rows, token_seq, page_table, lanes, ring_lo,
                               logit_rows, embed, lm_head, self._pools_in(paged_pool, ring_pool))

    def _draft(self, tokens, positions, attn_pos, kv_rows, token_seq, page_table, lanes, ring_lo, logit_rows,
               embed, lm_head, pools: dict):
        cfg = self.cfg
        x = op.take(embed, tokens, axis=0)
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        masks: dict = {}
        for i, layer in enumerate(self.layers):
            conv = cfg.kind == "dflash2"
            h = layer.input_layernorm(x)
            if conv:
                dyn = layer.attention_conv.kernel_projection(h)
                h = layer.attention_conv.apply(h, dyn, 0)
            a = self._attention(i, layer, h, positions, attn_pos, kv_rows, token_seq, page_table, lanes, ring_lo,
                                masks, pools)
            x = x + (layer.attention_conv.apply(a, dyn, 1) if conv else a)
            h = layer.post_attention_layernorm(x)
            if conv:
                dyn = layer.mlp_conv.kernel_projection(h)
                h = layer.mlp_conv.apply(h, dyn, 0)
            m = layer.mlp(h)
            x = x + (layer.mlp_conv.apply(m, dyn, 1) if conv else m)
        hr = op.take(self.norm(x), logit_rows, axis=0)
        logits = _gemv(hr, lm_head, out_dtype="float32", name="gemv_lm_head")  # CUDA: the decode GEMV, fp32 out
        if logits is None:
            logits = op.matmul(hr, op.permute_dims(lm_head), out_dtype="float32")
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = op.tanh(logits * (1.0 / cap)) * cap
        out: tuple = (logits,)
        if cfg.kind == "dflash2":
            out += (self.candidate_selector.hidden_projection(hr).astype("float32"),)
        return out + self._pools_out(pools)

    def select_walk(self, top_ids, top_vals, hidden, anchors):
        """DFlash2 greedy drafts [r] (step-major) from the candidates of draft's rows (selector_walk.py)."""
        sel = self.candidate_selector
        return op.tensor_ir_op(self.walk_kernel, "dflash_select_walk",
                               [top_ids, top_vals, hidden, anchors, sel.predecessor_codebook.weight,
                                sel.successor_codebook.weight],
                               nn.Tensor.placeholder((top_ids.shape[0],), "int32"))

    # ---- export ------------------------------------------------------------------------------
    def pool_shapes(self) -> dict:
        """Per-entry shapes (leading dim left out): paged per page, ring per lane."""
        cfg = self.cfg
        hkv, dh = cfg.num_key_value_heads, cfg.head_dim
        out = {}
        if self.paged:
            out["paged_pool"] = (len(self.paged), 2, hkv, PAGE_SIZE, dh)
        if self.ring:
            out["ring_pool"] = (len(self.ring), 2, hkv, cfg.ring_size, dh)
        return out

    def export_spec(self) -> dict:
        i32 = "int32"
        cfg = self.cfg
        mode = {"param_mode": "packed", "effect_mode": "none"}
        lead = {"paged_pool": "num_pages", "ring_pool": "lanes"}
        pools = {k: nn.spec.Tensor([lead[k], *shape], self.dtype) for k, shape in self.pool_shapes().items()}
        seq = {"token_seq": nn.spec.Tensor(["n"], i32), "page_table": nn.spec.Tensor(["b", "p"], i32),
               "lanes": nn.spec.Tensor(["b"], i32)}
        table = nn.spec.Tensor([cfg.vocab_size, cfg.hidden_size], self.dtype)
        walk = {}
        if cfg.kind == "dflash2" and self.walk_kernel is not None:
            S = self.walk_slots
            walk = {"select_walk": {"top_ids": nn.spec.Tensor(["r", S], i32),
                                    "top_vals": nn.spec.Tensor(["r", S], "float32"),
                                    "hidden": nn.spec.Tensor(["r", cfg.selector_rank], "float32"),
                                    "anchors": nn.spec.Tensor(["b"], i32), "$": mode}}
        return {
            "ctx": {"taps": nn.spec.Tensor(["n", cfg.num_taps * cfg.hidden_size], self.dtype),
                    "positions": nn.spec.Tensor(["n"], i32), **seq, "ring_keep": nn.spec.Tensor(["b"], i32),
                    **pools, "$": mode},
            "draft": {"tokens": nn.spec.Tensor(["n"], i32), "positions": nn.spec.Tensor(["n"], i32),
                      "attn_pos": nn.spec.Tensor(["n"], i32), "kv_rows": nn.spec.Tensor(["n"], i32), **seq,
                      "ring_lo": nn.spec.Tensor(["b"], i32), "logit_rows": nn.spec.Tensor(["r"], i32),
                      "embed": table, "lm_head": table, **pools, "$": mode},
            **walk,
        }
