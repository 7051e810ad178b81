"""HTTP into a sandbox port through the API's proxy (sb.get_host,
sb.http_client). Skips while the server has no port proxy."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import shoal

from .conftest import STRICT


@pytest.fixture
def web(sb):
    """A sandbox serving /www (busybox httpd) on port 8080."""
    with sb.http_client(8080) as c:
        r = c.get("/")
        if r.status_code == 404 and not r.headers.get("content-type", "").startswith("application/json") and not STRICT:
            pytest.skip(f"server has no port proxy yet: GET {sb.get_url(8080)} -> 404 {r.text.strip()!r}")
    sb.commands.run("httpd -f -p 127.0.0.1:8080 -h /www", background=True, timeout=0)
    deadline = time.monotonic() + 10
    with sb.http_client(8080) as c:
        while c.get("/index.html").status_code != 200:
            assert time.monotonic() < deadline, "httpd did not come up"
            time.sleep(0.05)
    return sb


def test_http_client_bound_to_a_port(web) -> None:
    with web.http_client(8080) as c:
        r = c.get("/index.html")
        assert r.status_code == 200 and r.text == "hello from the sandbox\n"
        assert c.get("/missing").status_code == 404


def test_get_host_is_e2b_style(server, web) -> None:
    url = f"http://{web.get_host(8080)}/index.html"
    r = httpx.get(url, headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 200 and r.text == "hello from the sandbox\n"
    assert httpx.get(url).status_code == 401  # the proxy needs the API key


def test_app_gets_its_own_authorization(web) -> None:
    # http_client sends the API key as X-API-Key: an Authorization header
    # of the caller's reaches the app (a raw listener records the request
    # and answers nothing: the client gives up; its input stays open, or
    # nc would close the connection at once).
    web.commands.run("sleep 30 | nc -l -p 8081 > /tmp/req", background=True, timeout=0)
    deadline = time.monotonic() + 10
    while "8081" not in web.commands.run("netstat -ltn", check=False).stdout:
        assert time.monotonic() < deadline, "nc did not listen"
        time.sleep(0.05)
    with web.http_client(8081, headers={"Authorization": "Bearer app-token"}, timeout=2) as c:
        try:
            answer = repr(c.get("/x").text)
        except httpx.HTTPError as e:
            answer = repr(e)
    deadline = time.monotonic() + 10
    while "\r\n\r\n" not in (req := web.files.read("/tmp/req")):
        assert time.monotonic() < deadline, (req, answer)
        time.sleep(0.05)
    head = req.split("\r\n\r\n")[0].lower()
    assert "authorization: bearer app-token" in head and "x-api-key" not in head, head


def test_nothing_listening(web) -> None:
    with web.http_client(9) as c:
        r = c.get("/")
    assert r.status_code == 502 and "9" in r.json()["message"]


def test_async_http_client(server, web) -> None:
    async def main() -> None:
        sb = await shoal.AsyncSandbox.connect(web.sandbox_id)
        async with sb.http_client(8080) as c:
            rs = await asyncio.gather(*[c.get("/index.html") for _ in range(8)])
        assert all(r.status_code == 200 for r in rs)
        await shoal.aclose()

    asyncio.run(main())
