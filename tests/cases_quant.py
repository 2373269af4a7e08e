"""Quantized-checkpoint cases run inside the rank group (see rank_group.py)."""

from __future__ import annotations

import os

import torch
from cases_load import MISSING_PATH, compare_model, full, mesh_for, reference
from forking import wait_for_child
from safetensors.torch import load_file

import streamload
from streamload.io.copy_ops import bit_view as bits


def case_quantized(
    rank: int,
    world: int,
    *,
    ckpt: str,
    ws: int,
    dtype: torch.dtype,
    readers: str,
    bucket_bytes: int = 20000,
    nodes: int = 0,
) -> dict | None:
    """streamload's dequantizing from_pretrained against transformers' on the same files.
    With ``nodes``, ``nodes`` simulated nodes whose first rank alone sees the files."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    path = ckpt
    if nodes:
        os.environ["STREAMLOAD_NODE"] = str(rank * nodes // ws)
        if rank * nodes // ws == (rank - 1) * nodes // ws and rank != 0:
            path = MISSING_PATH
    try:
        model = streamload.from_pretrained(
            path, device_mesh=mesh, dtype=dtype, bucket_bytes=bucket_bytes, progress=False, readers=readers
        )
    finally:
        os.environ.pop("STREAMLOAD_NODE", None)
    bad = compare_model(model, reference(ckpt, dtype))
    assert not bad, f"differ from transformers: {bad}"
    rep = model.streamload_report.to_dict()
    assert not rep["unexpected_keys"] and not rep["missing_keys"], rep
    return {
        "reader": rep.get("reader"),
        "converted": rep.get("converted"),
        "bytes_sent": rep.get("bytes_sent"),
    }


def case_fp8_params(rank: int, world: int, *, ckpt: str, ws: int, readers: str) -> dict | None:
    """fp8 tensors (no scales) load bit for bit into fp8 parameters."""
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    cfg = AutoConfig.from_pretrained(ckpt)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(os.path.join(ckpt, f)))
    for name, p in model.named_parameters():
        if state[name].dtype == torch.float8_e4m3fn:
            mod, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            setattr(mod, leaf, torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float8_e4m3fn, device="meta"),
                                                  requires_grad=False))  # fmt: skip
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    streamload.load_checkpoint(
        model, ckpt, device_mesh=mesh, readers=readers, bucket_bytes=20000, progress=False
    )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    n_fp8 = 0
    for name, p in model.named_parameters():
        want = state[name] if p.dtype == state[name].dtype else state[name].to(p.dtype)
        n_fp8 += p.dtype == torch.float8_e4m3fn
        if p.dtype != torch.float8_e4m3fn:
            assert torch.equal(bits(full(p)), bits(want)), name
            continue
        # gloo cannot all-gather float8: compare this rank's shard with its slice of the file.
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()[tuple(slice(0, n) for n in shape)]
        region = want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        assert local.dtype == want.dtype and torch.equal(bits(local), bits(region)), name
    assert n_fp8 > 0
    return {"fp8": n_fp8}


def case_fork_child_reads(rank: int, world: int, *, ckpt: str) -> dict | None:
    """A Checkpoint opened (and used) before os.fork() reads in the child."""
    if rank != 0:
        return None
    from streamload.io.checkpoint import Checkpoint

    c = Checkpoint(ckpt)
    name = next(k for k in c.keys() if c.info(k).nbytes > 1000)
    before = c.read(name)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if torch.equal(bits(c.read(name)), bits(before)) else 2
        finally:
            os._exit(code)
    wait_for_child(pid, 20, "the child deadlocked reading a Checkpoint opened before fork()")
    return {"ok": True}


def case_keep_quantized(rank: int, world: int, *, ckpt: str, ws: int, readers: str) -> dict | None:
    """from_pretrained(quantized="keep"): fp8 weights and float32 scales as stored."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = streamload.from_pretrained(
        ckpt, device_mesh=mesh, bucket_bytes=20000, progress=False, readers=readers, quantized="keep"
    )
    state: dict[str, torch.Tensor] = {}
    for f in os.listdir(ckpt):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(ckpt, f)))
    n_fp8 = 0
    for name, p in model.named_parameters():
        want = state[name]
        assert p.dtype == want.dtype, (name, p.dtype, want.dtype)
        if p.dtype != torch.float8_e4m3fn:
            assert torch.equal(bits(full(p)), bits(want)), name
            continue
        n_fp8 += 1
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()[tuple(slice(0, n) for n in shape)]
        region = want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        assert torch.equal(bits(local), bits(region)), name
    assert n_fp8 > 0
    return {"fp8": n_fp8}


def case_quantized_fallback(rank: int, world: int, *, ckpt: str, ws: int, readers: str) -> dict | None:
    """Every converter forced onto transformers' own ops (the fallback): its
    quantized inputs are read dequantized, so the model is still bit-exact."""
    import warnings

    from streamload.plan import convert

    mesh = mesh_for(ws)
    if mesh is None:
        return None

    def not_streamable(*args: object, **kwargs: object) -> dict:
        raise convert.NotStreamable("forced by the test")

    original = convert.apply_ops_symbolically
    convert.apply_ops_symbolically = not_streamable  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = streamload.from_pretrained(
                ckpt,
                device_mesh=mesh,
                dtype=torch.bfloat16,
                bucket_bytes=20000,
                progress=False,
                readers=readers,
            )
    finally:
        convert.apply_ops_symbolically = original
    converted = model.streamload_report.converted
    fallbacks = [k for k, v in converted.items() if v.startswith("fallback")]
    assert any(k.endswith("experts.gate_up_proj") for k in fallbacks), converted
    bad = compare_model(model, reference(ckpt, torch.bfloat16))
    assert not bad, f"differ from transformers: {bad}"
    return {"fallbacks": len(fallbacks)}
