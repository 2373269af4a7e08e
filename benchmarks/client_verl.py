"""verl 0.9.1's own FSDP engine load against the same build with streamload swapped in, side by
side in one run: load time, peak anonymous memory per rank, bit-exact, medians of N repeats.

Each run is verl's own code (``FSDPEngine._build_module`` + ``_build_fsdp_module``: from_pretrained
under get_init_weight_context_manager, apply_fsdp2, fsdp2_load_full_state_dict) in a fresh gloo group
of CPU ranks, timed from the start of the build to the loaded model on every rank (what the engine's
model build costs). Strategies take turns within each repeat. "peak anon / rank" is the ranks'
anonymous memory (RssAnon, sampled every 10 ms, together) over the baseline, divided by the rank
count; "bit-exact" is every parameter and buffer against transformers' from_pretrained (first repeat).

    python benchmarks/client_verl.py --gb 0.25 --ranks 2 4 --repeat 3

Rows: verl_own (verl's loader, tie guard kept: every rank runs from_pretrained for a tied model),
streamload (streamload's fsdp2_load_full_state_dict, guard kept), streamload_meta (streamload, guard
dropped: ranks >= 1 build on meta, tie_weights() before apply_fsdp2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from streamload.tools.bench.runner import run_strategy
from streamload.tools.synthetic import make_checkpoint, sized_config

MiB = 1 << 20
ENGINE = "streamload.tools.verl_engine"
STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "verl_own": (f"{ENGINE}:bench_verl_own", {}),
    "streamload": (f"{ENGINE}:bench_verl_streamload", {}),
    "streamload_meta": (f"{ENGINE}:bench_verl_streamload", {"meta_everywhere": True}),
}


def ensure_checkpoint(root: Path, gb: float) -> str:
    path = root / f"qwen2_tied_{gb:g}gb"
    if not (path / "config.json").exists():
        make_checkpoint(path, "qwen2", config=sized_config("qwen2", gb, tie=True), max_shard_size="1GB")
    return str(path)


def _median(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=0.25, help="checkpoint size (bf16 on disk; loaded as fp32)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="verl's model_dtype (fp32 masters by default)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--ckpt-dir", default="/tmp/streamload_bench_ckpts")
    ap.add_argument("--out", default="bench_out/client_verl")
    args = ap.parse_args()
    root = Path(args.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    ckpt = ensure_checkpoint(root, args.gb)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for ws in args.ranks:
        for rep in range(args.repeat):
            for name in args.strategies:
                target, opts = STRATEGIES[name]
                r = run_strategy(target, ckpt, ws, dtype=args.dtype, verify=rep == 0, **opts).to_dict()
                r.pop("timeline", None)
                runs.setdefault((ws, name), []).append(r)
                print(
                    f"ws={ws} rep={rep} {name}: {r['seconds']:.2f}s peak anon {r['peak_anon_over_baseline'] / MiB:.0f} MiB "
                    f"correct={r['correct']} {'ok' if r['ok'] else 'FAILED: ' + str(r['error'])}",
                    flush=True,
                )
    with open(Path(args.out) / "runs.jsonl", "w") as f:
        for (ws, name), rs in runs.items():
            for r in rs:
                f.write(json.dumps({"ranks": ws, "name": name, **r}) + "\n")
    print()
    print(
        "| checkpoint | ranks | load path | load s | peak anon / rank MiB | time vs verl_own | "
        "bit-exact |\n|---|---|---|---|---|---|---|"
    )
    for ws in args.ranks:
        base = [r["seconds"] for r in runs.get((ws, "verl_own"), []) if r["ok"]]
        for name in args.strategies:
            rs = runs[(ws, name)]
            ok = [r for r in rs if r["ok"]]
            secs = [r["seconds"] for r in ok]
            anon = [r["peak_anon_over_baseline"] / ws / MiB for r in ok]
            ratio = f"{statistics.median(secs) / statistics.median(base):.2f}x" if secs and base else "-"
            verified = [r["correct"] for r in rs if r.get("correct") is not None]
            exact = ("yes" if all(verified) else "NO") if verified else "not verified"
            if len(ok) < len(rs):
                exact += f" ({len(rs) - len(ok)} runs failed: {next(r['error'] for r in rs if not r['ok'])})"
            print(
                f"| qwen2 tied {args.gb:g} GB bf16 -> {args.dtype} | {ws} | {name} | {_median(secs)} | "
                f"{_median(anon)} | {ratio} | {exact} |"
            )


if __name__ == "__main__":
    main()
