"""torchtitan's HF export against streamload's, run inside the rank group (see rank_group.py):
torchtitan 0.3.0's own Qwen3 models parallelised with its own ``parallelize_qwen3``, written
once by torchtitan's own ``CheckpointManager._save_last_step`` (``last_save_in_hf=True``:
``to_hf``, ``dcp.save`` with ``HuggingFaceStorageWriter``, consolidation on rank 0) and once by
``streamload.integrations.torchtitan.save_hf``; ``compare_dirs`` reads both directories back
tensor by tensor (names, dtypes, shapes, bytes)."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import titan_models as tm
import torch

import streamload
from streamload.integrations.torchtitan import save_hf


def read_dir(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of every top-level ``*.safetensors`` of ``path``: name -> (dtype, shape, bytes)."""
    from safetensors import safe_open

    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                if k in out:
                    raise AssertionError(f"{k} in two files of {path}")
                t = fh.get_tensor(k)
                out[k] = (
                    str(t.dtype),
                    tuple(t.shape),
                    t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
                )
    return out


def compare_dirs(a: str | Path, b: str | Path) -> list[str]:
    """What differs between the checkpoints in ``a`` and ``b``: tensor names, then per tensor
    its dtype, shape and bytes (empty: the same tensors, byte for byte)."""
    ta, tb = read_dir(a), read_dir(b)
    bad = [f"only in {'a' if k in ta else 'b'}: {k}" for k in sorted(set(ta) ^ set(tb))]
    for k in sorted(set(ta) & set(tb)):
        (da, sa, ba), (db, sb, bb) = ta[k], tb[k]
        if da != db or sa != sb:
            bad.append(f"{k}: {da}{list(sa)} vs {db}{list(sb)}")
        elif ba != bb:
            bad.append(f"{k}: bytes differ")
    return bad


def files(path: str | Path) -> list[str]:
    """Every file under ``path``, relative, sorted."""
    root = Path(path)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def index_names(path: str | Path) -> list[str] | None:
    """The weight map's tensor names of ``path``'s index, None without one."""
    f = Path(path) / "model.safetensors.index.json"
    return sorted(json.loads(f.read_text())["weight_map"]) if f.exists() else None


def weight_map(path: str | Path) -> dict[str, str]:
    """The index's tensor -> file map of ``path``."""
    return dict(json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"])


def adapter(config: Any, assets: str | None) -> Any:
    """torchtitan's Qwen3 adapter; with ``assets`` (``hf_assets_path``) its ``fqn_to_index_mapping``
    is that checkpoint's index, and torchtitan writes the same files."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(config, assets)


def titan_own_save(
    model: torch.nn.Module, config: Any, folder: str, export_dtype: torch.dtype, assets: str | None = None
) -> str:
    """torchtitan's own ``CheckpointManager._save_last_step`` (and its ``dcp_save``), called as is
    on a stand-in ``self`` that holds what those methods read; returns the step directory."""
    from torchtitan.components.checkpointer.base import MODEL, ModelWrapper
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    owner = SimpleNamespace(
        last_save_in_hf=True,
        last_save_model_only=True,
        states={MODEL: ModelWrapper(model)},
        export_dtype=export_dtype,
        sd_adapter=adapter(config, assets),
        folder=folder,
        pg=None,
    )
    owner._create_checkpoint_id = partial(CheckpointManager._create_checkpoint_id, owner)
    owner.dcp_save = partial(CheckpointManager.dcp_save, owner)
    CheckpointManager._save_last_step(owner, 1)  # type: ignore[arg-type]
    return str(owner._create_checkpoint_id(1))


# The documented change (docs/clients/torchtitan.md, "Saving"), applied to torchtitan's own source.
ANCHOR = """            ), "Only model can be saved when saving in HF safetensors format."
"""
CHANGE = """            save_hf(
                self.states[MODEL].model,
                self._create_checkpoint_id(curr_step),
                self.sd_adapter,
                export_dtype=self.export_dtype,
            )
            return
"""


def patched_save_last_step() -> Any:
    """torchtitan 0.3.0's ``CheckpointManager._save_last_step`` with the documented change applied
    to its source text (the anchor must be there exactly once), compiled in its own module."""
    import inspect

    import torchtitan.components.checkpointer.dcp as dcp_mod

    src = inspect.getsource(dcp_mod.CheckpointManager._save_last_step)  # indented as in the class
    assert src.count(ANCHOR) == 1, "torchtitan's _save_last_step changed: the documented diff does not apply"
    src = "class _Patched:\n" + src.replace(ANCHOR, ANCHOR + CHANGE)
    scope = dict(vars(dcp_mod), save_hf=save_hf)
    exec(compile(src, dcp_mod.__file__, "exec"), scope)  # noqa: S102 - torchtitan's own source, patched
    return scope["_Patched"]._save_last_step


def titan_streamload_save(
    model: torch.nn.Module, config: Any, folder: str, export_dtype: torch.dtype, assets: str | None = None
) -> str:
    """The patched ``_save_last_step`` on the same stand-in ``self``; returns the step directory."""
    from torchtitan.components.checkpointer.base import MODEL, ModelWrapper
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    owner = SimpleNamespace(
        last_save_in_hf=True,
        last_save_model_only=True,
        states={MODEL: ModelWrapper(model)},
        export_dtype=export_dtype,
        sd_adapter=adapter(config, assets),
        folder=folder,
    )
    owner._create_checkpoint_id = partial(CheckpointManager._create_checkpoint_id, owner)
    patched_save_last_step()(owner, 1)
    return str(owner._create_checkpoint_id(1))


def case_titan_save(
    rank: int,
    world: int,
    *,
    kind: str,
    path: str,
    out: str,
    export_dtype: str = "float32",
    assets: bool = False,
) -> dict[str, Any]:
    """A parallelised torchtitan model (loaded from ``path``) written by torchtitan and by
    streamload into ``out/titan`` and ``out/streamload``; returns both step directories.
    ``assets``: the adapter has ``hf_assets_path=path`` (its index's split of the files)."""
    dtype = getattr(torch, export_dtype)
    cfg = tm.titan_config(kind)
    model = tm.build_meta(cfg)
    tm.parallelize(model, world)
    streamload.load_checkpoint(model, path, mapping=tm.adapter_for(cfg))
    hf_assets = path if assets else None
    own = titan_own_save(model, cfg, os.path.join(out, "titan"), dtype, hf_assets)
    mine = titan_streamload_save(model, cfg, os.path.join(out, "streamload"), dtype, hf_assets)
    return {"own": own, "streamload": mine}


def case_titan_save_refused(rank: int, world: int, *, path: str, out: str) -> str:
    """llama3's adapter (its ``from_hf`` permutes q/k rows: no verified region form) on a Qwen3
    model: a MappingError on every rank, nothing written."""
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    cfg = tm.titan_config("dense")
    model = tm.build_meta(cfg)
    tm.parallelize(model, world)
    streamload.load_checkpoint(model, path, mapping=tm.adapter_for(cfg))
    adapter = Llama3StateDictAdapter(llama3_configs["debugmodel"](attn_backend="flex"), None)
    try:
        save_hf(model, out, adapter)
    except streamload.MappingError as exc:
        return f"MappingError written={os.path.exists(out)}: {exc}"
    raise AssertionError("no MappingError")
