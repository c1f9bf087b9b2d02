"""The passes' shape reads never specialise a symbolic size (a guard that would pin a dynamic graph to one
batch size): a dynamic size reads as a ``SymDim`` that compares only by what is provably true and refuses to be
used as a number."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from v4compile.passes.base import NoMatch, SymDim, is_static, numel, shape


def _nodes() -> tuple[ShapeEnv, fx.Node, fx.Node, fx.Node]:
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env) as mode:
        x = mode.from_tensor(torch.empty(3, 8))
        size = env.create_unbacked_symint()
        y, z = torch.empty(size, 8), torch.empty(size * 2, 8)
    graph = fx.Graph()
    nodes = graph.placeholder("x"), graph.placeholder("y"), graph.placeholder("z")
    for node, val in zip(nodes, (x, y, z), strict=True):
        node.meta["val"] = val
    return env, *nodes


def test_reading_a_symbolic_shape_adds_no_guard() -> None:
    env, static, symbolic, double = _nodes()
    assert shape(static) == (3, 8) and is_static(shape(static))
    rows, width = shape(symbolic)
    assert isinstance(rows, SymDim) and width == 8 and not is_static(shape(symbolic))
    assert rows == shape(symbolic)[0] and rows != shape(double)[0] and rows != 3
    assert numel(shape(static)) == 24 and numel(shape(symbolic)) == f"{rows}*8"
    assert len({rows, shape(symbolic)[0]}) == 1
    assert not env.guards


@pytest.mark.parametrize("use", [int, bool, lambda d: d + 1, lambda d: d * 2, lambda d: d < 4, lambda d: range(d)])
def test_using_a_dynamic_size_as_a_number_is_a_near_miss(use: object) -> None:
    env, _, symbolic, _ = _nodes()
    with pytest.raises(NoMatch, match="is dynamic"):
        use(shape(symbolic)[0])
    assert not env.guards
