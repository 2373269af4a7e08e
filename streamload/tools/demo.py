"""`streamload demo`: a small tied MoE checkpoint, loaded with 4 CPU ranks,
verified, and compared with the rank-0 broadcast and every-rank ways."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def run_demo(world_size: int = 4, keep: str | None = None) -> int:
    """Runs the demo; returns a process exit code (0: everything verified)."""
    from .bench.runner import BenchGroup
    from .synthetic import make_checkpoint, sized_config

    t0 = time.perf_counter()
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="streamload_demo_"))
    ckpt = root / "tied_moe"
    try:
        if not (ckpt / "config.json").exists():
            cfg = sized_config("qwen3_moe", 0.06, tie=True, experts=16, expert_intermediate=128)
            make_checkpoint(ckpt, "qwen3_moe", config=cfg, max_shard_size="20MB")
        nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        print(f"checkpoint: {ckpt} ({nbytes / MiB:.0f} MiB, tied, {cfg_summary(ckpt)})", flush=True)
        print(f"starting {world_size} CPU ranks (gloo) ...", flush=True)
        group = BenchGroup(world_size)
        rows = []
        try:
            for strategy in ("streamload", "streamload_owners", "rank0_broadcast", "all_ranks"):
                r = group.run(strategy, str(ckpt), timeout=300)
                rows.append(r)
                if not r.ok:
                    break
        finally:
            group.close(kill=not all(r.ok for r in rows))
        print()
        print(
            f"| strategy ({world_size} ranks) | load s | memory over baseline minus shards | correct | tie held |"
        )
        print("|---|---|---|---|---|")
        for r in rows:
            if r.ok:
                print(
                    f"| {r.strategy} | {r.seconds:.2f} | {r.overhead_bytes / MiB:.0f} MiB | {r.correct} | {r.tie_held} |"
                )
            else:
                print(f"| {r.strategy} | failed: {r.error} | | | |")
        ok = bool(rows) and all(r.ok and r.correct for r in rows) and rows[0].tie_held is True
        print(
            f"\n{'demo passed' if ok else 'demo FAILED'}: every parameter of every strategy compared bit for bit "
            f"with transformers.from_pretrained ({time.perf_counter() - t0:.0f}s in all)"
        )
        return 0 if ok else 1
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def cfg_summary(ckpt: Path) -> str:
    import json

    cfg = json.loads((ckpt / "config.json").read_text())
    return f"{cfg.get('model_type')}, {cfg.get('num_hidden_layers')} layers, {cfg.get('num_experts', cfg.get('num_local_experts'))} experts per layer"
