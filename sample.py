"""
Sample text from a trained checkpoint.

    python sample.py --out_dir=out/quickstart
    python sample.py --out_dir=out/quickstart --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out --start=FILE:prompt.txt --temperature=0.7 --top_k=50
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

import prepare_data
from model import GPT, GPTConfig
from nanonorm.run_files import foreign_checkpoint, load_checkpoint
from nanonorm.train_config import ConfigError, check_device, exit_with, resolve_device


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="folder holding ckpt.pt")
    p.add_argument("--start", default="\n", help="prompt text, or FILE:path to read it from a file")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--max_new_tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="<1 sharper, >1 more random")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Values generate() cannot use, each with the fix."""
    if args.num_samples < 1:
        raise ConfigError(f"--num_samples={args.num_samples} must be at least 1")
    if args.max_new_tokens < 0:
        raise ConfigError(f"--max_new_tokens={args.max_new_tokens} must not be negative")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature={args.temperature} must be a number >= 0 (near 0: the likeliest token)")
    if args.top_k < 1:
        raise ConfigError(f"--top_k={args.top_k} must be at least 1")
    if not 0 <= args.seed < 2**64:  # torch.Generator.manual_seed's range
        raise ConfigError(f"--seed={args.seed} must lie in [0, 2**64)")
    try:
        check_device(args.device)
    except ConfigError as e:  # its message names train.py's key
        raise ConfigError(f"--{e}") from None


def read_prompt(start: str) -> str:
    """The prompt text: --start itself, or the file named by --start=FILE:path."""
    if start.startswith("FILE:"):
        try:
            with open(start[5:], encoding="utf-8") as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the prompt file {start[5:]!r} ({getattr(e, 'strerror', None) or e}); "
                              "give an existing UTF-8 text file after FILE:") from None
    if not start:
        raise ConfigError("the prompt is empty; give at least one character with --start (the default is a newline)")
    return start


def load_model(out_dir: str, device: str) -> tuple[GPT, prepare_data.Tokenizer]:
    checkpoint = load_checkpoint(os.path.join(out_dir, "ckpt.pt"), device)
    if "data_meta" not in checkpoint:
        raise ConfigError("this checkpoint has no tokenizer (it was trained on a vector task, not text)")
    try:  # a checkpoint whose checksum holds, from another version of the code
        model = GPT(GPTConfig(**checkpoint["model_args"]))
        model.load_state_dict(checkpoint["model"])
        tokenizer = prepare_data.tokenizer_from_meta(checkpoint["data_meta"])
    except (TypeError, ValueError, KeyError, RuntimeError) as e:
        raise foreign_checkpoint(out_dir, e) from None
    return model.to(device).eval(), tokenizer


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        args.device = resolve_device(args.device)
        start = read_prompt(args.start)
        model, tokenizer = load_model(args.out_dir, args.device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        prompt = torch.tensor([tokenizer.encode(start)], dtype=torch.long, device=args.device)
    except ValueError as e:  # a symbol outside the model's vocabulary
        print(f"error: cannot encode the prompt: {e}", file=sys.stderr)
        return 2
    generator = torch.Generator(args.device).manual_seed(args.seed)
    for _ in range(args.num_samples):
        out = model.generate(prompt, args.max_new_tokens, args.temperature, args.top_k, generator=generator,
                             vocab_limit=tokenizer.vocab_size)
        print(tokenizer.decode(out[0].tolist()))
        print("-" * 40)
    return 0


if __name__ == "__main__":
    exit_with(lambda: main(sys.argv[1:]))
