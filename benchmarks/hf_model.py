"""transformers' DeepSeek-V4 prefill side by side: its eager forward, ``torch.compile`` of it, and
``v4compile.optimize`` of it (the passes read transformers' dense masked attention as the sparse kernel).

The model is a random ``DeepseekV4ForCausalLM`` with V4-Flash's attention (64 heads of 512, window 128, C4 with a
512-entry indexer top-k, C128) in four layers of every kind, and a small MoE (8 experts) so that it builds and
compiles in a minute: the rows say what a transformers user gets, not V4-Flash's step (``step_profile.py``). The
floor is the step's FLOPs (2 x the parameters a token reads, routed experts at k/E, plus q K^T and P V over the
entries a row reads: window + top-k or every C128 entry) over ``--rate`` TFLOP/s of bf16 tensor cores.

    PYTHONPATH=$PWD python3 benchmarks/hf_model.py --lengths 2048 8192          # GPU
    PYTHONPATH=$PWD python3 benchmarks/hf_model.py --lengths 256 --small       # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from headline import timed

import v4compile

FLASH_ATTENTION = dict(num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
                       index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128)
SMALL_ATTENTION = dict(num_attention_heads=8, head_dim=128, q_lora_rank=128, o_groups=2, o_lora_rank=64,
                       index_n_heads=4, index_head_dim=64, index_topk=32, sliding_window=32)


def build(small: bool, device: str) -> torch.nn.Module:
    """The random bf16 model of the module docstring (``small``: a CPU-sized attention)."""
    import transformers

    settings = dict(vocab_size=32768, hidden_size=1024 if small else 4096, num_hidden_layers=4,
                    moe_intermediate_size=256 if small else 2048, n_routed_experts=8, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                 "compressed_sparse_attention"],
                    mlp_layer_types=["moe"] * 4, partial_rotary_factor=0.125 if not small else 0.5,
                    max_position_embeddings=65536, tie_word_embeddings=False,
                    **(SMALL_ATTENTION if small else FLASH_ATTENTION))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**settings))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0, 0.5)
    return model.to(torch.bfloat16).eval()


def step_flops(model: torch.nn.Module, tokens: int) -> float:
    """2 x parameters read per token (routed experts at k/E) + attention over each row's entries."""
    config = model.config
    params = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        share = config.num_experts_per_tok / config.n_routed_experts if ".experts." in name else 1.0
        params += p.numel() * share
    attention = 0.0
    for kind in config.layer_types:
        entries = config.sliding_window
        if kind == "compressed_sparse_attention":
            entries += min(config.index_topk, tokens // 4)
        elif kind == "heavily_compressed_attention":
            entries += tokens // 128
        attention += 4 * config.num_attention_heads * config.head_dim * entries
    return tokens * (2 * params + attention)


def row(model: torch.nn.Module, tokens: int, args: argparse.Namespace) -> dict[str, object]:
    """One prompt length: each column's median ms (or why it did not run), compile seconds, the optimized model's
    kernels and its logits against eager."""
    cuda = args.device == "cuda"
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    out: dict[str, object] = {"tokens": tokens, "floor_ms": step_flops(model, tokens) / (args.rate * 1e12) * 1e3}
    logits: dict[str, torch.Tensor] = {}
    columns = {"eager": lambda: model, "torch.compile": lambda: torch.compile(model),
               "v4compile": lambda: v4compile.optimize(model)}
    for name, make in columns.items():
        try:
            with torch.no_grad():
                t = time.perf_counter()
                fn = make()
                logits[name] = fn(ids, use_cache=False).logits[0, -256:].float()
                if cuda:
                    torch.cuda.synchronize()
                out[f"{name} first call s"] = round(time.perf_counter() - t, 1)
                out[f"{name} ms"] = timed(lambda f=fn: f(ids, use_cache=False), args.repeats, cuda)
            if name == "v4compile":
                kernels = Counter(m.kernel.split(".")[0] for r in fn.reports() for m in r.matches)
                out["kernels"] = dict(kernels)
                out["masks"] = [m.details["mask"] for r in fn.reports() for m in r.matches if "mask" in m.details]
        except torch.OutOfMemoryError:
            out[f"{name} ms"] = "OOM"
        finally:
            if cuda:
                torch.cuda.empty_cache()
    if "eager" in logits and "v4compile" in logits:
        got, want = logits["v4compile"], logits["eager"]
        out["cosine median"] = F.cosine_similarity(got, want, dim=-1).median().item()
        out["top token same"] = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a CPU-sized attention (8 heads of 128)")
    parser.add_argument("--rate", type=float, default=790.0, help="bf16 tensor-core TFLOP/s for the floor")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    model = build(args.small, args.device)
    rows = [row(model, n, args) for n in args.lengths]
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                                        "rows": rows}, indent=1))
    print("| tokens | floor ms | eager ms | torch.compile ms | v4compile ms | x floor | cosine median | top token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r.get(f"{c} ms", "-") for c in ("eager", "torch.compile", "v4compile")]
        ratio = r["v4compile ms"] / r["floor_ms"] if isinstance(r.get("v4compile ms"), float) else "-"
        print(f"| {r['tokens']} | {r['floor_ms']:.2f} | " + " | ".join(
            f"{c:.2f}" if isinstance(c, float) else str(c) for c in cells)
            + f" | {ratio if isinstance(ratio, str) else f'{ratio:.1f}'} | {r.get('cosine median', '-')} | "
              f"{r.get('top token same', '-')} |")


if __name__ == "__main__":
    main()
