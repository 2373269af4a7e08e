"""Checkpoints where recipes find them, on 2 gloo ranks (one group for the module).

The Hugging Face hub cache layout (``snapshots/<rev>/<file> -> ../../blobs/<hash>``)
loads bit-exact; index names that leave the directory, directory links leading out and
links to non-regular files are still refused. Recipes that give rank 0 a checkpoint pass
a path or ``Checkpoint.lazy(path)``, opened inside streamload's agreement, so a missing
or corrupt checkpoint is the same named error on every rank (never rank 0 alone while the
others wait)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import cases_clients as cases
import pytest
from rank_group import RankGroup

import streamload
from streamload.tools.synthetic import make_checkpoint


def hub_cache_layout(ckpt: Path, cache: Path, rev: str = "0123abcd") -> Path:
    """Moves every file of ``ckpt`` into ``cache/blobs/<sha256>`` and links it from
    ``cache/snapshots/<rev>/<name>``, relative links as huggingface_hub writes them."""
    snap = cache / "snapshots" / rev
    blobs = cache / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir(parents=True, exist_ok=True)
    (cache / "refs").mkdir(exist_ok=True)
    (cache / "refs" / "main").write_text(rev)
    for f in sorted(ckpt.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.move(str(f), blobs / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hub")
    common = dict(layers=2, vocab=97, hidden_size=24, intermediate_size=40, num_attention_heads=4)
    indexed = make_checkpoint(root / "a", "qwen2", tie=True, seed=51, max_shard_size="16KB", **common)
    single = make_checkpoint(root / "b", "qwen3_moe", tie=True, seed=52, num_experts=3)
    return {
        "indexed": str(hub_cache_layout(indexed, root / "models--org--dense")),
        "single": str(hub_cache_layout(single, root / "models--org--moe")),
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(2)
    yield g
    g.close()


def test_layout_is_the_hub_cache(hub: dict[str, str]) -> None:
    snap = Path(hub["indexed"])
    files = sorted(snap.iterdir())
    assert any(f.name == "model.safetensors.index.json" for f in files)
    assert all(f.is_symlink() and os.readlink(f).startswith("../../blobs/") for f in files)
    ckpt = streamload.Checkpoint(snap)
    assert len(ckpt.files) > 1 and all(Path(f.path).parent == snap for f in ckpt.files)


@pytest.mark.parametrize("name", ["indexed", "single"])
def test_hub_cache_loads_bit_exact_on_2_ranks(group: RankGroup, hub: dict[str, str], name: str) -> None:
    for readers in ("src", "owners"):
        for r in group.run(cases.case_load_path, ckpt=hub[name], readers=readers, timeout=180):
            assert r["bad"] == [] and r["tied"] is True, (readers, r)


def _linked(tmp_path: Path, target: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").symlink_to(target)
    return ckpt


def test_link_to_a_fifo_is_refused_without_opening_it(tmp_path: Path) -> None:
    # Opening a FIFO blocks until a writer comes: refused from its stat, before any open.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(streamload.CheckpointFileError, match="not a regular file"):
        streamload.Checkpoint(_linked(tmp_path, fifo))


def test_link_to_a_directory_or_device_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(streamload.CheckpointFileError, match="not a regular file"):
        streamload.Checkpoint(_linked(tmp_path, tmp_path / "d"))
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(streamload.CheckpointFileError, match="not a regular file"):
        streamload.Checkpoint(_linked(other, Path("/dev/zero")))


def test_dangling_link_is_a_file_error(tmp_path: Path) -> None:
    with pytest.raises(streamload.CheckpointFileError, match="dangling symlink"):
        streamload.Checkpoint(_linked(tmp_path, tmp_path / "gone.safetensors"))


def test_index_link_to_a_fifo_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(tmp_path / "pipe")
    (ckpt / "model.safetensors.index.json").symlink_to(tmp_path / "pipe")
    with pytest.raises(streamload.CheckpointFileError, match="not a regular file"):
        streamload.Checkpoint(ckpt)


@pytest.mark.parametrize("entry", ["../blobs/x", "/abs/x.safetensors", "sub/../../x.safetensors"])
def test_hub_index_names_leaving_the_snapshot_are_refused(hub: dict[str, str], entry: str) -> None:
    # Even where the name would reach a real blob: names are checked, links are followed.
    snap = Path(hub["indexed"]).parent / f"rev-{hashlib.sha1(entry.encode()).hexdigest()[:8]}"
    shutil.copytree(hub["indexed"], snap, symlinks=True)
    index = snap / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    index.unlink()
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = entry
    index.write_text(json.dumps(data))
    with pytest.raises(streamload.UnsafePathError):
        streamload.Checkpoint(snap)


# -- lazy sources ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lazy_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lazy")
    good = make_checkpoint(root / "good", "qwen2", tie=True, seed=61, layers=1, vocab=64)
    bad = make_checkpoint(root / "bad", "qwen2", tie=True, seed=61, layers=1, vocab=64)
    shard = next(bad.glob("*.safetensors"))
    os.truncate(shard, 8 + 10)  # the header now claims more than the file holds
    return {"good": str(good), "corrupt": str(bad), "missing": str(root / "nothing")}


def test_lazy_opens_nothing_until_loaded(lazy_ckpts: dict[str, str]) -> None:
    lazy = streamload.Checkpoint.lazy(lazy_ckpts["missing"])  # no error here: nothing is opened
    assert os.fspath(lazy) == lazy_ckpts["missing"] and isinstance(lazy, os.PathLike)
    opened = streamload.Checkpoint.lazy(lazy_ckpts["good"], mode="pread").open(mode="mmap")
    assert opened.read_mode == "pread" and Path(opened.path) == Path(lazy_ckpts["good"])


@pytest.mark.parametrize("recipe", ["path", "lazy"])
@pytest.mark.parametrize(("which", "error"), [("missing", "CheckpointError"), ("corrupt", "HeaderError")])
def test_bad_checkpoint_is_a_named_error_on_every_rank(
    group: RankGroup, lazy_ckpts: dict[str, str], recipe: str, which: str, error: str
) -> None:
    assert group.run(cases.case_lazy_error, ckpt=lazy_ckpts[which], recipe=recipe, timeout=120) == [error] * 2


def test_lazy_loads_bit_exact(group: RankGroup, lazy_ckpts: dict[str, str]) -> None:
    for r in group.run(cases.case_load_path, ckpt=lazy_ckpts["good"], lazy=True, timeout=120):
        assert r["bad"] == [] and r["tied"] is True, r
