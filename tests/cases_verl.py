"""Cases for tests/test_client_verl.py: verl 0.9.1's own FSDP engine build
(``FSDPEngine._build_module`` + ``_build_fsdp_module``: get_init_weight_context_manager,
from_pretrained, apply_fsdp2, fsdp2_load_full_state_dict) on CPU gloo ranks, with
verl's loader or streamload's swapped in, compared bit for bit."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from cases_load import compare_model, full, reference, tied
from torch import nn

import streamload
from streamload.errors import TieError
from streamload.io.copy_ops import bit_view as bits


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


def _engine(ckpt: str, mesh: Any, dtype: torch.dtype, offload: bool) -> Any:
    """The attributes ``FSDPEngine._build_module`` / ``_build_fsdp_module`` read, as verl's
    default FSDP2 actor config sets them (fp32 masters, bf16 compute, fp32 reduce)."""
    from transformers import AutoConfig

    precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    engine_config = SimpleNamespace(
        model_dtype=precision,
        forward_only=False,
        mixed_precision=None,
        wrap_policy={},
        strategy="fsdp2",
        offload_policy=offload,
        reshard_after_forward=True,
        forward_prefetch=False,
        get=lambda key, default=None: {"wrap_policy": {}}.get(key, default),
    )
    model_config = SimpleNamespace(
        hf_config=AutoConfig.from_pretrained(ckpt),
        model_type="language_model",
        local_path=ckpt,
        trust_remote_code=False,
        use_liger=False,
        fused_kernel_options=None,
        use_fused_kernels=False,
        enable_gradient_checkpointing=False,
        lora_rank=0,
        enable_activation_offload=False,
    )
    return SimpleNamespace(
        engine_config=engine_config,
        model_config=model_config,
        device_mesh=mesh,
        use_remove_padding=False,
        ulysses_sequence_parallel_size=1,
    )


@contextlib.contextmanager
def verl_build(
    *, loader: Callable[..., Any] | None, meta_everywhere: bool, tie_before_shard: bool
) -> Iterator[None]:
    """Patches the names ``transformer_impl`` looks up, as a user's diff of verl would:
    ``loader`` replaces ``fsdp2_load_full_state_dict`` (None: verl's own); ``meta_everywhere``
    drops the tie guard (``use_meta_tensor=True`` for tied models too); ``tie_before_shard``
    calls ``model.tie_weights()`` before ``apply_fsdp2``."""
    from verl.workers.engine.fsdp import transformer_impl as impl

    saved = {k: getattr(impl, k) for k in ("fsdp2_load_full_state_dict", "get_init_weight_context_manager", "apply_fsdp2")}
    if loader is not None:
        impl.fsdp2_load_full_state_dict = loader
    if meta_everywhere:
        impl.get_init_weight_context_manager = lambda use_meta_tensor=True, mesh=None: saved[
            "get_init_weight_context_manager"
        ](use_meta_tensor=True, mesh=mesh)
    if tie_before_shard:

        def apply_fsdp2(model: nn.Module, fsdp_kwargs: dict, config: Any) -> None:
            model.tie_weights()
            saved["apply_fsdp2"](model, fsdp_kwargs, config)

        impl.apply_fsdp2 = apply_fsdp2
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(impl, k, v)


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
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    engine = _engine(ckpt, mesh, dtype, offload)
    with verl_build(loader=loader, meta_everywhere=meta_everywhere, tie_before_shard=tie_before_shard):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = FSDPEngine._build_module(engine)
            module = FSDPEngine._build_fsdp_module(engine, module)
    return module


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor and every buffer, as bytes on the CPU."""
    out = {f"param {n}": bits(full(p)).cpu().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": bits(full(b)).cpu().clone() for n, b in model.named_buffers()})
    return out


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:10]
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def train_step(model: nn.Module, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One forward + backward + AdamW step on the same batch on every rank; returns the
    loss, the full gradients (before the step) and the full parameters after it."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 7), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {f"grad {n}": bits(full(p.grad)).cpu().clone() for n, p in model.named_parameters()}
    opt.step()
    after = {f"step {n}": bits(full(p)).cpu().clone() for n, p in model.named_parameters()}
    return {"loss": bits(out.loss.detach().float().reshape(1)).clone(), **grads, **after}


def _all_ranks_tied(model: nn.Module) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tied(model))
    return gathered


def case_engine_bit_exact(
    rank: int, world: int, *, ckpt: str, dtype: torch.dtype, meta_everywhere: bool, step: bool = True
) -> dict:
    """verl's own build and load vs the same build with streamload's loader swapped in
    (verl's tie guard kept, or meta init everywhere with ``tie_weights()`` before sharding):
    every parameter and buffer bit for bit, the tie on every rank, one training step."""
    ref_model = build_engine_model(ckpt, verl_mesh(), dtype)
    ref = snapshot(ref_model)
    vocab = ref_model.config.vocab_size
    ref_step = train_step(ref_model, vocab) if step else {}
    ref_tied = _all_ranks_tied(ref_model)
    del ref_model
    reports: list[Any] = []

    def loader(model: nn.Module, full_state: Any, mesh: Any, cpu_offload: Any) -> None:
        reports.append(streamload.fsdp2_load_full_state_dict(model, full_state, mesh, cpu_offload))

    model = build_engine_model(
        ckpt, verl_mesh(), dtype, loader=loader, meta_everywhere=meta_everywhere, tie_before_shard=meta_everywhere
    )
    assert len(reports) == 1
    got = snapshot(model)
    bad = differ(got, ref)
    assert not bad, f"streamload differs from verl's own load: {bad[:10]}"
    # And both equal transformers' from_pretrained for the same files and dtype.
    bad = compare_model(model, reference(ckpt, dtype))
    assert not bad, bad
    got_tied = _all_ranks_tied(model)
    assert got_tied == ref_tied, (got_tied, ref_tied)
    if step:
        mine = train_step(model, vocab)
        bad = differ(mine, ref_step)
        assert not bad, f"training step differs from verl's own: {bad[:10]}"
    return {"rank": rank, "tied": got_tied[rank], "report": reports[0].to_dict()}


def case_meta_untied_raises(rank: int, world: int, *, ckpt: str, dtype: torch.dtype) -> dict:
    """Meta init everywhere without ``tie_weights()``: ranks >= 1 shard an untied
    ``lm_head.weight`` as its own FSDP parameter; streamload must raise TieError on every
    rank before any byte moves, naming the parameter and the ranks."""
    reports: list[Any] = []

    def loader(model: nn.Module, full_state: Any, mesh: Any, cpu_offload: Any) -> None:
        reports.append(streamload.fsdp2_load_full_state_dict(model, full_state, mesh, cpu_offload))

    try:
        build_engine_model(ckpt, verl_mesh(), dtype, loader=loader, meta_everywhere=True)
    except TieError as exc:
        return {"rank": rank, "error": str(exc), "tensor": exc.tensor}
    raise AssertionError(f"rank {rank}: no TieError (loaded: {bool(reports)})")
