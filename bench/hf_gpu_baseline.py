"""HF transformers baseline on the same GPU: the Qwen3.x-27B geometry (random bf16 weights made on
the GPU), decode tok/s at a given context and batch, and prefill tok/s — the shapes that
bench/gpu_bench.py measures for our library; with --moe the Qwen3.5/3.6-35B-A3B geometry
(Qwen3_5MoeForCausalLM, bench/moe_gpu_bench.py's shapes).

  python bench/hf_gpu_baseline.py OUT.json [--ctx 8192] [--batches 1,8] [--steps 8] [--prefill 8192] [--moe]

transformers runs its own PyTorch GDN kernels here (no flash-linear-attention on the machine), i.e.
what a user of plain transformers gets.
"""
from __future__ import annotations

import argparse
import json
import time

GEOMETRY = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


TINY = dict(GEOMETRY, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16)


MOE_GEOMETRY = dict({k: v for k, v in GEOMETRY.items() if k != "intermediate_size"}, hidden_size=2048,
                    num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
                    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512)
MOE_TINY = dict({k: v for k, v in TINY.items() if k != "intermediate_size"}, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=32)


def build(torch, dev: str, geometry: dict):
    if "num_experts" in geometry:
        from transformers import Qwen3_5MoeForCausalLM as Model
        from transformers import Qwen3_5MoeTextConfig as Config
    else:
        from transformers import Qwen3_5ForCausalLM as Model
        from transformers import Qwen3_5TextConfig as Config

    cfg = Config(**geometry)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Model(cfg)
    model = model.to_empty(device=dev).to(torch.bfloat16).eval()
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(1, 8, generator=g).log().to(p.dtype))
            elif "norm" in n:
                p.fill_(1.0 if "linear_attn.norm" in n else 0.0)
            else:
                p.normal_(0, 0.02, generator=g)
    return model, cfg


def timed(torch, fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true", help="small geometry on the CPU (checks the script)")
    ap.add_argument("--moe", action="store_true", help="the 35B-A3B MoE geometry instead of the 27B")
    a = ap.parse_args()
    import torch

    dev = "cpu" if a.tiny else "cuda"
    res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M"), "decode": [], "prefill": None}
    import transformers

    res["transformers"] = transformers.__version__
    geometry = (MOE_TINY if a.tiny else MOE_GEOMETRY) if a.moe else (TINY if a.tiny else GEOMETRY)
    res["geometry"] = "qwen3.5-35b-a3b" if a.moe else "qwen3.x-27b"
    model, cfg = build(torch, dev, geometry)
    res["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():
        if a.prefill:
            ids = torch.randint(0, cfg.vocab_size, (1, a.prefill), device=dev)
            model(ids[:, :256], use_cache=False)  # warm-up
            _, dt = timed(torch, lambda: model(ids, use_cache=False, logits_to_keep=1))
            res["prefill"] = {"tokens": a.prefill, "seconds": dt, "tok_s": a.prefill / dt}
            print("prefill", res["prefill"], flush=True)
        for b in [int(x) for x in a.batches.split(",")]:
            ids = torch.randint(0, cfg.vocab_size, (b, a.ctx), device=dev)
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            nxt = torch.randint(0, cfg.vocab_size, (b, 1), device=dev)
            out = model(nxt, past_key_values=cache, use_cache=True)  # warm-up step
            cache = out.past_key_values

            def steps():
                c = cache
                for _ in range(a.steps):
                    c = model(nxt, past_key_values=c, use_cache=True).past_key_values
                return c

            _, dt = timed(torch, steps)
            step = dt / a.steps
            res["decode"].append({"batch": b, "ctx": a.ctx, "step_ms": step * 1000, "tok_s": b / step})
            print("decode", res["decode"][-1], flush=True)
            del cache, out
            if dev == "cuda":
                torch.cuda.empty_cache()
    res["max_allocated_bytes"] = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
