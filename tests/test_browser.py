"""JupyterLab in headless Chromium: run the notebooks, click Step, see the dashboard grow.

Starts `jupyter lab` on a free localhost port (token off) over a temp copy of notebooks/ whose
`nbval-skip` (GPU-only) cells are dropped, as CI's nbval skips them. Screenshots go to
`test-artifacts/`; with RLBENCH_DOCS_IMG=1 the widget screenshots are also written to docs/img/.

Needs Debian's chromium (`apt-get install -y chromium`) or PLAYWRIGHT_CHROMIUM_EXECUTABLE.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from dist_utils import free_port

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
DOCS_IMG = ROOT / "docs" / "img"
CHROMIUM = os.environ.get("PLAYWRIGHT_CHROMIUM_EXECUTABLE") or shutil.which("chromium") or "/usr/bin/chromium"
RUN_ALL_TIMEOUT_S = 480


def _cells_run(path: Path) -> list[dict]:
    """The cells CI runs: all but those tagged nbval-skip (GPU-only cells are not run on CPU)."""
    return [c for c in json.loads(path.read_text())["cells"] if "nbval-skip" not in c["metadata"].get("tags", [])]


def _copy_notebooks(dst: Path) -> None:
    for src in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(src.read_text())
        nb["cells"] = _cells_run(src)
        (dst / src.name).write_text(json.dumps(nb, indent=1))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """URL of a JupyterLab server over a temp copy of the notebooks; stopped (only this process) after."""
    pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: apt-get install -y chromium (or set PLAYWRIGHT_CHROMIUM_EXECUTABLE)")
    root = tmp_path_factory.mktemp("lab")
    nb_dir, settings = root / "notebooks", root / "settings"
    nb_dir.mkdir()
    _copy_notebooks(nb_dir)
    for ext, name, values in [
        ("apputils-extension", "notification", {"fetchNews": "false"}),
        # every cell in the DOM (no virtual scrolling) and no kernel-picker dialog
        ("notebook-extension", "tracker", {"windowingMode": "none", "autoStartDefaultKernel": True}),
    ]:
        (settings / "@jupyterlab" / ext).mkdir(parents=True, exist_ok=True)
        (settings / "@jupyterlab" / ext / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    port = free_port()
    env = os.environ | {
        "RLBENCH_SMOKE": "1", "OMP_NUM_THREADS": "1", "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTER_CONFIG_DIR": str(root / "config"), "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
    }
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
           "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={nb_dir}",
           "--ServerApp.disable_check_xsrf=True", "--ServerApp.allow_root=True", "--LabApp.news_url=None",
           "--LabApp.extension_manager=readonly"]
    log = open(root / "lab.log", "w")  # noqa: SIM115 - closed in the teardown below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=nb_dir)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"jupyter lab did not start:\n{(root / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(root / "lab.log", ARTIFACTS / "jupyterlab.log")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _prompts(page) -> list[str]:
    return [p.strip() for p in page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()]


def _run_all(page, notebook: str) -> None:
    """Run → Run All Cells once the kernel is live; retried when the click lands before the kernel connects."""
    for _ in range(3):
        # the execution indicator reads 'idle' before any kernel exists; the status bar names the kernel once live
        page.get_by_text(re.compile(r"ipykernel\) \| Idle")).first.wait_for(timeout=120_000)
        if page.locator(".jp-Dialog").count():  # a kernel picker despite the settings: take the default
            page.locator(".jp-Dialog .jp-mod-accept").click()
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator("li[data-command='runmenu:run-all']").click()
        deadline = time.time() + 30
        while time.time() < deadline:
            if any(p != "[ ]:" for p in _prompts(page)):
                return
            time.sleep(0.5)
    _shot(page, f"{notebook}-not-started")
    pytest.fail(f"{notebook}: Run All started no cell after 3 tries; prompts {_prompts(page)}")


def _open_and_run_all(browser, url: str, notebook: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    # a fresh workspace per notebook: no tabs restored from an earlier page
    page.goto(f"{url}/lab/workspaces/{notebook.split('.')[0]}/tree/{notebook}?reset")
    n_code = sum(c["cell_type"] == "code" for c in _cells_run(ROOT / "notebooks" / notebook))
    page.wait_for_function(f"() => document.querySelectorAll('.jp-CodeCell').length === {n_code}", timeout=60_000)
    _run_all(page, notebook)
    deadline = time.time() + RUN_ALL_TIMEOUT_S
    while True:  # done when every code cell shows an execution number
        prompts = _prompts(page)
        done = [p for p in prompts if p.startswith("[") and p[1:-2].strip().isdigit()]
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                              has_text="Traceback").count()
        if errors:
            _shot(page, f"{notebook}-error")
            pytest.fail(f"{notebook}: a cell raised; see test-artifacts/{notebook}-error.png")
        if len(done) == n_code:
            return page
        if time.time() > deadline:
            _shot(page, f"{notebook}-timeout")
            pytest.fail(f"{notebook}: {len(done)}/{n_code} cells ran in {RUN_ALL_TIMEOUT_S}s; prompts {prompts}")
        time.sleep(1)


def _shot(page_or_element, name: str, docs: bool = False) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page_or_element.screenshot(path=str(ARTIFACTS / f"{name}.png"))
    if docs and os.environ.get("RLBENCH_DOCS_IMG") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        page_or_element.screenshot(path=str(DOCS_IMG / f"{name}.png"))


REWARD_POINTS_JS = """() => {
  for (const gd of document.querySelectorAll('.js-plotly-plot')) {
    const t = (gd.data || []).find(t => t.name === 'reward: train');
    if (t) return t.x.length;
  }
  return -1;
}"""


def _dashboard_state(page) -> tuple[int, int]:
    steps = int(page.locator(".rlbench-steps").first.get_attribute("data-steps"))
    return steps, page.evaluate(REWARD_POINTS_JS)


def test_setup_notebook_step_button_adds_dashboard_point(lab, browser):
    page = _open_and_run_all(browser, lab, "01_setup.ipynb")
    page.wait_for_selector(".rlbench-steps", timeout=30_000)
    steps0, points0 = _dashboard_state(page)
    assert steps0 >= 3 and points0 == steps0  # the notebook's own controller.run(...) and step()
    _shot(page, "01_setup-after-run-all")

    page.get_by_role("button", name="Step", exact=True).first.click()
    deadline = time.time() + 180
    while _dashboard_state(page) != (steps0 + 1, points0 + 1):
        if time.time() > deadline:
            _shot(page, "01_setup-step-timeout")
            pytest.fail(f"dashboard still at {_dashboard_state(page)} after clicking Step (was {steps0, points0})")
        time.sleep(0.5)
    status = page.locator(".rlbench-status").first.inner_text()
    assert status.startswith("step ") and "done" in status

    controller = page.locator(".jp-OutputArea-output", has=page.locator(".rlbench-status")).first
    dashboard = page.locator(".jp-OutputArea-output", has=page.locator(".rlbench-steps")).first
    dashboard.scroll_into_view_if_needed()
    _shot(controller, "step_controller", docs=True)
    _shot(dashboard, "live_dashboard", docs=True)
    viewer = page.locator(".jp-OutputArea-output", has=page.locator(".rlbench-rollout-summary")).first
    _shot(viewer, "rollout_viewer", docs=True)
    _shot(page, "01_setup-after-step")
    page.close()


def test_packing_notebook_inspector_renders(lab, browser):
    page = _open_and_run_all(browser, lab, "02_packing.ipynb")
    summary = page.locator(".rlbench-packing-summary").first
    assert "micro-batches/rank" in summary.inner_text()
    inspector = page.locator(".jp-OutputArea-output", has=summary).first
    inspector.scroll_into_view_if_needed()
    page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=60_000)
    _shot(inspector, "packing_inspector", docs=True)
    _shot(page, "02_packing-after-run-all")
    page.close()
