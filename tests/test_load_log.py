"""The reader choice and its reason reach the log (logger "streamload")."""

from __future__ import annotations

import logging

import torch

import streamload
from streamload.tools.synthetic import make_checkpoint


def test_choice_and_reason_are_logged(tmp_path, caplog) -> None:
    ckpt = make_checkpoint(
        tmp_path / "ckpt",
        "qwen2",
        tie=True,
        seed=5,
        layers=1,
        vocab=61,
        hidden_size=24,
        intermediate_size=38,
        num_attention_heads=4,
        num_key_value_heads=2,
        dtype=torch.float32,
    )
    with caplog.at_level(logging.INFO, logger="streamload"):
        model = streamload.from_pretrained(ckpt, progress=False, map_files=True)
    rep = model.streamload_report
    assert rep.reader == "src: single process"
    messages = [r.getMessage() for r in caplog.records if r.name == "streamload"]
    assert any("readers=src (single process)" in m for m in messages), messages
    # One process reads everything; its float32 shards are views of the float32 file.
    assert rep.bytes_mapped == rep.payload_bytes > 0 and rep.bytes_read == 0
    assert any(f"mapped {rep.bytes_mapped / 1e9:.2f} GB" in m for m in messages), messages
