"""Cases for NaN payloads through a device load's path (issue #43 item 7), run inside the rank
group (see rank_group.py): the staged pipelines through the fake device (cases_gpu.FakeBackend
on "cpu"), compared bit for bit with transformers' from_pretrained on the CPU."""

from __future__ import annotations

import torch
from cases_gpu import FakeBackend
from cases_load import MISSING_PATH, compare_model, mesh_for, reference

import streamload

# NaN bit patterns of each width: quiet and signalling, both signs, several payloads.
NAN_BITS = {
    4: [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7FFFFFFF, 0x7F812345, 0xFFFFFFFF],
    2: [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FA3, 0x7FFF, 0xFFFF],  # bf16 NaNs
    1: [0x7F, 0xFF],  # float8_e4m3fn's two NaNs
}
F16_NAN_BITS = [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7D23, 0x7FFF, 0xFFFF]
_INT = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def put_nans(t: torch.Tensor, every: int = 5) -> torch.Tensor:
    """``t`` with every ``every``-th element a NaN of one of the patterns for its dtype, in turn."""
    out = t.clone().contiguous()
    size = out.element_size()
    pats = F16_NAN_BITS if out.dtype == torch.float16 else NAN_BITS[size]
    flat = out.view(-1).view(_INT[size])
    for i in range(0, flat.numel(), every):
        bits = pats[(i // every) % len(pats)]
        flat[i] = bits - (1 << (8 * size)) if size > 1 and bits >= 1 << (8 * size - 1) else bits
    return out


def case_nan_load(rank: int, world: int, *, ckpt: str, ws: int, readers: str, dtype: str) -> dict | None:
    """Loads ``ckpt`` into ``dtype`` parameters through the staged pipeline (fake device)."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    from streamload.load import prepare
    from streamload.transport import staging

    FakeBackend.LOG.clear()
    staging.BACKENDS["cpu"] = FakeBackend
    # On the CPU, owners loads take one coarse bucket (nothing is staged there); here they stage.
    coarse, prepare.OWNERS_CPU_BUCKET_BYTES = prepare.OWNERS_CPU_BUCKET_BYTES, 0
    try:
        model = streamload.from_pretrained(
            ckpt if readers == "owners" or rank == 0 else MISSING_PATH,
            device_mesh=mesh,
            dtype=getattr(torch, dtype),
            bucket_bytes=2048,
            progress=False,
            readers=readers,
            map_files=False,
        )
    finally:
        del staging.BACKENDS["cpu"]
        prepare.OWNERS_CPU_BUCKET_BYTES = coarse
    ref = reference(ckpt, getattr(torch, dtype))
    nans = sum(int(torch.isnan(p.float()).sum()) for p in ref.parameters())
    return {"bad": compare_model(model, ref), "nans": nans, "staged": len(FakeBackend.LOG)}
