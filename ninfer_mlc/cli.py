"""`ninfer` command line: compile, serve, generate, bench."""
from __future__ import annotations

import argparse
import sys

from .config import CLIError
from .paths import default_model_dir


def _compile(args) -> int:
    from .compile.build import compile_model
    from .compile.config import ConfigError
    from .compile.convert import ConversionError
    from .compile.targets import TargetError

    try:
        compile_model(args.model_dir, target=args.target, quant=args.quant, max_context=args.max_context,
                      out_dir=args.output, name=args.name, kv_dtype=args.kv_dtype, kv_hadamard=args.kv_hadamard,
                      fp4_mma=args.fp4_mma, random_weights=args.random_weights, tap_layers=args.tap_layers,
                      rope_overrides={"scaling_type": args.rope_scaling_type, "factor": args.rope_scaling_factor,
                                      "original_context": args.rope_scaling_original_context})
    except (ConfigError, ConversionError, TargetError) as e:
        raise CLIError(str(e)) from None
    return 0


def _generate(args) -> int:
    from .generate import generate_text

    text = generate_text(args.model or default_model_dir(), args.prompt, max_tokens=args.max_tokens,
                         temperature=args.temperature, seed=args.seed, chat=not args.raw)
    print(text)
    return 0


def _bench(args) -> int:
    from .bench import main_bench

    return main_bench(args, default_model_dir())


def _serve(args) -> int:
    from .server.app import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer", description="Compiler-based engine for Qwen3.x hybrid models")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("compile", help="compile a Hugging Face model (or DFlash drafter) directory into dist/NAME/")
    c.add_argument("model_dir")
    c.add_argument("--target", default="llvm", help="llvm | cuda:sm_90 | cuda:sm_120")
    c.add_argument("--quant", default="f32", help="f32 | bf16 | nvfp4 (NVFP4 decoder weights with fused dequant; bf16 activations on CUDA, f32 on CPU)")
    c.add_argument("--max-context", type=int, default=None)
    c.add_argument("--kv-dtype", choices=["f32", "bf16", "fp8", "nvfp4"], default=None,
                   help="KV cache page format (default: the --quant dtype). fp8: E4M3 with a per-(token, head) "
                        "power-of-two scale; nvfp4: E2M1 with an E4M3 scale per 16 dims (144 B per token per KV "
                        "head at head_dim 256, 3.6x smaller than bf16)")
    c.add_argument("--kv-hadamard", action="store_true",
                   help="rotate Q and K by a normalised Walsh-Hadamard over head_dim after RoPE (V unrotated). "
                        "Off by default: measured on synthetic NVFP4 attention it does not help (output error "
                        "without/with: 0.136/0.134 on Gaussian K, 0.255/0.317 on K with 4 outlier channels x20; "
                        "16-element blocks already isolate outliers)")
    c.add_argument("--fp4-mma", choices=["on", "off"], default=None,
                   help="NVFP4 projections: prefill rows on the sm_120a block-scaled FP4 tensor cores (activations "
                        "quantized to NVFP4 on the fly, per-token scale), decode rows keep the dequant GEMV. "
                        "Default: on for --target cuda:sm_120 --quant nvfp4, else off (needs both)")
    c.add_argument("--random-weights", type=int, default=None, metavar="SEED",
                   help="benchmark artifact: no converted weights (only config.json is read); every parameter is "
                        "drawn on the device at load time from SEED. `ninfer serve` refuses it unless given "
                        "--allow-random-weights")
    c.add_argument("--tap-layers", default=None, metavar="IDS|DRAFTER_DIR",
                   help="for --spec dflash|dflash2: also compile prefill_t / verify_t, which return the outputs of "
                        "these decoder layers (comma-separated ids, or a DFlash drafter directory: its "
                        "target_layer_ids). A DFlash drafter directory given as MODEL_DIR compiles the drafter itself "
                        "(--quant f32 or bf16: the target's activation dtype)")
    c.add_argument("-o", "--output", default=None, help="output directory (default dist/NAME)")
    c.add_argument("--name", default=None)
    c.add_argument("--rope-scaling-type", choices=["linear", "yarn"], default=None)
    c.add_argument("--rope-scaling-factor", type=float, default=None)
    c.add_argument("--rope-scaling-original-context", type=int, default=None)
    c.set_defaults(func=_compile)

    g = sub.add_parser("generate", help="generate text for one prompt (quick check)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="compiled model dir (default: the embedded tiny model)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.set_defaults(func=_generate)

    from .bench import add_bench_args

    b = sub.add_parser("bench", help="decode/prefill throughput of a compiled model, as JSON")
    add_bench_args(b)
    b.set_defaults(func=_bench)

    from .server.options import add_serve_args

    s = sub.add_parser("serve", help="OpenAI + Anthropic compatible HTTP server",
                       description="Serve a compiled model over the OpenAI and Anthropic APIs.")
    add_serve_args(s)
    s.set_defaults(func=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
