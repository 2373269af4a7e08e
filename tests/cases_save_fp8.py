"""fp8 save cases run inside the rank group (see rank_group.py): ``save_pretrained(...,
quantize="fp8")`` against a reference quantizer run on the gathered tensors."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from cases_load import full, mesh_for, reference, subgroup
from safetensors.torch import load_file, save_file

import streamload
from streamload.io.copy_ops import bit_view as bits

BLOCK = 128


def ref_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The straightforward per-block quantizer on a whole tensor, as transformers' ``Fp8Quantize``
    writes it: amax per 128x128 block, ``scale = 448 / amax`` (1 where amax is 0), ``q = (w *
    scale).clamp(-448, 448).to(float8_e4m3fn)``, ``weight_scale_inv = 1 / scale``."""
    *lead, rows, cols = w.shape
    x = w.to(torch.float32).reshape(*lead, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = x.abs().amax(dim=(-3, -1))
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = 448.0 / safe
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = (x * scale.unsqueeze(-1).unsqueeze(-3)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), (1.0 / scale).to(torch.float32)


def transformers_quantize(key: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' own ``Fp8Quantize`` on one tensor."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    return Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))._quantize_one(key, w)


def dequantize(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """float32 ``q * weight_scale_inv`` per block (the product streamload and transformers form)."""
    s = inv.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)
    return q.to(torch.float32) * s


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _tensors(d: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def check_files(out: str, hub: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The files hold ``hub`` with every quantized tensor equal to the reference quantizer's
    (and transformers' own) bytes; returns the quantization config and the quantized keys."""
    got = _tensors(out)
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    quantized = sorted(k for k, t in got.items() if t.dtype == torch.float8_e4m3fn)
    assert quantized, "nothing was quantized"
    scales = {k[: -len("weight")] + "weight_scale_inv" for k in quantized}
    assert set(got) == set(hub) | scales, sorted(set(got) ^ (set(hub) | scales))
    for k, want in hub.items():
        if k in quantized:
            q, inv = ref_quantize(want)
            theirs = transformers_quantize(k, want)
            s = k[: -len("weight")] + "weight_scale_inv"
            assert _equal(q, theirs[k]) and _equal(inv, theirs[s]), f"{k}: the reference is not transformers'"
            assert _equal(got[k], q), f"{k}: fp8 bytes differ from the reference quantizer"
            assert _equal(got[s], inv), f"{s}: differs from the reference quantizer"
        else:
            assert _equal(got[k], want), f"{k}: the unquantized tensor changed"
    return {"config": qc, "quantized": quantized}


def dequantized_dir(out: str) -> str:
    """A plain (unquantized) checkpoint of ``out``'s reference dequantized values in float32."""
    got = _tensors(out)
    plain: dict[str, torch.Tensor] = {}
    for k, t in got.items():
        if k.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            plain[k] = dequantize(t, got[k[: -len("weight")] + "weight_scale_inv"])
        else:
            plain[k] = t.to(torch.float32)
    d = tempfile.mkdtemp(prefix="streamload_fp8ref_")
    save_file(plain, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg.pop("quantization_config")
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    return d


def _hub_of(ckpt: str) -> dict[str, torch.Tensor]:
    """transformers' own save of the checkpoint's model (its hub tensors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = tempfile.mkdtemp(prefix="streamload_fp8hub_")
        reference(ckpt, None).save_pretrained(d)
    return _tensors(d)


def case_fp8_round_trip(
    rank: int, world: int, *, ckpt: str, ws: int, out: str, writers: str, bucket_bytes: int = 8192
) -> dict[str, Any] | None:
    """load -> save_pretrained(quantize="fp8") -> (rank 0) the files against the reference
    quantizer and transformers' loader; every rank: streamload's fp8 load equals the reference
    dequantized values bit for bit."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = streamload.from_pretrained(ckpt, device_mesh=mesh, progress=False)
    local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters() if p.dim() == 2}
    rep = streamload.save_pretrained(
        model,
        out,
        quantize="fp8",
        writers=writers,
        process_group=subgroup(ws),
        bucket_bytes=bucket_bytes,
        max_shard_size="300KB",
    )
    result: dict[str, Any] = {"report": rep, "local_rows": local_rows}
    failure: BaseException | None = None
    ref_dir = dequantized_dir(out)  # every rank: the save is complete once it returned
    if rank == 0:
        try:
            result.update(check_files(out, _hub_of(ckpt)))
            want = reference(ref_dir, torch.bfloat16)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from transformers import AutoModelForCausalLM

                theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
            wanted = dict(want.named_parameters())
            bad = [n for n, p in theirs.named_parameters() if not _equal(p.detach(), wanted[n].detach())]
            assert not bad, f"transformers loads other values than the reference dequantized ones: {bad}"
        except BaseException as exc:  # noqa: BLE001 - raised after the collective load below
            failure = exc
    # streamload's own fp8 path (dequantizing load) against the reference dequantized values.
    again = streamload.from_pretrained(out, device_mesh=mesh, dtype=torch.bfloat16, progress=False)
    wanted = dict(reference(ref_dir, torch.bfloat16).named_parameters())
    bad = [n for n, p in again.named_parameters() if not _equal(full(p).detach(), wanted[n].detach())]
    assert not bad, f"streamload loads other values than the reference dequantized ones: {bad}"
    if failure is not None:
        raise failure
    return result


class _Linears(torch.nn.Module):
    """A plain module: two Linears (one row-, one column-sharded), a bias, a 1-D tensor, and a
    Linear whose shape the block does not divide."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.rows = torch.nn.Linear(256, 384, bias=True)
        self.cols = torch.nn.Linear(384, 256, bias=False)
        self.odd = torch.nn.Linear(100, 128, bias=False)
        self.norm = torch.nn.Parameter(torch.randn(256, generator=g))
        with torch.no_grad():
            for p in (self.rows.weight, self.rows.bias, self.cols.weight, self.odd.weight):
                rows = torch.rand(p.shape[0], generator=g) * 8  # amax differing per row: each block its own
                p.copy_(torch.randn(p.shape, generator=g) * (rows[:, None] if p.dim() == 2 else rows))
            self.cols.weight[:, 200:] = 0  # whole zero blocks (scale 1) next to cut ones
        self.to(torch.bfloat16)


def case_fp8_plain_tp(rank: int, world: int, *, ws: int, out: str, writers: str) -> dict[str, Any] | None:
    """Shard(0) and Shard(1) DTensors whose shard edges cut 128x128 blocks (rows and columns):
    the files equal the reference quantizer on the full tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = _Linears()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    placements = {
        "rows.weight": Shard(0),
        "cols.weight": Shard(1),
        "rows.bias": Shard(0),
        "odd.weight": Replicate(),
    }
    for name, pl in placements.items():
        mod, leaf = name.split(".")
        param = getattr(getattr(model, mod), leaf)
        setattr(getattr(model, mod), leaf, torch.nn.Parameter(distribute_tensor(param.data, mesh, [pl])))
    rep = streamload.save_pretrained(
        model, out, quantize="fp8", writers=writers, process_group=subgroup(ws), bucket_bytes=4096
    )
    result: dict[str, Any] = {"report": rep}
    if rank == 0:
        got = _tensors(out)
        assert sorted(k for k, t in got.items() if t.dtype == torch.float8_e4m3fn) == [
            "cols.weight",
            "rows.weight",
        ]
        assert "odd.weight_scale_inv" not in got
        for k, w in want.items():
            if k in ("rows.weight", "cols.weight"):
                q, inv = ref_quantize(w)
                assert _equal(got[k], q), k
                assert _equal(got[k[:-6] + "weight_scale_inv"], inv), k
                assert (inv != 1).any() and (k == "rows.weight" or (inv == 1).any())  # zero blocks: scale 1
            else:
                assert _equal(got[k], w), k
    return result
