"""vLLM glue: what runs inside a vLLM worker (through ``LLM.collective_rpc``) and what the
trainer learns from it. vLLM is never imported here at module level; the worker functions are
module-level so that an engine in another process can import them by name.

Two things an in-place ``reload_weights`` does not do by itself (vLLM 0.32, read in
``model_executor/model_loader/reload/layerwise.py``), both measured on the CPU engine:

- **Ties.** vLLM reloads layer by layer and re-runs a layer's ``process_weights_after_loading``
  only when that layer received a weight. A tied ``lm_head`` shares its Parameter with
  ``embed_tokens`` but is its own layer, and on CPU its processing packs a private copy of the
  weight for the logits GEMM (``dispatch_cpu_unquantized_gemm``: an sgl packed weight or a
  oneDNN handle in ``layer.cpu_linear``). A reload that sends ``model.embed_tokens.weight`` only
  (what a hub checkpoint holds) updates the shared Parameter but leaves the head computing with
  the old packed copy. The fix is to send the tensor again under every engine name whose layer
  holds the Parameter (``tie_aliases``): learned from the engine's own module tree, never
  hard-coded.
- **MoE experts.** ``UnquantizedFusedMoEMethod._setup_kernel`` treats a second call as a "weight
  update" and skips ``moe_kernel.fused_experts.process_weights_after_loading``, which on CPU is
  where ``CPUUnquantizedExperts`` prepacks ``w13_weight`` / ``w2_weight`` into its grouped-GEMM
  layout. After a reload the experts hold the checkpoint layout read as if prepacked: the
  expert outputs are wrong (slightly, on a tiny random model: the same greedy tokens, logprobs
  off by ~1e-5). ``refresh_experts`` re-runs the experts' own processing after the reload.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

_CONFIG_DROP = ("architectures", "transformers_version", "_name_or_path", "auto_map", "dtype", "torch_dtype")


def worker_info(worker: Any) -> dict[str, Any]:
    """Runs in a vLLM worker: the engine's model config and its tied Parameters.

    Returns:
        ``config``: the engine's hf config as a dict (``model_type`` included); ``ties``: for
        each Parameter held by more than one layer, one name per layer (the same layer reached
        by two paths counts once); ``model``: the engine's model class name.
    """
    model = worker.model_runner.get_model()
    cfg = worker.model_runner.model_config.hf_config
    config = cfg.to_dict()
    config["model_type"] = cfg.model_type
    holders: dict[int, dict[int, str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            holders.setdefault(id(p), {}).setdefault(id(module), full)
    ties = [sorted(by_layer.values()) for by_layer in holders.values() if len(by_layer) > 1]
    return {"config": config, "ties": ties, "model": type(model).__name__}


def worker_reload(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Runs in a vLLM worker: ``reload_weights`` from ``weights``, then the experts' packing.

    Returns:
        ``seconds`` in the engine (the weights' production included: they are pulled from the
        iterator) and the ``refreshed`` MoE layers.
    """
    t0 = time.perf_counter()
    worker.reload_weights(weights_iterator=iter(weights))
    refreshed = refresh_experts(worker.model_runner.get_model())
    return {"seconds": time.perf_counter() - t0, "refreshed": refreshed}


def refresh_experts(model: nn.Module) -> int:
    """Re-runs the fused experts' own ``process_weights_after_loading`` on every unquantized MoE
    layer whose kernel was set up before (see the module docstring); returns how many."""
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ != "UnquantizedFusedMoEMethod":
            continue
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or not _overrides(type(experts), "process_weights_after_loading"):
            continue
        with torch.no_grad():
            experts.process_weights_after_loading(module)
        n += 1
    return n


def _overrides(cls: type, name: str) -> bool:
    """Whether ``cls`` defines ``name`` below the class that introduced it (not the base no-op)."""
    owners = [c for c in cls.__mro__ if name in c.__dict__]
    return len(owners) > 1 and owners[0] is not owners[-1]


def tie_aliases(ties: list[list[str]], hub_names: Iterable[str]) -> dict[str, list[str]]:
    """Hub name -> the engine's other names for it (layers that share its Parameter).

    Args:
        ties: ``worker_info``'s ``ties``.
        hub_names: the names the trainer sends.

    Example:
        >>> tie_aliases([["lm_head.weight", "model.embed_tokens.weight"]], ["model.embed_tokens.weight"])
        {'model.embed_tokens.weight': ['lm_head.weight']}
    """
    hub = set(hub_names)
    out: dict[str, list[str]] = {}
    for names in ties:
        sent = [n for n in names if n in hub]
        if len(sent) == 1:
            others = [n for n in names if n not in hub]
            if others:
                out[sent[0]] = others
    return out


_EXPECTED: dict[str, dict[str, tuple[int, ...]]] = {}


def expected_hub_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The hub tensors (names, shapes) a checkpoint of the engine's config holds, from
    transformers' own save-time state dict of a meta model built from that config.

    Example:
        >>> expected_hub_shapes(engine_info["config"])["model.embed_tokens.weight"]
        (256, 128)
    """
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from ..save.layout import hub_state

    kw = {k: v for k, v in config.items() if k not in _CONFIG_DROP}
    key = json.dumps(kw, sort_keys=True, default=str)
    if key not in _EXPECTED:
        model_type = kw.pop("model_type")
        cfg = AutoConfig.for_model(model_type, **kw)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(cfg)
        _EXPECTED[key] = {k: tuple(t.shape) for k, t in hub_state(meta).items()}
    return _EXPECTED[key]
