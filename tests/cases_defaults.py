"""Cases for issue #15's defaults (run inside the rank group, see rank_group.py):
copies under readers="auto", strict=False on meta builds with real buffers,
and mapped parameters that own exactly their bytes."""

from __future__ import annotations

import io
import warnings

import torch
from cases_load import MISSING_PATH, compare_model, full, mesh_for, reference
from torch import nn

import streamload
from streamload.io.copy_ops import bit_view as bits


def _shard(model: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def case_copies(rank: int, world: int, *, a: str, b: str, readers: str) -> dict | None:
    """Rank 0 is given copy ``a``, the others copy ``b`` (equal header and sampled blocks)."""
    mesh = mesh_for(world)
    model = streamload.from_pretrained(
        a if rank == 0 else b, device_mesh=mesh, progress=False, readers=readers
    )
    bad = compare_model(model, reference(a, None))
    return {"reader": model.streamload_report.reader, "bad": bad}


def case_strict_false_meta_params(rank: int, world: int, *, ckpt: str, full_ckpt: str) -> dict | None:
    """qwen2 built with accelerate's init_empty_weights(include_buffers=False), a real
    persistent buffer added, loaded from files without ``model.norm.weight`` and ``lm_head.weight``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = mesh_for(world)
    config = AutoConfig.from_pretrained(ckpt)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    extra = torch.randn(37, generator=torch.Generator().manual_seed(5))
    model.model.register_buffer("extra_scale", extra.clone())  # persistent, real, not in the file
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    _shard(model, mesh)
    report = streamload.load_checkpoint(
        model, ckpt if rank == 0 else MISSING_PATH, device_mesh=mesh, strict=False, progress=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = reference(ckpt, None)  # transformers initialises the same missing keys
    ref.model.register_buffer("extra_scale", extra.clone())
    bad = [n for n in compare_model(model, ref) if n != "lm_head.weight"]
    head = full(model.lm_head.weight).float()
    return {
        "missing": sorted(report.missing_keys),
        "bad": bad,
        "extra_kept": torch.equal(bits(model.model.extra_scale), bits(extra)),
        "inv_freq_kept": torch.equal(model.model.rotary_emb.inv_freq, inv_freq),
        "norm_ones": bool(torch.equal(full(model.model.norm.weight).float(), torch.ones(config.hidden_size))),
        "head_std": float(head.std()),
        "head_mean": float(head.mean()),
        "initializer_range": config.initializer_range,
    }


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 12)  # in the file
        self.b = nn.Linear(12, 9)  # not in the file: reset_parameters
        self.register_buffer("scale", torch.zeros(5))  # persistent, real, not in the file


class Opaque(nn.Module):
    """A parameter with no initialiser (no reset_parameters, no _init_weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))


def case_strict_false_plain(rank: int, world: int, *, ckpt: str, opaque: bool) -> dict | None:
    """A plain module under init_empty_weights(include_buffers=False), FSDP-sharded."""
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import fully_shard

    mesh = mesh_for(world)
    with init_empty_weights(include_buffers=False):
        net = Block()
        if opaque:
            net.opaque = Opaque()
    scale = torch.arange(5, dtype=torch.float32) + 0.25
    net.scale.copy_(scale)
    fully_shard(net, mesh=mesh)
    try:
        report = streamload.load_checkpoint(
            net, ckpt if rank == 0 else MISSING_PATH, device_mesh=mesh, strict=False, progress=False
        )
    except streamload.KeyMismatchError as exc:
        return {"raised": type(exc).__name__, "missing": exc.missing}
    from safetensors.torch import load_file

    want = load_file(f"{ckpt}/model.safetensors")
    w = full(net.b.weight)
    bound = 1 / 12**0.5  # nn.Linear.reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    return {
        "raised": None,
        "missing": sorted(report.missing_keys),
        "a_loaded": torch.equal(full(net.a.weight), want["a.weight"])
        and torch.equal(full(net.a.bias), want["a.bias"]),
        "scale_kept": torch.equal(net.scale, scale),
        "b_in_bounds": bool(w.abs().max() <= bound and full(net.b.bias).abs().max() <= bound),
        "b_spread": float(w.std()),
    }


def case_mapped_storage(rank: int, world: int, *, ckpt: str, map_files: bool | str) -> dict | None:
    """Every rank reads its own shards; each mapped shard's storage and saved size are its bytes."""
    mesh = mesh_for(world)
    model = streamload.from_pretrained(
        ckpt, device_mesh=mesh, progress=False, readers="owners", map_files=map_files
    )
    rows = []
    for name, p in model.named_parameters():
        local = p.to_local()
        nbytes = local.numel() * local.element_size()
        if nbytes < 256 << 10:
            continue  # torch.save's own framing (~1-2 KiB) would dominate the 1% bound
        buf = io.BytesIO()
        torch.save(p.detach().to_local(), buf)
        rows.append((name, nbytes, local.untyped_storage().nbytes(), len(buf.getvalue())))
    bad = compare_model(model, reference(ckpt, None))
    return {"rows": rows, "bytes_mapped": model.streamload_report.bytes_mapped, "bad": bad}


def case_mapped_policy(rank: int, world: int, *, ckpt: str) -> dict | None:
    """map_files="auto" (the default): trainable parameters are copies, frozen ones are mapped
    from files this process cannot write (a read-only mount, simulated: the ranks run as whoever
    runs the tests) and copied from writable ones (tests/test_mapped_writable.py: real permissions)."""
    from unittest import mock

    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = mesh_for(world)
    trained = streamload.from_pretrained(ckpt, device_mesh=mesh, progress=False, readers="owners")
    config = AutoConfig.from_pretrained(ckpt)
    frozen = []
    for read_only in (True, False):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
        model.requires_grad_(False)
        _shard(model, mesh)
        with mock.patch("streamload.model.mapped.os.access", lambda path, mode, w=not read_only: w):
            report = streamload.load_checkpoint(
                model, ckpt, device_mesh=mesh, progress=False, readers="owners"
            )
        frozen.append((model, report))
    ref = reference(ckpt, None)
    return {
        "trained_mapped": trained.streamload_report.bytes_mapped,
        "frozen_mapped": frozen[0][1].bytes_mapped,
        "writable_mapped": frozen[1][1].bytes_mapped,
        "payload": frozen[0][1].payload_bytes,
        "bad": compare_model(trained, ref)
        + compare_model(frozen[0][0], ref)
        + compare_model(frozen[1][0], ref),
    }
