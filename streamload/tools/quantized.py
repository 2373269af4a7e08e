"""Quantized random checkpoints for tests and benchmarks: a random bf16
model written by ``make_checkpoint``, then quantized file by file in the
hub layouts transformers loads (nothing is downloaded).

- FP8 block-scaled (DeepSeek-V3 style): every ``*_proj.weight`` whose shape
  the block divides becomes float8_e4m3fn plus a float32
  ``*_proj.weight_scale_inv``, with transformers' own quantizer arithmetic
  (``Fp8Quantize``); ``config.json`` gets ``quant_method: fp8``.
- MXFP4 (GPT-OSS style): each fused expert tensor ``experts.<p>`` [E, A, B]
  becomes ``experts.<p>_blocks`` [E, B, A/32, 16] (two e2m1 values a byte,
  low nibble first) and ``experts.<p>_scales`` [E, B, A/32] (e8m0 bytes);
  ``config.json`` gets ``quant_method: mxfp4``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .synthetic import make_checkpoint

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled float8_e4m3fn with transformers' ``Fp8Quantize`` arithmetic.

    Args:
        w: a [..., R, C] floating tensor.
        block: (rows, cols) of one scale block; where it does not divide R or
            C the last block is partial (a ceil grid, as DeepSeek-V3 stores it).

    Returns:
        (weight in float8_e4m3fn, float32 ``weight_scale_inv`` [..., ceil(R/br), ceil(C/bc)]).

    Example:
        >>> q, s = quantize_fp8_blocks(torch.randn(256, 256), (128, 128))
    """
    br, bc = block
    *lead, rows, cols = w.shape
    pr, pc = -(-rows // br) * br, -(-cols // bc) * bc
    # Zero padding changes no block's amax; it is cropped off again below.
    x = torch.nn.functional.pad(w.float(), (0, pc - cols, 0, pr - rows))
    x = x.reshape(*lead, pr // br, br, pc // bc, bc)
    amax = x.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), 1.0)
    q = (x * scale.unsqueeze(-1).unsqueeze(-3)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, pr, pc)[..., :rows, :cols].contiguous(), (1.0 / scale).float()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of a [..., R, K] tensor along K (groups of 32; K divisible by 32).

    Returns:
        (blocks uint8 [..., R, K/32, 16], scales uint8 [..., R, K/32]) such that
        value = e2m1(nibble) * 2^(scale - 127), low nibble first.

    Example:
        >>> blocks, scales = quantize_mxfp4(torch.randn(4, 64, 96))
    """
    *lead, rows, k = w.shape
    g = w.float().reshape(*lead, rows, k // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    idx = (scaled.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)  # nearest e2m1 code
    pairs = idx.reshape(*lead, rows, k // 32, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def _rewrite(ckpt: Path, convert: Any) -> None:
    """Rewrites every safetensors file of ``ckpt`` with ``convert(name, tensor) -> dict``."""
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    weight_map: dict[str, str] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out.update(convert(name, f.get_tensor(name)))
        save_file(out, str(path), metadata=metadata)
        weight_map.update({k: path.name for k in out})
    if index is not None:
        index["weight_map"] = dict(sorted(weight_map.items()))
        index_path.write_text(json.dumps(index, indent=2))


def _set_quant_config(ckpt: Path, qcfg: dict[str, Any]) -> None:
    cfg_path = ckpt / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = qcfg
    cfg_path.write_text(json.dumps(cfg, indent=2))


def make_fp8_checkpoint(
    out_dir: str | os.PathLike,
    model_type: str = "llama",
    *,
    block: tuple[int, int] = (128, 128),
    ragged: tuple[str, ...] = (),
    config_block: bool = True,
    **kw: Any,
) -> Path:
    """A random checkpoint with FP8 block-scaled ``*_proj`` weights (DeepSeek-V3 layout).

    Args:
        out_dir: destination directory.
        model_type: transformers model type (e.g. ``"llama"``, ``"deepseek_v3"``).
        block: ``weight_block_size``.
        ragged: name suffixes of projections also quantized where the block
            does not divide them (a ceil grid); others are then left unquantized.
        config_block: False leaves ``weight_block_size`` out of the config
            (loaders then derive the block from each grid).
        **kw: passed to ``make_checkpoint`` (seed, max_shard_size, config overrides).

    Returns:
        The checkpoint directory.

    Example:
        >>> make_fp8_checkpoint("/tmp/fp8", "llama", hidden_size=256, intermediate_size=384)
    """
    ckpt = make_checkpoint(out_dir, model_type, dtype=torch.bfloat16, **kw)

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        eligible = name.endswith("_proj.weight") and t.ndim == 2
        if not eligible:
            return {name: t}
        divides = not (t.shape[0] % block[0] or t.shape[1] % block[1])
        if not (divides or name.endswith(ragged)):
            return {name: t}
        q, s = quantize_fp8_blocks(t, block)
        return {name: q, name[: -len("weight")] + "weight_scale_inv": s}

    _rewrite(ckpt, convert)
    _set_quant_config(
        ckpt,
        {
            "quant_method": "fp8",
            **({"weight_block_size": list(block)} if config_block else {}),
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
        },
    )
    return ckpt


def hf_reference_kwargs(ckpt: str | os.PathLike) -> dict[str, Any]:
    """Keywords that make transformers' ``from_pretrained`` of ``ckpt`` the dequantized reference.

    An MXFP4 checkpoint gets ``Mxfp4Config(dequantize=True)``: with the ``kernels`` package and
    triton installed (transformers >= 5.2x pulls ``kernels``), transformers would otherwise keep the
    experts in MXFP4 and fetch ``kernels-community/gpt-oss-triton-kernels`` from the hub, which an
    offline machine refuses; without them it dequantized anyway. Other checkpoints get nothing.

    Example:
        >>> AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto", **hf_reference_kwargs(ckpt))
    """
    config = Path(ckpt) / "config.json"
    if not config.is_file():
        return {}
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") != "mxfp4":
        return {}
    from transformers import Mxfp4Config  # type: ignore[attr-defined]

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def make_mxfp4_checkpoint(out_dir: str | os.PathLike, model_type: str = "gpt_oss", **kw: Any) -> Path:
    """A random checkpoint with MXFP4 fused experts (GPT-OSS layout).

    Args:
        out_dir: destination directory.
        model_type: a model whose experts hold fused ``gate_up_proj`` / ``down_proj``.
        **kw: passed to ``make_checkpoint``.

    Returns:
        The checkpoint directory.

    Example:
        >>> make_mxfp4_checkpoint("/tmp/mx", hidden_size=64, intermediate_size=64)
    """
    ckpt = make_checkpoint(out_dir, model_type, dtype=torch.bfloat16, **kw)

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not (name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and t.ndim == 3):
            return {name: t}
        blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # [E, B, A]: groups along the model's dim 1
        return {name + "_blocks": blocks, name + "_scales": scales}

    _rewrite(ckpt, convert)
    _set_quant_config(ckpt, {"quant_method": "mxfp4", "modules_to_not_convert": None})
    return ckpt


__all__ = ["make_fp8_checkpoint", "make_mxfp4_checkpoint", "quantize_fp8_blocks", "quantize_mxfp4"]
