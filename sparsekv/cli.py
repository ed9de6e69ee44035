"""Command line: ``sparsekv serve | generate | bench | eval | convert``."""

from __future__ import annotations

import argparse
import json
import sys

from sparsekv.cli_args import add_engine_args, engine_config_from_args


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    from sparsekv.llm import LLM
    from sparsekv.sampling_params import SamplingParams

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as fh:
            prompts.extend(line.rstrip("\n") for line in fh if line.strip())
    if not prompts:
        prompts = ["Explain in two sentences why the KV cache limits LLM serving."]
    config = engine_config_from_args(args)
    llm = LLM(engine_config=config)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    inputs = [[{"role": "user", "content": p}] if args.chat else p for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=len(inputs) > 1)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        if args.json:
            stats = output.kv_stats
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                        "kv_compression_ratio": stats.compression_ratio if stats else 0.0,
                    }
                )
            )
        else:
            print(f"### {prompt}\n{completion.text}\n[{completion.finish_reason}]")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from sparsekv.server.app import serve

    return serve(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from sparsekv.loader import convert_gguf, resolve_model

    out = convert_gguf(resolve_model(args.gguf), args.out_dir)
    print(f"wrote {out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from sparsekv.bench.main import main as bench_main

    return bench_main(args.bench_args)


def cmd_eval(args: argparse.Namespace) -> int:
    from sparsekv.evaluation.main import main as eval_main

    return eval_main(args.eval_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsekv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline for one or more prompts")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (default: env SPARSEKV_API_KEY)",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=8 << 20, help="largest request body (413 past it)"
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds before a request is aborted (default: none)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="after SIGTERM, seconds running requests may take to finish before they are "
        "aborted; new requests get 503 meanwhile, a second signal exits at once (default: 30)",
    )
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    convert = sub.add_parser("convert", help="write a Hugging Face folder from a GGUF file")
    convert.add_argument("gguf", help="GGUF path or built-in model name")
    convert.add_argument("out_dir")
    convert.set_defaults(func=cmd_convert)

    bench = sub.add_parser("bench", help="benchmarks: throughput, kernels, serve, sweep")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    evaluate = sub.add_parser("eval", help="long-context accuracy and fidelity")
    evaluate.add_argument("eval_args", nargs=argparse.REMAINDER)
    evaluate.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench and eval parse their own flags (argparse's REMAINDER rejects a leading flag).
    if argv and argv[0] in ("bench", "eval"):
        from sparsekv.evaluation.provenance import code_version

        code_version()  # the checkout their reports name: as it is now, at the start
        args = argparse.Namespace(bench_args=argv[1:], eval_args=argv[1:])
        handler = cmd_bench if argv[0] == "bench" else cmd_eval
        try:
            return handler(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
