"""A dynamic-shape capture stays dynamic through the backend: the ATen retrace keeps Dynamo's symbolic sizes
and the passes' shape reads never specialise them (a new batch size then reuses the compiled graph)."""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import v4compile
from v4compile.backend import make_backend
from v4compile.passes.base import shape
from v4compile.passes.manager import PassManager


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


def test_a_dynamic_batch_is_captured_once_and_reused(tiny_model: v4compile.DeepSeekV4) -> None:
    manager = PassManager([], backend="reference")
    decode = torch.compile(tiny_model.decode_step, backend=make_backend(manager, inductor=False), dynamic=None)
    length = 24
    for batch in (2, 3, 5):
        ids = torch.randint(0, tiny_model.config.vocab_size, (batch, length),
                            generator=torch.Generator().manual_seed(batch))
        mine, eager = tiny_model.new_cache(batch, 128), tiny_model.new_cache(batch, 128)
        with torch.no_grad():
            tiny_model(ids, cache=mine)
            tiny_model(ids, cache=eager)
            got = decode(ids[:, -1:], torch.full((batch,), length), mine)
            want = tiny_model.decode_step(ids[:, -1:], torch.full((batch,), length), eager)
        assert torch.equal(got, want)
    # the first batch size compiles static; the second makes the batch dynamic; the third reuses that graph
    assert len(manager.reports) == 2
