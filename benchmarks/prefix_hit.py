"""What a prefix hit costs as the prefix grows: the engine's ``begin_prefill`` for a prompt whose first ``length``
tokens are cached (ShadowRadix match, the window tail and compressor states copied in, the cached pages mapped into
the staging row's page table, fresh pages taken and cleared for the rest), timed at several prefix lengths.

    python benchmarks/prefix_hit.py [--preset flash] [--lengths 1024,8192,32768,131072] [--device cuda]

No model runs: the caches are the engine's own (``CacheManager``), sized for the full preset (V4-Flash: 43 layers)
with every cached page holding random entries. The time should not grow with the prefix: a hit copies a fixed-size
tail and state, and maps pages, where a cache of contiguous rows copies every cached entry.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from v4compile import V4Config
from v4compile.model.cache import PAGE_TOKENS
from v4compile.runtime.cache_manager import CacheManager, pages_for, plan_memory


def hit_ms(config: V4Config, length: int, new_tokens: int, device: str, reps: int) -> dict[str, float]:
    """Median milliseconds of ``begin_prefill`` for a prompt of ``length`` cached tokens plus one new token, and the
    bytes a hit copies and maps."""
    max_len = length + new_tokens
    model = SimpleNamespace(config=config, embed=torch.nn.Embedding(1, 1, device=device))
    plan = plan_memory(config, max_len, None, 1, 1, None)
    caches = CacheManager(model, plan, rows=1, max_seq_len=max_len, chunk=PAGE_TOKENS, prefix_cache=True,
                          tail_every=0)
    assert caches.store is not None
    for pool in caches.entry_pages.pools.values():
        pool.normal_()
    prompt = torch.randint(0, config.vocab_size, (length + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    first = caches.begin_prefill(0, prompt, restore=False, tokens=length + new_tokens)
    assert first is not None
    caches.store.save(prompt[:length], caches.staging[0], first.pages)
    samples = []
    for _ in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        hit = caches.begin_prefill(0, prompt, restore=True, tokens=length + new_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
        assert hit is not None and hit.resume_len == length
        caches.release(hit.pages)
    samples = sorted(samples[1:])
    mapped = pages_for(length) * caches.entry_pages.page_bytes
    return {"length": length, "hit_ms": samples[len(samples) // 2], "min_ms": samples[0],
            "mapped_bytes": mapped, "page_bytes": caches.entry_pages.page_bytes}


def main() -> None:
    """Times hits at each length and prints a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash")
    parser.add_argument("--lengths", default="1024,8192,32768,131072")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens the request adds (fresh pages)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    config = V4Config.preset(args.preset, max_seq_len=max(lengths) + args.new_tokens)
    rows = [hit_ms(config, n, args.new_tokens, args.device, args.reps) for n in lengths]
    print(f"prefix hit cost, {args.preset} ({config.n_layers} layers), {args.device}, + {args.new_tokens} new tokens")
    print("| cached tokens | hit ms (median) | min ms | entries mapped, MB (not copied) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['length']} | {r['hit_ms']:.3f} | {r['min_ms']:.3f} | {r['mapped_bytes'] / 1e6:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
