"""Fingerprints: equal for copies of the same files wherever they live,
different for another version of the same model (same header, other data)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from streamload.transport.readers import _first_difference, file_identity, fingerprint


def _write(d: Path, seed: int) -> Path:
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file(
        {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
        str(d / "model.safetensors"),
    )
    return d


def test_copies_match_and_versions_do_not(tmp_path: Path) -> None:
    v1 = _write(tmp_path / "v1", 0)
    copy = tmp_path / "node1"
    shutil.copytree(v1, copy)
    os.utime(copy / "model.safetensors", (1, 1))  # another node's copy: another mtime
    v2 = _write(tmp_path / "v2", 1)  # same names, shapes and header; other weights
    a, b = ((d / "model.safetensors").read_bytes() for d in (v1, v2))
    head = 8 + int.from_bytes(a[:8], "little")
    assert a[:head] == b[:head] and a != b
    assert fingerprint(v1) == fingerprint(copy) is not None
    assert fingerprint(v1) != fingerprint(v2)
    assert _first_difference(fingerprint(v2), fingerprint(v1)) == (
        "model.safetensors",
        "header or sampled data differs",
    )
    assert fingerprint(tmp_path / "missing") is None
    assert _first_difference(None, fingerprint(v1)) == (None, "the checkpoint cannot be opened there")


def test_file_identity_proves_the_same_file_not_a_copy(tmp_path: Path) -> None:
    v1 = _write(tmp_path / "v1", 0)
    copy = tmp_path / "copy"
    shutil.copytree(v1, copy)  # copy2 keeps the mtime: only the inode tells it apart
    linked = tmp_path / "linked"
    linked.mkdir()
    os.link(v1 / "model.safetensors", linked / "model.safetensors")
    assert file_identity(v1) is not None
    assert file_identity(v1) == file_identity(str(v1)) == file_identity(linked)  # the same file
    assert file_identity(copy) != file_identity(v1)
    assert fingerprint(copy) == fingerprint(v1)  # what auto used to trust
    assert file_identity(tmp_path / "missing") is None and file_identity(None) is None
