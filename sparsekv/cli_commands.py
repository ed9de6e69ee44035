"""The ``sparsekv`` subcommands' handlers: each takes the parsed arguments (``cli.build_parser``)
and returns the exit status; a ``ValueError`` they raise is printed as one ``error:`` line with
exit status 2 (``cli.main``)."""

from __future__ import annotations

import argparse
import errno
import json
import socket
from pathlib import Path

from sparsekv.cli_args import engine_config_from_args

DEFAULT_PROMPT = "Explain in two sentences why the KV cache limits LLM serving."


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts given as arguments, the ``--prompt`` values, then the non-blank lines of
    ``--prompts-file`` (lines end at ``\n``; a trailing ``\r`` is dropped).

    Raises:
        ValueError: ``--prompts-file`` names a file that cannot be read or holds no prompt.
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
        # lines end at "\n" only (str.splitlines also splits at form feeds, U+2028, ...)
        lines = [line.removesuffix("\r") for line in text.split("\n")]
        from_file = [line for line in lines if line.strip()]
        if not from_file:
            raise ValueError(f"--prompts-file: {path} holds no prompt (no non-blank line)")
        prompts.extend(from_file)
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
