"""Cases for shards that live on the host in a device load (issue #43 item 8), run inside the
rank group (see rank_group.py): an FSDP2 CPU-offloaded model with a persistent buffer the
checkpoint fills, loaded through the fake device (cases_gpu.FakeBackend stands for CUDA on
"cpu"), must stage its buffer alone: the offloaded shards are filled in place."""

from __future__ import annotations

from typing import Any

import torch
from cases_gpu import FakeBackend
from cases_load import full, mesh_for
from torch import nn

import streamload
from streamload.io.copy_ops import bit_view


class OffloadNet(nn.Module):
    """Sharded (offloaded) weights and a persistent buffer FSDP2 keeps on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 6)  # 6 rows: uneven shards at 4 ranks, none empty at 2-3
        self.out = nn.Linear(6, 5, bias=False)
        self.register_buffer("scale", torch.zeros(5))  # persistent: the checkpoint fills it


def net_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in OffloadNet().state_dict().items()}


class CountingBackend(FakeBackend):
    """The fake device, also counting the bytes copied host -> device."""

    COPIED: list[int] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        CountingBackend.COPIED.append(src.numel())
        return super().copy(dst, src, after)


def case_offloaded_buffer_load(rank: int, world: int, *, ckpt: str, ws: int) -> dict | None:
    """Loads ``net_state`` (readers="owners") into an offloaded OffloadNet built on meta."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from streamload.load import prepare
    from streamload.transport import staging

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    with torch.device("meta"):
        net = OffloadNet()
    fully_shard(net, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    CountingBackend.COPIED.clear()
    FakeBackend.LOG.clear()
    staging.BACKENDS["cpu"] = CountingBackend
    # On the CPU, owners loads take one coarse bucket (nothing is staged there); here they stage.
    coarse, prepare.OWNERS_CPU_BUCKET_BYTES = prepare.OWNERS_CPU_BUCKET_BYTES, 0
    try:
        streamload.load_checkpoint(
            net, ckpt, device_mesh=mesh, readers="owners", bucket_bytes=256, progress=False
        )
    finally:
        del staging.BACKENDS["cpu"]
        prepare.OWNERS_CPU_BUCKET_BYTES = coarse
    want = net_state()
    got = {n: full(t) for n, t in [*net.named_parameters(), *net.named_buffers()]}
    bad = [n for n in want if not torch.equal(bit_view(got[n]), bit_view(want[n]))]
    shard_bytes = sum(
        p.to_local().numel() * p.element_size() for p in net.parameters() if isinstance(p, DTensor)
    )
    return {
        "copied": sum(CountingBackend.COPIED),
        "stagers": len(FakeBackend.LOG),
        "buffer_bytes": net.scale.numel() * net.scale.element_size(),
        "shard_bytes": shard_bytes,
        "bad": bad,
    }
