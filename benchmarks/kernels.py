"""Kernel benchmark: for each kernel and shape one row with ours, the model's PyTorch code in eager, the same
code under plain torch.compile, the floor (bytes moved / measured copy bandwidth) and ours as % of floor.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python3 benchmarks/kernels.py [--out results.json] [--quick] [--only mhc topk ...]

It measures the ceilings (device copy bandwidth, bf16 matmul rate) itself at start, checks every kernel
against the reference on fresh random inputs before timing it, and prints the table last. Every time is
a CUDA-graph replay (device time, as the runtime runs the model); the note gives our op as a plain host
call, whose Python dispatch and launch cost can exceed a short kernel's device time. The prefill attention row
(``--only attention_prefill``) has no eager or compiled column, and its floor is the larger of its FLOPs at the
bf16 rate and its bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from v4compile.codegen import ops, reference
from v4compile.model.mhc import hc_post, hc_pre


@dataclass
class Row:
    kernel: str
    shape: str
    ours_us: float
    eager_us: float | None
    compiled_us: float | None
    floor_us: float
    bytes: int
    note: str = ""

    @property
    def pct_of_floor(self) -> float:
        return 100.0 * self.floor_us / self.ours_us


def bench(fn: Callable[[], object], quick: bool) -> float:
    """Median microseconds of ``fn`` (CUDA events via triton.testing.do_bench)."""
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=25 if quick else 100, rep=100 if quick else 400, return_mode="median")


def capture_graph(fn: Callable[[], object]) -> tuple[Callable[[], None], object]:
    """``fn`` captured in a CUDA graph after two warm-up calls on a side stream: the replay and the output
    buffer each replay writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warm-up's stream: per-stream kernel state carries over
        out = fn()
    return graph.replay, out


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph; returns the replay (launch gaps gone, as in the runtime's decode)."""
    return capture_graph(fn)[0]


def in_graph_us(fn: Callable[[], object], quick: bool, repeat: int = 20) -> float:
    """Microseconds per call of ``fn`` inside one CUDA graph holding ``repeat`` calls: what the op adds to a
    decode-step graph, without the fixed cost of launching a graph of its own."""
    return bench(graphed(lambda: [fn() for _ in range(repeat)]), quick) / repeat


def ceilings(quick: bool) -> dict[str, float]:
    """Measured device-to-device copy bandwidth (bytes read + written per s) and bf16 matmul FLOP/s."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_us = bench(lambda: dst.copy_(src), quick)
    copy_bw = 2 * src.nbytes / (copy_us * 1e-6)
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_us = bench(lambda: a @ b, quick)
    return {"copy_bytes_per_s": copy_bw, "bf16_flop_per_s": 2 * n**3 / (mm_us * 1e-6)}


def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return torch.compile(fn, dynamic=False)


def _ran(prefix: str) -> None:
    """Fails unless every kernel whose name starts with ``prefix`` built and ran (no silent fallback)."""
    from v4compile.codegen.registry import REGISTRY

    records = [r for n, r in REGISTRY.records.items() if n.startswith(prefix)]
    if not records or any(r.error or not r.launches for r in records):
        raise AssertionError(f"kernel {prefix}* did not run: {[(r.name, r.error) for r in records]}")


def _check(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if not err < tol:
        raise AssertionError(f"{what}: relative error {err:.2e} exceeds {tol:.0e}")


def _tilelang_note(call: Callable[[], torch.Tensor], want: torch.Tensor, what: str, kernel: str, quick: bool,
                   tol: float, per_call: bool = False,
                   checked: Callable[[torch.Tensor], torch.Tensor] = lambda out: out) -> str:
    """"; TileLang kernel N us" for ``call`` (``checked`` of its output against ``want``, kernel ``kernel*`` seen
    running) as a CUDA graph replay (``per_call``: per call in a 20-call graph), where TileLang is installed; else
    nothing."""
    if importlib.util.find_spec("tilelang") is None:
        return ""
    _check(checked(call()), want, f"TileLang {what}", tol=tol)
    _ran(kernel)
    if per_call:
        return f"; TileLang kernel {in_graph_us(call, quick):.1f} us/call"
    return f"; TileLang kernel {bench(graphed(call), quick):.1f} us"


def compressor_prefill_row(ceil: dict[str, float], quick: bool, ratio: int, tokens: int = 65536,
                           width: int = 512) -> Row:
    """The fused prefill pooling over ``tokens`` tokens of fp32 kv and score projections."""
    c = 2 if ratio == 4 else 1
    kv = torch.randn(1, tokens, c * width, device="cuda")
    score = torch.randn(1, tokens, c * width, device="cuda")
    ape = torch.randn(ratio, c * width, device="cuda")
    n = tokens // ratio
    ref = reference.compressor_pool
    want = ref(kv.double(), score.double(), ape.double(), ratio, width, n)
    _check(ops.compressor_pool(kv, score, ape, ratio, width, n, "triton"), want, f"compressor C{ratio}")
    _ran(f"compressor_pool.c{ratio}.w{width}.triton")
    compiled = _compiled(ref)
    compiled(kv, score, ape, ratio, width, n)
    moved = kv.nbytes + score.nbytes + ape.nbytes + n * width * 4

    def ours() -> torch.Tensor:
        return ops.compressor_pool(kv, score, ape, ratio, width, n, "triton")

    host_us = bench(ours, quick)
    from v4compile.codegen.registry import REGISTRY

    tilelang = ""
    if importlib.util.find_spec("tilelang") is not None:
        _check(ops.compressor_pool(kv, score, ape, ratio, width, n, "tilelang"), want, f"TileLang compressor C{ratio}")
        tl_us = bench(graphed(lambda: ops.compressor_pool(kv, score, ape, ratio, width, n, "tilelang")), quick)
        tilelang = f"; TileLang kernel {tl_us:.1f} us"
    launch = REGISTRY.records[f"compressor_pool.c{ratio}.w{width}.triton"].launch
    config = ", ".join(f"{k}={v}" for k, v in launch.items() if k in ("BLOCK_J", "CHUNK", "BLOCK_D", "num_warps"))
    return Row(f"compressor pool C{ratio} (prefill, CUDA graph)", f"{tokens} tok x {c * width}",
               bench(graphed(ours), quick), bench(graphed(lambda: ref(kv, score, ape, ratio, width, n)), quick),
               bench(graphed(lambda: compiled(kv, score, ape, ratio, width, n)), quick),
               1e6 * moved / ceil["copy_bytes_per_s"], moved, note=f"{config}; host call {host_us:.1f} us{tilelang}")


def compressor_decode_row(ceil: dict[str, float], quick: bool, batch: int, ratio: int = 4, width: int = 512) -> Row:
    """The one-token decode update's pooling over the compressor state, timed as CUDA graph replays."""
    kv = torch.randn(batch, 2 * ratio, 2 * width, device="cuda")
    score = torch.randn(batch, 2 * ratio, 2 * width, device="cuda")
    ref = reference.compressor_pool_state
    want = ref(kv.double(), score.double(), ratio, width)
    _check(ops.compressor_pool_state(kv, score, ratio, width, "triton"), want, "compressor state")
    _ran(f"compressor_pool_state.c{ratio}.w{width}.triton")
    compiled = _compiled(ref)
    compiled(kv, score, ratio, width)
    moved = kv.nbytes // 2 + score.nbytes // 2 + batch * width * 4

    def ours() -> torch.Tensor:
        return ops.compressor_pool_state(kv, score, ratio, width, "triton")

    host_us = bench(ours, quick)
    return Row("compressor decode update C4 (CUDA graph)", f"batch {batch}", bench(graphed(ours), quick),
               bench(graphed(lambda: ref(kv, score, ratio, width)), quick),
               bench(graphed(lambda: compiled(kv, score, ratio, width)), quick),
               1e6 * moved / ceil["copy_bytes_per_s"], moved,
               note=f"in a 20-call graph {in_graph_us(ours, quick):.1f} us/call; host call {host_us:.1f} us")


def _entry_inputs(ratio: int, width: int, rotate: bool, rows: int, positions: torch.Tensor) -> tuple:
    """Finish inputs like the model's: cos/sin of the entries' first tokens (C4 layers' YaRN RoPE), an fp32 norm
    weight, the model's epsilon; the indexer branch rotates, the main branch has power-of-two FP8 scales."""
    from v4compile.model.rope import rope_cos_sin, rope_frequencies

    cos, sin = rope_cos_sin(rope_frequencies(64, 1.6e5, 65536, 16, 32, 1).cuda(), positions)
    return cos, sin, torch.rand(width, device="cuda") + 0.5, 1e-6, rotate, True, True


def compressor_entries_row(ceil: dict[str, float], quick: bool, ratio: int, width: int, rotate: bool,
                           tokens: int = 65536) -> Row:
    """Prefill pooling with the entry's finish (norm, RoPE, FP8 or Hadamard + FP4) fused, against the model's
    pooling + finish; the note gives the pooling kernel followed by the compiled finish (what fusing saves)."""
    from v4compile.model.compressor import finish_entries

    c = 2 if ratio == 4 else 1
    kv = torch.randn(1, tokens, c * width, device="cuda")
    score = torch.randn(1, tokens, c * width, device="cuda")
    ape = torch.randn(ratio, c * width, device="cuda")
    n = tokens // ratio
    finish = _entry_inputs(ratio, width, rotate, n, torch.arange(n, device="cuda") * ratio)
    ref = reference.compressor_entries
    want = ref(kv, score, ape, ratio, width, n, *finish)
    _check(ops.compressor_entries(kv, score, ape, ratio, width, n, *finish, "triton"), want,
           f"compressor entries C{ratio}", tol=1e-2)
    form = "hadamard_fp4" if rotate else "fp8"
    tilelang = _tilelang_note(lambda: ops.compressor_entries(kv, score, ape, ratio, width, n, *finish, "tilelang"),
                              want, f"compressor entries C{ratio}",
                              f"compressor_entries.c{ratio}.w{width}.{form}.tilelang", quick, tol=1e-2)
    _ran(f"compressor_entries.c{ratio}.w{width}.{form}.triton")
    compiled, compiled_finish = _compiled(ref), _compiled(finish_entries)
    compiled(kv, score, ape, ratio, width, n, *finish)
    moved = kv.nbytes + score.nbytes + ape.nbytes + n * width * 2

    def ours() -> torch.Tensor:
        return ops.compressor_entries(kv, score, ape, ratio, width, n, *finish, "triton")

    def unfused() -> torch.Tensor:
        return compiled_finish(ops.compressor_pool(kv, score, ape, ratio, width, n, "triton"), *finish)

    unfused()
    from v4compile.codegen.registry import REGISTRY

    launch = REGISTRY.records[f"compressor_entries.c{ratio}.w{width}.{form}.triton"].launch
    config = ", ".join(f"{k}={v}" for k, v in launch.items() if k in ("BLOCK_J", "CHUNK", "num_warps"))
    return Row(f"compressor entries C{ratio} {form} (prefill, pool + finish, CUDA graph)",
               f"{tokens} tok x {c * width}", bench(graphed(ours), quick),
               bench(graphed(lambda: ref(kv, score, ape, ratio, width, n, *finish)), quick),
               bench(graphed(lambda: compiled(kv, score, ape, ratio, width, n, *finish)), quick),
               1e6 * moved / ceil["copy_bytes_per_s"], moved,
               note=f"{config}; pool kernel + compiled finish {bench(graphed(unfused), quick):.1f} us{tilelang}")


def compressor_entry_state_row(ceil: dict[str, float], quick: bool, batch: int, ratio: int, width: int = 512) -> Row:
    """The decode update's pooling over the compressor state with the entry's finish fused, against the model's
    code; the note gives the pooling kernel followed by the compiled finish, both per call in a 20-call graph."""
    from v4compile.model.compressor import finish_entries

    c = 2 if ratio == 4 else 1
    kv = torch.randn(batch, c * ratio, c * width, device="cuda")
    score = torch.randn(batch, c * ratio, c * width, device="cuda")
    finish = _entry_inputs(ratio, width, False, batch, torch.randint(0, 4096, (batch,), device="cuda") * ratio)
    ref = reference.compressor_entry_state
    want = ref(kv, score, ratio, width, *finish)
    _check(ops.compressor_entry_state(kv, score, ratio, width, *finish, "triton"), want, "compressor entry state",
           tol=1e-2)
    _ran(f"compressor_entry_state.c{ratio}.w{width}.fp8.triton")
    tilelang = _tilelang_note(lambda: ops.compressor_entry_state(kv, score, ratio, width, *finish, "tilelang"), want,
                              "compressor entry state", f"compressor_entry_state.c{ratio}.w{width}.fp8.tilelang",
                              quick, tol=1e-2, per_call=True)
    compiled, compiled_finish = _compiled(ref), _compiled(finish_entries)
    compiled(kv, score, ratio, width, *finish)
    moved = (kv.nbytes + score.nbytes) // c + batch * width * 2

    def ours() -> torch.Tensor:
        return ops.compressor_entry_state(kv, score, ratio, width, *finish, "triton")

    def unfused() -> torch.Tensor:
        return compiled_finish(ops.compressor_pool_state(kv, score, ratio, width, "triton"), *finish)

    unfused()
    return Row(f"compressor entry update C{ratio} (decode, pool + finish, CUDA graph)", f"batch {batch}",
               bench(graphed(ours), quick), bench(graphed(lambda: ref(kv, score, ratio, width, *finish)), quick),
               bench(graphed(lambda: compiled(kv, score, ratio, width, *finish)), quick),
               1e6 * moved / ceil["copy_bytes_per_s"], moved,
               note=f"in a 20-call graph {in_graph_us(ours, quick):.1f} us/call; pool kernel + compiled finish "
                    f"{in_graph_us(unfused, quick):.1f} us/call{tilelang}")


def topk_row(ceil: dict[str, float], quick: bool, batch: int, k: int, n: int = 262144, ties: bool = False) -> Row:
    """Exact top-k (ties to the lowest index) against the model's stable-sort prefix and torch.topk, on
    bf16-valued scores like the indexer's (``ties``: an eighth of the row holds four repeated values, so
    thousands of keys tie at the threshold and the kernel takes its exact slow path)."""
    x = torch.randn(batch, n, device="cuda").bfloat16().float()
    if ties:
        x[:, : n // 8] = torch.randint(0, 4, (batch, n // 8), device="cuda").float()
    want_v, want_i = reference.radix_topk(x, k, False)

    def exact(backend: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The backend's top-k call, checked once against the stable-sort reference (and seen running)."""
        def call() -> tuple[torch.Tensor, torch.Tensor]:
            return ops.radix_topk(x, k, False, backend)

        got_v, got_i = call()
        if not (torch.equal(got_i, want_i) and torch.equal(got_v, want_v)):
            raise AssertionError(f"{backend} radix top-k {batch}x{n} k={k} differs from the stable-sort reference")
        _ran(f"radix_topk.k{k}.{backend}")
        return call

    ours = exact("triton")
    compiled = _compiled(lambda t: reference.radix_topk(t, k, False))
    compiled(x)
    topk_us = bench(graphed(lambda: torch.topk(x, k)), quick)
    moved = x.nbytes + batch * k * 12
    host_us = bench(ours, quick)
    tilelang = ""
    if importlib.util.find_spec("tilelang") is not None:
        theirs = exact("tilelang")
        tilelang = (f"; TileLang kernels {bench(graphed(theirs), quick):.1f} us, in a 20-call graph "
                    f"{in_graph_us(theirs, quick):.1f} us/call")
    return Row(f"top-k k={k} (CUDA graph){', heavy ties' if ties else ''}", f"batch {batch} x {n}",
               bench(graphed(ours), quick), bench(graphed(lambda: reference.radix_topk(x, k, False)), quick),
               bench(graphed(lambda: compiled(x)), quick), 1e6 * moved / ceil["copy_bytes_per_s"], moved,
               note=f"torch.topk {topk_us:.1f} us; ours in a 20-call graph {in_graph_us(ours, quick):.1f} us/call; "
                    f"as a host call {host_us:.1f} us{tilelang}")


def attention_inputs(batch: int, heads: int, selected: int, entries: int,
                     dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One decode query per row (bf16), ``entries`` bf16 KV entries, a random sink, ``selected`` distinct
    entry ids per row with the last 7 masked (-1), and the softmax scale."""
    q = torch.randn(batch, 1, heads, dim, device="cuda").bfloat16()
    kv = torch.randn(batch, entries, dim, device="cuda").bfloat16()
    sink = torch.randn(heads, device="cuda")
    index = torch.argsort(torch.rand(batch, 1, entries, device="cuda"), dim=-1)[..., :selected]
    index[:, :, -7:] = -1
    return q, kv, sink, index, dim**-0.5


def sparse_attention_row(ceil: dict[str, float], quick: bool, batch: int, heads: int = 64, selected: int = 768,
                         entries: int = 8192, dim: int = 512) -> Row:
    """Decode attention of one C4 layer at 16K context: 128 window + 512 selected + 128 C128-sized
    entries per row (distinct, 7 masked), ``heads`` query heads, head dim 512, bf16 KV."""
    q, kv, sink, index, scale = attention_inputs(batch, heads, selected, entries, dim)
    want = reference.sparse_attention(q.double(), kv.double(), sink.double(), index, scale)
    _check(ops.sparse_attention(q, kv, sink, index, scale, "triton"), want, "sparse attention", tol=1e-2)
    _ran(f"sparse_attention.d{dim}")
    compiled = _compiled(reference.sparse_attention)
    compiled(q, kv, sink, index, scale)
    moved = batch * (selected * dim * 2 + 2 * heads * dim * 2 + selected * 8)

    def ours() -> torch.Tensor:
        return ops.sparse_attention(q, kv, sink, index, scale, "triton")

    def eager() -> torch.Tensor:
        return reference.sparse_attention(q, kv, sink, index, scale)

    host_us = bench(ours, quick)
    tilelang = _tilelang_note(lambda: ops.sparse_attention(q, kv, sink, index, scale, "tilelang"), want,
                              "sparse attention", f"sparse_attention.d{dim}.bf16dot.tilelang", quick, tol=1e-2)
    return Row("sparse MQA attention with sink (decode, CUDA graph)",
               f"batch {batch}, {heads} heads, {selected} entries", bench(graphed(ours), quick),
               bench(graphed(eager), quick), bench(graphed(lambda: compiled(q, kv, sink, index, scale)), quick),
               1e6 * moved / ceil["copy_bytes_per_s"], moved, note=f"{_config('sparse_attention.d')}; "
                                                                  f"host call {host_us:.1f} us{tilelang}")


def sparse_attention_prefill_row(ceil: dict[str, float], quick: bool, tokens: int = 8192, heads: int = 64,
                                 window: int = 128, selected: int = 512, ratio: int = 4, dim: int = 512) -> Row:
    """Prefill attention of one C4 layer over ``tokens`` new tokens: each query reads its ``window`` latest
    window keys and ``selected`` distinct random compressed entries (causal: only those its position completed),
    from one bf16 KV of the window keys followed by the entries, as the model lays them out. The floor is the
    larger of the QK and PV FLOPs at the bf16 rate and the bytes read once; the reference is checked on the
    first and last 128 queries (all of them would not fit in fp64). No eager or compiled column: the model's
    code gathers [tokens, window + selected, dim] at once."""
    entries = tokens // ratio
    if entries < selected:
        raise ValueError(f"{tokens} tokens make {entries} C{ratio} entries, fewer than the {selected} selected")
    q = torch.randn(1, tokens, heads, dim, device="cuda").bfloat16()
    kv = torch.randn(1, tokens + entries, dim, device="cuda").bfloat16()
    sink = torch.randn(heads, device="cuda")
    pos = torch.arange(tokens, device="cuda")
    win = pos[:, None] - torch.arange(window, device="cuda")
    win = torch.where(win >= 0, win, -1)
    done = ((pos + 1) // ratio)[:, None]  # entries complete at each position
    scores = torch.rand(tokens, entries, device="cuda").masked_fill(torch.arange(entries, device="cuda") >= done,
                                                                    -1.0)
    picks = scores.topk(selected, dim=1).indices  # distinct, the completed ones first, like the indexer's top-k
    picks = torch.where(picks < done, tokens + picks, -1)
    index = torch.cat([win, picks], dim=1)[None]
    scale = dim**-0.5
    ends = torch.cat([torch.arange(128, device="cuda"), torch.arange(tokens - 128, tokens, device="cuda")])

    def ours() -> torch.Tensor:
        return ops.sparse_attention(q, kv, sink, index, scale, "triton")

    def rows(out: torch.Tensor) -> torch.Tensor:
        return out[:, ends]

    want = reference.sparse_attention(q[:, ends].double(), kv.double(), sink.double(), index[:, ends], scale)
    _check(rows(ours()), want, "prefill sparse attention", tol=1e-2)
    _ran(f"sparse_attention.d{dim}")
    flops = 2 * 2 * heads * dim * int((index >= 0).sum())  # QK and PV over the keys each query attends to
    moved = 2 * (2 * tokens * heads * dim + (tokens + entries) * dim) + 8 * tokens * (window + selected)
    floor_us = 1e6 * max(flops / ceil["bf16_flop_per_s"], moved / ceil["copy_bytes_per_s"])
    tilelang = _tilelang_note(lambda: ops.sparse_attention(q, kv, sink, index, scale, "tilelang"), want,
                              "prefill sparse attention", f"sparse_attention.d{dim}.bf16dot.tilelang", quick,
                              tol=1e-2, checked=rows)
    return Row("sparse MQA attention with sink (prefill, one C4 layer)",
               f"{tokens} tokens, {heads} heads, {window} + {selected} keys", bench(graphed(ours), quick), None, None,
               floor_us, moved, note=f"{_config('sparse_attention.d')}; {flops / 1e12:.2f} TFLOP{tilelang}")


def head_padding_row(ceil: dict[str, float], quick: bool, batch: int, heads: int = 8, multiple: int = 64,
                     selected: int = 768, entries: int = 8192, dim: int = 512) -> Row:
    """Decode attention with ``heads`` query heads per rank (64 heads at tp=8): "ours" is the head_padding
    pass's call (zero heads up to the Hopper tile ``multiple``); the note has the kernel run on the real
    heads alone; eager and torch.compile run the model code on the real heads."""
    q, kv, sink, index, scale = attention_inputs(batch, heads, selected, entries, dim)

    def padded() -> torch.Tensor:
        return ops.sparse_attention_padded(q, kv, sink, index, scale, multiple, "triton")

    def unpadded() -> torch.Tensor:
        return ops.sparse_attention(q, kv, sink, index, scale, "triton")

    got, want = padded(), unpadded()
    diff = (got.float() - want.float()).abs().max().item()
    torch.testing.assert_close(got, want)  # head blocks of another size may round one ulp apart
    compiled = _compiled(reference.sparse_attention)
    compiled(q, kv, sink, index, scale)
    moved = batch * (selected * dim * 2 + 2 * heads * dim * 2 + selected * 8)
    padded_us, unpadded_us = bench(graphed(padded), quick), bench(graphed(unpadded), quick)
    return Row(f"head padding: sparse attention, {heads} heads/rank padded to {multiple} (CUDA graph)",
               f"batch {batch}, {selected} entries", padded_us,
               bench(graphed(lambda: reference.sparse_attention(q, kv, sink, index, scale)), quick),
               bench(graphed(lambda: compiled(q, kv, sink, index, scale)), quick),
               1e6 * moved / ceil["copy_bytes_per_s"], moved,
               note=f"unpadded kernel on {heads} heads {unpadded_us:.1f} us, padded / unpadded "
                    f"{padded_us / unpadded_us:.2f}x; max |padded - unpadded| {diff:.1e}")


def indexer_scores_row(ceil: dict[str, float], quick: bool, batch: int, keys: int = 16384, heads: int = 64,
                       dim: int = 128) -> Row:
    """Lightning-indexer scoring for one decode token per row against ``keys`` compressed keys (64K
    context), bf16 like the model."""
    q = torch.randn(batch, 1, heads, dim, device="cuda").bfloat16()
    k = torch.randn(batch, keys, dim, device="cuda").bfloat16()
    w = torch.randn(batch, 1, heads, device="cuda").bfloat16()
    ref = reference.indexer_scores
    want = ref(q, k, w)
    _check(ops.indexer_scores(q, k, w, "triton"), want, "indexer scores", tol=1e-2)
    _ran(f"indexer_scores.d{dim}.bf16.triton")
    compiled = _compiled(ref)
    compiled(q, k, w)
    moved = k.nbytes + q.nbytes + w.nbytes + batch * keys * 4

    def ours() -> torch.Tensor:
        return ops.indexer_scores(q, k, w, "triton")

    host_us = bench(ours, quick)
    tilelang = _tilelang_note(lambda: ops.indexer_scores(q, k, w, "tilelang"), want, "indexer scores",
                              f"indexer_scores.d{dim}.bf16.tilelang", quick, tol=1e-2)
    return Row("indexer scoring (decode, CUDA graph)", f"batch {batch}, {heads} heads x {keys} keys",
               bench(graphed(ours), quick), bench(graphed(lambda: ref(q, k, w)), quick),
               bench(graphed(lambda: compiled(q, k, w)), quick), 1e6 * moved / ceil["copy_bytes_per_s"], moved,
               note=f"{_config('indexer_scores.d')}; host call {host_us:.1f} us{tilelang}")


def _config(prefix: str) -> str:
    """The launch configuration the registry recorded for the kernel named ``prefix*``."""
    from v4compile.codegen.registry import REGISTRY

    launch = next(r.launch for n, r in REGISTRY.records.items() if n.startswith(prefix))
    return ", ".join(f"{k}={v}" for k, v in launch.items() if k.isupper() or k == "num_warps")


def mhc_row(ceil: dict[str, float], quick: bool, batch: int, dim: int = 4096, n: int = 4, iters: int = 20) -> Row:
    """mHC pre + post of one sub-layer at decode, V4-Flash dims: ``batch`` rows of n bf16 streams x dim, fn
    [(2+n)n, n*dim] fp32. Ours is mhc_pre then mhc_post; eager and torch.compile run the model's hc_pre then
    hc_post. The floor's bytes: fn once, the streams read by both steps, y written, the sub-layer output read,
    the new streams written."""
    x = torch.randn(batch, n, dim, device="cuda").bfloat16()
    fn = torch.randn((2 + n) * n, n * dim, device="cuda") / math.sqrt(n * dim) * 4
    scale = torch.rand(3, device="cuda") + 0.5
    base = torch.randn((2 + n) * n, device="cuda")
    sub = torch.randn(batch, dim, device="cuda").bfloat16()

    def model_code(x: torch.Tensor, sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, post, comb = hc_pre(x, fn, scale, base, iters, 1e-6, 1e-6)
        return y, hc_post(sub, x, post, comb)

    def pre() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ops.mhc_pre(x, fn, scale, base, iters, 1e-6, 1e-6, "triton")

    mixed = pre()

    def ours() -> tuple[torch.Tensor, torch.Tensor]:
        y, post, comb = pre()
        return y, ops.mhc_post(sub, x, post, comb, "triton")

    for got, want, what in zip(ours(), model_code(x, sub), ("mHC pre y", "mHC post"), strict=True):
        _check(got, want, what, tol=1e-2)
    _ran(f"mhc_pre.n{n}.d{dim}.triton")
    _ran(f"mhc_post.n{n}.d{dim}.triton")
    compiled = _compiled(model_code)
    compiled(x, sub)
    moved = fn.nbytes + 3 * x.nbytes + 2 * sub.nbytes + batch * (n + n * n) * 4 * 2
    pre_us = bench(graphed(pre), quick)
    post_us = bench(graphed(lambda: ops.mhc_post(sub, x, mixed[1], mixed[2], "triton")), quick)
    tilelang = ""
    if importlib.util.find_spec("tilelang") is not None:

        def tilelang_steps() -> tuple[torch.Tensor, torch.Tensor]:
            y, post, comb = ops.mhc_pre(x, fn, scale, base, iters, 1e-6, 1e-6, "tilelang")
            return y, ops.mhc_post(sub, x, post, comb, "tilelang")

        for got, want, what in zip(tilelang_steps(), model_code(x, sub), ("TileLang mHC pre y", "TileLang mHC post"),
                                   strict=True):
            _check(got, want, what, tol=1e-2)
        _ran(f"mhc_pre.n{n}.d{dim}.tilelang")
        _ran(f"mhc_post.n{n}.d{dim}.tilelang")
        tilelang = f"; TileLang kernels {bench(graphed(tilelang_steps), quick):.1f} us"
    return Row("mHC pre+post (decode, CUDA graph)", f"batch {batch}, n {n} x D {dim}, {iters} iters",
               bench(graphed(ours), quick), bench(graphed(lambda: model_code(x, sub)), quick),
               bench(graphed(lambda: compiled(x, sub)), quick), 1e6 * moved / ceil["copy_bytes_per_s"], moved,
               note=f"pre {pre_us:.1f} us ({_config('mhc_pre.')}), post {post_us:.1f} us ({_config('mhc_post.')}); "
                    f"in a 20-call graph {in_graph_us(ours, quick):.1f} us/call; host call {bench(ours, quick):.1f} us"
                    f"{tilelang}")


SECTIONS: dict[str, Callable[[dict[str, float], bool], list[Row]]] = {
    "compressor": lambda c, q: [compressor_prefill_row(c, q, ratio) for ratio in (4, 128)]
    + [compressor_decode_row(c, q, batch) for batch in (1, 16, 64, 256)],
    "compressor_finish": lambda c, q: [compressor_entries_row(c, q, 4, 512, False),
                                       compressor_entries_row(c, q, 128, 512, False),
                                       compressor_entries_row(c, q, 4, 128, True)]
    + [compressor_entry_state_row(c, q, batch, ratio) for ratio in (4, 128) for batch in (1, 16, 64, 256)],
    "topk": lambda c, q: [topk_row(c, q, batch, k) for batch, k in ((1, 512), (64, 512), (1, 1024), (256, 512))]
    + [topk_row(c, q, 1, 2048, n=1 << 20), topk_row(c, q, 1, 512, ties=True),
       topk_row(c, q, 8192, 512, n=2048), topk_row(c, q, 64, 512, n=65536)],  # an 8K prefill; 64 rows at 256K
    "attention": lambda c, q: [sparse_attention_row(c, q, batch) for batch in (1, 16, 64, 128)],
    "attention_prefill": lambda c, q: [sparse_attention_prefill_row(c, q)],
    "head_padding": lambda c, q: [head_padding_row(c, q, batch) for batch in (1, 16, 64)],
    "indexer": lambda c, q: [indexer_scores_row(c, q, batch) for batch in (1, 16, 64)],
    "mhc": lambda c, q: [mhc_row(c, q, batch) for batch in (1, 4, 16, 64)],
}
"""The benchmark sections in table order; ``--only`` runs some of them."""


def main() -> None:
    """Runs the chosen benchmark sections (all by default) and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows and ceilings as JSON here")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run only these sections")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    ceil = ceilings(args.quick)
    rows = [row for name, section in SECTIONS.items() if name in (args.only or SECTIONS)
            for row in section(ceil, args.quick)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceilings": ceil,
                       "rows": [asdict(r) | {"pct_of_floor": r.pct_of_floor} for r in rows]}, f, indent=1)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; copy "
          f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s")
    print("| kernel | shape | ours us | eager us | torch.compile us | floor us | % of floor | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        eager = "-" if r.eager_us is None else f"{r.eager_us:.1f}"
        compiled = "-" if r.compiled_us is None else f"{r.compiled_us:.1f}"
        print(f"| {r.kernel} | {r.shape} | {r.ours_us:.1f} | {eager} | {compiled} | {r.floor_us:.1f} | "
              f"{r.pct_of_floor:.0f}% | {r.note} |")


if __name__ == "__main__":
    main()
