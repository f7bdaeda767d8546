"""The reference pages as a person reads them: the built site in Debian's Chromium (Playwright with
``executable_path``, never a browser download) at 1280 px and on a phone (390 px). No page scrolls
sideways and no table is wider than the text; type signatures and table cells show no escape
backslash; a class's attributes are a definition list; the outcomes page is a table of every
outcome. Each page's top and its first table, at both widths, go to ``build/screenshots/reference/``."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from consumer_kit import Outcome

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "build" / "screenshots" / "reference"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
PAGES = ["reference/settings/", "reference/metrics/", "reference/outcomes/", "reference/cli/",
         "reference/api/", "reference/asyncapi/"]
WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}

# Where the page is wider than its viewport, or a table wider than the article that holds it.
OVERFLOW = """() => {
  const article = document.querySelector('.md-content__inner').getBoundingClientRect();
  const tables = [...document.querySelectorAll('.md-typeset table')].filter(t => {
    const box = t.getBoundingClientRect();
    return box.width > article.width + 1 || box.right > article.right + 1;
  }).map(t => t.rows[0].innerText.slice(0, 60));
  return {page: document.documentElement.scrollWidth, viewport: window.innerWidth, tables};
}"""
BACKSLASHES = """() => [...document.querySelectorAll('.md-typeset table, .doc-signature, .doc-attributes')]
  .map(e => e.innerText).filter(text => text.includes('\\\\')).map(text => text.slice(0, 80))"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site built with ``mkdocs build --strict``, served on 127.0.0.1; yields its base URL."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


@pytest.fixture(scope="module")
def pages() -> Iterator[dict[str, Any]]:
    """One page per width in one Chromium (the sync API: these tests run no event loop)."""
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} missing: apt-get install -y chromium (.ci/run does)"
        if os.environ.get("CONSUMER_KIT_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield {name: chromium.new_page(viewport={"width": w, "height": h}) for name, (w, h) in WIDTHS.items()}
        finally:
            chromium.close()


@pytest.mark.parametrize("path", PAGES)
def test_the_page_fits_the_screen_and_shows_no_escapes(site: str, pages: dict[str, Any], path: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for width, page in pages.items():
        page.goto(f"{site}/{path}")
        fit = page.evaluate(OVERFLOW)
        assert fit["page"] <= fit["viewport"] and fit["tables"] == [], (width, fit)
        assert page.evaluate(BACKSLASHES) == [], width
        name = path.strip("/").split("/")[-1]
        page.screenshot(path=str(SCREENSHOTS / f"{name}-{width}.png"))  # the page's top, as it opens
        first = page.locator(".md-typeset table, .doc-attributes").first
        if first.count():  # and its first table (or attribute list) whole, the fixed header out of its way
            page.add_style_tag(content=".md-header { position: static !important; }")
            first.screenshot(path=str(SCREENSHOTS / f"{name}-{width}-table.png"))


def test_a_class_s_attributes_are_a_definition_list(site: str, pages: dict[str, Any]) -> None:
    page = pages["desktop"]
    page.goto(f"{site}/reference/api/")
    handler = page.locator("[id='consumer_kit.Handler']").locator("xpath=following::dl[contains(@class, 'doc-attributes')][1]")
    terms = handler.locator("dt").all_inner_texts()
    assert terms[:2] == ["operation_type (str)", "fingerprint_exclude (Any)"], terms
    assert "pydantic" in handler.locator("dd").nth(1).inner_text()  # fingerprint_exclude's definition
    assert page.locator(".doc-contents > p:has-text('Class attributes')").count() == 0


def test_the_outcomes_page_is_a_table_of_every_outcome(site: str, pages: dict[str, Any]) -> None:
    page = pages["phone"]
    page.goto(f"{site}/reference/outcomes/")
    listed = page.locator(".md-typeset table tbody tr td:first-child").all_inner_texts()
    assert sorted(cell.strip() for cell in listed) == sorted(outcome.value for outcome in Outcome)
    headers = page.locator(".md-typeset table thead th").all_inner_texts()
    assert headers == ["outcome", "the delivery", "attempt", "what happened"]
    label = page.locator(".md-typeset table tbody td").first.get_attribute("data-label")
    assert label == "outcome"  # on a phone each row is a block of labelled lines
