"""Load a V4 checkpoint directory (or build the tiny preset) and generate greedily with the KV cache.

    python examples/generate.py                       # tiny preset, random weights
    python examples/generate.py ../shared/golden/tiny-fp8-fp4 --steps 16
"""

from __future__ import annotations

import argparse

import torch

import v4compile
from v4compile.demo import greedy_decode


def main() -> None:
    """Parses arguments, loads the model and prints the generated ids per prompt."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="directory with config.json and *.safetensors")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    if args.checkpoint:
        model = v4compile.load(args.checkpoint)
    else:
        model = v4compile.DeepSeekV4(v4compile.V4Config.preset("tiny"), seed=0)
    model.eval()
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len))
    ids, _, prefill_s, decode_s = greedy_decode(model, prompt, args.steps)
    for row in ids[:, args.prompt_len :].tolist():
        print(" ".join(map(str, row)))
    print(f"prefill {prefill_s * 1e3:.1f} ms, decode {decode_s * 1e3 / max(args.steps - 1, 1):.1f} ms/step")


if __name__ == "__main__":
    main()
