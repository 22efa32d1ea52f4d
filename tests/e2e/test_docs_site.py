"""The docs site as a reader's browser shows it: mkdocs builds it, a local HTTP server serves it, and
Debian's headless Chromium opens every page. A picture that does not load, or a link to a page or
an anchor that is not there, fails the test. Marked `browser`: `.ci/run` installs Chromium and the
docs extra after the test command and runs `pytest -m browser`; elsewhere it skips, naming both,
unless JAXLLM_REQUIRE_BROWSER=1 makes their absence a failure."""

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request

import pytest
from support.docs import ROOT

from jaxllm.pictures import PICTURES

MISSING = [p for p in ("mkdocs", "selenium") if importlib.util.find_spec(p) is None]
MISSING += [b for b in ("chromium", "chromedriver") if shutil.which(b) is None]
REASON = f"needs {', '.join(MISSING)}: pip install -e '.[docs]' and apt-get install chromium chromium-driver"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(bool(MISSING) and os.environ.get("JAXLLM_REQUIRE_BROWSER") != "1", reason=REASON),
]


class _Files(http.server.SimpleHTTPRequestHandler):
    """Files only: a directory without its index.html is a missing page, not a listing."""

    def list_directory(self, path):
        self.send_error(404, "no index.html here")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built site, served on 127.0.0.1: (its URL, its directory)."""
    built = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(built)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Files, directory=str(built)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/", built
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@functools.cache
def _html(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.read().decode()
    except OSError:
        return None


def test_every_page_shows_its_pictures_and_every_link_resolves(site, browser):
    from selenium.webdriver.support.wait import WebDriverWait

    url, built = site
    pages = sorted(str(p.parent.relative_to(built)) for p in built.rglob("index.html"))
    assert len(pages) >= 20, f"the site has only {pages}"
    broken_images, broken_links, shown = [], [], set()
    for page in pages:
        address = urllib.parse.urljoin(url, "" if page == "." else f"{page}/")
        browser.get(address)
        WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")
        assert browser.current_url == address, f"asked for {address}, shown {browser.current_url}"
        images = browser.execute_script(
            "return Array.from(document.images, i => [i.currentSrc, i.complete && i.naturalWidth > 0])"
        )
        broken_images += [f"{page}: {src}" for src, loaded in images if not loaded]
        shown |= {src.rsplit("/", 1)[-1] for src, loaded in images if loaded}
        for link in browser.execute_script("return Array.from(document.querySelectorAll('a[href]'), a => a.href)"):
            target, _, anchor = link.partition("#")
            if not target.startswith(url):
                continue  # another site: not reachable from here, and not ours to keep
            html = _html(target)
            if html is None or (anchor and f'id="{urllib.parse.unquote(anchor)}"' not in html):
                broken_links.append(f"{page}: {link}")
    assert not broken_images, f"pictures that do not load: {broken_images}"
    assert not broken_links, f"links to no page or no anchor: {sorted(set(broken_links))}"
    assert set(PICTURES) <= shown, f"pictures no page showed: {set(PICTURES) - shown}"
