"""Tiny random checkpoints of every causal-LM architecture transformers registers.

The sweep (``tests/test_arch_sweep.py``, ``benchmarks/arch_sweep.py``) shrinks
each registered config generically, writes a random model with transformers'
own ``save_pretrained`` and first checks that transformers itself round-trips
it: an architecture transformers cannot reload bit for bit is skipped with
that reason, never counted against streamload.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .synthetic import randomize_

# Generic sizes, by the attribute names transformers' configs use for them.
LAYERS = 2
_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "dim", "model_dim"), 32),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "decoder_attention_heads",
            "encoder_attention_heads",
            "attention_heads",
        ),
        4,
    ),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels"), 8),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
            "ffn_hidden_size",
            "d_ff",
            "inner_dim",
            "mlp_dim",
            "hidden_dim",
        ),
        64,
    ),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "moe_ffn_hidden_size",
            "moe_hidden_size",
        ),
        16,
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"), 2),
    **dict.fromkeys(
        ("vocab_size", "shape_vocab_size", "pronunciation_vocab_size", "encoder_hash_byte_group_vocab"), 128
    ),
    **dict.fromkeys(
        (
            "emb_dim",
            "hidden_size_global",
            "lru_width",
            "pronunciation_embed_dim",
            "shape_embed_dim",
            "expert_ffn_hidden_size",
        ),
        32,
    ),
    **dict.fromkeys(("d_head", "swa_head_dim"), 8),
    # Projectors between towers (vision/audio to text) of width 32.
    **dict.fromkeys(("adapter_in_dim", "adapter_out_dim", "adapter_input_size"), 32),
    **dict.fromkeys(("zero_expert_num",), 2),
    **dict.fromkeys(("mamba_n_heads",), 4),
    **dict.fromkeys(("mamba_d_head",), 16),
    **dict.fromkeys(("mamba_d_state", "state_size"), 16),
    **dict.fromkeys(("vocab_size_per_layer_input", "unpadded_vocab_size"), 128),
    **dict.fromkeys(("hidden_size_per_layer_input",), 8),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 64),
    **dict.fromkeys(("q_lora_rank",), 16),
    **dict.fromkeys(("kv_lora_rank",), 8),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 4),
    **dict.fromkeys(("v_head_dim",), 8),
}
_LAYER_KEYS = (
    "num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers",
    "encoder_layers", "num_encoder_layers",
)  # fmt: skip
# Sizes some default configs leave None (their models do not build without them).
_FILL_NONE: dict[str, int] = dict(
    head_dim=8, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1
)
# Layer lists keep a prefix holding every kind of layer (a hybrid needs its attention layer), up to this.
MAX_LAYERS = 8
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
# Shrunk models above this many parameters are not "tiny": the config resisted shrinking.
MAX_PARAMS = 10_000_000


class Skip(Exception):
    """An architecture the sweep cannot try, with the reason."""


@dataclass
class Built:
    """A saved tiny checkpoint of one architecture."""

    model_type: str
    path: Path
    params: int


def causal_lm_types() -> list[str]:
    """Every model type transformers registers for ``AutoModelForCausalLM``.

    Returns:
        The model types, in transformers' registration order.

    Example:
        >>> "llama" in causal_lm_types()
        True
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _per_layer(key: str, value: Any, old_layers: int | None) -> bool:
    """A per-layer list or pattern string (layer_types, "M*M-")."""
    if old_layers is None or old_layers <= 1:
        return False
    if isinstance(value, list):
        return len(value) == old_layers
    return isinstance(value, str) and "pattern" in key and len(value) == old_layers


def _layers_needed(d: dict[str, Any], old_layers: int | None, layers: int) -> int:
    """The fewest layers (at least ``layers``) whose prefix of every per-layer list holds each kind."""
    need = layers
    for key, value in d.items():
        if _per_layer(key, value, old_layers):
            try:
                firsts = {v: i for i, v in reversed(list(enumerate(value)))}
            except TypeError:  # unhashable entries: not a list of layer kinds
                continue
            need = max(need, max(firsts.values()) + 1)
    return min(need, MAX_LAYERS, old_layers or need)


def _shrink_dict(d: dict[str, Any], layers: int, keep_kinds: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    old_layers = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    n = _layers_needed(d, old_layers, layers) if keep_kinds else min(layers, old_layers or layers)
    for key, value in d.items():
        if isinstance(value, dict) and value and all(isinstance(k, int) or str(k).isdigit() for k in value):
            # Per-layer overrides keyed by layer index (per_layer_config).
            out[key] = {
                k: _shrink_dict(v, layers, keep_kinds) if isinstance(v, dict) else v
                for k, v in value.items()
                if int(k) < n
            }
        elif isinstance(value, dict) and key.endswith("config"):
            out[key] = _shrink_dict(value, layers, keep_kinds)
        elif key in _LAYER_KEYS and isinstance(value, int):
            out[key] = min(value, n)
        elif key in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, _SIZES[key])
        elif key in _FILL_NONE and value is None:
            out[key] = _FILL_NONE[key]
        elif _per_layer(key, value, old_layers) and old_layers is not None and old_layers > n:
            out[key] = value[:n]  # per-layer lists follow the layer count
        else:
            out[key] = value
    vocab = out.get("vocab_size")
    if isinstance(vocab, int):
        for key in _TOKEN_IDS:
            tok = out.get(key)
            if isinstance(tok, int) and tok >= vocab:
                out[key] = vocab - 1 - _TOKEN_IDS.index(key)
            elif isinstance(tok, list):
                out[key] = [t if t < vocab else vocab - 1 for t in tok if isinstance(t, int)]
    if d.get("num_key_value_heads") == d.get("num_attention_heads") and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # multi-head attention stays so
    _agree(out, n)
    if "is_decoder" in out:
        out["is_decoder"] = True  # the causal-LM head of an encoder family is its decoder use
    return out


def _agree(d: dict[str, Any], n: int) -> None:
    """Restores the relations some configs validate between the sizes just shrunk."""
    if all(isinstance(d.get(k), int) for k in ("expand", "num_heads", "head_dim", "hidden_size")):
        d["num_heads"] = d["hidden_size"] * d["expand"] // d["head_dim"]  # mamba2: heads x head_dim = inner
    if all(isinstance(d.get(k), int) for k in ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head")):
        d["mamba_d_ssm"] = d["mamba_n_heads"] * d["mamba_d_head"]  # falcon_h1: ssm width = heads x head dim
    parts = ("n_input_layers", "n_recurrent_layers", "n_output_layers")
    if all(isinstance(d.get(k), int) for k in parts) and n >= 3:
        d.update(n_input_layers=1, n_recurrent_layers=n - 2, n_output_layers=1)  # they must sum to the layers
    if isinstance(d.get("num_kv_shared_layers"), int):
        d["num_kv_shared_layers"] = min(d["num_kv_shared_layers"], n // 2)


def shrink_config(model_type: str, layers: int = LAYERS, keep_kinds: bool = True) -> Any:
    """The default config of ``model_type`` with every size made tiny.

    Args:
        model_type: a transformers model type.
        layers: decoder layers to keep (per-layer lists are cut to match).
        keep_kinds: keep more layers (up to ``MAX_LAYERS``) where that is what
            it takes for every kind of layer in a per-layer list to appear.

    Returns:
        The shrunk config (raises Skip when it cannot be built).

    Example:
        >>> shrink_config("llama").hidden_size
        32
    """
    from transformers import AutoConfig

    try:
        base = AutoConfig.for_model(model_type)
    except Exception as exc:  # noqa: BLE001 - a config class that needs arguments is a skip
        raise Skip(f"default config does not build: {type(exc).__name__}: {exc}") from exc
    d = _shrink_dict(base.to_dict(), layers, keep_kinds)
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    d.pop("architectures", None)
    try:
        return type(base).from_dict(d)
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"shrunk config does not build: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def differing(model: nn.Module, ref: nn.Module) -> list[str]:
    """Names of parameters and buffers of ``model`` whose bytes differ from ``ref``'s.

    DTensor parameters are compared as their ``full_tensor()``; a name only
    one side has counts as differing.

    Args:
        model: the model under test.
        ref: the reference (e.g. transformers' ``from_pretrained``).

    Returns:
        The differing names (buffers prefixed ``buffer``).

    Example:
        >>> differing(loaded, reference) == []
        True
    """

    def full(t: torch.Tensor) -> torch.Tensor:
        to_full = getattr(t, "full_tensor", None)
        return to_full() if to_full is not None else t

    bad = []
    for kind, mine, theirs in (
        ("", dict(model.named_parameters()), dict(ref.named_parameters())),
        ("buffer ", dict(model.named_buffers()), dict(ref.named_buffers())),
    ):
        for name in sorted(set(mine) | set(theirs)):
            if name not in mine or name not in theirs:
                bad.append(f"{kind}{name} (only one side has it)")
                continue
            if _differ(full(mine[name]).detach(), theirs[name].detach()):
                bad.append(f"{kind}{name}")
    return bad


def alias_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names that are one object, as sorted groups of two or more.

    Example:
        >>> alias_groups(tied_model)
        [['lm_head.weight', 'model.embed_tokens.weight']]
    """
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return sorted(sorted(g) for g in by_id.values() if len(g) > 1)


def _buildable_config(model_type: str, dtype: torch.dtype) -> tuple[Any, int]:
    """The shrunk config whose model builds (every layer kind first, else the plain prefix)
    and its parameter count, counted on meta: a config that resisted shrinking must not allocate."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    first: Skip | None = None
    for keep_kinds in (True, False):
        try:
            cfg = shrink_config(model_type, keep_kinds=keep_kinds)
            cfg.dtype = dtype
            with _quiet(), init_empty_weights():
                return cfg, _params(AutoModelForCausalLM.from_config(cfg, dtype=dtype))
        except Skip as exc:
            first = first or exc
        except Exception as exc:  # noqa: BLE001
            first = first or Skip(f"model does not build from the shrunk config: {type(exc).__name__}: {exc}")
    assert first is not None
    try:
        with _quiet(), init_empty_weights():
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception as exc:  # noqa: BLE001 - then the shrinking is not what fails
        raise Skip(
            f"transformers' default config does not build a model either: {type(exc).__name__}: {exc}"
        ) from exc
    raise first


def _attempt(why: str, fn: Callable[[], nn.Module]) -> nn.Module:
    """Runs transformers' own step quietly; its failure is a Skip saying ``why``."""
    try:
        with _quiet():
            return fn()
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises is the reason
        raise Skip(f"{why}: {type(exc).__name__}: {exc}") from exc


def _differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    from ..io.copy_ops import bit_view

    return a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bit_view(a), bit_view(b))


def build_checkpoint(
    model_type: str, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Built:
    """Writes a tiny random ``model_type`` model with ``save_pretrained``, checked to round-trip.

    Every parameter and floating persistent buffer is random; the model is
    saved in ``dtype`` (bfloat16 by default, as most checkpoints are) and transformers' own ``from_pretrained`` must give it
    back bit for bit, else the architecture is skipped with that reason.

    Args:
        model_type: a causal-LM model type.
        out_dir: the checkpoint directory (created).
        seed: random seed.
        dtype: the dtype the model is built and saved in.

    Returns:
        The Built checkpoint (raises Skip with the reason).

    Example:
        >>> build_checkpoint("codegen", "/tmp/codegen").params > 0
        True
    """
    from transformers import AutoModelForCausalLM

    cfg, n = _buildable_config(model_type, dtype)
    if n > MAX_PARAMS:
        raise Skip(f"config does not shrink generically ({n:,} parameters after shrinking)")

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)

    model: Any = _attempt("model does not build from the shrunk config", build)
    randomize_(model, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def round_trip() -> nn.Module:
        model.save_pretrained(out)
        return AutoModelForCausalLM.from_pretrained(out, dtype=dtype)

    ref = _attempt("transformers cannot save and reload it", round_trip)
    # Non-persistent buffers are not in the files: the reference for them is
    # from_pretrained itself, so the round trip is judged on the state dict.
    mine, theirs = model.state_dict(), ref.state_dict()
    bad = sorted(
        k for k in set(mine) | set(theirs) if k not in mine or k not in theirs or _differ(mine[k], theirs[k])
    )
    if bad:
        raise Skip(f"transformers' own save_pretrained -> from_pretrained changes {bad[:3]}")
    return Built(model_type, out, n)
