"""`ninfer` command line: compile, serve, generate, bench.

Every subcommand takes MODEL the same way (ninfer_mlc/model_source.py): a compiled directory, a
Hugging Face directory or a Hub repo id; failures are one `ninfer: error:` line naming the flag or
the model (ninfer_mlc/cli_support.py), never a traceback.
"""
from __future__ import annotations

import argparse
import sys

from .config import CLIError, add_flags, from_args
from .paths import default_model_dir


def _compile(args) -> int:
    from .cli_support import model_errors
    from .compile.options import CompileOptions
    from .compile.progress import Progress
    from .model_source import artifact_name, source_for_compile

    with model_errors(args.model):
        opts = from_args(CompileOptions, args).resolved()
        src = source_for_compile(args.model)  # downloads a repo id before TVM is even imported
        from .compile.build import compile_model

        name = args.name or artifact_name(src, opts) + ("-random" if args.random_weights is not None else "")
        compile_model(src.path, out_dir=args.output, name=name, progress=Progress(),
                      random_weights=args.random_weights, **opts.compile_kwargs())
    return 0


def _generate(args) -> int:
    from .cli_support import model_errors, resolve_model
    from .generate import run_prompt
    from .runtime.assemble import open_engine
    from .runtime.config import EngineConfig

    if args.model_flag is not None:
        if args.model is not None:
            raise CLIError("give MODEL either as the first argument or with --model (deprecated), not both")
        print("ninfer: warning: --model is deprecated; give MODEL as the first argument", file=sys.stderr)
        args.model = args.model_flag
    art = resolve_model(args, default_model_dir())
    with model_errors(str(art)):
        eng = open_engine(art, EngineConfig(max_concurrency=1))
    try:
        print(run_prompt(eng, art, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                         seed=args.seed, chat=not args.raw))
    finally:
        eng.stop()
    return 0


def _bench(args) -> int:
    from .bench import batch_sizes, main_bench
    from .cli_support import model_errors, resolve_model
    from .contract.manifest import read_manifest

    batch_sizes(args.batch)  # a bad --batch fails before any model work
    art = resolve_model(args, default_model_dir())
    with model_errors(str(art)):
        read_manifest(art)  # missing or damaged artifact: one line, not a traceback from the loader
    return main_bench(args, art)


def _serve(args) -> int:
    from .server.app import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    from .cli_support import add_model_arg, add_model_compile_flags, int_at_least, non_negative_float
    from .compile.options import CompileOptions

    p = argparse.ArgumentParser(prog="ninfer", description="Compiler-based engine for Qwen3.x hybrid models")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{compile,serve,generate,bench}")

    c = sub.add_parser("compile", help="compile a Hugging Face model or DFlash drafter (directory or Hub repo id) into dist/NAME/",
                       description="Compile a Hugging Face model into a library, converted weights and a manifest.")
    c.add_argument("model", metavar="MODEL",
                   help="a Hugging Face model directory or a Hub repo id (org/name[@revision], downloaded into the "
                        "Hugging Face cache)")
    add_flags(c, CompileOptions)
    c.add_argument("-o", "--output", default=None, help="output directory (default: dist/NAME)")
    c.add_argument("--name", default=None, help="artifact name (default: MODEL's name-QUANT-TARGET)")
    c.add_argument("--random-weights", type=int, default=None, metavar="SEED",
                   help="benchmark artifact: no converted weights (only config.json and the tokenizer are read); "
                        "every parameter is drawn on the device at load time from SEED. `ninfer serve` refuses it "
                        "unless given --allow-random-weights")
    c.set_defaults(func=_compile)

    from .server.options import add_serve_args

    s = sub.add_parser("serve", help="OpenAI + Anthropic compatible HTTP server",
                       description="Serve a model over the OpenAI and Anthropic APIs.")
    add_serve_args(s)
    s.set_defaults(func=_serve)

    g = sub.add_parser("generate", help="generate text for one prompt (quick check)",
                       description="Generate text for one prompt: `ninfer generate [MODEL] PROMPT`.")
    add_model_arg(g, default_text="the embedded tiny model")
    g.add_argument("prompt", metavar="PROMPT", help="the prompt (sent as a user message unless --raw)")
    g.add_argument("--model", dest="model_flag", metavar="MODEL", default=None,
                   help="deprecated spelling of the MODEL argument")
    g.add_argument("--max-tokens", type=int_at_least(1), default=32, metavar="N",
                   help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature, 0 = greedy (default: %(default)s)")
    g.add_argument("--seed", type=int_at_least(0), default=None, metavar="N", help="sampling seed (default: random)")
    g.add_argument("--raw", action="store_true", help="send PROMPT as it is, without the chat template")
    add_model_compile_flags(g)
    g.set_defaults(func=_generate)

    from .bench import add_bench_args

    b = sub.add_parser("bench", help="decode/prefill throughput of a model, as JSON",
                       description="Decode and prefill throughput of a model through the executor, as JSON.")
    add_bench_args(b)
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
