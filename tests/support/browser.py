"""Headless Chromium (Debian's package, which `.ci/run` installs) driven by Playwright for Python, for the web
console's tests: a page that records the browser's console errors and the page's uncaught exceptions."""

import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# as root in a sandbox without a GPU or a network: no sandbox, no GPU, none of Chromium's own connections
FLAGS = ("--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")
VIEWPORT = {"width": 1280, "height": 800}


@contextmanager
def chromium() -> Iterator[Browser]:
    if not shutil.which(CHROMIUM):
        raise RuntimeError(f"no Chromium at {CHROMIUM}: install Debian's package (`apt-get install "
                           "chromium`), as .ci/run does")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=list(FLAGS))
        try:
            yield browser
        finally:
            browser.close()


class WatchedPage:
    """A new browser context's page (its own storage: no key left by another test) and what went wrong in
    it."""

    def __init__(self, browser: Browser):
        self.context = browser.new_context(viewport=VIEWPORT)
        self.page: Page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def close(self) -> None:
        self.context.close()
