"""torchtitan cases for the review fixes, run inside the rank group (see rank_group.py):
a load after a forward (FSDP's lazy-init ``to_sharded_hook``), torchtitan's activation
checkpointing (the checkpoint wrapper's hook and name prefix), a re-tie after
``fully_shard`` (TieError everywhere), and the FSDP internals those checks read."""

from __future__ import annotations

from typing import Any

import titan_models as tm
import torch
from cases_titan import compare
from torch import nn

import streamload
from streamload.io.copy_ops import bit_view as bits
from streamload.model.fsdp_rebind import rebound_params
from streamload.model.hooks import _hook_name


def parallelize_ac(model: nn.Module, world: int) -> None:
    """``parallelize_qwen3`` over FSDP with torchtitan's full activation checkpointing."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.qwen3 import parallelize_qwen3

    tm.use_cpu_meshes()
    pc = ParallelismConfig(data_parallel_shard_degree=-1, spmd_backend="partial_dtensor")
    parallelize_qwen3(
        model,
        parallel_dims=ParallelDims.from_config(pc, world),
        training=TrainingConfig(),
        parallelism=pc,
        compile_config=CompileConfig(),
        ac_config=FullAC.Config(),
        dump_folder="/tmp",
    )


def _hooks(model: nn.Module) -> list[str]:
    return sorted({_hook_name(h) for m in model.modules() for h in m._load_state_dict_pre_hooks.values()})


def case_titan_hooked_load(rank: int, world: int, *, kind: str, path: str, how: str) -> dict[str, Any]:
    """``how`` = "forward": materialise, init, one forward, then load (FSDP lazy init ran);
    "ac": a meta build parallelised with activation checkpointing, then load."""
    cfg = tm.titan_config(kind)
    model = tm.build_meta(cfg)
    if how == "ac":
        parallelize_ac(model, world)
    else:
        tm.parallelize(model, world)
        model.to_empty(device="cpu")
        model.init_weights(buffer_device=torch.device("cpu"))  # type: ignore[operator]
        tm.forward_logits(model, tm.tokens())
    hooks = _hooks(model)
    names = [n for n, _ in model.named_parameters()]
    report = streamload.load_checkpoint(model, path, mapping=tm.adapter_for(cfg))
    one = tm.titan_reference(cfg, path)
    own = tm.titan_parallel_reference(cfg, path, world)
    every = [*model.named_parameters(), *model.named_buffers()]
    unwrap = {n.replace("_checkpoint_wrapped_module.", ""): t for n, t in every}
    plain = nn.Module()
    for n, t in unwrap.items():  # compare by the unwrapped names torchtitan's reference has
        plain.register_buffer(n.replace(".", "__"), t)
    ref = nn.Module()
    for n, t in {**dict(one.named_parameters()), **dict(one.named_buffers())}.items():
        ref.register_buffer(n.replace(".", "__"), t)
    x = tm.tokens()
    return {
        "hooks": hooks,
        "wrapped": any("_checkpoint_wrapped_module" in n for n in names),
        "bad": compare(plain, ref),
        "missing": list(report.missing_keys),
        "tied": model.lm_head.weight is model.tok_embeddings.weight,  # type: ignore[union-attr]
        "logits_equal": torch.equal(bits(tm.forward_logits(model, x)), bits(tm.forward_logits(own, x))),
    }


def case_titan_retie(rank: int, world: int, *, path: str) -> str:
    """Untied when fully_shard ran, re-tied on meta afterwards: FSDP still holds the old parameter."""
    cfg = tm.titan_config("dense")
    model = tm.build_meta(cfg)
    model.tok_embeddings.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))  # type: ignore[union-attr]
    tm.parallelize(model, world)
    assert rebound_params(model) == []
    model.tok_embeddings.weight = model.lm_head.weight  # type: ignore[union-attr]
    # The FSDP internals rebound_params reads: a rename there must fail here, not pass silently.
    assert rebound_params(model) == [("tok_embeddings.weight", "lm_head.weight")], rebound_params(model)
    try:
        streamload.load_checkpoint(model, path, mapping=tm.adapter_for(cfg))
    except streamload.TieError as exc:
        # Raised from the placement agreement: before the first weight byte (after to_empty).
        return f"TieError: {exc}"
    raise AssertionError("no TieError")


def case_own_buffer_local(rank: int, world: int) -> list[list[float]]:
    """Only rank 0 recomputes its DTensor buffers (ranks may differ in what they reach): it
    must neither wait for the others (a collective would hang here) nor get other than its
    part. Returns, per buffer, this rank's local values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchtitan.protocols.module import Module

    from streamload.model.own_buffers import init_own_buffers

    class Cached(Module):  # type: ignore[misc, valid-type]
        def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
            self.rep = torch.arange(5, dtype=torch.float32) * 1.5
            self.shard = torch.arange(7, dtype=torch.float32) - 3.25

    mesh = init_device_mesh("cpu", (world,))
    mod = Cached()
    local_len = torch.chunk(torch.zeros(7), world)[rank].numel()  # Shard(0): torch.chunk's split
    mod.register_buffer("rep", DTensor.from_local(torch.zeros(5), mesh, [Replicate()], run_check=False))
    mod.register_buffer(
        "shard",
        DTensor.from_local(
            torch.zeros(local_len), mesh, [Shard(0)], run_check=False, shape=(7,), stride=(1,)
        ),
    )
    if rank == 0:
        assert init_own_buffers(mod, ["rep", "shard"], torch.device("cpu")) == {"rep", "shard"}
        assert isinstance(mod.rep, DTensor) and isinstance(mod.shard, DTensor)
    return [mod.rep.to_local().tolist(), mod.shard.to_local().tolist()]
