"""`prime-rl report RUN [RUN ...]`: a run's curves, or several runs' overlaid, as one PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

from prime_rl.observe.report import write_report


def main(argv: list[str]) -> int:
    """`prime-rl report`: draws from each RUN/metrics.jsonl alone, so it works on a finished, a
    crashed or a running run; runs without step rows are skipped with a note on stderr."""
    parser = argparse.ArgumentParser(
        prog="prime-rl report",
        description="Draw one PNG of a run's metrics (reward, mismatch KL, staleness, entropy, completion length, "
        "time per phase); with several runs, each run is one color in every panel.",
    )
    parser.add_argument("runs", type=Path, nargs="+", metavar="RUN", help="a run's output_dir")
    parser.add_argument("--output", type=Path, default=None,
                        help="PNG to write (default: RUN/report.png, or <first RUN>/report-compare.png for several runs)")
    parser.add_argument("--label", action="append", default=None, metavar="NAME",
                        help="a run's name in the legend, once per run in the runs' order (default: the run directory's name)")
    args = parser.parse_args(argv)
    result = write_report(args.runs, args.output, args.label)
    print(f"[prime-rl] report: {result.output} ({', '.join(result.panels)})")
    return 0
