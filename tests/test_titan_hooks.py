"""Review fixes of the torchtitan mapping: load pre-hooks that change no value are allowed
by name (FSDP's lazy-init ``to_sharded_hook``, the activation-checkpoint wrapper's), a
FusedQKVLinear whose merge hook is not found is a MappingError, an adapter is accepted only
with the verified source of ``from_hf`` and its helpers, and a re-tie after ``fully_shard``
is a TieError on every rank. 3 gloo ranks (odd: uneven shards)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:  # an installed one that fails to import is an error
    pytest.skip("torchtitan is a clients extra (.ci/clients-nodeps.txt)", allow_module_level=True)
import cases_titan as cases  # noqa: E402
import cases_titan_fix as fix  # noqa: E402
import titan_models as tm  # noqa: E402
import torchtitan.models.qwen3  # noqa: E402, F401
from rank_group import RankGroup  # noqa: E402

import streamload  # noqa: E402
from streamload.model import hooks  # noqa: E402
from streamload.plan import adapter_check  # noqa: E402


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("titanfix")
    return {
        kind: tm.write_checkpoint(root / kind, kind, seed=31 + i) for i, kind in enumerate(("dense", "moe"))
    }


@pytest.fixture(scope="module")
def group():
    g = RankGroup(3)
    yield g
    g.close()


def test_checkpoint_wrapper_hook_name() -> None:
    """Fails loudly if torch renames the wrapper's load pre-hook that hooks.py allows."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = checkpoint_wrapper(torch.nn.Linear(2, 2))
    names = {hooks._hook_name(h) for h in wrapped._load_state_dict_pre_hooks.values()}
    assert names == {hooks.CHECKPOINT_PREFIX_HOOK}, names


def test_missing_fused_hook_is_mapping_error(ckpts: dict[str, str]) -> None:
    """A FusedQKVLinear whose merge hook is gone (a torch rename) must not skip the merge silently."""
    cfg = tm.titan_config("dense")
    model = tm.build_meta(cfg)
    for m in model.modules():
        if type(m).__name__ == hooks.FUSED_QKV_CLASS:
            m._load_state_dict_pre_hooks.clear()
    with pytest.raises(streamload.MappingError, match="no .*_merge_qkv_on_load load hook"):
        streamload.load_checkpoint(model, ckpts["dense"], mapping=tm.adapter_for(cfg))


def test_unverified_fused_hook_is_mapping_error(ckpts: dict[str, str]) -> None:
    """A merge hook with the verified name but other code (a subclass's override, a patched
    torchtitan) has no checked interleave: refused, not loaded with the verified layout."""
    cfg = tm.titan_config("dense")
    model = tm.build_meta(cfg)

    def _merge_qkv_on_load(module: Any, state_dict: Any, prefix: str, *args: Any) -> None:
        keys = [f"{prefix}{w}.weight" for w in ("wq", "wk", "wv")]
        state_dict[f"{prefix}wqkv.weight"] = torch.cat([state_dict.pop(k) for k in keys])

    _merge_qkv_on_load.__qualname__ = "Int8FusedQKVLinear._merge_qkv_on_load"
    for m in model.modules():
        if type(m).__name__ == hooks.FUSED_QKV_CLASS:
            m._load_state_dict_pre_hooks.clear()
            m.register_load_state_dict_pre_hook(_merge_qkv_on_load)
    with pytest.raises(streamload.MappingError, match="is not the verified one"):
        streamload.load_checkpoint(model, ckpts["dense"], mapping=tm.adapter_for(cfg))
    assert all(p.is_meta for p in model.parameters())


def test_adapter_helper_override_is_refused(ckpts: dict[str, str]) -> None:
    """A subclass overriding a helper from_hf calls is refused by name; a plain subclass is not."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    class Scaled(Qwen3StateDictAdapter):  # type: ignore[misc]
        def _concatenate_expert_weights(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            out = super()._concatenate_expert_weights(*args, **kwargs)
            return None if out is None else out * 2

    class Plain(Qwen3StateDictAdapter):  # type: ignore[misc]
        pass

    cfg = tm.titan_config("moe")
    with pytest.raises(streamload.MappingError, match="_concatenate_expert_weights"):
        streamload.load_checkpoint(tm.build_meta(cfg), ckpts["moe"], mapping=Scaled(cfg, None))
    model = tm.build_meta(cfg)
    streamload.load_checkpoint(model, ckpts["moe"], mapping=Plain(cfg, None))
    assert cases.compare(model, tm.titan_reference(cfg, ckpts["moe"])) == []


def test_adapter_other_version_is_refused(ckpts: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter_check.metadata, "version", lambda name: "9.9.9")
    cfg = tm.titan_config("dense")
    with pytest.raises(streamload.MappingError, match="verified on torchtitan .*not 9.9.9"):
        streamload.load_checkpoint(tm.build_meta(cfg), ckpts["dense"], mapping=tm.adapter_for(cfg))


def test_load_after_forward(group: RankGroup, ckpts: dict[str, str]) -> None:
    """FSDP registers to_sharded_hook at lazy init: a load after one forward is exact."""
    out = group.run(fix.case_titan_hooked_load, timeout=400, kind="dense", path=ckpts["dense"], how="forward")
    for r in out:
        assert hooks.TO_SHARDED_HOOK in r["hooks"], r["hooks"]  # fails loudly on a torch rename
        assert r["bad"] == [] and r["missing"] == [] and r["tied"] and r["logits_equal"], r


def test_activation_checkpointing(group: RankGroup, ckpts: dict[str, str]) -> None:
    """torchtitan's full AC wraps each layer (name prefix, prefix hook): loaded bit for bit."""
    out = group.run(fix.case_titan_hooked_load, timeout=400, kind="moe", path=ckpts["moe"], how="ac")
    for r in out:
        assert r["wrapped"] and hooks.CHECKPOINT_PREFIX_HOOK in r["hooks"], r["hooks"]
        assert r["bad"] == [] and r["missing"] == [] and r["logits_equal"], r


def test_retie_after_fully_shard_is_tie_error(group: RankGroup, ckpts: dict[str, str]) -> None:
    out = group.run(fix.case_titan_retie, timeout=300, path=ckpts["dense"])
    assert all(r.startswith("TieError") and "'tok_embeddings.weight'" in r and "lm_head" in r for r in out), (
        out
    )


def test_own_buffers_no_collective(group: RankGroup) -> None:
    """Runs last: a collective inside the recompute would hang rank 0 and the harness kills the group."""
    out = group.run(fix.case_own_buffer_local, timeout=60)
    want_shard = torch.chunk(torch.arange(7, dtype=torch.float32) - 3.25, group.world)[0].tolist()
    assert out[0] == [(torch.arange(5, dtype=torch.float32) * 1.5).tolist(), want_shard], out[0]
    assert all(r == [[0.0] * 5, [0.0] * len(r[1])] for r in out[1:]), out
