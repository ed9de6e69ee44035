"""Command line: ``sparsekv`` serve, generate, bench, eval, calibrate, convert, models, env."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import socket
import sys
from pathlib import Path

from sparsekv.cli_args import OnOffFlag, add_engine_args, engine_config_from_args, flag_of_error

DEFAULT_PROMPT = "Explain in two sentences why the KV cache limits LLM serving."


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


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts given as arguments, the ``--prompt`` values, then the non-empty lines of
    ``--prompts-file``.

    Raises:
        ValueError: ``--prompts-file`` names a file that cannot be read.
    """
    prompts = list(getattr(args, "texts", None) or []) + list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"--prompts-file: no such file: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--prompts-file: cannot read {path}: {exc}") from None
        prompts.extend(line for line in text.splitlines() if line.strip())
    return prompts or [DEFAULT_PROMPT]


def check_port_free(host: str, port: int) -> None:
    """Bind ``(host, port)`` once and release it, before the model loads.

    Raises:
        ValueError: the port is in use or cannot be bound (names ``--port``/``--host``).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host: cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"--port: {host}:{port} is already in use; stop what listens there or "
                    "choose another port"
                ) from None
            raise ValueError(f"--host/--port: cannot bind {host}:{port}: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from sparsekv.distributed.batch import output_row
    from sparsekv.sampling_params import SamplingParams

    prompts = read_prompts(args)
    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if config.parallel.data_parallel_size > 1:
        rows = _generate_on_replicas(config, prompts, params, args.chat)
    else:
        from sparsekv.llm import LLM

        if config.parallel.threads_per_rank is not None:
            import torch

            torch.set_num_threads(config.parallel.threads_per_rank)
        llm = LLM(engine_config=config)
        inputs = [[{"role": "user", "content": p}] if args.chat else p for p in prompts]
        try:
            outputs = llm.generate(inputs, params, use_tqdm=len(inputs) > 1)
        finally:
            llm.shutdown()  # the tensor-parallel ranks, if any
        rows = [output_row(p, o) for p, o in zip(prompts, outputs)]
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"### {row['prompt']}\n{row['text']}\n[{row['finish_reason']}]")
    return 0


def _generate_on_replicas(config, prompts: list[str], params, chat: bool) -> list[dict]:
    """``generate --data-parallel-size N``: one ray.data actor per replica."""
    from sparsekv.distributed.batch import generate_with_replicas
    from sparsekv.distributed.cluster import connect

    cluster = connect(config.parallel.ray_address)
    try:
        return generate_with_replicas(config, prompts, params, chat)
    finally:
        cluster.shutdown()


def cmd_serve(args: argparse.Namespace) -> int:
    check_port_free(args.host, args.port)  # before minutes of model loading, not after
    from sparsekv.server.app import serve

    return serve(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from sparsekv.loader import convert_gguf, resolve_model

    out = convert_gguf(resolve_model(args.gguf), args.out_dir, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from sparsekv.models.families import FAMILIES

    print(f"{'family':<9} {'model_type':<22} {'GGUF':<8} checkpoints")
    for family in FAMILIES.values():
        types = ", ".join(family.model_types)
        print(f"{family.name:<9} {types:<22} {family.gguf_architecture:<8} {family.examples}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from sparsekv.env_report import main as env_main

    return env_main(as_json=args.json)


def cmd_bench(args: argparse.Namespace) -> int:
    from sparsekv.bench.main import main as bench_main

    return bench_main(args.bench_args)


def cmd_eval(args: argparse.Namespace) -> int:
    from sparsekv.evaluation.main import main as eval_main

    return eval_main(args.eval_args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from sparsekv.evaluation.calibrate import main as calibrate_main

    return calibrate_main(args.calibrate_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsekv",
        description="sparsekv: an LLM serving engine whose KV cache is sparse layer by layer.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

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
