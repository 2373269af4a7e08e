"""Summaries of a checkpoint's tensor table: what `streamload inspect` prints."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from .checkpoint import Checkpoint, TensorInfo

# model.layers.3.mlp.experts.17.gate_proj.weight -> (model.layers.3.mlp.experts, 17, gate_proj.weight)
EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<suffix>.+)$")
EMBED_SUFFIXES = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "tok_embeddings.weight",
)
HEAD_SUFFIXES = ("lm_head.weight", "embed_out.weight", "output.weight")


@dataclass
class ExpertGroup:
    """Per-expert tensors that a model may fuse: one pattern, many experts."""

    pattern: str  # e.g. model.layers.*.mlp.experts.*.gate_proj.weight
    layers: int
    experts: int
    tensors: int


@dataclass
class Summary:
    tensors: int
    total_bytes: int
    bytes_by_dtype: dict[str, int]
    files: list[tuple[str, int, int]]  # (path, tensors, bytes)
    expert_groups: list[ExpertGroup] = field(default_factory=list)
    tie_candidates: list[str] = field(default_factory=list)


def expert_groups(infos: list[TensorInfo]) -> list[ExpertGroup]:
    """Groups per-expert keys by pattern (layer and expert indices wildcarded)."""
    experts: dict[str, set[tuple[str, int]]] = defaultdict(set)
    layers: dict[str, set[str]] = defaultdict(set)
    counts: Counter[str] = Counter()
    for t in infos:
        m = EXPERT_KEY.match(t.name)
        if not m:
            continue
        prefix_pattern = re.sub(r"\.\d+\.", ".*.", m["prefix"] + ".")[:-1]
        pattern = f"{prefix_pattern}.*.{m['suffix']}"
        experts[pattern].add((m["prefix"], int(m["index"])))
        layers[pattern].add(m["prefix"])
        counts[pattern] += 1
    out: list[ExpertGroup] = []
    for pattern in sorted(experts):
        per_layer = Counter(prefix for prefix, _ in experts[pattern])
        out.append(ExpertGroup(pattern, len(layers[pattern]), max(per_layer.values()), counts[pattern]))
    return out


def tie_candidates(names: list[str]) -> list[str]:
    """Describes embedding / output-head pairs that a tied model would share."""
    embeds = [n for n in names if n.endswith(EMBED_SUFFIXES)]
    heads = [n for n in names if n.endswith(HEAD_SUFFIXES)]
    out: list[str] = []
    for e in embeds:
        if heads:
            out.extend(f"{e} and {h} both present (tied models keep only the first)" for h in heads)
        else:
            out.append(f"{e} present, no output head: tied (or headless) model")
    if heads and not embeds:
        out.extend(f"{h} present, no input embedding: tied with the head as canonical" for h in heads)
    return out


def summarize(ckpt: Checkpoint) -> Summary:
    """Builds the summary that `streamload inspect` prints."""
    infos = ckpt.tensors
    by_dtype: Counter[str] = Counter()
    per_file: dict[str, list[int]] = {f.path: [0, 0] for f in ckpt.files}
    for t in infos:
        by_dtype[t.dtype] += t.nbytes
        per_file[t.file][0] += 1
        per_file[t.file][1] += t.nbytes
    return Summary(
        tensors=len(infos),
        total_bytes=sum(t.nbytes for t in infos),
        bytes_by_dtype=dict(by_dtype),
        files=[(p, c[0], c[1]) for p, c in per_file.items()],
        expert_groups=expert_groups(infos),
        tie_candidates=tie_candidates([t.name for t in infos]),
    )


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_summary(s: Summary, path: str) -> str:
    lines = [
        f"checkpoint: {path}",
        f"tensors:    {s.tensors}",
        f"bytes:      {human(s.total_bytes)} ({s.total_bytes})",
    ]
    lines.append("by dtype:")
    lines += [f"  {d:8s} {human(b):>12s}" for d, b in sorted(s.bytes_by_dtype.items())]
    lines.append(f"files:      {len(s.files)}")
    lines += [f"  {p}  {c} tensors  {human(b)}" for p, c, b in s.files]
    if s.expert_groups:
        lines.append("per-expert groups (fusable):")
        lines += [
            f"  {g.pattern}  layers={g.layers} experts={g.experts} tensors={g.tensors}"
            for g in s.expert_groups
        ]
    else:
        lines.append("per-expert groups: none")
    lines.append("tie candidates:" if s.tie_candidates else "tie candidates: none")
    lines += [f"  {t}" for t in s.tie_candidates]
    return "\n".join(lines)
