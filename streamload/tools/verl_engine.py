"""verl 0.9.1's own FSDP engine build on CPU gloo ranks, for the client tests and benchmark:
``FSDPEngine._build_module`` then ``_build_fsdp_module`` (get_init_weight_context_manager,
from_pretrained, apply_fsdp2, fsdp2_load_full_state_dict), run from verl's own code with the
names it looks up patched the way a user's diff of verl would change them."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

# This module exists for verl (tests/test_client_verl.py, benchmarks/client_verl.py): import it
# once, here, so that a timed build never pays verl's import (ray, tensordict: seconds).
from verl.workers.engine.fsdp import transformer_impl as impl

from ..integrations.verl import offload_policy


def tied(model: nn.Module) -> bool | None:
    """Whether the head is the input embedding's Parameter (None: the model has no such pair)."""
    head = getattr(model, "lm_head", None)
    get = getattr(model, "get_input_embeddings", None)
    if head is None or get is None:
        return None
    return head.weight is get().weight


def use_cpu_platform() -> None:
    """verl has no CPU platform: its ``get_device_id()`` asks CUDA. Registers one
    through verl's own plugin hook (``set_platform``), so verl's functions run on CPU ranks."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    if getattr(platform_manager._current_platform, "device_name", None) == "cpu":
        return

    class PlatformCPU(PlatformCUDA):
        device_name = "cpu"  # type: ignore[assignment]
        device_module = torch.cpu  # type: ignore[assignment]

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:  # verl moves models to get_device_id()
            return "cpu"

        def synchronize(self, device_index: int | None = None) -> None:
            return None

    platform_manager.set_platform(PlatformCPU())


# What FSDPEngine._build_module / _build_fsdp_module read from verl's configs, as verl's default
# FSDP2 actor sets them (bf16 compute, fp32 reduce; no LoRA, liger, fused kernels or checkpointing).
_ENGINE_CONFIG: dict[str, Any] = {
    "forward_only": False,
    "mixed_precision": None,
    "wrap_policy": {},
    "strategy": "fsdp2",
    "reshard_after_forward": True,
    "forward_prefetch": False,
}
_MODEL_CONFIG: dict[str, Any] = {
    "model_type": "language_model",
    "trust_remote_code": False,
    "use_liger": False,
    "fused_kernel_options": None,
    "use_fused_kernels": False,
    "enable_gradient_checkpointing": False,
    "lora_rank": 0,
    "enable_activation_offload": False,
}


def _engine(ckpt: str, mesh: Any, dtype: torch.dtype, offload: bool) -> Any:
    """A stand-in ``self`` for ``FSDPEngine._build_module`` / ``_build_fsdp_module``: the attributes
    they read, ``model_dtype`` (verl's default: fp32 masters) and ``offload_policy`` as asked."""
    from transformers import AutoConfig

    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    engine_config = SimpleNamespace(**_ENGINE_CONFIG, model_dtype=precision, offload_policy=offload)
    engine_config.get = lambda key, default=None: {"wrap_policy": {}}.get(key, default)
    model_config = SimpleNamespace(
        **_MODEL_CONFIG, hf_config=AutoConfig.from_pretrained(ckpt), local_path=ckpt
    )
    parts = {"engine_config": engine_config, "model_config": model_config, "device_mesh": mesh}
    return SimpleNamespace(**parts, use_remove_padding=False, ulysses_sequence_parallel_size=1)


# What verl's apply_fsdp2 was handed in the last build on this rank (meta? tied?).
SEEN: dict[str, Any] = {}


@contextlib.contextmanager
def verl_build(
    *, loader: Callable[..., Any] | None, meta_everywhere: bool, tie_before_shard: bool
) -> Iterator[None]:
    """Patches the names ``transformer_impl`` looks up, as a user's diff of verl would:
    ``loader`` replaces ``fsdp2_load_full_state_dict`` (None: verl's own); ``meta_everywhere``
    drops the tie guard (``use_meta_tensor=True`` for tied models too); ``tie_before_shard``
    calls ``model.tie_weights()`` before ``apply_fsdp2``; ``CPUOffloadPolicy`` pins only where
    torch can (``streamload.integrations.verl.offload_policy``)."""
    saved = {
        k: getattr(impl, k)
        for k in (
            "fsdp2_load_full_state_dict",
            "get_init_weight_context_manager",
            "apply_fsdp2",
            "CPUOffloadPolicy",
        )
    }
    original_init = saved["get_init_weight_context_manager"]

    def apply_fsdp2(model: nn.Module, fsdp_kwargs: dict, config: Any) -> None:
        SEEN.update(meta=any(p.is_meta for p in model.parameters()), tied_before=tied(model))
        if tie_before_shard:
            cast(Any, model).tie_weights()
        saved["apply_fsdp2"](model, fsdp_kwargs, config)

    patched: dict[str, Any] = {
        # verl hard-codes CPUOffloadPolicy(pin_memory=True); pinning needs an accelerator.
        "CPUOffloadPolicy": lambda pin_memory=True: offload_policy(pin_memory),
        "apply_fsdp2": apply_fsdp2,
    }
    if loader is not None:
        patched["fsdp2_load_full_state_dict"] = loader
    if meta_everywhere:
        patched["get_init_weight_context_manager"] = lambda use_meta_tensor=True, mesh=None: original_init(
            use_meta_tensor=True, mesh=mesh
        )
    for k, v in patched.items():
        setattr(impl, k, v)
    try:
        with hub_kernels_off():
            yield
    finally:
        for k, v in saved.items():
            setattr(impl, k, v)


@contextlib.contextmanager
def hub_kernels_off() -> Iterator[None]:
    """``USE_HUB_KERNELS=0`` while verl builds its module, as a verl user on transformers >= 5.2x
    with the ``kernels`` package must set it (docs/clients/verl.md): transformers' ``from_pretrained``
    kernelizes by default when ``kernels`` is installed, and ``kernels`` refuses verl's meta init on
    ranks >= 1 (``ValueError: Unsupported device type 'meta'``) - verl 0.9.1 pins transformers < 5.11,
    which had no such default. A variable the caller set is left as it is."""
    if "USE_HUB_KERNELS" in os.environ:
        yield
        return
    os.environ["USE_HUB_KERNELS"] = "0"
    try:
        yield
    finally:
        os.environ.pop("USE_HUB_KERNELS", None)


_MESH: dict[int, Any] = {}


def verl_mesh() -> Any:
    """The 1-D mesh verl's ``create_device_mesh`` makes for plain FSDP (dim "fsdp"), once per process."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world not in _MESH:
        _MESH[world] = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    return _MESH[world]


def build_engine_model(
    ckpt: str,
    mesh: Any,
    dtype: torch.dtype,
    *,
    loader: Callable[..., Any] | None = None,
    meta_everywhere: bool = False,
    tie_before_shard: bool = False,
    offload: bool = False,
) -> nn.Module:
    """verl's ``FSDPEngine._build_module`` then ``_build_fsdp_module``, verl's own code."""
    use_cpu_platform()
    engine = _engine(ckpt, mesh, dtype, offload)
    with verl_build(loader=loader, meta_everywhere=meta_everywhere, tie_before_shard=tie_before_shard):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = impl.FSDPEngine._build_module(engine)
            module = impl.FSDPEngine._build_fsdp_module(engine, module)
    return module


def bench_verl_own(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """Bench strategy: verl's own engine build and ``fsdp2_load_full_state_dict`` (tie guard kept)."""
    return build_engine_model(ckpt, mesh, dtype)


def bench_verl_streamload(ckpt: str, mesh: Any, dtype: torch.dtype, opts: dict[str, Any]) -> nn.Module:
    """Bench strategy: the same build with streamload's loader swapped in; ``opts["meta_everywhere"]``
    also drops verl's tie guard (meta init on ranks >= 1, ``tie_weights()`` before sharding)."""
    from ..integrations.frameworks import fsdp2_load_full_state_dict

    meta = bool(opts.get("meta_everywhere", False))
    return build_engine_model(
        ckpt, mesh, dtype, loader=fsdp2_load_full_state_dict, meta_everywhere=meta, tie_before_shard=meta
    )
