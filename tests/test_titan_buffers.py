"""Buffers a mapped format lacks (torchtitan's ``_init_self_buffers``): exempt from key
matching only where the module's class overrides the initialiser and the call really
writes them; anything else is missing (KeyMismatchError under strict, listed otherwise).
One process; torchtitan's ``Module`` base, tiny modules, a two-tensor checkpoint."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import streamload
from streamload.model import own_buffers
from streamload.plan.mapping import _is_alias

if importlib.util.find_spec("torchtitan") is None:  # an installed one that fails to import is an error
    pytest.skip("torchtitan is a clients extra (.ci/clients-nodeps.txt)", allow_module_level=True)
from torchtitan.protocols.module import Module  # noqa: E402

MAPPING = {"proj.weight": "lin.weight", "proj.bias": "lin.bias"}


class NoOverride(Module):  # type: ignore[misc, valid-type]
    """Inherits torchtitan's no-op _init_self_buffers: its buffer is never computed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("scale", torch.full((2,), 7.0))


class OverrideNoWrite(NoOverride):
    """Overrides the initialiser but leaves the buffer alone."""

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        return None


class NoOverrideReset(NoOverride):
    """A no-op ``reset_parameters``: a hook that looks like an initialiser and writes nothing."""

    def reset_parameters(self) -> None:
        return None


class OverrideNoWriteReset(OverrideNoWrite):
    def reset_parameters(self) -> None:
        return None


class Reassigns(NoOverride):
    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        self.scale = torch.tensor([1.5, -2.25], device=buffer_device)


class WritesInPlace(NoOverride):
    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        self.scale.copy_(torch.tensor([1.5, -2.25]))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("own_buffers")
    g = torch.Generator().manual_seed(3)
    save_file(
        {"proj.weight": torch.randn(2, 3, generator=g), "proj.bias": torch.randn(2, generator=g)},
        str(root / "model.safetensors"),
    )
    return str(root)


def _meta(cls: type[nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return cls()


def test_base_initialiser_is_torchtitans_noop() -> None:
    """Fails loudly if torchtitan moves or renames the no-op base that BASE_INIT names."""
    fn = Module._init_self_buffers
    assert f"{fn.__module__}.{fn.__qualname__}" == own_buffers.BASE_INIT
    body = inspect.getsource(fn).split('"""')[-1].strip()
    assert body == "pass", body
    assert not own_buffers.overrides_init(NoOverride())
    assert own_buffers.overrides_init(Reassigns())


@pytest.mark.parametrize("cls", [NoOverride, OverrideNoWrite])
def test_unwritten_buffer_strict_is_key_mismatch(ckpt: str, cls: type[nn.Module]) -> None:
    with pytest.raises(streamload.KeyMismatchError, match="scale") as info:
        streamload.load_checkpoint(_meta(cls), ckpt, mapping=MAPPING)
    assert info.value.missing == ["scale"]


@pytest.mark.parametrize("cls", [NoOverride, OverrideNoWrite, NoOverrideReset, OverrideNoWriteReset])
def test_unwritten_buffer_not_strict_is_loud(ckpt: str, cls: type[nn.Module]) -> None:
    """strict=False on meta: nothing initialises it, so refused by name, never garbage
    (also where the module has a no-op ``reset_parameters`` besides its no-op override)."""
    with pytest.raises(streamload.KeyMismatchError, match=r"scale"):
        streamload.load_checkpoint(_meta(cls), ckpt, mapping=MAPPING, strict=False)


@pytest.mark.parametrize("cls", [NoOverride])
def test_real_build_buffer_is_missing(ckpt: str, cls: type[nn.Module]) -> None:
    """A real (not meta) build, no initialiser of its own: strict raises, strict=False keeps the
    value and lists it missing. (An overriding module's buffer on a real build is the caller's
    init, kept as torchtitan's own load keeps it: tests/test_client_torchtitan.py init_first.)"""
    with pytest.raises(streamload.KeyMismatchError, match="scale"):
        streamload.load_checkpoint(cls(), ckpt, mapping=MAPPING)
    model = cls()
    report = streamload.load_checkpoint(model, ckpt, mapping=MAPPING, strict=False)
    assert report.missing_keys == ["scale"]
    assert torch.equal(model.get_buffer("scale"), torch.full((2,), 7.0))


@pytest.mark.parametrize("cls", [Reassigns, WritesInPlace])
def test_written_buffer_is_recomputed(ckpt: str, cls: type[nn.Module]) -> None:
    model = _meta(cls)
    report = streamload.load_checkpoint(model, ckpt, mapping=MAPPING)
    assert report.missing_keys == []
    assert torch.equal(model.get_buffer("scale"), torch.tensor([1.5, -2.25]))
    from safetensors.torch import load_file

    sd = load_file(str(Path(ckpt) / "model.safetensors"))
    assert torch.equal(model.lin.weight, sd["proj.weight"]) and torch.equal(model.lin.bias, sd["proj.bias"])


def test_alias_by_identity_not_order() -> None:
    """A tie whose lm_head is registered before tok_embeddings: both names are the one object."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 5, bias=False)
            self.tok_embeddings = nn.Embedding(5, 4)
            self.tok_embeddings.weight = self.lm_head.weight

    model = Tied()
    assert _is_alias(model, "tok_embeddings.weight") and _is_alias(model, "lm_head.weight")
    assert not _is_alias(nn.Linear(2, 2), "weight")
