"""``sparsekv bench spec-decode``: speculative decoding against plain decoding, offline.

A built-in set of code-editing chat prompts (repeat a function, rename a variable, add type
hints: the answer copies most of the prompt, so prompt lookup hits) runs at each batch size of
``--batch-sizes`` twice on one engine: once with every request opted out of speculation
(``speculative: {"method": null}``), once with the engine's drafter (``--speculative-method``,
``ngram`` by default). Greedy decoding, fixed ``--output-len``, EOS ignored. Reported per run:
output tokens/s, TPOT P50 (each request's ``(last - first token) / (tokens - 1)``), the drafts'
mean accepted length and acceptance rate, the drafting and the verification milliseconds per
verifying step (a self-drafting model's draft forwards counted as drafting), and whether the
two runs' tokens agree. With prefix caching on (the default), each batch's prompts are
prefilled once before both runs (``max_tokens`` 1), so neither run's wall time holds a cold
prefill the other skips. ``--rounds N`` runs the pair N times back to back; the rows then carry
each figure's median over the rounds and ``speedup`` is the median of the per-round ratios
(``speedup_rounds``), which drift of the machine between rounds moves less.

``--prompt-tokens N`` replaces the built-in prompts by long ones of about ``N`` tokens (a
Python module of renamed copies of the snippets and a task about one function in its middle).
With ``--speculative-method sparse_self`` the rows also carry the bytes a step reads (weights,
the whole cache for a target step, the draft view for a draft forward) and the bandwidth bound
they imply (``bench.spec_bytes``), at ``--read-bandwidth`` GB/s or a probed figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time

from sparsekv.bench import common, spec_bytes
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.cli_help import doc_parser
from sparsekv.engine.prompts import render_chat
from sparsekv.sampling_params import SamplingParams
from sparsekv.spec_decode import self_draft

_CODE = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for value in values:\n        total += (value - m) ** 2\n"
    "    return total / len(values)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def is_empty(self):\n        return len(self.items) == 0\n",
    "def fizzbuzz(n):\n    result = []\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n"
    "            result.append('FizzBuzz')\n        elif i % 3 == 0:\n"
    "            result.append('Fizz')\n        elif i % 5 == 0:\n"
    "            result.append('Buzz')\n        else:\n            result.append(str(i))\n"
    "    return result\n",
    "def read_config(path):\n    config = {}\n    with open(path) as handle:\n"
    "        for line in handle:\n            line = line.strip()\n"
    "            if not line or line.startswith('#'):\n                continue\n"
    "            key, value = line.split('=', 1)\n            config[key.strip()] = value.strip()\n"
    "    return config\n",
]
_TASKS = [
    "Repeat this Python code exactly:\n\n{code}",
    "Rename the variable `total` to `acc` (or, if there is none, the first function's first "
    "parameter to `data`) and print the whole code:\n\n{code}",
    "Add a one-line docstring to every function and print the whole code:\n\n{code}",
    "Add type hints to this code and print the whole code:\n\n{code}",
]

SUMMARY_COLUMNS = (
    "system",
    "batch_size",
    "output_tokens",
    "wall_s",
    "output_tok_s",
    "tpot_p50_ms",
    "mean_accepted_length",
    "acceptance_rate",
    "draft_ms_per_step",
    "verify_ms_per_step",
    "speedup",
    "same_tokens",
)
BYTES_COLUMNS = (
    "system",
    "batch_size",
    "context_slots",
    "view_slots",
    "target_step_mb",
    "draft_step_mb",
    "plain_bound_tok_s",
    "self_bound_tok_s",
)


def build_parser() -> argparse.ArgumentParser:
    parser = doc_parser("sparsekv bench spec-decode", __doc__)
    parser.add_argument(
        "--batch-sizes", default="1,4,16", help="comma-separated batch sizes (default: 1,4,16)"
    )
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens each")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="plain / speculative pairs per batch size; rows report per-round medians and the "
        "median of the per-round speedups (default 1)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="long prompts of about this many tokens (default 0: the built-in short ones)",
    )
    parser.add_argument(
        "--read-bandwidth",
        type=float,
        default=None,
        help="GB/s for the bytes-read bound of sparse_self rows (default: probed)",
    )
    common.add_common_args(parser, "reports/spec_decode.json")
    add_engine_args(parser)
    return parser


def code_edit_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """``num_prompts`` chat-templated prompts cycling over the built-in code-editing tasks."""
    prompts = []
    for i in range(num_prompts):
        code, task = _CODE[i % len(_CODE)], _TASKS[(i // len(_CODE)) % len(_TASKS)]
        messages = [{"role": "user", "content": task.format(code=code)}]
        prompts.append(render_chat(tokenizer, messages))
    return prompts


def long_prompts(tokenizer, num_prompts: int, num_tokens: int) -> list[list[int]]:
    """``num_prompts`` chat prompts of about ``num_tokens`` tokens: a module of renamed copies
    of the built-in snippets and a task about one function in the middle of it."""
    one_copy = sum(len(tokenizer.encode(code)) for code in _CODE) / len(_CODE)
    num_copies = max(1, int((num_tokens - 80) / one_copy))
    prompts = []
    for i in range(num_prompts):
        copies = [
            _CODE[(i + c) % len(_CODE)].replace("def ", f"def m{c}_") for c in range(num_copies)
        ]
        middle = copies[num_copies // 2]
        name = middle.split("def ", 1)[1].split("(", 1)[0]
        task = _TASKS[i % len(_TASKS)].split(":")[0]
        text = (
            "Here is a Python module:\n\n" + "\n\n".join(copies) + f"\n\n{task}, for the "
            f"function `{name}` only."
        )
        prompts.append(render_chat(tokenizer, [{"role": "user", "content": text}]))
    return prompts


def main(argv: list[str] | None = None, *, checkpoint=None) -> int:
    """Parse flags, run the benchmark, print a table and write the report."""
    args = build_parser().parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    args.command = "sparsekv bench spec-decode " + shlex.join(given)
    document = run_spec_decode(args, checkpoint=checkpoint)
    print(common.format_table(document["rows"], SUMMARY_COLUMNS))
    if "target_step_mb" in document["rows"][0]:
        print(common.format_table(document["rows"], BYTES_COLUMNS))
    print(f"wrote {args.output}")
    return 0


def run_spec_decode(args: argparse.Namespace, checkpoint=None) -> dict:
    """Run plain and speculative decoding at each batch size; write ``args.output`` (JSON and
    Markdown).

    Returns:
        The report: ``rows`` (one per system and batch size) and ``provenance``.

    Raises:
        ValueError: a batch size below 1.
    """
    load_start = common.load_average()
    common.apply_threads(args.threads)
    config = engine_config_from_args(args)
    if config.speculative.method is None:
        config.speculative = dataclasses.replace(config.speculative, method="ngram")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes: every size must be >= 1, got {args.batch_sizes!r}")
    if args.rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {args.rounds}")
    checkpoint = common.load_checkpoint(config, checkpoint)
    engine = common.build_engine(config, checkpoint)
    if not args.no_warmup:
        common.warm_up(engine, engine.vocab_size)
    bandwidth = None
    if config.speculative.method == "sparse_self":
        bandwidth = args.read_bandwidth * 1e9 if args.read_bandwidth else None
        bandwidth = bandwidth or spec_bytes.measure_bandwidth()
    rows = []
    for batch_size in batch_sizes:
        if args.prompt_tokens > 0:
            prompts = long_prompts(engine.tokenizer, batch_size, args.prompt_tokens)
        else:
            prompts = code_edit_prompts(engine.tokenizer, batch_size)
        if config.cache.enable_prefix_caching:
            _run(engine, prompts, 1, {"method": None}, "prime")  # both runs then hit the cache
        plains, specs = [], []
        for _ in range(args.rounds):  # back to back: a round's two runs share the machine's state
            plains.append(_run(engine, prompts, args.output_len, {"method": None}, "plain"))
            specs.append(_run(engine, prompts, args.output_len, None, config.speculative.method))
        speeds = [[r["output_tok_s"] for r in runs] for runs in (specs, plains)]
        plain, spec = median_row(plains), median_row(specs)
        spec["speedup"] = common.paired_ratio(*speeds)
        if args.rounds > 1:
            spec["speedup_rounds"] = [round(a / b, 4) for a, b in zip(*speeds)]
        same = sum(a == b for a, b in zip(plain.pop("tokens"), spec.pop("tokens")))
        spec["same_tokens"] = f"{same}/{batch_size}"
        if bandwidth is not None:
            _add_bytes(engine, config.speculative, prompts, args.output_len, bandwidth, plain, spec)
        rows += [plain, spec]
    document = {
        "rows": rows,
        "provenance": common.bench_provenance(config, vars(args), load_start),
    }
    if bandwidth is not None:
        document["read_bandwidth"] = bandwidth
    if getattr(args, "command", None):
        document["provenance"]["command"] = args.command
    common.write_json(args.output, document)
    markdown = args.output.rsplit(".", 1)[0] + ".md"
    common.write_markdown(markdown, "Speculative decoding", rows, document["provenance"])
    return document


# Per-run figures a multi-round row reports as the median over its rounds.
_MEDIAN_KEYS = ("wall_s", "output_tok_s", "tpot_p50_ms", "draft_ms_per_step", "verify_ms_per_step")


def median_row(runs: list[dict]) -> dict:
    """The first run's row with each of ``_MEDIAN_KEYS`` replaced by its median over ``runs``
    (a figure some run lacks stays the first run's).

    Raises:
        ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("median_row: no runs")
    row = dict(runs[0])
    for key in _MEDIAN_KEYS:
        values = [run[key] for run in runs]
        if all(value is not None for value in values):
            row[key] = statistics.median(values)
    return row


def _add_bytes(engine, spec, prompts, output_len: int, bandwidth: float, *rows: dict) -> None:
    """The bytes-read figures of each row (``bench.spec_bytes``) at the run's mean context."""
    context = round(sum(map(len, prompts)) / len(prompts) + output_len / 2)
    block_size = engine.kv.block_size
    view = spec_bytes.view_slots(
        context, block_size, spec.draft_sink_tokens, spec.draft_recent_tokens
    )
    model = engine.parts.model
    weights = spec_bytes.weight_bytes(model)
    draft_vocab = self_draft.draft_vocab(spec.draft_vocab_size)
    draft_weights = spec_bytes.draft_weight_bytes(model, weights, draft_vocab, len(prompts))
    per_slot = spec_bytes.slot_bytes(engine)
    for row in rows:
        row.update(
            spec_bytes.step_figures(
                weights,
                per_slot,
                context,
                len(prompts),
                spec.num_speculative_tokens,
                view,
                row["mean_accepted_length"],
                bandwidth,
                draft_weights,
            )  # fmt: skip
        )


def _run(engine, prompts, output_len: int, speculative: dict | None, system: str) -> dict:
    """One batch of greedy requests; its throughput, TPOT and the drafts' statistics."""
    params = SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True, speculative=speculative
    )
    requests = [common.BenchRequest(f"{system}-{i}", p, params) for i, p in enumerate(prompts)]
    before = dataclasses.replace(engine.stats.spec_decode)
    start = time.perf_counter()
    outputs, trace = common.run_requests(engine, requests)
    wall = time.perf_counter() - start
    after = engine.stats.spec_decode
    num_drafts = after.num_drafts - before.num_drafts
    num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    tpots = []
    for output in outputs.values():
        n = len(output.outputs[0].token_ids)
        if n > 1:
            tpots.append((output.metrics["last_token"] - output.metrics["first_token"]) / (n - 1))
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs.values())
    verify_steps = after.num_verify_steps - before.num_verify_steps
    per_step = 1000 / verify_steps if verify_steps else None
    return {
        "system": system,
        "batch_size": len(prompts),
        "output_tokens": num_tokens,
        "wall_s": wall,
        "output_tok_s": num_tokens / wall,
        "tpot_p50_ms": 1000 * common.percentile(tpots, 50),
        "mean_accepted_length": 1 + accepted / num_drafts if num_drafts else None,
        "acceptance_rate": accepted / num_draft_tokens if num_draft_tokens else None,
        "num_steps": trace.num_steps,
        "draft_ms_per_step": per_step and per_step * (after.draft_seconds - before.draft_seconds),
        "verify_ms_per_step": per_step
        and per_step * (after.verify_seconds - before.verify_seconds),
        "tokens": [outputs[r.request_id].outputs[0].token_ids for r in requests],
    }
