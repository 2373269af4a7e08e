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
