"""The dashboard in a real browser on a live trio run (issue 37): `[dashboard] enabled` starts
the page beside the run and the launcher prints its URL; headless Chromium (Debian's
`chromium`, driven by Playwright) loads it, sees the reward curve grow while the run trains,
opens a traced sample and finds its tokens with the trainer's view of them; the run ends with
the page's process stopped like the others."""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from helpers import assert_no_secret_in_traces, free_port, start_launcher, tagged_processes, trio_toml
from prime_rl.traces import read_traces, rollout_traces_path, trainer_traces_path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is a dev dependency (uv sync)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is missing (apt-get install chromium; "
                                                          "scripts/test.sh installs it as root)")

BROWSER_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
"""As this machine's probe started Chromium: without the network flags it keeps calling out."""

SCREENSHOT = os.environ.get("PRIME_RL_DASHBOARD_SCREENSHOT")
"""Where to keep the page's screenshot (the test writes one to its tmp folder otherwise)."""


def reward_points(page) -> int:
    return page.evaluate("() => { const d = document.getElementById('chart-reward');"
                         " return d && d.data && d.data.length ? d.data[0].x.length : 0; }")


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_the_page_of_a_live_run_grows_and_shows_a_samples_tokens(tmp_path, tiny_model):
    run_dir, config = tmp_path / "run", tmp_path / "run.toml"
    port = free_port()
    config.write_text(trio_toml(tiny_model, run_dir, max_steps=60, async_level=1,
                                extra=f"\n[dashboard]\nenabled = true\nport = {port}\n"))
    proc, tag = start_launcher(config)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    url = wait_for(lambda: next((line.split("dashboard: ", 1)[1].strip() for line in lines if "dashboard: http" in line), None),
                   120, "the launcher to print the dashboard's URL")
    assert url == f"http://127.0.0.1:{port}/"
    shot = Path(SCREENSHOT) if SCREENSHOT else tmp_path / "dashboard.png"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            wait_for(lambda: page_loaded(page, url), 120, "the page to load")
            # the curve grows while the run trains
            first = wait_for(lambda: reward_points(page) >= 2 and reward_points(page), 240, "two steps on the reward curve")
            grown = wait_for(lambda: reward_points(page) > first and reward_points(page), 120, "the curve to grow")
            assert grown > first
            # a sample the trainer has trained on: step 0's, chosen with the step filter
            wait_for(lambda: page.locator("#f-step option[value='0']").count(), 60, "step 0 among the traced steps")
            wait_for(lambda: trained(run_dir, "train-0-"), 60, "the trainer's rows of step 0")
            page.select_option("#f-step", "0")
            wait_for(lambda: page.locator("tr.trace").count() and page.locator("tr.trace").first.get_attribute("data-id")
                     .startswith("train-0-"), 30, "step 0's samples in the list")
            page.locator("tr.trace").first.click()
            wait_for(lambda: page.locator(".tok").count(), 30, "the sample's tokens")
            tokens = page.locator(".tok")
            tokens.first.hover()
            hover = page.locator("#hover").inner_text()
            assert "sampled logprob" in hover and "trainer logprob" in hover and "mismatch" in hover, hover
            assert page.locator(".msg.assistant").count() >= 1 and page.locator(".msg.user").count() >= 1
            page.select_option("#f-colour", "entropy")
            assert page.locator(".tok").count() == tokens.count()
            assert "FAILED" not in page.locator("#status").inner_text()
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    proc.wait(timeout=900)  # not `finish`: its communicate() would close the pipe the reader is reading
    reader.join(timeout=10)
    assert proc.returncode == 0, "".join(lines)
    assert shot.stat().st_size > 50_000
    assert tagged_processes(tag) == [], "the dashboard stops with the run"
    rollouts, trainer = read_traces(rollout_traces_path(run_dir)).rows, read_traces(trainer_traces_path(run_dir)).rows
    assert {r["step"] for r in rollouts} == set(range(60)) and {r["id"] for r in trainer} <= {r["id"] for r in rollouts}
    assert_no_secret_in_traces(run_dir)


def page_loaded(page, url: str) -> bool:
    try:
        page.goto(url, wait_until="load")
    except Exception:  # noqa: BLE001 - the server is still starting
        return False
    return page.locator("#trace-list").count() == 1


def trained(run_dir: Path, prefix: str) -> bool:
    return any(r["id"].startswith(prefix) for r in read_traces(trainer_traces_path(run_dir)).rows)
