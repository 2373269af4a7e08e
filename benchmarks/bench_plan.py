"""Planning cost at thousands of ranks, without any process group: the plan one
rank (``owners``), one node's reader (``node``, 8 ranks per node) or one
receiver of the ``src`` reader (``src``) builds for
a table shaped like DeepSeek-V3 671B (61 layers, the first 3 dense, 256 routed
experts per MoE layer stored one tensor each as on the hub, bf16), sharded
FSDP-style (Shard(0)) over 1,024 and 8,192 simulated ranks.

Each rank derives only the placements of the ranks it plans for from the
layout specs (streamload.model.specs), hashes the specs into the digest the
ranks all-gather, and builds its bucket plan (a ``src`` receiver: bucket
boundaries from the specs alone, its own segments only, as
streamload.load.prepare does); the time and the Python memory
peak (tracemalloc, in a separate pass so it does not slow the timed one) are
printed per rank and for a node's reader.

    python benchmarks/bench_plan.py --ranks 1024 8192 [--repeat 3] [--modes src]

Buckets of a ``src`` plan come from the specs alone (one reader sends every
copy of every element, so with replicated layouts their number grows with
the copies; a receiver holds one list slot per bucket and builds only its own
segments).
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import Replicate, Shard

from streamload.model.specs import (
    LayoutSpec,
    MeshInfo,
    global_layout,
    placement_for,
    placements_for,
    spec_digest,
)
from streamload.plan.buckets import Plan, Target, build_plan
from streamload.plan.global_buckets import build_served_plan
from streamload.plan.regions import SourcePiece, identity_piece

H, VOCAB, LAYERS, DENSE, EXPERTS = 7168, 129280, 61, 3, 256
I_DENSE, I_EXPERT = 18432, 2048
Q_LORA, KV_LORA, ROPE, HEADS, QK_HEAD, V_HEAD = 1536, 512, 64, 128, 192, 128
RANKS_PER_NODE = 8
BUCKET_BYTES = 256 << 20  # the GPU default: thousands of ranks are GPUs


def v3_table() -> tuple[dict[str, tuple[str, tuple[int, ...], str]], list[Target]]:
    """The hub table (per-expert tensors) and the fused model's targets with their pieces."""
    table: dict[str, tuple[str, tuple[int, ...], str]] = {}
    targets: list[Target] = []

    def plain(name: str, shape: tuple[int, ...]) -> None:
        table[name] = ("BF16", shape, f"model-{len(table) // 4000:05d}.safetensors")
        targets.append(Target(name, shape, (identity_piece(name, shape),)))

    plain("model.embed_tokens.weight", (VOCAB, H))
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        plain(f"{p}.input_layernorm.weight", (H,))
        plain(f"{p}.post_attention_layernorm.weight", (H,))
        plain(f"{p}.self_attn.q_a_proj.weight", (Q_LORA, H))
        plain(f"{p}.self_attn.q_a_layernorm.weight", (Q_LORA,))
        plain(f"{p}.self_attn.q_b_proj.weight", (HEADS * QK_HEAD, Q_LORA))
        plain(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, H))
        plain(f"{p}.self_attn.kv_a_layernorm.weight", (KV_LORA,))
        plain(f"{p}.self_attn.kv_b_proj.weight", (HEADS * (QK_HEAD - ROPE + V_HEAD), KV_LORA))
        plain(f"{p}.self_attn.o_proj.weight", (H, HEADS * V_HEAD))
        if i < DENSE:
            plain(f"{p}.mlp.gate_proj.weight", (I_DENSE, H))
            plain(f"{p}.mlp.up_proj.weight", (I_DENSE, H))
            plain(f"{p}.mlp.down_proj.weight", (H, I_DENSE))
            continue
        plain(f"{p}.mlp.gate.weight", (EXPERTS, H))
        plain(f"{p}.mlp.gate.e_score_correction_bias", (EXPERTS,))
        for n in ("gate_proj", "up_proj"):
            plain(f"{p}.mlp.shared_experts.{n}.weight", (I_EXPERT, H))
        plain(f"{p}.mlp.shared_experts.down_proj.weight", (H, I_EXPERT))
        gate_up: list[SourcePiece] = []
        down: list[SourcePiece] = []
        for e in range(EXPERTS):
            key = f"{p}.mlp.experts.{e}"
            for j, n in enumerate(("gate_proj", "up_proj")):
                table[f"{key}.{n}.weight"] = ("BF16", (I_EXPERT, H), "experts.safetensors")
                # stack over experts of cat(gate, up): expert e, rows [j*I, (j+1)*I)
                gate_up.append(
                    SourcePiece(
                        f"{key}.{n}.weight", (e, j * I_EXPERT, 0), (1, I_EXPERT, H), (0, 0), (None, 0, 1)
                    )
                )
            table[f"{key}.down_proj.weight"] = ("BF16", (H, I_EXPERT), "experts.safetensors")
            down.append(
                SourcePiece(f"{key}.down_proj.weight", (e, 0, 0), (1, H, I_EXPERT), (0, 0), (None, 0, 1))
            )
        targets.append(Target(f"{p}.mlp.experts.gate_up_proj", (EXPERTS, 2 * I_EXPERT, H), tuple(gate_up)))
        targets.append(Target(f"{p}.mlp.experts.down_proj", (EXPERTS, H, I_EXPERT), tuple(down)))
    plain("model.norm.weight", (H,))
    plain("lm_head.weight", (VOCAB, H))
    return table, targets


def plan_for(
    targets: list[Target],
    dtypes: dict[str, str],
    world: int,
    layout: str,
    ranks: list[int],
    src: bool = False,
) -> tuple[Plan, str]:
    """What one rank does after the table arrives: specs, digest, the served ranks' placements, the plan."""
    if layout == "fsdp":  # one FSDP dim over every rank
        mesh, placements = MeshInfo((world,), tuple(range(world))), (Shard(0),)
    else:  # HSDP: replicas of 64-rank FSDP groups
        mesh, placements = MeshInfo((world // 64, 64), tuple(range(world))), (Replicate(), Shard(0))
    specs = [LayoutSpec(t.shape, "BF16", mesh, placements) for t in targets]
    digest = spec_digest([t.name for t in targets], specs)
    if src:
        layouts = [global_layout(s, world) for s in specs]

        def place(row: int, t_idx: int) -> Any:
            return placement_for(specs[t_idx], ranks[row])

        return build_served_plan(targets, dtypes, layouts, len(ranks), place, BUCKET_BYTES), digest
    return build_plan(targets, dtypes, placements_for(specs, ranks), BUCKET_BYTES), digest


def measure(fn: Callable[[], Any], repeat: int = 1) -> tuple[list[float], int, Any]:
    """(seconds of each timed pass, tracemalloc peak bytes, result): ``repeat`` timed passes,
    then one traced pass (the peak of the same code on the same inputs does not vary)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    tracemalloc.start()
    out = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return times, peak, out


def spread(times: list[float], digits: int = 3) -> str:
    """The median, with [min-max] when there are several passes."""
    med = statistics.median(times)
    if len(times) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(times):.{digits}f}-{max(times):.{digits}f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--repeat", type=int, default=1, help="timed passes per row (median [min-max])")
    ap.add_argument(
        "--modes", nargs="+", default=["owners", "node", "src"], choices=["owners", "node", "src"]
    )
    args = ap.parse_args()
    tt_table, m_table, (table, targets) = measure(v3_table)
    t_table = statistics.median(tt_table)
    dtypes = {k: v[0] for k, v in table.items()}
    total = sum(
        2
        * (t.shape[0] if t.shape else 1)
        * (t.shape[1] if len(t.shape) > 1 else 1)
        * (t.shape[2] if len(t.shape) > 2 else 1)
        for t in targets
    )
    print(
        f"table: {len(table)} checkpoint tensors, {len(targets)} model targets, {total / 1e9:.0f} GB bf16; "
        f"built in {t_table:.2f} s, {m_table / 2**20:.0f} MiB (every rank, independent of the rank count)"
    )
    print()
    print(
        "| ranks | layout | mode | plans for | plan s | total s (with table) | plan peak MiB | total peak MiB | buckets | segments | bytes planned |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        for layout in ("fsdp", "hsdp64"):
            # Rank 3: in the first node, which holds a part of every tensor (with FSDP over
            # thousands of ranks, later ranks hold none of the 256-expert stacks).
            me = 3
            node = list(
                range(me // RANKS_PER_NODE * RANKS_PER_NODE, (me // RANKS_PER_NODE + 1) * RANKS_PER_NODE)
            )
            modes = (
                ("owners (one rank)", [me], False),
                ("node (one node's reader)", node, False),
                ("src (one receiver)", [me], True),
            )
            for mode, ranks, src in modes:
                if mode.split()[0] not in args.modes:
                    continue

                def run(
                    ranks: list[int] = ranks, world: int = world, layout: str = layout, src: bool = src
                ) -> tuple[Plan, str]:
                    return plan_for(targets, dtypes, world, layout, ranks, src)

                times, peak, (plan, _) = measure(run, args.repeat)
                segs = sum(len(s) for b in plan.buckets for s in b.segments)
                print(
                    f"| {world} | {layout} | {mode} | {len(ranks)} | {spread(times)} | "
                    f"{spread([t + t_table for t in times], 2)} | "
                    f"{peak / 2**20:.1f} | {(peak + m_table) / 2**20:.0f} | {len(plan.buckets)} | {segs} | "
                    f"{sum(plan.rank_bytes) / 2**30:.1f} GiB |"
                )


if __name__ == "__main__":
    main()
