"""Command line: ``sparsekv`` serve, generate, bench, eval, calibrate, convert, models, env."""

from __future__ import annotations

import argparse
import logging
import sys

from sparsekv.cli_args import OnOffFlag, add_engine_args, flag_of_error
from sparsekv.cli_commands import (
    DEFAULT_PROMPT,
    cmd_bench,
    cmd_calibrate,
    cmd_convert,
    cmd_env,
    cmd_eval,
    cmd_generate,
    cmd_models,
    cmd_serve,
    read_prompts,
)

__all__ = ["DEFAULT_PROMPT", "build_parser", "error_line", "main", "read_prompts"]


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=128, metavar="N",
        help="most tokens to generate per prompt (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--temperature", type=float, default=0.0, metavar="T",
        help="softmax temperature; 0 is greedy decoding (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--top-p", type=float, default=1.0, metavar="P",
        help="nucleus sampling: keep the smallest token set of this mass (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--top-k", type=int, default=0, metavar="K",
        help="keep the K most likely tokens; 0 keeps all (default: %(default)s)",
    )  # fmt: skip
    group.add_argument(
        "--seed", type=int, default=None, metavar="N",
        help="sampling seed, for repeatable sampled outputs (default: none)",
    )  # fmt: skip


def _add_generate(sub) -> None:
    """``sparsekv generate``: prompts, sampling and engine flags."""
    gen = sub.add_parser(
        "generate",
        help="generate offline for one or more prompts",
        description="Generate offline for one or more prompts (continuous batching, no server). "
        "Prints each prompt after '### ', its completion, and why it ended in brackets ([stop]: "
        "an end-of-sequence token or stop string, [length]: --max-tokens or the context); "
        "--json prints token ids and KV usage too.",
    )
    gen.add_argument(
        "texts", nargs="*", metavar="PROMPT", help="prompts as arguments (as --prompt TEXT)"
    )
    prompts = gen.add_argument_group("prompts and output")
    prompts.add_argument(
        "--prompt", action="append", metavar="TEXT",
        help=f"a prompt; repeat the flag for several (default: {DEFAULT_PROMPT!r})",
    )  # fmt: skip
    prompts.add_argument(
        "--prompts-file", metavar="PATH", help="a UTF-8 file with one prompt per line"
    )
    prompts.add_argument(
        "--chat", action=OnOffFlag, default=True,
        help="send each prompt as one user message through the chat template; --no-chat "
        "sends the raw text (base models) (default: on)",
    )  # fmt: skip
    prompts.add_argument(
        "--json", action="store_true",
        help="print one JSON object per prompt (text, token ids, finish reason, KV usage)",
    )  # fmt: skip
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    """``sparsekv serve``: server and engine flags."""
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) "
        "plus /health and /metrics.",
    )
    server = serve.add_argument_group("server")
    server.add_argument(
        "--host", default="127.0.0.1", metavar="ADDRESS",
        help="address to bind (default: %(default)s, this machine only)",
    )  # fmt: skip
    server.add_argument(
        "--port", type=int, default=8000, metavar="N", help="TCP port (default: %(default)s)"
    )
    server.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 (default: env SPARSEKV_API_KEY, "
        "else none)",
    )  # fmt: skip
    server.add_argument(
        "--max-body-bytes", type=int, default=8 << 20, metavar="N",
        help="largest request body; larger ones get HTTP 413 (default: %(default)s = 8 MiB)",
    )  # fmt: skip
    server.add_argument(
        "--request-timeout", type=float, default=None, metavar="SECONDS",
        help="abort a request after this long (default: none)",
    )  # fmt: skip
    server.add_argument(
        "--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
        help="after SIGTERM, how long running requests may take to finish before they are "
        "aborted; new requests get 503 meanwhile, a second signal exits at once "
        "(default: %(default)s)",
    )  # fmt: skip
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def _add_tools(sub) -> None:
    """convert, models, env, and bench / eval / calibrate (which parse their own flags)."""
    convert = sub.add_parser("convert", help="write a Hugging Face folder from a GGUF file")
    convert.add_argument("gguf", metavar="MODEL", help="GGUF path or built-in model name")
    convert.add_argument(
        "out_dir", metavar="OUT_DIR", help="folder to write (config.json, safetensors, tokenizer)"
    )
    convert.add_argument(
        "--overwrite", action="store_true",
        help="write into a folder that holds files: replace its checkpoint files and remove an "
        "earlier checkpoint's other weights, index and tokenizer files (default: refuse it)",
    )  # fmt: skip
    convert.set_defaults(func=cmd_convert)

    models = sub.add_parser("models", help="list the supported model architectures")
    models.set_defaults(func=cmd_models)

    env = sub.add_parser(
        "env",
        help="versions, CPU, kernel variants, caches and settings on this machine (for bug "
        "reports)",
        description="What sparsekv will do on this machine: versions, the CPU, the native "
        "kernel variants (`sparsekv bench kernels --list`), cache folders and the environment "
        "variables set now. Builds the native kernels on first use.",
    )
    env.add_argument("--json", action="store_true", help="print the same as one JSON object")
    env.set_defaults(func=cmd_env)

    bench = sub.add_parser(
        "bench", help="benchmarks (`sparsekv bench --help` lists them; docs/benchmarks.md)"
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    evaluate = sub.add_parser(
        "eval", help="long-context accuracy per method and ratio (`sparsekv eval --help`)"
    )
    evaluate.add_argument("eval_args", nargs=argparse.REMAINDER)
    evaluate.set_defaults(func=cmd_eval)

    calibrate = sub.add_parser(
        "calibrate",
        help="per-layer budgets from measured attention concentration "
        "(`sparsekv calibrate --help`)",
    )
    calibrate.add_argument("calibrate_args", nargs=argparse.REMAINDER)
    calibrate.set_defaults(func=cmd_calibrate)


def build_parser() -> argparse.ArgumentParser:
    """The ``sparsekv`` parser: one subcommand each, ``func`` its handler (``cli_commands``)."""
    parser = argparse.ArgumentParser(
        prog="sparsekv",
        description="sparsekv: an LLM serving engine whose KV cache is sparse layer by layer.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    _add_generate(sub)
    _add_serve(sub)
    _add_tools(sub)
    return parser


def error_line(exc: ValueError) -> str:
    """``error: <message>``, plus the flag that sets the field the message names, if any
    (config errors name fields: ``kv_compression.budget`` is ``--kv-budget``)."""
    flag = flag_of_error(str(exc))
    return f"error: {exc}" + (f" [{flag}]" if flag else "")


def main(argv: list[str] | None = None) -> int:
    """Run one ``sparsekv`` command; returns its exit status (2 for invalid input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # INFO lines (model loading, native kernel builds) go to stderr, so --json output stays clean.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # bench and eval parse their own flags (argparse's REMAINDER rejects a leading flag).
    if argv and argv[0] in ("bench", "eval", "calibrate"):
        from sparsekv.evaluation.provenance import code_version

        code_version()  # the checkout their reports name: as it is now, at the start
        args = argparse.Namespace(bench_args=argv[1:], eval_args=argv[1:], calibrate_args=argv[1:])
        handler = {"bench": cmd_bench, "eval": cmd_eval, "calibrate": cmd_calibrate}[argv[0]]
        try:
            return handler(args)
        except ValueError as exc:
            print(error_line(exc), file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
