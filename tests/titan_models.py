"""torchtitan 0.3.0 models for the client tests: tiny Qwen3 configs (fused QKV, dense
tied and per-expert MoE), their transformers twins for writing hub checkpoints, the
parallelisation with torchtitan's own functions on CPU, and torchtitan's own HF load
(``adapter.from_hf`` on the safetensors state dict, then ``load_state_dict``, whose
fused-QKV hook merges ``wq/wk/wv``) as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

# Odd sizes where torchtitan allows: heads_per_kv 3, so a fused QKV group is 5 heads.
DIMS: dict[str, Any] = dict(dim=48, head_dim=8, n_heads=6, n_kv_heads=2, vocab=97, layers=2, hidden=40)
MOE: dict[str, Any] = dict(experts=12, top_k=2, moe_hidden=24)  # 12: torchtitan needs experts % ranks == 0


def sizes(**overrides: int) -> dict[str, int]:
    """DIMS and MOE with ``overrides`` (the benchmark's larger models)."""
    unknown = set(overrides) - set(DIMS) - set(MOE)
    if unknown:
        raise TypeError(f"unknown sizes {sorted(unknown)}")
    return {**DIMS, **MOE, **overrides}


def titan_config(kind: str, fuse_qkv: bool = True, **overrides: int) -> Any:
    """A torchtitan Qwen3Model.Config: ``kind`` is "dense" (tied), "untied" (dense) or "moe" (untied)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    d = sizes(**overrides)
    rope = CosSinRoPE.Config(dim=d["head_dim"], max_seq_len=64, theta=1_000_000.0)
    common = dict(
        n_layers=d["layers"],
        dim=d["dim"],
        n_heads=d["n_heads"],
        n_kv_heads=d["n_kv_heads"],
        head_dim=d["head_dim"],
        fuse_qkv=fuse_qkv,
        attn_backend="flex",
        rope=rope,
    )
    if kind in ("dense", "untied"):
        layer_cfgs = _build_qwen3_layers(hidden_dim=d["hidden"], **common)
    else:
        layer_cfgs = _build_qwen3_moe_layers(
            moe_hidden_dim=d["moe_hidden"],
            num_experts=d["experts"],
            top_k=d["top_k"],
            moe_comm_backend="standard",
            **common,
        )
    config = Qwen3Model.Config(
        vocab_size=d["vocab"],
        dim=d["dim"],
        norm=_qwen3_norm(d["dim"]),
        enable_weight_tying=kind == "dense",
        tok_embeddings=Embedding.Config(
            num_embeddings=d["vocab"], embedding_dim=d["dim"], param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=d["dim"], out_features=d["vocab"], param_init=_LINEAR_INIT),
        layers=layer_cfgs,
    )
    # As the trainer's update_from_config: the TP plan (used only where TP is enabled).
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    set_qwen3_sharding_config(config, enable_sp=True, enable_ep=False)
    return config


def hf_config(kind: str, **overrides: int) -> Any:
    """The transformers config whose checkpoint the torchtitan config loads."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    d = sizes(**overrides)
    common = dict(
        hidden_size=d["dim"],
        head_dim=d["head_dim"],
        num_attention_heads=d["n_heads"],
        num_key_value_heads=d["n_kv_heads"],
        vocab_size=d["vocab"],
        num_hidden_layers=d["layers"],
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=64,
    )
    if kind in ("dense", "untied"):
        return Qwen3Config(intermediate_size=d["hidden"], tie_word_embeddings=kind == "dense", **common)
    return Qwen3MoeConfig(
        moe_intermediate_size=d["moe_hidden"],
        intermediate_size=d["hidden"],
        num_experts=d["experts"],
        num_experts_per_tok=d["top_k"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        **common,
    )


def write_checkpoint(
    out: Path,
    kind: str,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    shard: str = "40KB",
    **overrides: int,
) -> str:
    """A hub checkpoint (transformers' ``save_pretrained``, random weights, small shards)."""
    from streamload.tools.synthetic import make_checkpoint

    cfg = hf_config(kind, **overrides)
    return str(make_checkpoint(out, config=cfg, seed=seed, dtype=dtype, max_shard_size=shard))


def adapter_for(config: Any) -> Any:
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(config, None)


def build_meta(config: Any) -> nn.Module:
    with torch.device("meta"):
        return config.build()


def use_cpu_meshes() -> None:
    """torchtitan builds its meshes on its detected device type ("cuda" without a GPU)."""
    import torchtitan.distributed.parallel_dims as pd

    pd.device_type = "cpu"


def parallelize(model: nn.Module, world: int, tp: int = 1) -> Any:
    """torchtitan's own ``parallelize_qwen3`` (FSDP over ``world // tp``, TP over ``tp``)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import parallelize_qwen3

    use_cpu_meshes()
    pc = ParallelismConfig(
        data_parallel_shard_degree=-1, tensor_parallel_degree=tp, spmd_backend="partial_dtensor"
    )
    dims = ParallelDims.from_config(pc, world)
    parallelize_qwen3(
        model,
        parallel_dims=dims,
        training=TrainingConfig(),
        parallelism=pc,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="/tmp",
    )
    return dims


def titan_reference(config: Any, path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """torchtitan's own HF load on one process: init_weights, then ``from_hf`` + ``load_state_dict``."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    hf: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    sd = adapter_for(config).from_hf(hf)
    result = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    # As torchtitan's DCP load, which asks only for what to_hf names: the MoE load-balancing
    # bias stays at its initial value, everything else comes from the files.
    assert all(k.endswith("expert_bias_E") for k in result.missing_keys), result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    return model


def forward_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """One forward with torchtitan's own flex-attention masks (causal, one document per row)."""
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    masks = model.get_attention_masks(positions)  # type: ignore[operator]
    with torch.no_grad():
        out = model(tokens, positions=positions, attention_masks=masks)
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def tokens(vocab: int = DIMS["vocab"], n: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(5))


def titan_own_load(model: nn.Module, config: Any, path: str) -> None:
    """torchtitan's own HF load into its parallelised model: ``CheckpointManager.dcp_load``
    (``to_hf`` of ``ModelWrapper.state_dict()``, DCP with the adapter's
    ``HuggingFaceStorageReader``, ``from_hf``, ``ModelWrapper.load_state_dict``), called as is."""
    from types import SimpleNamespace

    from torchtitan.components.checkpointer.base import MODEL, ModelWrapper
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    wrapper = ModelWrapper(model)
    owner = SimpleNamespace(sd_adapter=adapter_for(config), states={MODEL: wrapper})
    CheckpointManager.dcp_load(owner, wrapper.state_dict(), path, from_hf=True, from_quantized=False)  # type: ignore[arg-type]


def titan_parallel_reference(config: Any, path: str, world: int, tp: int = 1) -> nn.Module:
    """torchtitan's flow end to end: meta build, parallelize, to_empty, init_weights, own HF load."""
    torch.manual_seed(0)
    model = build_meta(config)
    parallelize(model, world, tp=tp)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))  # type: ignore[operator]
    titan_own_load(model, config, path)
    return model
