"""Cases for tests/test_client_verl.py: verl 0.9.1's own FSDP engine build
(``FSDPEngine._build_module`` + ``_build_fsdp_module``: get_init_weight_context_manager,
from_pretrained, apply_fsdp2, fsdp2_load_full_state_dict) on CPU gloo ranks, with
verl's loader or streamload's swapped in, compared bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from cases_load import compare_model, full, reference, tied
from torch import nn

import streamload
from streamload.errors import TieError
from streamload.integrations.verl import offload_policy
from streamload.io.copy_ops import bit_view as bits
from streamload.tools.verl_engine import SEEN, build_engine_model, verl_mesh


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor and every buffer, as bytes on the CPU."""
    out = {f"param {n}": bits(full(p)).cpu().clone() for n, p in model.named_parameters()}
    out.update({f"buffer {n}": bits(full(b)).cpu().clone() for n, b in model.named_buffers()})
    return out


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:10]
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def train_step(model: nn.Module, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One forward + backward + verl's ``fsdp2_clip_grad_norm_`` + AdamW step on the same batch on
    every rank; returns the loss, the grad norm, the full gradients (before the step) and the full
    parameters after it."""
    from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 7), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {f"grad {n}": bits(full(p.grad)).cpu().clone() for n, p in model.named_parameters()}
    norm = fsdp2_clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    after = {f"step {n}": bits(full(p)).cpu().clone() for n, p in model.named_parameters()}
    return {
        "loss": bits(out.loss.detach().float().reshape(1)).clone(),
        "grad norm": bits(full(norm).detach().float().reshape(1)).clone(),
        **grads,
        **after,
    }


def _all_ranks_tied(model: nn.Module) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tied(model))
    return gathered


class _StrategyCount:
    """Counts the reader strategies streamload makes (after its agreements, before the first
    weight byte): an error raised "before any byte moves" must leave the count at 0."""

    def __enter__(self) -> _StrategyCount:
        from streamload.load import prepare as prepare_mod

        self.made = 0
        self._saved = prepare_mod.make_strategy

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.made += 1
            return self._saved(*args, **kwargs)

        prepare_mod.make_strategy = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        from streamload.load import prepare as prepare_mod

        prepare_mod.make_strategy = self._saved  # type: ignore[assignment]


def _swapped(reports: list[Any], **kw: Any) -> Callable[..., None]:
    """streamload's fsdp2_load_full_state_dict where verl calls its own (same positional call)."""

    def loader(model: nn.Module, full_state: Any, mesh: Any, cpu_offload: Any) -> None:
        reports.append(streamload.fsdp2_load_full_state_dict(model, full_state, mesh, cpu_offload, **kw))

    return loader


def case_engine_bit_exact(
    rank: int,
    world: int,
    *,
    ckpt: str,
    dtype: torch.dtype,
    meta_everywhere: bool,
    offload: bool = False,
    step: bool = True,
) -> dict:
    """verl's own build and load vs the same build with streamload's loader swapped in
    (verl's tie guard kept, or meta init everywhere with ``tie_weights()`` before sharding):
    every parameter and buffer bit for bit, the tie on every rank, one training step."""
    ref_model = build_engine_model(ckpt, verl_mesh(), dtype, offload=offload)
    ref = snapshot(ref_model)
    vocab = ref_model.config.vocab_size
    ref_step = train_step(ref_model, vocab) if step else {}
    ref_tied = _all_ranks_tied(ref_model)
    del ref_model
    reports: list[Any] = []
    model = build_engine_model(
        ckpt,
        verl_mesh(),
        dtype,
        loader=_swapped(reports),
        meta_everywhere=meta_everywhere,
        tie_before_shard=meta_everywhere,
        offload=offload,
    )
    seen = dict(SEEN)
    assert len(reports) == 1
    got = snapshot(model)
    bad = differ(got, ref)
    assert not bad, f"streamload differs from verl's own load: {bad[:10]}"
    # And both equal transformers' from_pretrained for the same files and dtype (parameters:
    # verl's module.to(dtype) also casts the rotary buffers, which transformers keeps fp32).
    bad = [b for b in compare_model(model, reference(ckpt, dtype)) if not b.startswith("buffer ")]
    assert not bad, bad
    got_tied = _all_ranks_tied(model)
    assert got_tied == ref_tied, (got_tied, ref_tied)
    if offload:
        assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    if step:
        mine = train_step(model, vocab)
        bad = differ(mine, ref_step)
        assert not bad, f"training step differs from verl's own: {bad[:10]}"
    return {"rank": rank, "tied": got_tied[rank], "seen": seen, "report": reports[0].to_dict()}


def case_meta_untied(rank: int, world: int, *, ckpt: str, dtype: torch.dtype, check: bool = True) -> dict:
    """Meta init everywhere without ``tie_weights()``: ranks >= 1 shard an untied
    ``lm_head.weight`` as its own FSDP parameter. With the check, TieError on every rank
    before any byte moves; with it disabled (``check=False``), the load "succeeds" while the
    ranks' FSDP parameter sets differ (what the check exists for)."""
    from streamload.load import prepare as prepare_mod
    from streamload.model.fsdp_ties import fsdp_groups

    reports: list[Any] = []
    handed: list[Any] = []
    swapped = _swapped(reports)

    def loader(model: nn.Module, *args: Any) -> None:
        handed.append(fsdp_groups(model))  # what fully_shard took, before the load re-ties anything
        swapped(model, *args)

    saved = prepare_mod.agree_ties
    if not check:
        prepare_mod.agree_ties = lambda *a, **k: None  # type: ignore[assignment]
    try:
        with _StrategyCount() as count:
            model = build_engine_model(ckpt, verl_mesh(), dtype, loader=loader, meta_everywhere=True)
    except TieError as exc:
        return {
            "rank": rank,
            "error": str(exc),
            "tensor": exc.tensor,
            "seen": dict(SEEN),
            "strategies": count.made,
        }
    finally:
        prepare_mod.agree_ties = saved
    groups: list[Any] = [None] * world
    dist.all_gather_object(groups, handed[0])
    return {"rank": rank, "error": None, "seen": dict(SEEN), "tied": tied(model), "groups": groups}


def case_buffers_kwarg(rank: int, world: int, *, ckpt: str, dtype: torch.dtype, bad: str = "") -> dict:
    """Newer verl's ``buffers=``: rank 0's values end up in every rank's buffers (each rank's
    inv_freq is recomputed by the load; rank 0 passes different values to prove which wins);
    ``bad`` ("name", "shape", "dtype") makes rank 0's mapping wrong: the same error on every rank."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt)
    reports: list[Any] = []
    name = "model.rotary_emb.inv_freq"
    buffers: dict[str, torch.Tensor] = {}
    if rank == 0:
        dim = config.hidden_size // config.num_attention_heads
        value = torch.arange(dim // 2, dtype=torch.float32) * 0.125 + 1.0
        if bad == "shape":
            value = value[:-1]
        if bad == "dtype":
            value = value.double()
        buffers = {("model.rotary_emb.nonexistent" if bad == "name" else name): value}
    try:
        with _StrategyCount() as count:
            model = build_engine_model(ckpt, verl_mesh(), dtype, loader=_swapped(reports, buffers=buffers))
    except streamload.StreamloadError as exc:
        return {"rank": rank, "error": type(exc).__name__, "strategies": count.made}
    got = dict(model.named_buffers())[name]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, got.cpu())
    return {"rank": rank, "error": None, "values": gathered}


def case_pinning_needs_accelerator(rank: int, world: int) -> dict:
    """torch's fact that ``offload_policy`` relies on: without an accelerator, verl's
    ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True))`` raises in torch;
    ``pin_memory=False`` shards. Fails loudly if a torch release changes either."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if torch.accelerator.is_available():
        return {"rank": rank, "skipped": True}
    raised = None
    try:
        fully_shard(nn.Linear(4, 6), mesh=verl_mesh(), offload_policy=CPUOffloadPolicy(pin_memory=True))
    except RuntimeError as exc:
        raised = str(exc)
    layer = fully_shard(nn.Linear(4, 6), mesh=verl_mesh(), offload_policy=offload_policy())
    return {
        "rank": rank,
        "raised": raised,
        "pinned": offload_policy().pin_memory,
        "sharded": type(layer).__name__,
    }


def _meta_qwen(ckpt: str, untie: bool) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    # accelerate's init_empty_weights leaves the head untied (its register_parameter hook
    # re-wraps it): tie_weights() outside the context ties it, as the fixed recipes do.
    if not untie:
        model.tie_weights()
    assert tied(model) is not untie
    return model


def _shard_and_load(model: nn.Module, ckpt: str, also: nn.Module | None = None) -> dict:
    """fully_shard every layer (and ``also``, when given), then the root; load; the TieError, if any."""
    from torch.distributed.fsdp import fully_shard

    for module in [*model.model.layers, *([also] if also is not None else [])]:
        fully_shard(module, mesh=verl_mesh())
    fully_shard(model, mesh=verl_mesh())
    try:
        streamload.load_checkpoint(model, ckpt, device_mesh=verl_mesh(), progress=False)
    except TieError as exc:
        return {"rank": dist.get_rank(), "error": str(exc), "tensor": exc.tensor}
    return {"rank": dist.get_rank(), "error": None}


def case_plain_untied_everywhere(rank: int, world: int, *, ckpt: str) -> dict:
    """Every rank shards an untied alias (no verl involved): the ranks agree, yet FSDP holds
    ``lm_head.weight`` apart, so re-binding after the load would be undone at the first forward:
    TieError on every rank, naming every rank."""
    return _shard_and_load(_meta_qwen(ckpt, untie=True), ckpt)


def case_wrap_differs(rank: int, world: int, *, ckpt: str) -> dict:
    """Ranks that wrap different modules (rank 0 also shards the norm on its own) agree on
    names and placements but not on FSDP's parameter groups: TieError on every rank."""
    model = _meta_qwen(ckpt, untie=False)
    return _shard_and_load(model, ckpt, also=model.model.norm if rank == 0 else None)
