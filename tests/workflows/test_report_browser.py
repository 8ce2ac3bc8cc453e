"""The report page in a real browser: headless Chromium loads every inlined image and draws a
page that is not blank. scripts/test.sh installs Debian's `chromium` when it is missing (as
root); elsewhere this test skips, saying so. Costs about 10 s (two Chromium starts)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="hivetune report draws with matplotlib: pip install 'hivetune[plots]'")
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from hivetune.workflows.report import report  # noqa: E402
from test_report import make_run  # noqa: E402

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: scripts/test.sh installs it (apt-get install chromium, as root); "
                             "without root, install Debian's chromium package to run this test")

# Runs at the load event (after every image has loaded or failed) and writes what it saw into
# the DOM, which --dump-dom prints: "loaded/total" and the data-file names of images that did not load.
CHECK_SCRIPT = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const bad = images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.dataset.file);
  const out = document.createElement("pre");
  out.id = "image-check";
  out.textContent = (images.length - bad.length) + "/" + images.length + " broken:" + bad.join(",");
  document.body.appendChild(out);
});
</script>"""
# A control: an image that cannot decode, so the check above is seen to fail when it should.
BROKEN_IMAGE = '<img src="data:image/png;base64,AAAAAAAA" alt="control" data-file="control-broken.png">'


def chromium(*args: str, tmp: Path) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run", f"--user-data-dir={tmp / 'profile'}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_report_renders_in_chromium(tmp_path):
    run = make_run(tmp_path / "run")
    result = report(run)
    page = Path(result["html"]).read_text()
    n_images = len(result["pngs"])
    assert n_images == 7

    check = Path(result["out"]) / "check.html"
    check.write_text(page.replace("</body>", BROKEN_IMAGE + CHECK_SCRIPT + "</body>"))
    dom = chromium("--virtual-time-budget=10000", "--dump-dom", check.as_uri(), tmp=tmp_path)
    found = re.search(r'<pre id="image-check">(\d+)/(\d+) broken:([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    assert (int(found[1]), int(found[2]), found[3]) == (n_images, n_images + 1, "control-broken.png")

    shot = tmp_path / "shot.png"
    chromium("--window-size=1200,2000", f"--screenshot={shot}", Path(result["html"]).as_uri(), tmp=tmp_path)
    with Image.open(shot) as im:
        assert im.size == (1200, 2000)
        pixels = np.asarray(im.convert("L"), dtype=np.float64)
    # A blank page is one colour (variance 0); text, tables and charts give a spread of greys.
    assert pixels.var() > 200, pixels.var()
    assert (pixels < 200).mean() > 0.02  # some share of the page is ink, not background
    # rows of the screenshot with something drawn reach down past the first screenful of text
    inked_rows = np.nonzero((pixels < 200).any(axis=1))[0]
    assert inked_rows.max() > 1500
