"""from_pretrained: build on meta with real buffers, shard, stream the weights."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError, hf_missing
from ..io.remote import RemotePath, as_remote, read_small
from ..load.driver import run_load
from ..load.prepare import LoadOptions
from ..load.source import compare_tied, open_source
from ..model.placement import resolve_device, resolve_group
from ..model.state import ModelState, rebind_ties, record_state
from ..timeline import PhaseClock
from ..transport.arrival import meeting
from ..transport.protocol import gather_or_raise


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class transformers lists in
    ``_no_split_modules`` (else the children of the largest ModuleList),
    outermost first and never nested in each other."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found: list[tuple[str, nn.Module]] = []
    if names:
        for mod_name, mod in model.named_modules():
            if type(mod).__name__ in names and not any(mod_name.startswith(p + ".") for p, _ in found):
                found.append((mod_name, mod))
    if not found:
        lists: list[nn.ModuleList] = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        if lists:
            longest = max(range(len(lists)), key=lambda i: len(lists[i]))
            return list(lists[longest])
    return [m for _, m in found]


def default_shard_fn(model: nn.Module, mesh: Any) -> None:
    """``fully_shard`` each repeated block, then the root. Tied modules
    (embedding and head) stay in the root group, so the tie is one parameter."""
    from torch.distributed.fsdp import fully_shard

    # A model built under accelerate's init_empty_weights comes back untied (its
    # register_parameter hook re-wraps the head): tie first, or FSDP would manage
    # the head as a parameter of its own, which no load can re-tie (a TieError).
    ties = record_state(model).ties
    rebind_ties(model, ties)
    names = {id(m): n for n, m in model.named_modules()}
    for block in repeated_blocks(model):
        # A block holding one end of a tie (BERT's embeddings are in its _no_split_modules)
        # stays in the root group: fully_shard re-registers a parameter only inside the
        # block, so the head outside would become a second FSDP parameter (a TieError).
        prefix = names[id(block)] + "."
        if any(len({n.startswith(prefix) for n in (g.canonical, *g.aliases)}) > 1 for g in ties):
            continue
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def meta_model(path: str | os.PathLike, dtype: torch.dtype | None = None) -> nn.Module:
    """``AutoModelForCausalLM`` from the config at ``path``: parameters on meta, buffers real.

    Args:
        path: a checkpoint directory with config.json.
        dtype: parameter dtype (default: the config's, else float32).

    Returns:
        The model skeleton (initialisation runs on meta only).

    Example:
        >>> model = meta_model("/ckpt", torch.bfloat16)
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype or getattr(config, "dtype", None) or torch.float32
        )


def _no_init_weights() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialising on meta is only slower
        import contextlib

        return contextlib.nullcontext()
    return no_init_weights()


def keep_quantized_skeleton(model: nn.Module, config: Any) -> None:
    """Gives a meta model the parameters an FP8 block-scaled checkpoint loads
    into as it is: transformers' own ``FP8Linear`` (fp8 ``weight`` and float32
    ``weight_scale_inv``) in place of every ``nn.Linear`` but the skipped ones.

    Args:
        model: the model on meta, before sharding.
        config: its config, with ``quantization_config`` (quant_method fp8).

    Example:
        >>> keep_quantized_skeleton(model, config)  # then fully_shard and load with quantized="keep"
    """
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    from ..plan.quant import scheme_from_config

    scheme = scheme_from_config(config)
    if scheme is None or scheme.method != "fp8":
        raise ValueError("quantized='keep' builds FP8 block-scaled models only (quant_method fp8)")
    qc = config.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    fp8 = FineGrainedFP8Config(
        weight_block_size=scheme.block or (128, 128),
        activation_scheme=qc.get("activation_scheme", "dynamic"),
        modules_to_not_convert=qc.get("modules_to_not_convert"),
    )
    skip = list(fp8.modules_to_not_convert or []) or ["lm_head"]
    replace_with_fp8_linear(model, modules_to_not_convert=skip, quantization_config=fp8, pre_quantized=True)


def _read_remote_configs(path: RemotePath) -> dict[str, Any]:
    """config.json and generation_config.json of a checkpoint in object storage, fetched whole
    and parsed as transformers' from_pretrained parses them (nothing is written to disk)."""
    from transformers import CONFIG_MAPPING, GenerationConfig

    raw, generation = read_small(path, "config.json", "generation_config.json")
    if raw is None:
        raise CheckpointError(
            "no config.json: from_pretrained builds the model from it",
            path.url_of("config.json"),
            hint="upload config.json beside the *.safetensors, or build the model yourself and "
            "call streamload.load_checkpoint(model, URL)",
        )
    try:
        values = json.loads(raw)
        config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"config.json does not describe a transformers model: {exc}", path.url_of("config.json")
        ) from exc
    config._name_or_path = path.url
    out: dict[str, Any] = {"config": config}
    if generation is not None:
        out["generation_config"] = GenerationConfig.from_dict(json.loads(generation))
    return out


def _read_configs(path: Path | RemotePath) -> dict[str, Any]:
    from transformers import AutoConfig, GenerationConfig

    if isinstance(path, RemotePath):
        return _read_remote_configs(path)
    if path.is_dir() and not (path / "config.json").exists():
        raise CheckpointError(
            "no config.json: from_pretrained builds the model from it",
            str(path),
            hint="pass the model's full directory (config.json beside the *.safetensors), or build the "
            "model yourself and call streamload.load_checkpoint(model, DIR)",
        )
    out: dict[str, Any] = {"config": AutoConfig.from_pretrained(path)}
    if (path / "generation_config.json").exists():
        out["generation_config"] = GenerationConfig.from_pretrained(path)
    return out


def from_pretrained(
    path: str | os.PathLike,
    model_cls: Any = None,
    device_mesh: Any = None,
    shard_fn: Callable[[nn.Module, Any], None] | None = None,
    dtype: torch.dtype | None = None,
    src_rank: int = 0,
    bucket_bytes: int | None = None,
    strict: bool = True,
    progress: bool | None = None,
    **load_kwargs: Any,
) -> nn.Module:
    """Drop-in for ``from_pretrained`` + ``fully_shard`` + loading the weights.

    Only ``src_rank`` reads ``path`` (config included); every rank builds the
    model on meta with real buffers, shards it, and receives only its shards.

    Args:
        path: checkpoint directory (config.json + safetensors), local or in object storage
            (``s3://bucket/prefix``, ``gs://``, ``az://``; see ``storage_options`` of ``load_checkpoint``).
        model_cls: a transformers auto class or model class (default
            ``AutoModelForCausalLM``).
        device_mesh: default: a 1-D mesh over the default group on cuda (NCCL)
            or cpu (gloo); None without torch.distributed (no sharding).
        shard_fn: ``callable(model, mesh)``; default: ``default_shard_fn``.
        dtype: parameter dtype (default: the checkpoint's, as transformers' "auto").
        src_rank, bucket_bytes, strict, progress: see ``load_checkpoint``.
        load_kwargs: ``load_checkpoint``'s other knobs (``timeout=`` included: the wait for peers
            that have not called, see ``load_checkpoint``); ``quantized="keep"`` with an FP8
            block-scaled checkpoint builds transformers' ``FP8Linear`` modules and loads the fp8
            weights and their ``weight_scale_inv`` as they are (default: dequantize into ``dtype``).

    Returns:
        The sharded model in eval mode, with ``config`` and ``generation_config``,
        and the LoadReport as ``model.streamload_report``.

    Example:
        >>> model = streamload.from_pretrained("/ckpt", dtype=torch.float32)
    """
    group = resolve_group(None, device_mesh)
    # Defaults filled in (a rank passing readers="auto" agrees with one that leaves it out).
    given = {k: load_kwargs[k] for k in ("slots", "readers", "quantized", "unexpected") if k in load_kwargs}
    agreed = LoadOptions(src_rank=src_rank, strict=strict, bucket_bytes=bucket_bytes, **given).agreed()
    agreed["dtype"] = dtype
    clock = PhaseClock()  # the report's phases cover the whole call: meeting, config, build, shard
    with meeting("from_pretrained", group, load_kwargs.get("timeout"), agreed):
        clock.mark("meet")
        return _from_pretrained(
            path,
            model_cls,
            device_mesh,
            shard_fn,
            dtype,
            src_rank,
            bucket_bytes,
            strict,
            progress,
            load_kwargs,
            clock,
        )


def _from_pretrained(
    path: str | os.PathLike,
    model_cls: Any,
    device_mesh: Any,
    shard_fn: Callable[[nn.Module, Any], None] | None,
    dtype: torch.dtype | None,
    src_rank: int,
    bucket_bytes: int | None,
    strict: bool,
    progress: bool | None,
    load_kwargs: dict[str, Any],
    clock: PhaseClock,
) -> nn.Module:
    """``from_pretrained`` once the ranks met."""
    try:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise hf_missing("streamload.from_pretrained", exc) from exc

    path = as_remote(path, load_kwargs.get("storage_options"))
    group = resolve_group(None, device_mesh)
    rank = dist.get_rank() if group is not None else 0
    if device_mesh is None and group is not None:
        from torch.distributed.device_mesh import init_device_mesh

        dev = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
        device_mesh = init_device_mesh(dev, (dist.get_world_size(group),))
    # No model yet: the index is the group's bound device, else the current one.
    bcast_device = (
        resolve_device(nn.Module(), device_mesh, group) if device_mesh is not None else torch.device("cpu")
    )
    clock.mark("setup")

    def configs() -> dict[str, Any]:
        with clock.part("open.config"):
            return _read_configs(path if isinstance(path, RemotePath) else Path(path))

    # The reader sends the config with the tensor table; no other rank needs the files.
    empty = ModelState({}, {}, [])  # nothing: no model yet (built below, after the config arrives)
    opened = open_source(
        path,
        rank,
        src_rank,
        group,
        bcast_device,
        empty,
        load_kwargs.get("read_mode", "auto"),  # kept: ranks that read their own shards open with it too
        load_kwargs.get("threads"),  # kept too: ranks that read their own shards use it
        extra=configs,
        drop_cache=bool(load_kwargs.get("drop_cache", False)),
        direct_io=load_kwargs.get("direct_io"),
        clock=clock,
        ask_identity=load_kwargs.get("readers", "auto") != "src",
    )
    clock.mark("open")
    meta = opened.meta
    config = meta.extra["config"]
    cls: Any = model_cls or AutoModelForCausalLM
    param_dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(param_dtype, str):
        param_dtype = getattr(torch, param_dtype)
    error: BaseException | None = None
    try:
        # Parameters on meta, buffers real; no initialisation (the load fills every
        # parameter), as transformers' own from_pretrained builds its skeleton.
        with init_empty_weights(include_buffers=False), _no_init_weights():
            if hasattr(cls, "from_config"):
                model = cls.from_config(config, dtype=param_dtype)
            else:
                model = cls._from_config(config, dtype=param_dtype)
        if load_kwargs.get("quantized") == "keep":
            keep_quantized_skeleton(model, config)
        if "generation_config" in meta.extra and getattr(model, "generation_config", None) is not None:
            model.generation_config = meta.extra["generation_config"]
        # transformers ties lazily: on meta the head may still be its own Parameter.
        # Tie before sharding, so FSDP manages one parameter (one shard, one
        # all-gather, one gradient) rather than two it would later fold together.
        rebind_ties(model, record_state(model).ties)
        clock.mark("build")
        if device_mesh is not None:
            (shard_fn or default_shard_fn)(model, device_mesh)
        clock.mark("shard")
        if opened.source is not None and rank == src_rank:
            # Tie conflicts need the model's tie groups, which exist only now.
            meta.tie_conflicts = compare_tied(opened.source, record_state(model))
        options = LoadOptions(
            src_rank=src_rank,
            strict=strict,
            bucket_bytes=bucket_bytes,
            progress=progress,
            device_mesh=device_mesh,
            **load_kwargs,
        )
    except BaseException as exc:  # noqa: BLE001 - reported to every rank, then re-raised
        error = exc
    # The reader alone reads the tied tensors, and any rank may fail to build its model:
    # one agreement, so such a failure raises on every rank instead of leaving the
    # others waiting in the load's first collective.
    gather_or_raise(None, error, rank, group, bcast_device)
    clock.mark("agree_build")
    model.eval()
    report = run_load(model, path, options, opened, clock)
    model.streamload_report = report  # type: ignore[assignment]
    return model
