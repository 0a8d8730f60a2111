"""`disttrain doctor`: a static analyzer for distributed-training scripts.

    disttrain doctor [--format text|json|sarif] [-o FILE] [--select IDS] [--ignore IDS] [--advice] PATH...

Parses each script with `ast` (never imports or runs it, never imports torch) and
reports every pitfall with its practice ID (docs/practices.md), place, cause and fix.
Defects only by default; `--advice` adds the preferences (severity "advice").
Exit status: 1 when an error-severity finding exists, 0 otherwise (warnings alone: 0);
user mistakes (missing file, syntax error, unknown rule id) raise `UserError`, which
the CLI prints as one line with status 2.

`main` is the only public entry; importing this package stays cheap (argparse only),
the analyzer and renderers load when called.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

_DESCRIPTION = """Lint PyTorch distributed training scripts for known pitfalls
(DataParallel, optimizer before wrap, missing set_device/set_epoch, unguarded or
non-atomic checkpoints, double loss scaling, ...). Suppress one finding with
`# disttrain: ignore[rule-id]` on its line."""


def _ids(text: str) -> set[str]:
    return {x.strip() for x in text.split(",") if x.strip()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disttrain doctor", description=_DESCRIPTION)
    p.add_argument(
        "paths", nargs="*", metavar="PATH", help="training scripts or directories (searched recursively for *.py)"
    )
    p.add_argument(
        "--format",
        choices=("text", "json", "sarif"),
        default="text",
        help="text (default, for people), json, or sarif (SARIF 2.1.0 for CI code scanning)",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write the report to FILE instead of stdout (an existing FILE only when it is an earlier report)",
    )
    p.add_argument("--select", type=_ids, metavar="IDS", help="only these rule ids (comma-separated)")
    p.add_argument("--ignore", type=_ids, metavar="IDS", help="skip these rule ids (comma-separated)")
    p.add_argument(
        "--advice",
        action="store_true",
        help="also report advice (preferences such as the launcher), not only defects",
    )
    p.add_argument("--list-rules", action="store_true", help="print every rule with its help and exit")
    return p


DEEP_STACK = 512 * 2**20
"""Stack of the thread that re-runs an analysis too deep for the main thread's."""


def _deep(fn, *args):
    """`fn(*args)`; on a RecursionError (a very long expression: the parser and the rules
    walk the tree recursively) once more on a thread with a large stack and a high
    recursion limit; a `UserError` if even that is not enough."""
    try:
        return fn(*args)
    except RecursionError:
        pass
    import threading

    from disttrain.errors import UserError

    box: dict = {}

    def run():
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(200_000)
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            box["err"] = e
        finally:
            sys.setrecursionlimit(limit)

    old = threading.stack_size(DEEP_STACK)
    try:
        worker = threading.Thread(target=run, name="disttrain-doctor-deep")
        worker.start()
        worker.join()
    finally:
        threading.stack_size(old)
    if isinstance(box.get("err"), RecursionError):
        raise UserError(
            "a script is nested too deeply for doctor to analyse (a very long expression or "
            "deeply nested code); split it into smaller statements"
        ) from None
    if "err" in box:
        raise box["err"]
    return box["out"]


def main(argv: list[str]) -> int:
    """Run the doctor on `argv` (without the `doctor` word). Returns the exit status."""
    from disttrain.errors import UserError

    args = _parser().parse_args(argv)
    from disttrain.doctor import analyzer
    from disttrain.doctor import doctor_report as report

    if args.list_rules:
        report.print_rules(sys.stdout)
        return 0
    if not args.paths:
        raise UserError("no script given: disttrain doctor SCRIPT.py [DIR ...] (see --help)")
    for path in args.paths:  # a folder without scripts must not pass as checked and clean
        if os.path.isdir(path) and not analyzer.collect_files([path]):
            raise UserError(
                f"{path}: no Python files in this folder (hidden, build and virtualenv "
                f"folders are skipped); give the training script(s) to check"
            )
    if args.output:  # before the analysis: a user's file is refused, not overwritten
        from disttrain.config.paths import output_file

        output_file(args.output, "--output", replaceable=report.is_earlier_report)
    files, findings = _deep(analyzer.analyze_paths, args.paths, args.select, args.ignore, args.advice)
    if args.format == "json":
        text = report.render_json(files, findings)
    elif args.format == "sarif":
        text = report.render_sarif(files, findings)
    else:
        text = None
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as out:
                if text is None:
                    report.print_text(files, findings, out)
                else:
                    out.write(text)
        except OSError as e:
            raise UserError(f"{args.output}: cannot write the report ({e.strerror})") from None
    elif text is None:
        report.print_text(files, findings, sys.stdout)
    else:
        sys.stdout.write(text)
    return 1 if analyzer.has_errors(findings) else 0
