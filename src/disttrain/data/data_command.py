"""`disttrain data prepare TEXT_FILES... --out DIR [--tokenizer tokenizer.json]`."""

from __future__ import annotations

import argparse

from disttrain.errors import UserError

USAGE = "usage: disttrain data prepare TEXT_FILES... --out DIR [--tokenizer tokenizer.json]"


HELP = f"""{USAGE}

subcommands:
  prepare   tokenize text files into token files for [data] tokens (one per text file;
            resumable): disttrain data prepare --help lists its options
"""


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP, end="")
        return 0
    if not argv or argv[0] != "prepare":
        raise UserError(f"disttrain data: unknown or missing subcommand; {USAGE}")
    parser = argparse.ArgumentParser(
        prog="disttrain data prepare",
        description="Tokenize text files into token files for [data] tokens (one per text file; resumable).",
    )
    parser.add_argument("texts", nargs="+", metavar="TEXT_FILE", help="the text files to tokenize")
    parser.add_argument("--out", required=True, help="the folder to write the token files and meta.json to")
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer.json (default: bytes, vocabulary 256)")
    parser.add_argument(
        "--format",
        default="llmc",
        choices=("llmc", "nanogpt"),
        help="llmc: a 1 KiB header with the token count (default); nanogpt: raw tokens",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv[1:])
    from disttrain.data.prepare import prepare

    report = prepare(args.texts, args.out, tokenizer=args.tokenizer, fmt=args.format, progress=not args.quiet)
    print(
        f"disttrain data prepare: {len(report.written)} file(s) written ({report.tokens:,} tokens), "
        f"{len(report.skipped)} already complete, vocabulary {report.vocab_size} -> {args.out}. "
        f'Train on it with [data] tokens = "{args.out}" and model.vocab_size >= {report.vocab_size}.'
    )
    return 0
