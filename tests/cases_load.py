"""Cases run inside the rank group (see rank_group.py): each is called on all
ranks; ranks outside the case's world size return None at once."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import streamload
from streamload.io.copy_ops import bit_view as bits
from streamload.tools.quantized import hf_reference_kwargs

_GROUPS: dict[int, Any] = {}
MISSING_PATH = "/nonexistent/streamload/ckpt"


def subgroup(ws: int):
    """A process group of ranks [0, ws); every rank must call this."""
    if ws not in _GROUPS:
        _GROUPS[ws] = dist.new_group(list(range(ws)))
    return _GROUPS[ws] if dist.get_rank() < ws else None


def mesh_for(ws: int):
    from torch.distributed.device_mesh import DeviceMesh

    g = subgroup(ws)
    return None if g is None else DeviceMesh.from_group(g, "cpu")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare_model(model: nn.Module, ref: nn.Module) -> list[str]:
    """Names of parameters or buffers that differ from the reference, bitwise."""
    bad = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        f = full(p)
        r = ref_params[name]
        if f.dtype != r.dtype or f.shape != r.shape or not torch.equal(bits(f), bits(r)):
            bad.append(name)
    ref_bufs = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        r = ref_bufs[name]
        if b.shape != r.shape or not torch.equal(bits(b.to(r.dtype)), bits(r)):
            bad.append(f"buffer {name}")
    return bad


def reference(ckpt: str, dtype: torch.dtype | None):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype or "auto", **hf_reference_kwargs(ckpt))


def tied(model: nn.Module) -> bool | None:
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or emb is None:
        return None
    return head.weight is emb.weight


def case_compare_checkpoints(rank: int, world: int, *, a: str, b: str) -> None:
    """transformers loads checkpoints ``a`` and ``b`` to the same parameters."""
    if rank == 0:
        bad = compare_model(reference(b, None), reference(a, None))
        assert not bad, bad


def case_from_pretrained(
    rank: int,
    world: int,
    *,
    ckpt: str,
    ws: int,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 4096,
    hsdp: bool = False,
    ref_ckpt: str | None = None,
    readers: str = "auto",
    all_see: bool = False,
    nodes: int = 0,
) -> dict | None:
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = mesh_for(ws)
        if mesh is None:
            return None
    import os

    if nodes:  # simulate `nodes` nodes on this machine; the first rank of each sees the files
        os.environ["STREAMLOAD_NODE"] = str(rank * nodes // ws)
        all_see = False
    sees = all_see or rank == 0 or (nodes and rank * nodes // ws != (rank - 1) * nodes // ws)
    path = ckpt if sees else MISSING_PATH  # by default only the reader sees the files
    try:
        model = streamload.from_pretrained(
            path, device_mesh=mesh, dtype=dtype, bucket_bytes=bucket_bytes, progress=False, readers=readers
        )
    finally:
        os.environ.pop("STREAMLOAD_NODE", None)
    ref = reference(ref_ckpt or ckpt, dtype)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref), (tied(model), tied(ref))
    assert not model.training
    if ref_ckpt is None:  # the same files: config and generation config as transformers gives them
        assert model.config.to_dict() == ref.config.to_dict() or _same_config(model.config, ref.config)
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    rep = model.streamload_report
    assert rep.peak_staging_bytes <= rep.slots * rep.bucket_bytes
    return {"report": rep.to_dict(), "tied": tied(model)}


def _same_config(a, b) -> bool:
    da, db = a.to_dict(), b.to_dict()
    for d in (da, db):
        d.pop("dtype", None)
        d.pop("transformers_version", None)
    return da == db


def case_load_meta_model(rank: int, world: int, *, ckpt: str, ws: int, shard_dim: int = 0) -> dict | None:
    """A model built entirely on meta (buffers too), sharded on dim ``shard_dim``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)

    def placement(p: nn.Parameter):
        # FSDP2 shards dims other than 0 only evenly.
        ok = p.ndim > shard_dim and p.shape[shard_dim] % ws == 0
        return Shard(shard_dim) if ok else Shard(0)

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    report = streamload.load_checkpoint(
        model, ckpt if rank == 0 else MISSING_PATH, device_mesh=mesh, bucket_bytes=1 << 15, progress=False
    )
    ref = reference(ckpt, None)
    bad = compare_model(model, ref)
    assert not bad, f"differ from transformers: {bad}"
    assert tied(model) == tied(ref)
    placements = {p.placements[0] for p in model.parameters()}
    assert Shard(shard_dim) in placements, placements
    return report.to_dict()


class TinyNet(nn.Module):
    """Uneven shapes, a 0-d parameter, persistent and non-persistent buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 2)  # 2 rows: at 3 or 4 ranks some ranks hold none
        self.wide = nn.Linear(5, 7, bias=False)
        self.gain = nn.Parameter(torch.tensor(0.0))
        self.register_buffer("scale", torch.zeros(5))
        self.register_buffer("table", torch.arange(6, dtype=torch.float32) * 0.5, persistent=False)


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    net = TinyNet()
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in net.state_dict().items()}


def case_plain_module(rank: int, world: int, *, ckpt: str, ws: int, shard: bool) -> dict | None:
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import fully_shard

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    with init_empty_weights(include_buffers=False):
        net = TinyNet()
    if shard:
        # FSDP cannot shard a 0-d parameter: it stays a plain, unmanaged tensor.
        fully_shard(net, mesh=mesh, ignored_params={net.gain})
    report = streamload.load_checkpoint(
        net,
        ckpt if rank == 0 else MISSING_PATH,
        device_mesh=mesh,
        process_group=mesh.get_group(),
        bucket_bytes=256,
        progress=False,
    )
    want = tiny_state()
    for name, value in want.items():
        got = full(net.get_parameter(name) if "." in name or name == "gain" else net.get_buffer(name))
        if name == "scale":
            got = net.scale
        assert torch.equal(bits(got), bits(value)), name
    assert torch.equal(net.table, torch.arange(6, dtype=torch.float32) * 0.5)
    assert report.buckets > 1 and report.peak_staging_bytes <= report.slots * 256
    return report.to_dict()


def case_tied_gradient(rank: int, world: int, *, ckpt: str, ws: int) -> dict | None:
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model = streamload.from_pretrained(
        ckpt if rank == 0 else MISSING_PATH, device_mesh=mesh, dtype=torch.float32, progress=False
    )
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grad = full(model.get_input_embeddings().weight.grad)

    def ref_grad(untie: bool) -> torch.Tensor:
        ref = reference(ckpt, torch.float32)
        if untie:  # what a naive meta + to_empty load leaves behind
            ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())
        ref.train()
        ref(input_ids=ids, labels=ids).loss.backward()
        return ref.get_input_embeddings().weight.grad

    tied_ref, untied_ref = ref_grad(False), ref_grad(True)
    assert tied(model)
    assert torch.allclose(grad, tied_ref, rtol=1e-4, atol=1e-6), (grad - tied_ref).abs().max()
    # The check cannot pass vacuously: an untied model's gradient is far off.
    assert not torch.allclose(untied_ref, tied_ref, rtol=1e-2, atol=1e-4)
    return {
        "max_diff": float((grad - tied_ref).abs().max()),
        "untied_diff": float((untied_ref - tied_ref).abs().max()),
    }


def _file_digests(ckpt: str) -> dict[str, str]:
    import hashlib
    from pathlib import Path

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(ckpt).iterdir())}


def case_train_steps(
    rank: int, world: int, *, ckpt: str, ws: int, readers: str, map_files: bool
) -> dict | None:
    """Two SGD steps on the loaded tied model match the single-process model
    taking the same steps; with mapped shards the checkpoint is never written."""
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    before = _file_digests(ckpt)
    model = streamload.from_pretrained(
        ckpt, device_mesh=mesh, progress=False, readers=readers, map_files=map_files
    )
    rep = model.streamload_report
    ref = reference(ckpt, None)
    ids = torch.arange(24).reshape(2, 12) % model.config.vocab_size
    losses, ref_losses = [], []
    for net, out in ((model, losses), (ref, ref_losses)):
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        for _ in range(3):
            loss = net(input_ids=ids, labels=ids).loss
            out.append(float(loss))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert tied(model)
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (losses, ref_losses)
    assert losses[0] != losses[2], "the steps changed nothing"
    emb = full(model.get_input_embeddings().weight)
    assert torch.allclose(emb, ref.get_input_embeddings().weight, rtol=1e-4, atol=1e-5)
    dist.barrier(mesh.get_group())
    assert _file_digests(ckpt) == before, "the checkpoint changed"
    return {"bytes_mapped": rep.bytes_mapped, "reader": rep.reader, "losses": losses}


def case_strict_keys(rank: int, world: int, *, ckpt: str, ws: int, strict: bool) -> dict | None:
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    try:
        model = streamload.from_pretrained(
            ckpt if rank == 0 else MISSING_PATH, device_mesh=mesh, strict=strict, progress=False
        )
    except streamload.KeyMismatchError as exc:
        return {"raised": type(exc).__name__, "missing": exc.missing, "unexpected": exc.unexpected}
    rep = model.streamload_report
    return {"raised": None, "missing": rep.missing_keys, "unexpected": rep.unexpected_keys}


class OpaqueConcatenate:
    """A user op with no region form (not one of transformers' own classes)."""

    supports_many_to_many = False

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        parts = []
        for sp in source_patterns:
            if sp in input_dict:
                v = input_dict.pop(sp)
                parts.extend(v if isinstance(v, list) else [v])
        return {target_patterns[0]: torch.cat(parts, dim=self.dim)}


def case_fallback_op(rank: int, world: int, *, ckpt: str, ws: int, model_type: str) -> dict | None:
    """A converter op the planner cannot stream is applied by transformers'
    own code on the reader, one group at a time, and stays bit-exact."""
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import MergeModulelist, WeightConverter

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    original = cm.get_checkpoint_conversion_mapping(model_type)
    opaque = [
        WeightConverter(
            ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            "mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), OpaqueConcatenate(dim=1)],
        ),
        WeightConverter(
            ["mlp.experts.*.down_proj.weight"], "mlp.experts.down_proj", operations=[MergeModulelist(dim=0)]
        ),
    ]
    cm.register_checkpoint_conversion_mapping(model_type, opaque, overwrite=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = streamload.from_pretrained(
                ckpt if rank == 0 else MISSING_PATH, device_mesh=mesh, bucket_bytes=2048, progress=False
            )
        ref = reference(ckpt, None)
    finally:
        cm.register_checkpoint_conversion_mapping(model_type, original, overwrite=True)
    bad = compare_model(model, ref)
    assert not bad, bad
    converted = model.streamload_report.converted
    assert any(v.startswith("fallback") for v in converted.values()), converted
    assert any(v.startswith("streamed MergeModulelist") for v in converted.values()), converted
    return {"warned": any("no streaming form" in str(w.message) for w in caught)}


def _verl_model(ckpt: str, dtype: torch.dtype, rank: int, mesh):
    """verl's _build_module + apply_fsdp2: rank 0 real weights, others meta."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamload.integrations.pretrained import default_shard_fn

    if rank == 0:
        model = reference(ckpt, dtype)
        full_state = model.state_dict()
    else:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=dtype)
        full_state = model.state_dict()  # verl passes the meta state dict on other ranks
    default_shard_fn(model, mesh)
    return model, full_state


def case_verl_sequence(
    rank: int, world: int, *, ckpt: str, ws: int, dtype: torch.dtype, use_checkpoint: bool = False
) -> dict | None:
    mesh = mesh_for(ws)
    if mesh is None:
        return None
    model, full_state = _verl_model(ckpt, dtype, rank, mesh)
    if use_checkpoint and rank == 0:
        full_state = streamload.Checkpoint(ckpt)
    report = streamload.fsdp2_load_full_state_dict(model, full_state, mesh)
    del full_state
    ref = reference(ckpt, dtype)
    bad = compare_model(model, ref)
    assert not bad, bad
    assert tied(model) == tied(ref)
    return report.to_dict()


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def case_receiver_memory(rank: int, world: int, *, ckpt: str, ws: int, bucket_bytes: int) -> dict | None:
    """What a receiving rank allocates during the call: sampled RSS peak."""
    import threading

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from streamload.integrations.pretrained import default_shard_fn

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    config = AutoConfig.from_pretrained(ckpt)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    default_shard_fn(model, mesh)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            stop.wait(0.002)

    import gc

    gc.collect()
    dist.barrier()
    before = _rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    streamload.load_checkpoint(
        model,
        ckpt if rank == 0 else MISSING_PATH,
        device_mesh=mesh,
        bucket_bytes=bucket_bytes,
        progress=False,
    )
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], _rss())
    shards = sum(local_bytes(t) for t in list(model.parameters()) + list(model.buffers()))
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"rank": rank, "growth": peak[0] - before, "shards": shards, "model": full}


def local_bytes(t: torch.Tensor) -> int:
    lt = t.to_local() if hasattr(t, "to_local") else t
    return lt.numel() * lt.element_size()


def _process_group_count() -> int:
    """How many process groups torch holds (a private table: fail loudly if torch renames it)."""
    c10d = dist.distributed_c10d
    assert hasattr(c10d, "_world"), "torch.distributed.distributed_c10d._world is gone: update this count"
    assert hasattr(c10d._world, "pg_map"), "torch.distributed.distributed_c10d._world.pg_map is gone"
    return len(c10d._world.pg_map)


def case_node_repeated_loads(rank: int, world: int, *, ckpt: str, ws: int, loads: int = 5) -> dict | None:
    """Loads ``loads`` times in node mode on one mesh; returns the process-group count after each."""
    import os

    mesh = mesh_for(ws)
    if mesh is None:
        return None
    before = _process_group_count()
    os.environ["STREAMLOAD_NODE"] = str(rank * 2 // ws)  # two simulated nodes
    counts, readers = [], []
    try:
        for _ in range(loads):
            path = ckpt if rank * 2 % ws == 0 else MISSING_PATH  # the first rank of each node sees the files
            model = streamload.from_pretrained(path, device_mesh=mesh, progress=False, readers="node")
            readers.append(model.streamload_report.reader)
            counts.append(_process_group_count())
            del model
    finally:
        os.environ.pop("STREAMLOAD_NODE", None)
    return {"before": before, "counts": counts, "readers": readers}
