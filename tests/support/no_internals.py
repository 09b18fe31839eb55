"""What an HTTP error body must not show a client: a traceback, a file path, an IP address, a Ray id. The
suite checks every 4xx/5xx body its HTTP clients receive from our API (tests/conftest.py's autouse
fixture), whichever client the test uses: httpx2 (the openai client) or requests (schemathesis too)."""

import re
from urllib.parse import urlsplit

import httpx2
import requests

INTERNALS = {
    "a traceback": re.compile(r"Traceback|File \""),
    "a file path": re.compile(r"(?<![\w.~-])/(?:home|tmp|work|usr|root|opt|var|proc|dev|srv|mnt)/"),
    "an IPv4 address": re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])"),
    "an IPv6 address": re.compile(r"(?i)(?<![\w:])(?:(?:[0-9a-f]{1,4}:){7}[0-9a-f]{1,4}"
                                  r"|(?:[0-9a-f]{1,4}(?::[0-9a-f]{1,4})*)?::(?:[0-9a-f]{1,4}(?::[0-9a-f]{1,4})*)?"
                                  r")(?![\w:])"),
    # 16+ hex digits with a letter among them, not a number's (1.7976931348623157e+308)
    "a Ray id": re.compile(r"(?i)(?<![0-9a-z.])(?=[0-9]*[a-f])[0-9a-f]{16,}(?![0-9a-z.+-])"
                           r"|ActorID|ObjectRef|NodeID|TaskID|WorkerID|\bray\."),
}
# our server's routes: errors of other servers a test talks to (Ray's dashboard, its metrics export) are
# theirs
API_PATHS = re.compile(r"^/(?:v1/|tokenize|detokenize|health|version|metrics|openapi\.json)")


def internals(body: str) -> list[str]:
    """What of INTERNALS the body shows, with the text found."""
    return [f"{what}: {m.group(0)!r}" for what, pattern in INTERNALS.items() if (m := pattern.search(body))]


class ErrorBodies:
    """Wraps httpx2's and requests' send while installed: each error response of our API is read and checked;
    what it shows is collected in `found` (asserted empty by the fixture, so an error the client turns into an
    exception still fails the test)."""

    def __init__(self):
        self.found: list[str] = []

    def check(self, url: str, status: int, body: str) -> None:
        if status >= 400 and API_PATHS.match(urlsplit(url).path):
            self.found += [f"{status} {url}: {x} in {body[:300]!r}" for x in internals(body)]

    def install(self, monkeypatch) -> None:
        def httpx_send(send):
            def checked(client, request, **kwargs):
                response = send(client, request, **kwargs)
                if response.status_code >= 400:
                    response.read()
                    self.check(str(request.url), response.status_code, response.text)
                return response
            return checked

        def httpx_send_async(send):
            async def checked(client, request, **kwargs):
                response = await send(client, request, **kwargs)
                if response.status_code >= 400:
                    await response.aread()
                    self.check(str(request.url), response.status_code, response.text)
                return response
            return checked

        def requests_send(send):
            def checked(adapter, request, **kwargs):
                response = send(adapter, request, **kwargs)
                if response.status_code >= 400:
                    self.check(request.url, response.status_code, response.text)
                return response
            return checked

        monkeypatch.setattr(httpx2.Client, "send", httpx_send(httpx2.Client.send))
        monkeypatch.setattr(httpx2.AsyncClient, "send", httpx_send_async(httpx2.AsyncClient.send))
        adapter = requests.adapters.HTTPAdapter
        monkeypatch.setattr(adapter, "send", requests_send(adapter.send))
