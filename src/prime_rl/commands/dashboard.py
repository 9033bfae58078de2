"""`prime-rl dashboard [RUN ...] [--port N] [--host H]`: a web page of runs, live while they
write (``prime_rl.observe.dashboard``). It only reads the run folders."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from prime_rl.observe.dashboard import DASHBOARD_TOKEN_ENV, DEFAULT_PORT, DashboardError, is_loopback, run_views, serve

DEFAULT_RUN = Path("outputs/reverse-text/rl")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="prime-rl dashboard", description="A web page of runs: metrics, status and "
                                     "the traced rollouts, live while the runs write.")
    parser.add_argument("runs", nargs="*", type=Path, metavar="RUN", help=f"a run's output_dir (default: {DEFAULT_RUN})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to listen on (default {DEFAULT_PORT})")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; any other needs the token printed in the page's URL)")
    parser.add_argument("--token", default=None, help=f"the token of a page on another address (default: ${DASHBOARD_TOKEN_ENV}, "
                        "else a new random one)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be 1 to 65535, got {args.port}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    views, problems = run_views(args.runs or [DEFAULT_RUN])
    for line in problems:
        print(f"[dashboard] {line}", file=sys.stderr, flush=True)
    if not views:
        print("[dashboard] error: none of the run folders exists", file=sys.stderr, flush=True)
        return 2
    token = None if is_loopback(args.host) else (args.token or os.environ.get(DASHBOARD_TOKEN_ENV) or secrets.token_urlsafe(24))
    try:
        serve(views, args.host, args.port, token)
    except DashboardError as e:
        print(f"[dashboard] error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
