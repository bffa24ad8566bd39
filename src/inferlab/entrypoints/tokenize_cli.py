"""`inferlab tokenize`: print a text's tokens the way llama.cpp's llama-tokenize does.

    inferlab tokenize -p "Why is my parcel late?" --show-count
      4898 -> 'Why'
       314 -> ' is'
    ...
    Total number of tokens: 6

Only the tokenizer is loaded (no weights), so this is quick even for a large model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-m", "--model", default=None, help="GGUF file, model folder or hub id (default: the default model)"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("-p", "--prompt", default=None, help="the text to tokenize")
    source.add_argument("-f", "--file", default=None, help="read the text from this file")
    source.add_argument("--stdin", action="store_true", help="read the text from standard input")
    parser.add_argument("--ids", action="store_true", help="print only the ids, as a list: [1, 2, 3]")
    parser.add_argument("--show-count", action="store_true", help="print the number of tokens at the end")
    parser.add_argument(
        "--no-bos", action="store_true", help="never add BOS, even if the model's tokenizer adds one by default"
    )
    parser.add_argument(
        "--no-parse-special",
        action="store_true",
        help="treat special-token text such as <|im_start|> as plain text",
    )


def _read_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file is not None:
        return Path(args.file).read_text(encoding="utf-8")
    if args.stdin:
        return sys.stdin.read()
    raise ValueError("give the text with -p TEXT, -f FILE or --stdin")


def format_token_lines(pieces: list[tuple[int, str]]) -> list[str]:
    """llama-tokenize's layout: the id right-aligned in 6 columns, the piece in single quotes."""
    return [f"{token_id:6d} -> '{piece}'" for token_id, piece in pieces]


def run(args: argparse.Namespace) -> int:
    text = _read_text(args)
    from inferlab.models.registry import resolve_model
    from inferlab.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(resolve_model(args.model).path)
    if args.no_parse_special:
        tokenizer.backend.encode_special_tokens = True  # our own instance: nobody else sees this
    ids = tokenizer.encode(text, add_special_tokens=not args.no_bos)
    if args.ids:
        print("[" + ", ".join(str(i) for i in ids) + "]")
    else:
        for line in format_token_lines([(i, tokenizer.id_to_piece(i)) for i in ids]):
            print(line)
    if args.show_count:
        print(f"Total number of tokens: {len(ids)}")
    return 0
