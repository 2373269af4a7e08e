"""verl's model merger (``python -m verl.model_merger merge --backend fsdp``), on N ranks: a
finished run's FSDP2 shards into a Hugging Face directory, no process holding the model.

verl 0.9.1's ``FSDPModelMerger`` (``verl/model_merger/fsdp_model_merger.py``) runs in ONE process:
it ``torch.load``s every ``model_world_size_{W}_rank_{r}.pt`` (FSDP2 DTensor shards), casts each
local piece to bf16, concatenates them along the shard dim into full tensors, and calls
transformers' ``save_pretrained`` of an empty bf16 model with that state dict, then saves the
tokenizer / processor from ``<local_dir>/huggingface``. Host memory: the whole model, twice.

Here the same directory comes from W ranks (W = the run's world size, from ``fsdp_config.json``):
each rank loads only its own ``.pt``, copies its local pieces into a meta-built model sharded
with ``fully_shard`` over a 1-D mesh of W ranks (FSDP2's dim-0 chunks, the layout the run saved),
and ``streamload.save_pretrained(dtype=torch.bfloat16)`` writes every rank's bytes (the same
rounding as the merger's ``.bfloat16()`` on the pieces). Supported input: verl's FSDP2 shards on a
1-D mesh, no LoRA; FSDP1 (``FSDP_version`` 1: ShardedTensor pieces), HSDP (``("ddp", "fsdp")``),
a LoRA-only checkpoint or another rank count is a ``SaveError`` on every rank, before any write.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import RemoteRankError, SaveError
from ..model.placement import resolve_group
from ..save.driver import SaveReport, save_pretrained
from ..transport.protocol import gather_or_raise


def _read_run(local_dir: str, world: int) -> int:
    """The run's world size from ``fsdp_config.json``, checked against this job's."""
    with open(os.path.join(local_dir, "fsdp_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("FSDP_version") != 2:
        raise SaveError(
            f"{local_dir}: FSDP_version {cfg.get('FSDP_version')}: only verl's FSDP2 shards (DTensor "
            "pieces) are merged by streamload; use verl's own model merger"
        )
    if cfg.get("world_size") != world:
        raise SaveError(
            f"{local_dir} was saved by {cfg.get('world_size')} ranks; run the merge on as many "
            f"(this job has {world})"
        )
    return world


def _build(hf_path: str, state: dict[str, Any], trust_remote_code: bool) -> nn.Module:
    """The model on meta from the run's config, in its shards' dtype, sharded over the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    from .pretrained import default_shard_fn

    merger_cfg = ModelMergerConfig(
        operation="merge", backend="fsdp", hf_model_config_path=hf_path, trust_remote_code=trust_remote_code
    )
    helper = FSDPModelMerger(merger_cfg)  # verl's own config, auto class and generation config
    dtypes = {v.dtype for v in state.values() if torch.is_tensor(v) and v.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    with torch.device("meta"):
        model = helper.get_transformers_auto_model_class().from_config(
            helper.model_config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    default_shard_fn(model, mesh)
    model.to_empty(device="cpu")
    helper.patch_model_generation_config(model)
    return model


@torch.no_grad()
def _fill(model: nn.Module, state: dict[str, Any]) -> None:
    """Copies this rank's saved pieces into the model's local shards, checked name by name."""
    from torch.distributed.tensor import DTensor

    own = model.state_dict()
    if any("lora_" in k or ".adapter_" in k for k in state):
        raise SaveError("a LoRA checkpoint: use verl's own model merger (it saves the adapter)")
    if set(own) != set(state):
        raise SaveError(
            f"the shards' keys differ from the model's: only in the shards "
            f"{sorted(set(state) - set(own))[:8]}, only in the model {sorted(set(own) - set(state))[:8]}"
        )
    for name, dst in own.items():
        src = state[name]
        if isinstance(dst, DTensor) != isinstance(src, DTensor):
            raise SaveError(f"{name}: sharded in the run and not here (or the reverse)")
        if isinstance(src, DTensor):
            if src.device_mesh.ndim != 1 or tuple(src.placements) != tuple(dst.placements):
                raise SaveError(
                    f"{name}: saved as {list(src.placements)} over mesh {src.device_mesh.mesh_dim_names}; "
                    "streamload merges FSDP2 shards on a 1-D mesh (Shard(0)) only"
                )
            dst, src = dst.to_local(), src.to_local()
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise SaveError(
                f"{name}: the shard is {src.dtype}{list(src.shape)}, the model's {dst.dtype}{list(dst.shape)}"
            )
        dst.copy_(src)


def merge_fsdp_checkpoint(
    local_dir: str,
    target_dir: str,
    *,
    hf_model_config_path: str | None = None,
    trust_remote_code: bool = False,
    timeout: float | None = None,
    **kwargs: Any,
) -> SaveReport:
    """verl's ``model_merger merge --backend fsdp``, on the run's rank count; collective over
    the default group (launch with ``torchrun --nproc-per-node W``).

    Args:
        local_dir: verl's step directory (``.../global_step_N/actor``: the ``.pt`` shards,
            ``fsdp_config.json``, ``huggingface/``).
        target_dir: the Hugging Face directory to write (created or replaced).
        hf_model_config_path: config and tokenizer (default ``<local_dir>/huggingface``, verl's).
        trust_remote_code: as verl's merger.
        timeout: seconds to wait for ranks that have not called (``save_pretrained``).
        **kwargs: more ``streamload.save_pretrained`` keywords (``max_shard_size=``, ``writers=``).

    Returns:
        This rank's SaveReport.

    Raises:
        SaveError: on every rank, for an input streamload does not merge (module docstring) or a
            failed write.

    Example:
        >>> merge_fsdp_checkpoint("ckpts/global_step_100/actor", "hf/step_100")
    """
    hf_path = hf_model_config_path or os.path.join(local_dir, "huggingface")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = resolve_group(None, None)
    error: BaseException | None = None
    model: nn.Module | None = None
    try:
        _read_run(local_dir, world)
        path = os.path.join(local_dir, f"model_world_size_{world}_rank_{rank}.pt")
        state = torch.load(path, map_location="cpu", weights_only=False)
        model = _build(hf_path, state, trust_remote_code)
        _fill(model, state)
        del state
    except BaseException as exc:  # noqa: BLE001 - agreed: every rank raises, none waits in the save
        error = exc if isinstance(exc, (SaveError, KeyboardInterrupt)) else _as_save_error(exc, rank)
    try:
        gather_or_raise(None, error, rank, group, torch.device("cpu"))
    except RemoteRankError as exc:  # a peer's failure: the merge's promise is a SaveError, naming it
        raise SaveError(exc.reason, file=exc.file, tensor=exc.tensor, rank=exc.rank, hint=exc.hint) from exc
    assert model is not None
    kwargs.setdefault("max_shard_size", "50GB")  # the merger's save_pretrained default
    # The tokenizer / processor go into the save's temporary directory: committed with the weights.
    return save_pretrained(
        model,
        target_dir,
        dtype=torch.bfloat16,
        timeout=timeout,
        extra_files=lambda tmp: _save_processing(hf_path, tmp, trust_remote_code),
        **kwargs,
    )


def _as_save_error(exc: BaseException, rank: int) -> SaveError:
    err = SaveError(f"the merge's input could not be read ({type(exc).__name__}: {exc})", rank=rank)
    err.__cause__ = exc
    return err


def _save_processing(hf_path: str, target_dir: str, trust_remote_code: bool) -> None:
    """The merger's tokenizer / processor step (verl's ``hf_processor`` / ``hf_tokenizer``)."""
    from verl.utils import hf_processor, hf_tokenizer

    processor = hf_processor(hf_path, trust_remote_code=trust_remote_code)
    tokenizer = hf_tokenizer(hf_path, trust_remote_code=trust_remote_code)
    if processor is not None:
        processor.save_pretrained(target_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(target_dir)


def main(argv: list[str] | None = None) -> int:
    """``torchrun --nproc-per-node W -m streamload.integrations.verl_merge LOCAL_DIR TARGET_DIR``:
    ``merge_fsdp_checkpoint`` over a gloo group of the launcher's ranks (the merge runs on the CPU).
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("local_dir")
    parser.add_argument("target_dir")
    parser.add_argument("--hf-model-config-path", default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        merge_fsdp_checkpoint(
            args.local_dir,
            args.target_dir,
            hf_model_config_path=args.hf_model_config_path,
            trust_remote_code=args.trust_remote_code,
        )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
