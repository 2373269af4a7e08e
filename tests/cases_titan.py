"""torchtitan cases run inside the rank group (see rank_group.py): torchtitan's own
Qwen3 models, built on meta and parallelised with torchtitan's own ``parallelize_qwen3``
(FSDP, or TP x FSDP), loaded by streamload with torchtitan's adapter as the mapping, and
compared bit for bit (every parameter, buffer and the logits of one forward) with
torchtitan's own HF load on one process."""

from __future__ import annotations

import copy
from typing import Any

import titan_models as tm
import torch
from torch import nn

import streamload
from streamload.io.copy_ops import bit_view as bits


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(model: nn.Module, ref: nn.Module) -> list[str]:
    """Names whose full tensor differs from the reference's, as bytes."""
    bad = []
    ref_t = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    got = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if set(ref_t) != set(got):
        return sorted(set(ref_t) ^ set(got))
    for name, t in got.items():
        f, r = _full(t).detach(), _full(ref_t[name]).detach()
        if f.dtype != r.dtype or f.shape != r.shape or not torch.equal(bits(f), bits(r)):
            bad.append(name)
    return bad


def case_titan_load(
    rank: int, world: int, *, kind: str, path: str, tp: int = 1, init_first: bool = False, strict: bool = True
) -> dict[str, Any]:
    """streamload into torchtitan's parallelised model vs torchtitan's own HF load.

    ``init_first``: torchtitan's own order (``to_empty`` + ``init_weights`` before the
    checkpoint) with a distinctive load-balancing bias that the load must keep.
    """
    cfg = tm.titan_config(kind)
    model = tm.build_meta(cfg)
    tm.parallelize(model, world, tp=tp)
    bias = {}
    if init_first:
        model.to_empty(device="cpu")
        model.init_weights(buffer_device=torch.device("cpu"))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias_E"):
                b.copy_(torch.arange(b.numel(), dtype=b.dtype) + 0.5)
                bias[name] = b.clone()
    report = streamload.load_checkpoint(model, path, mapping=tm.adapter_for(cfg), strict=strict)
    # Parameters against torchtitan's from_hf on one process; logits (bf16 FSDP compute)
    # against torchtitan's own DCP load into the same parallelised model.
    one = tm.titan_reference(cfg, path)
    own = tm.titan_parallel_reference(cfg, path, world, tp=tp)
    for name, value in bias.items():  # torchtitan's load leaves the bias as it was: so must streamload
        one.get_buffer(name).copy_(value)
        own.get_buffer(name).copy_(value)
    bad = compare(model, one) + [f"own: {n}" for n in compare(model, own)]
    x = tm.tokens()
    logits_equal = torch.equal(bits(tm.forward_logits(model, x)), bits(tm.forward_logits(own, x)))
    tied = model.lm_head.weight is model.tok_embeddings.weight  # type: ignore[union-attr]
    return {
        "bad": bad,
        "logits_equal": logits_equal,
        "tied": tied,
        "missing": list(report.missing_keys),
        "placements": sorted({str(getattr(p, "placements", "plain")) for p in model.parameters()}),
    }


def case_titan_bad_mapping(rank: int, world: int, *, path: str, how: str) -> str:
    """A mapping with no exact region form fails on every rank, before any byte moves."""
    cfg = tm.titan_config("dense")
    model = tm.build_meta(cfg)
    tm.parallelize(model, world)
    adapter = tm.adapter_for(cfg)
    mapping: Any = adapter
    if how == "swapped_qk":  # q_proj read as wk: the adapter agrees, the fused QKV cannot hold it
        mapping = copy.deepcopy(adapter)
        fm = mapping.from_hf_map
        q, k = "model.layers.{}.self_attn.q_proj.weight", "model.layers.{}.self_attn.k_proj.weight"
        fm[q], fm[k] = fm[k], fm[q]
    elif how == "collide":  # two checkpoint tensors onto one parameter
        mapping = dict(adapter.from_hf_map)
        mapping["model.layers.{}.mlp.up_proj.weight"] = "layers.{}.feed_forward.w1.weight"
    elif how == "unknown_hook":  # a load hook streamload cannot see through
        model.norm.register_load_state_dict_pre_hook(lambda *a: None)
    try:
        streamload.load_checkpoint(model, path, mapping=mapping)
    except streamload.MappingError as exc:
        # Nothing was materialised: the model is still on meta.
        still_meta = all(getattr(p, "_local_tensor", p).is_meta for p in model.parameters())
        return f"MappingError meta={still_meta}: {exc}"
    raise AssertionError("no MappingError")


def case_titan_tp_untied(rank: int, world: int, *, path: str) -> str:
    """TP unties lm_head on a meta build; loading it as is would silently untie: TieError everywhere."""
    cfg = tm.titan_config("dense")
    model = tm.build_meta(cfg)
    tm.parallelize(model, world, tp=2)
    try:
        streamload.load_checkpoint(model, path, mapping=tm.adapter_for(cfg))
    except streamload.TieError as exc:
        still_meta = all(getattr(p, "_local_tensor", p).is_meta for p in model.parameters())
        return f"TieError meta={still_meta}: {exc}"
    raise AssertionError("no TieError")
