"""Registered attributes read nn.Module's registries: never a stale copy of a submodule or
parameter, whatever replaces it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inferd.layers.registered import Registered


class Block(nn.Module):
    proj = Registered[nn.Linear]()
    scale = Registered[nn.Parameter]("_parameters")

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))


def test_reads_the_registered_submodule_and_parameter() -> None:
    block = Block()
    assert block.proj is block._modules["proj"]
    assert block.scale is block._parameters["scale"]
    # Registered as before: the state dict and the module tree do not change.
    assert list(block.state_dict()) == ["scale", "proj.weight", "proj.bias"]
    assert [name for name, _ in block.named_children()] == ["proj"]


def test_a_replacement_is_seen_at_once() -> None:
    block = Block()
    block.proj = nn.Linear(4, 8)  # a subclass's or a loader's replacement
    block.scale = nn.Parameter(torch.zeros(4))
    assert block.proj.out_features == 8 and block.proj is block._modules["proj"]
    assert torch.equal(block.scale, torch.zeros(4))
    block.load_state_dict({**block.state_dict(), "scale": torch.full((4,), 3.0)})
    assert torch.equal(block.scale, torch.full((4,), 3.0))


def test_a_missing_entry_is_an_attribute_error() -> None:
    block = Block.__new__(Block)
    nn.Module.__init__(block)
    with pytest.raises(AttributeError, match="'proj'"):
        _ = block.proj
    assert not hasattr(block, "scale")
    block.add_module("proj", nn.Identity())  # nn.Module's own registration still works
    assert isinstance(block.proj, nn.Identity)
