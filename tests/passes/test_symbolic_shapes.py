"""The passes' shape reads never specialise a symbolic size (a guard that would pin a dynamic graph to one
batch size)."""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from v4compile.passes.base import shape


def test_reading_a_symbolic_shape_adds_no_guard() -> None:
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        x = mode.from_tensor(torch.empty(3, 8), symbolic_context=None)
        size = env.create_unbacked_symint()
        y = torch.empty(size, 8)
    static, symbolic = fx.Graph().placeholder("x"), fx.Graph().placeholder("y")
    static.meta["val"], symbolic.meta["val"] = x, y
    assert shape(static) == (3, 8)
    assert shape(symbolic) is None
    assert not env.guards
