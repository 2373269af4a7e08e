"""``streamload bench --remote``: loading a checkpoint served from S3, side by side.

The checkpoint is uploaded once to a local S3 endpoint (``LocalS3``: moto on loopback, ranged GETs
reading only their range; the upload is not timed). Then, per rank count and ``--repeat`` times
(strategies taking turns within a repeat), each strategy runs on every rank of a fresh gloo group
through the load bench's runner: the same clock (load, then a first touch and an in-place write of
every shard, as a first optimizer step), the same memory sampling and the same bit-exact pass
against transformers' ``from_pretrained`` of the local copy (``remote_strategies`` holds the
strategies). Two ceilings read the same objects with no model at all, each rank its 1/N share of
the bytes in 8 MiB ranged GETs, 16 in flight: ``ceiling`` with obstore (the loader's client),
``ceiling_s3fs`` with s3fs, so the choice of client rests on a measurement.

Per strategy the table gives the load and load + first step times (median, min-max), the model's
bytes over that time (GB/s), the time against the obstore ceiling's, the bytes fetched by all ranks
over the bytes of the safetensors objects (streamload: its LoadReport's ``remote_bytes``; the others:
the sizes of what they read), each rank's peak RSS (``VmHWM`` at the end of its load) and peak
anonymous memory over its baseline (sampled through the first step), and bit-exactness.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .runner import RunResult, run_strategy
from .save import checkpoint_bytes
from .table import MiB, _timing, baseline_row, median_of, render_table, write_jsonl

# runai: rank 0 streams and broadcasts; every rank streaming (runai_every_rank, run when named)
# fetches N times the bytes and measured slower (2 ranks, qwen2 and qwen3_moe checkpoints).
REMOTE_STRATEGIES = [
    "ceiling",
    "ceiling_s3fs",
    "streamload_src",
    "streamload_owners",
    "runai",
    "download_then_load",
]
CEILINGS = frozenset({"ceiling", "ceiling_s3fs"})  # no model: nothing to verify
BUCKET = "streamload-bench"
MODULE = "streamload.tools.bench.remote_strategies"


def remote_strategy_names() -> list[str]:
    """Every strategy ``--remote`` runs (the default list, then the variants run only when named)."""
    from .remote_strategies import REMOTE_LOADERS

    return [*REMOTE_STRATEGIES, *(s for s in REMOTE_LOADERS if s not in REMOTE_STRATEGIES)]


def read_stats(stats_dir: str, world: int) -> dict[str, list[Any]]:
    """Each rank's figures (``remote_strategies.record``): bytes, requests, retries and peak RSS at
    the end of the load, by rank; None where a rank recorded none or its client does not count it."""
    per_rank = []
    for rank in range(world):
        path = Path(stats_dir) / f"{rank}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    return {k: [s.get(k) for s in per_rank] for k in ("bytes", "requests", "retries", "peak_rss")}


def run_remote_strategy(
    strategy: str, ckpt: str, world: int, remote: dict[str, Any], *, dtype: str, verify: bool, **opts: Any
) -> dict[str, Any]:
    """One run of ``strategy`` on ``world`` fresh ranks against the uploaded checkpoint.

    Args:
        strategy: a name of ``remote_strategies.REMOTE_LOADERS``.
        ckpt: the local copy (the correctness pass's reference).
        remote: ``remote_url``, ``remote_options`` (obstore's) and ``remote_env`` (AWS_*).
        dtype, verify: as the load bench's runner takes them.
        opts: keywords passed to streamload's ``from_pretrained``.

    Returns:
        The RunResult as a dict, named ``strategy``, with ``fetched_bytes``, ``requests``,
        ``retries`` and ``peak_rss`` (each rank's VmHWM at the end of its load) by rank.
    """
    stats_dir = tempfile.mkdtemp(prefix="streamload_remote_stats_")
    try:
        res: RunResult = run_strategy(
            f"{MODULE}:{strategy}",
            ckpt,
            world,
            dtype=dtype,
            verify=verify and strategy not in CEILINGS,
            stats_dir=stats_dir,
            **remote,
            **opts,
        )
        stats = read_stats(stats_dir, world)
    finally:
        shutil.rmtree(stats_dir, ignore_errors=True)
    return {
        **res.to_dict(),
        "strategy": strategy,
        "fetched_bytes": stats["bytes"],
        "requests": stats["requests"],
        "retries": stats["retries"],
        "peak_rss": stats["peak_rss"],  # VmHWM: the runner's ru_maxrss counts the parent's RSS
    }


def _total(values: Sequence[int | None] | None) -> int | None:
    """The ranks' sum, or None when any rank did not count it."""
    if not values or any(v is None for v in values):
        return None
    return sum(int(v) for v in values if v is not None)


def _per_rank(values: Sequence[int | None]) -> str:
    return "/".join("-" if v is None else f"{v / MiB:.0f}" for v in values) + " MiB"


def remote_table(rows: Sequence[dict[str, Any]], group_keys: Sequence[str], baseline: str = "ceiling") -> str:
    """One line per strategy and rank count: times, GB/s of the model's bytes over load + first
    step, the time against ``baseline`` (the obstore ceiling), bytes fetched over bytes needed,
    requests and retries (all ranks), each rank's peak RSS and peak anonymous memory over its
    baseline, and whether every tensor equals transformers' bit for bit."""
    head = [
        *group_keys,
        "ranks",
        "strategy",
        "load s (min-max)",
        "load + first step s (min-max)",
        "GB/s",
        "vs " + baseline,
        "fetched / needed",
        "requests",
        "retries",
        "peak RSS per rank (load)",
        "peak anon per rank",
        "bit-exact",
    ]

    def cells(d: dict[str, Any]) -> list[str]:
        seconds = d["first_step_seconds"]
        base = baseline_row(rows, d, baseline, group_keys)
        fetched, requests, retries = (_total(d.get(k)) for k in ("fetched_bytes", "requests", "retries"))
        return [
            _timing(d, "seconds"),
            _timing(d, "first_step_seconds"),
            f"{d['needed_bytes'] / seconds / 1e9:.2f}" if seconds else "-",
            f"{seconds / base['first_step_seconds']:.2f}x" if base and base["first_step_seconds"] else "-",
            f"{fetched / d['needed_bytes']:.2f}" if fetched is not None and d["needed_bytes"] else "-",
            "-" if requests is None else str(requests),
            "-" if retries is None else str(retries),
            _per_rank(d["peak_rss"]),
            _per_rank(d["peak_anon_per_rank"]),
            "-" if d.get("correct") is None else str(d["correct"]),
        ]

    return render_table(head, rows, group_keys, cells)


def run_remote(args: argparse.Namespace, ckpt: str, label: str, opts: dict[str, Any]) -> int:
    """``streamload bench --remote``: uploads ``ckpt`` to a local S3 endpoint, then runs every
    strategy per rank count ``--repeat`` times; writes results.jsonl (medians), runs.jsonl (every
    run) and table.md to ``--out``.

    Args:
        args: the bench's arguments (``--ranks``, ``--strategies``, ``--repeat``, ``--dtype``,
            ``--no-verify``, ``--out``).
        ckpt, label: the local checkpoint and its name in the table.
        opts: keywords for streamload's ``from_pretrained`` (``--options``).
    """
    if args.cold or args.save:
        raise SystemExit("--remote measures loads from S3: --cold and --save do not apply")
    names = remote_strategy_names()
    strategies = args.strategies or REMOTE_STRATEGIES
    unknown = [s for s in strategies if s not in names]
    if unknown:
        raise SystemExit(f"--remote: unknown strategies {unknown}; one of {names}")
    try:
        import moto  # noqa: F401 - LocalS3's server, imported only when it starts
        import obstore  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"--remote needs moto[server] and obstore ({exc})") from exc
    from .remote_strategies import read_once
    from .s3 import LocalS3

    os.makedirs(args.out, exist_ok=True)
    needed = checkpoint_bytes(ckpt)
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    with LocalS3() as s3:
        url = s3.upload_dir(ckpt, BUCKET, label)
        remote = {"remote_url": url, "remote_options": dict(s3.storage_options), "remote_env": dict(s3.env)}
        read_once(url, s3.storage_options)  # not timed: the first strategy meets a warm endpoint too
        print(f"uploaded {ckpt} ({needed / 1e9:.3f} GB of safetensors) to {url}", flush=True)
        for world in args.ranks:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
            for rep in range(max(1, args.repeat)):
                for strategy in strategies:  # taking turns: an endpoint that drifts hits them alike
                    verify = not args.no_verify and rep == 0
                    row = run_remote_strategy(
                        strategy, ckpt, world, remote, dtype=args.dtype, verify=verify, **opts
                    )
                    row.update(label=label, repeat=rep, needed_bytes=needed)
                    runs[strategy].append(row)
                    fetched = _total(row["fetched_bytes"])
                    print(
                        f"{label} ranks={world} {strategy} #{rep + 1}: {row['seconds']:.2f}s, first step "
                        f"{row['first_step_seconds']:.2f}s, fetched "
                        f"{'-' if fetched is None else f'{fetched / 1e9:.3f} GB'}, correct={row['correct']}: "
                        f"{'ok' if row['ok'] else 'FAILED (' + str(row['error']) + ')'}",
                        flush=True,
                    )
            raw.extend(row for s in strategies for row in runs[s])
            rows.extend(median_of(runs[s]) for s in strategies)
    write_jsonl(Path(args.out) / "results.jsonl", rows)
    write_jsonl(Path(args.out) / "runs.jsonl", raw)
    table = remote_table(rows, ["label"])
    (Path(args.out) / "table.md").write_text(table + "\n")
    print(table)
    print(f"wrote {Path(args.out) / 'results.jsonl'}, {Path(args.out) / 'table.md'}")
    return 0
