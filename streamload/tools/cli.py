"""The `streamload` command: inspect, demo, ingest, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..io.checkpoint import Checkpoint
    from ..io.summary import format_summary, summarize

    ckpt = Checkpoint(args.checkpoint, mode=args.mode)
    print(format_summary(summarize(ckpt), args.checkpoint))
    print(_quantized_groups(ckpt, args.checkpoint))
    if args.tensors:
        for t in ckpt.tensors:
            print(f"{t.name}\t{t.dtype}\t{list(t.shape)}\t{t.file}\t{t.offset}\t{t.nbytes}")
    return 0


def _quantized_groups(ckpt, path: str) -> str:
    import json
    from pathlib import Path

    from ..plan.quant import quant_groups, quantized_view, scheme_from_config

    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
    scheme = scheme_from_config(cfg)
    _, quant = quantized_view({t.name: (t.dtype, t.shape, t.file) for t in ckpt.tensors}, scheme)
    groups = quant_groups(quant)
    if not groups:
        return "quantized groups: none"
    head = f"quantized groups ({scheme.method if scheme else 'detected fp8'}; loads dequantized by default):"
    return "\n".join([head] + [f"  {p}  {kind} block={b[0]}x{b[1]} tensors={n}" for p, kind, b, n in groups])


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(world_size=args.ranks, keep=args.keep)


def _cmd_ingest(args: argparse.Namespace) -> int:
    import torch

    from .ingest import ingest

    dtype = getattr(torch, args.dtype) if args.dtype else None
    rep = ingest(args.src, args.dst, dtype=dtype, max_shard_size=args.max_shard_size, threads=args.threads)
    print(
        f"wrote {args.dst}: {rep.tensors} tensors in {rep.files} files, {rep.bytes_written} bytes; "
        f"{rep.converted} tensors converted"
        + (f"; dropped unexpected keys: {rep.dropped}" if rep.dropped else "")
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamload", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarise a checkpoint's tensor table")
    p.add_argument("checkpoint", help="a .safetensors file or a checkpoint directory")
    p.add_argument("--mode", default="auto", choices=["auto", "mmap", "pread", "cold"])
    p.add_argument("--tensors", action="store_true", help="also list every tensor")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("ingest", help="rewrite a per-expert MoE checkpoint in the model's fused layout")
    p.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="output directory (must not exist; written atomically)")
    p.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bfloat16")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=_cmd_ingest)

    p = sub.add_parser("bench", help="compare loading strategies side by side (time, memory, correctness)")
    from .bench.cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("demo", help="generate a small checkpoint, load it and compare")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--keep", default=None, help="write the demo checkpoint here instead of a temp dir")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `streamload` command."""
    from ..errors import HF_MODULES, StreamloadError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except StreamloadError as exc:
        print(f"streamload: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in HF_MODULES:
            raise
        print(f"streamload: error: {exc}\n  hint: pip install 'streamload[hf]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
