"""A screenshot of `prime-rl dashboard` on a run, as docs/dashboard.png is made.

    uv run python scripts/dashboard_screenshot.py outputs/reverse-text/rl docs/dashboard.png [--step 100]

Starts the dashboard on a free port, opens it in Debian's headless chromium (Playwright, as
tests/test_dashboard_browser.py does), opens the traced sample of ``--step`` (default: the
newest traced step) with the largest advantage, coloured by ``--colour``, hovers its third
token, opens the `loss/` metrics, and writes the whole page as a PNG.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[1]
BROWSER_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--step", default=None, help="the traced step whose first sample is opened (default: the newest)")
    parser.add_argument("--colour", default="mismatch", choices=["advantage", "mismatch", "entropy", "logprob"])
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium is missing: apt-get install chromium")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "prime_rl.cli", "dashboard", "--port", str(port), "--", str(args.run)],
                              cwd=REPO)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1200})
            for _ in range(100):
                try:
                    page.goto(f"http://127.0.0.1:{port}/", wait_until="load")
                    break
                except Exception:  # noqa: BLE001 - still starting
                    time.sleep(0.2)
            page.wait_for_selector("tr.trace", timeout=30_000)
            step = args.step or page.locator("#f-step option").last.get_attribute("value")
            page.select_option("#f-step", step)
            page.wait_for_function(f"() => document.querySelector('tr.trace')?.dataset.id.startsWith('train-{step}-')")
            page.select_option("#f-colour", args.colour)
            rows = page.locator("tr.trace")
            advantages = [abs(float(a)) if a not in ("–", "") else 0.0 for a in rows.locator("td:nth-child(6)").all_inner_texts()]
            rows.nth(advantages.index(max(advantages))).click()  # a sample that teaches something
            page.wait_for_selector(".tok")
            page.locator("#group-loss summary").click()
            page.wait_for_timeout(2500)  # a poll draws the opened group
            page.locator(".tok").nth(2).hover()
            page.screenshot(path=str(args.output), full_page=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
