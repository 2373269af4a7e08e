"""The quantized region algebra without processes: scheme detection, the
logical table (scales consumed), and regions mapped onto dequant op boxes."""

from __future__ import annotations

import pytest

from streamload.plan.quant import (
    LOGICAL_DTYPE,
    QuantizationError,
    QuantScheme,
    dequant_region,
    quant_groups,
    quantized_view,
    scheme_from_config,
)
from streamload.plan.regions import SourcePiece, regions_for_box


def test_scheme_from_config_dicts_and_objects() -> None:
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}
    assert scheme_from_config(fp8) == QuantScheme("fp8", (128, 64))
    assert scheme_from_config({"quantization_config": {"quant_method": "mxfp4"}}) == QuantScheme("mxfp4")
    assert scheme_from_config({"quantization_config": {"quant_method": "bitsandbytes"}}) is None
    assert scheme_from_config({}) is None and scheme_from_config(None) is None

    class Cfg:
        quantization_config = {"quant_method": "fp8", "weight_block_size": None}

    assert scheme_from_config(Cfg()) == QuantScheme("fp8", None)


def test_fp8_view_consumes_scales_and_keeps_the_rest() -> None:
    table = {
        "a.weight": ("F8_E4M3", (300, 256), "f0"),
        "a.weight_scale_inv": ("F32", (3, 2), "f0"),
        "b.weight": ("BF16", (4, 4), "f0"),
        "c.weight": ("F8_E4M3", (8, 8), "f1"),  # no scale: a plain fp8 tensor
    }
    with pytest.warns(UserWarning, match="derives \\[100, 128\\]"):
        view, quant = quantized_view(table, QuantScheme("fp8", (128, 128)))
    assert view == {
        "a.weight": (LOGICAL_DTYPE, (300, 256), "f0"),
        "b.weight": ("BF16", (4, 4), "f0"),
        "c.weight": ("F8_E4M3", (8, 8), "f1"),
    }
    q = quant["a.weight"]
    assert (q.kind, q.scale, q.dims, q.block, q.axes) == ("fp8_block", "a.weight_scale_inv", (1, 300, 256),
                                                          (128, 128), (None, 0, 1))  # fmt: skip
    # Without a configured block it is derived from the grid as transformers
    # derives it (rows // grid rows: 100, not a 128 guess).
    _, inferred = quantized_view(table, None)
    assert inferred["a.weight"].block == (100, 128)
    _, silent = quantized_view(table, QuantScheme("fp8"))
    assert silent["a.weight"].block == (100, 128)
    with pytest.raises(QuantizationError, match="does not match"):
        quantized_view(table, QuantScheme("fp8", (64, 128)))


def test_mxfp4_view_is_transformers_transposed_layout() -> None:
    table = {
        "e.gate_up_proj_blocks": ("U8", (3, 24, 4, 16), "f"),
        "e.gate_up_proj_scales": ("U8", (3, 24, 4), "f"),
        "e.gate_up_proj_bias": ("BF16", (3, 24), "f"),
    }
    view, quant = quantized_view(table, QuantScheme("mxfp4"))
    assert view == {
        "e.gate_up_proj": (LOGICAL_DTYPE, (3, 128, 24), "f"),
        "e.gate_up_proj_bias": ("BF16", (3, 24), "f"),
    }
    q = quant["e.gate_up_proj"]
    assert (q.dims, q.axes, q.block) == ((3, 24, 128), (0, 2, 1), (1, 32))
    assert quant_groups(quant) == [("e.gate_up_proj", "mxfp4", (1, 32), 1)]


def test_regions_map_onto_op_boxes() -> None:
    """Two experts [96, 256] stacked and concatenated into [2, 192, 256]; the
    shard of fused rows 50..150 of expert 1."""
    _, quant = quantized_view(
        {
            f"x.{e}.{p}.weight{s}": (dt, shp, "f")
            for e in range(2)
            for p in ("gate", "up")
            for s, dt, shp in (("", "F8_E4M3", (96, 256)), ("_scale_inv", "F32", (1, 2)))
        },
        QuantScheme("fp8", (128, 128)),
    )
    pieces = [
        SourcePiece(f"x.{e}.{p}.weight", (e, k * 96, 0), (1, 96, 256), (0, 0), (None, 0, 1))
        for e in range(2)
        for k, p in enumerate(("gate", "up"))
    ]
    box = ((1, 2), (50, 150), (0, 256))
    regs = list(regions_for_box(pieces, box))
    assert [r.key for r in regs] == ["x.1.gate.weight", "x.1.up.weight"]
    geo = [dequant_region(quant[r.key], r, [100 * 256, 256, 1]) for r in regs]
    assert geo[0].box == ((0, 1), (50, 46), (0, 256)) and geo[0].strides == (0, 256, 1)
    assert geo[1].box == ((0, 1), (0, 54), (0, 256))
    assert [r.box_start for r in regs] == [(0, 0, 0), (0, 46, 0)]


def test_fp8_configured_block_that_transformers_derives_otherwise_warns() -> None:
    table = {
        "r.weight": ("F8_E4M3", (192, 256), "f"),  # grid 2 x 2: transformers derives 96 rows
        "r.weight_scale_inv": ("F32", (2, 2), "f"),
        "one.weight": ("F8_E4M3", (96, 256), "f"),  # one block of rows: any block size agrees
        "one.weight_scale_inv": ("F32", (1, 2), "f"),
    }
    with pytest.warns(UserWarning, match=r"'r\.weight' \[192, 256\].*derives \[96, 128\]") as rec:
        _, quant = quantized_view(table, QuantScheme("fp8", (128, 128)))
    assert quant["r.weight"].block == (128, 128)
    assert not any("one.weight" in str(w.message) for w in rec)
    # A config that says nothing: transformers' derivation, no warning.
    _, quant = quantized_view(table, QuantScheme("fp8"))
    assert (quant["r.weight"].block, quant["one.weight"].block) == ((96, 128), (96, 128))


def test_fp8_grid_transformers_refuses_needs_a_configured_block() -> None:
    table = {"w.weight": ("F8_E4M3", (301, 256), "f"), "w.weight_scale_inv": ("F32", (4, 2), "f")}
    with pytest.raises(QuantizationError, match="weight_block_size"):
        quantized_view(table, QuantScheme("fp8"))
    with pytest.warns(UserWarning, match="refuses this grid"):
        _, quant = quantized_view(table, QuantScheme("fp8", (80, 128)))
    assert quant["w.weight"].block == (80, 128)


def test_mxfp4_scales_must_be_u8() -> None:
    for sdtype in ("F8_E8M0", "I8", "BF16"):
        table = {
            "e.down_proj_blocks": ("U8", (3, 24, 4, 16), "f"),
            "e.down_proj_scales": (sdtype, (3, 24, 4), "f"),
        }
        with pytest.raises(QuantizationError, match=f"'e.down_proj_scales' are {sdtype}"):
            quantized_view(table, QuantScheme("mxfp4"))
