"""`streamload bench`: strategies side by side on one checkpoint."""

from __future__ import annotations

import argparse
import ast
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cold import cold_table, disk_bandwidth, median_rows
from .remote import REMOTE_STRATEGIES, remote_strategy_names, run_remote
from .runner import run_strategy
from .save import run_save
from .save_strategies import CLIENT_SAVERS, SAVE_STRATEGIES, SAVERS
from .strategies import FLOORS, STRATEGIES, keyword_annotation, load_keywords
from .table import markdown_table, median_of, phase_table, write_jsonl

DEFAULT_STRATEGIES = [
    "streamload",
    "streamload_owners",
    "streamload_auto",
    "rank0_broadcast",
    "all_ranks",
    "accelerate_efficient",
    "dcp_hf",
    "hf_native",
]
# --cold: the ways the issue sets streamload against, from a cold page cache.
COLD_STRATEGIES = [
    "streamload",
    "streamload_owners",
    "streamload_auto",
    "rank0_broadcast",
    "dcp_hf",
    "hf_native",
    "fastsafetensors",
]


def load_option(item: str) -> tuple[str, Any]:
    """One ``--options`` item, ``KEY=VALUE``: KEY a keyword of ``load_checkpoint`` (see
    ``load_keywords``), VALUE a Python literal (``ast.literal_eval``: ``True``, ``1048576``,
    ``'cold'``); a bare word that is no literal (``cold``) is the string.

    Raises:
        argparse.ArgumentTypeError: no ``=``, a key that is no such keyword (the message lists
            them), a value that does not parse, or one of the wrong type for a keyword typed
            ``bool`` or ``int`` (``direct_io=ture`` must not pass for a true string).

    Example:
        >>> load_option("direct_io=True")
        ('direct_io', True)
    """
    key, sep, raw = item.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {item!r}")
    allowed = load_keywords()
    if key not in allowed:
        raise argparse.ArgumentTypeError(
            f"{key!r} is not a keyword of streamload.load_checkpoint that the bench passes on; "
            f"one of {', '.join(allowed)} (docs/options.md)"
        )
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        if not raw.isidentifier():
            raise argparse.ArgumentTypeError(f"{key}={raw}: not a Python literal") from None
        value = raw  # read_mode=cold: a bare word is the string
    typed = set(str(keyword_annotation(key)).replace(" ", "").split("|"))
    if typed & {"bool", "int"} and typed <= {"bool", "int", "None"}:  # only plain bool/int keywords
        if value is None:
            ok = "None" in typed
        elif isinstance(value, bool):
            ok = "bool" in typed
        else:
            ok = isinstance(value, int) and "int" in typed
        if not ok:
            raise argparse.ArgumentTypeError(f"{key}={raw}: expected {' | '.join(sorted(typed))}")
    return key, value


def load_options(items: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The parsed ``--options`` as keywords (a key given twice: the last wins)."""
    return dict(items)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint", nargs="?", help="checkpoint directory (omit to generate one with --model-type/--gb)"
    )
    p.add_argument(
        "--model-type", default="qwen2", help="for a generated checkpoint, e.g. qwen2 or qwen3_moe"
    )
    p.add_argument("--gb", type=float, default=0.1, help="size of a generated checkpoint")
    p.add_argument("--experts", type=int, default=64, help="experts per layer of a generated MoE checkpoint")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        metavar="STRATEGY",
        # Checked by the mode that runs them (a save strategy may also be a client's "module:function").
        help="load: "
        + ", ".join(sorted(STRATEGIES))
        + "; --save: "
        + ", ".join([*SAVERS, *CLIENT_SAVERS])
        + " or module:function; --remote: "
        + ", ".join(remote_strategy_names()),
    )
    p.add_argument(
        "--save",
        action="store_true",
        help="measure saving instead: each rank group loads the checkpoint once, then every save strategy "
        f"({', '.join(SAVE_STRATEGIES)}) writes it as a Hugging Face checkpoint (docs/benchmarks.md, Save)",
    )
    p.add_argument(
        "--save-dir",
        default=None,
        help="with --save: where the outputs are written (its file system is the one measured; "
        "default: a temporary directory under --out)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="with --save: every strategy's max_shard_size")
    p.add_argument(
        "--sync",
        action="store_true",
        help="measure the weight sync into colocated vLLM engines instead (the vLLM venv's interpreter: "
        "STREAMLOAD_VLLM_PYTHON or .venv-vllm): streamload, vLLM's ModuleSource, save + reload, the "
        "one-collective floor, on a dense and a per-expert MoE checkpoint of --gb each",
    )
    p.add_argument(
        "--remote",
        action="store_true",
        help="load from S3 instead: the checkpoint is uploaded to a local S3 endpoint (moto) and every "
        f"remote strategy ({', '.join(REMOTE_STRATEGIES)}) loads it, beside the endpoint's ceiling "
        "(needs obstore, moto, s3fs and runai-model-streamer-s3)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="evict the checkpoint from the page cache before each strategy (checked with mincore) and "
        "measure the disk's sequential read bandwidth in the same run",
    )
    p.add_argument("--read-mode", default=None, help="streamload's read_mode (default: auto)")
    p.add_argument(
        "--options",
        nargs="+",
        action="extend",
        type=load_option,
        default=[],
        metavar="KEY=VALUE",
        help="keywords for the streamload strategies' load_checkpoint / from_pretrained, values as "
        "Python literals, e.g. --options direct_io=True prefault=False (docs/options.md)",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket-mib", type=int, default=None)
    p.add_argument("--no-verify", action="store_true", help="skip the correctness pass")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per strategy; the table shows medians and min-max"
    )
    p.add_argument("--out", default="bench_out/bench")
    p.add_argument("--ckpt-dir", default="/tmp/streamload_bench_ckpts")


def run(args: argparse.Namespace) -> int:
    from ..synthetic import make_checkpoint, sized_config

    if args.sync:
        from .sync import run_sync

        return run_sync(args)
    ckpt = args.checkpoint
    label = Path(ckpt).name if ckpt else f"{args.model_type}_{args.gb:g}gb"
    if ckpt is None:
        path = Path(args.ckpt_dir) / (label + (f"_{args.experts}e" if "moe" in args.model_type else ""))
        if not (path / "config.json").exists():
            kw = {"experts": args.experts} if "moe" in args.model_type else {}
            make_checkpoint(
                path, args.model_type, config=sized_config(args.model_type, args.gb, tie=True, **kw)
            )
        ckpt = str(path)
    if args.save:
        return run_save(args, ckpt, label)
    if args.remote:
        return run_remote(args, ckpt, label, load_options(args.options))
    unknown = [s for s in args.strategies or [] if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown load strategies {unknown} (save strategies need --save)")
    os.makedirs(args.out, exist_ok=True)
    opts: dict[str, Any] = {"bucket_bytes": args.bucket_mib << 20} if args.bucket_mib else {}
    if args.read_mode:
        opts["read_mode"] = args.read_mode
    keywords = load_options(args.options)
    opts.update(keywords)  # passed as keywords, never through the environment
    # Recorded with each run (JSON: scalars as they are, anything else as its repr).
    given = {
        k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v) for k, v in keywords.items()
    }
    strategies = args.strategies or (COLD_STRATEGIES if args.cold else DEFAULT_STRATEGIES)
    if not args.cold and any(s.startswith("streamload") for s in strategies):
        # The floor of a warm load, measured in the same run: ratios to it in the table.
        strategies = [*strategies, *(f for f in FLOORS if f not in strategies)]
    rows: list[dict[str, Any]] = []  # one per strategy and rank count (medians)
    raw: list[dict[str, Any]] = []  # every run
    for world in args.ranks:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
        for rep in range(max(1, args.repeat)):
            # Strategies take turns within each repeat: a disk or a host that drifts hits them alike.
            for strategy in strategies:
                extra: dict[str, Any] = {}
                if args.cold:
                    bw = disk_bandwidth(ckpt)
                    stream = disk_bandwidth(ckpt, buffered=True)
                    extra = {
                        "disk_gbps": bw.gbps,
                        "disk_direct": bw.direct,
                        "file_bytes": bw.bytes,
                        "buffered_gbps": stream.gbps,
                    }
                    print(
                        f"disk: {bw.bytes / 1e9:.2f} GB in {bw.seconds:.2f} s = {bw.gbps:.2f} GB/s "
                        f"({'O_DIRECT' if bw.direct else 'buffered'}); one buffered stream "
                        f"{stream.seconds:.2f} s = {stream.gbps:.2f} GB/s",
                        flush=True,
                    )
                verify = not args.no_verify and rep == 0 and strategy not in FLOORS
                r = run_strategy(
                    strategy, ckpt, world, dtype=args.dtype, verify=verify, cold=args.cold, **opts
                )
                row = {**r.to_dict(), "label": label, "repeat": rep, "options": given, **extra}
                runs[strategy].append(row)
                status = "ok" if r.ok else f"FAILED ({r.error})"
                print(
                    f"{label} ranks={world} {strategy}{' cold' if args.cold else ''} #{rep + 1}: {r.seconds:.2f}s"
                    f" (+{r.touch_seconds:.2f}s first touch), first step {r.first_step_seconds:.2f}s, "
                    f"overhead {r.overhead_bytes / 2**20:.0f} MiB, "
                    f"correct={r.correct}, tie held={r.tie_held}: {status}",
                    flush=True,
                )
                if args.cold and r.phases:  # where rank 0's time went (LoadReport.phases)
                    print(
                        "  rank 0: " + ", ".join(f"{k} {v:.3f}s" for k, v in r.phases.items() if v >= 0.001)
                    )
        raw.extend(row for s in strategies for row in runs[s])
        summary = median_rows if args.cold else median_of
        rows.extend(summary(runs[s]) for s in strategies)
    write_jsonl(Path(args.out) / "results.jsonl", rows)  # one row per strategy and rank count
    write_jsonl(Path(args.out) / "runs.jsonl", raw)  # every run
    table = cold_table(rows, ["label"]) if args.cold else markdown_table(rows, ["label"])
    phases = "" if args.cold else phase_table(rows)
    if phases:
        table += "\n\n" + phases
    (Path(args.out) / "table.md").write_text(table + "\n")
    with open(Path(args.out) / "timelines.json", "w") as f:
        json.dump(
            [{k: r[k] for k in ("label", "world", "strategy", "timeline", "ok", "seconds")} for r in rows], f
        )
    from .plot import plot_timelines

    png = plot_timelines(
        [r for r in rows if r.get("repeat", 0) == 0], Path(args.out) / "memory.png", title=f"loading {label}"
    )
    print(table)
    print(f"wrote {Path(args.out) / 'results.jsonl'}, {Path(args.out) / 'table.md'}, {png}")
    return 0
