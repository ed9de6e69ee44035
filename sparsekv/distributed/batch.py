"""Offline generation over replicas: ``sparsekv generate --data-parallel-size N``.

The prompts become a ``ray.data`` dataset; ``map_batches`` runs one actor per replica, each
holding a whole ``LLM`` (engine, page pool, prefix cache), and each batch is generated with
continuous batching inside its actor. Results come back as plain rows, in prompt order.
``ray.data`` needs pyarrow: ``pip install 'ray[data]>=2.40'`` (the ``ray-data`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sparsekv.config import EngineConfig
from sparsekv.distributed.replica import replica_threads
from sparsekv.outputs import RequestOutput
from sparsekv.sampling_params import SamplingParams


def output_row(prompt: str, output: RequestOutput) -> dict:
    """The row of one finished request: text, token ids, finish reason, KV usage and the
    prompt tokens taken from the prefix cache."""
    completion = output.outputs[0]
    stats = output.kv_stats
    return {
        "prompt": prompt,
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "kv_tokens_kept": stats.tokens_kept if stats else 0,
        "kv_tokens_full": stats.tokens_full if stats else 0,
        "kv_compression_ratio": stats.compression_ratio if stats else 0.0,
        "kv_sliding_window_ratio": stats.window_ratio if stats else 0.0,
        "cached_tokens": output.num_cached_tokens,
    }


class GenerateActor:
    """One replica of the offline path: an ``LLM`` that generates the batches it is given.

    Args:
        config: the engine configuration (``config.parallel`` sets the thread count).
        params: sampling parameters for every prompt.
        chat: send each prompt as one user message through the chat template.
    """

    def __init__(self, config: EngineConfig, params: SamplingParams, chat: bool) -> None:
        from sparsekv.llm import LLM

        parallel = config.parallel
        torch.set_num_threads(
            replica_threads(parallel.threads_per_rank, parallel.data_parallel_size)
        )
        self.llm = LLM(engine_config=config)
        self.params = params
        self.chat = chat

    def __call__(self, batch: dict) -> dict:
        """Generate one batch: columns ``index`` and ``prompt`` in, the rows' columns out."""
        prompts = [str(p) for p in batch["prompt"]]
        inputs = [[{"role": "user", "content": p}] if self.chat else p for p in prompts]
        outputs = self.llm.generate(inputs, self.params)
        rows = [output_row(p, o) for p, o in zip(prompts, outputs)]
        columns = {name: [row[name] for row in rows] for name in rows[0]}
        return {"index": list(batch["index"]), **columns}


def generate_with_replicas(
    config: EngineConfig,
    prompts: Sequence[str],
    params: SamplingParams,
    chat: bool,
    num_cpus_per_replica: float | None = None,
) -> list[dict]:
    """Generate every prompt on ``config.parallel.data_parallel_size`` actors (``ray.data``).

    Args:
        config: the engine configuration each actor loads.
        prompts: the prompts, split into one batch per replica.
        params: sampling parameters for every prompt.
        chat: send each prompt as one user message through the chat template.
        num_cpus_per_replica: Ray CPUs each actor requests (``None``: its thread count).

    Returns:
        One row per prompt (``output_row``), in prompt order.

    Raises:
        ValueError: ``ray.data`` (or pyarrow) is not installed.
    """
    try:
        import ray.data
    except ImportError:
        raise ValueError(
            "data_parallel_size > 1 needs ray.data: pip install 'ray[data]>=2.40' "
            "(the ray-data extra of the sparsekv checkout)"
        ) from None
    parallel = config.parallel
    num_replicas = parallel.data_parallel_size
    if num_cpus_per_replica is None:
        num_cpus_per_replica = replica_threads(parallel.threads_per_rank, num_replicas)
    items = [{"index": i, "prompt": p} for i, p in enumerate(prompts)]
    dataset = ray.data.from_items(items, override_num_blocks=min(num_replicas, len(items)))
    results = dataset.map_batches(
        GenerateActor,
        fn_constructor_kwargs={"config": config, "params": params, "chat": chat},
        batch_size=max(1, math.ceil(len(items) / num_replicas)),
        concurrency=num_replicas,
        num_cpus=num_cpus_per_replica,
    )
    rows = sorted(results.take_all(), key=lambda row: row["index"])
    return [{k: _plain(v) for k, v in row.items() if k != "index"} for row in rows]


def _plain(value):
    """numpy scalars and arrays (ray.data's columns) as Python values, for JSON."""
    return value.tolist() if hasattr(value, "tolist") else value
