"""Remote image URLs in OpenAI chat messages (services/gateway/image_urls.py): fetched from
allowed hosts within the size and time limits, never through a redirect, never from a private
address unless allowed, and every refusal a 400 naming the URL's field."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest
from aiohttp import web

from services.gateway.image_urls import _public, host_allowed
from tests.unit.test_openai_http import http_stack, png_data_url, user_message

pytestmark = pytest.mark.anyio
PARAM = "messages[0].content[1].image_url.url"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@contextlib.asynccontextmanager
async def image_server():
    """A loopback HTTP server: /cat.png, a redirect to it, a body past 20 kB, a slow answer, a 404."""
    _, png = png_data_url()

    async def cat(request):
        return web.Response(body=png, content_type="image/png")

    async def redirect(request):
        raise web.HTTPFound("/cat.png")

    async def huge(request):
        resp = web.StreamResponse()  # chunked: no Content-Length to refuse up front
        await resp.prepare(request)
        for _ in range(40):
            await resp.write(b"\0" * 1024)
        return resp

    async def slow(request):
        await asyncio.sleep(5)
        return web.Response(body=png, content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", cat)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/huge", huge)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", png
    finally:
        await runner.cleanup()


async def refused(client, url: str) -> dict:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="valora-base", messages=user_message(url))
    assert bad.value.body["param"] == PARAM
    return bad.value.body


async def test_allowed_hosts_are_fetched_within_the_limits():
    async with (
        image_server() as (base, png),
        http_stack(
            image_url_hosts=["127.0.0.1"],
            image_url_allow_http=True,
            image_url_allow_private=True,
            image_url_timeout_s=1.0,
            max_image_bytes=20000,
        ) as (worker, client, _),
    ):
        resp = await client.chat.completions.create(model="valora-base", messages=user_message(f"{base}/cat.png"))
        assert resp.choices[0].message.content == "two cars"
        assert worker.items[0].images[0].data == png and worker.items[0].images[0].mime_type == "image/png"
        assert (await refused(client, f"{base}/redirect"))["code"] == "image_url_fetch_failed"
        assert (await refused(client, f"{base}/huge"))["code"] == "image_url_too_large"
        assert (await refused(client, f"{base}/slow"))["code"] == "image_url_fetch_failed"
        assert (await refused(client, f"{base}/missing"))["code"] == "image_url_fetch_failed"
        port = base.rsplit(":", 1)[1]
        assert (await refused(client, f"http://localhost:{port}/cat.png"))["code"] == "image_url_refused"
        assert (await refused(client, f"http://user:pw@127.0.0.1:{port}/cat.png"))["code"] == "image_url_refused"
        assert len(worker.items) == 1  # nothing refused reached a worker


async def test_private_addresses_and_plain_http_are_refused_by_default():
    async with (
        image_server() as (base, _),
        http_stack(image_url_hosts=["127.0.0.1", "localhost"], image_url_allow_http=True) as (worker, client, _),
    ):
        body = await refused(client, f"{base}/cat.png")  # 127.0.0.1: loopback
        assert body["code"] == "image_url_refused" and "private or local" in body["message"]
        port = base.rsplit(":", 1)[1]
        body = await refused(client, f"http://localhost:{port}/cat.png")  # a name the lookup finds local
        assert body["code"] == "image_url_refused" and "resolves to a private or local" in body["message"]
    async with http_stack(image_url_hosts=["127.0.0.1"]) as (worker, client, _):
        body = await refused(client, "http://127.0.0.1:1/cat.png")  # https only
        assert body["code"] == "image_url_refused" and "https://" in body["message"]
        assert not worker.items


def test_host_patterns_and_public_addresses():
    assert host_allowed("img.example.com", ["*.example.com"]) and host_allowed("Example.COM.", ["example.com"])
    assert not host_allowed("example.com", ["*.example.com"]) and not host_allowed("badexample.com", ["example.com"])
    assert not host_allowed("evil.com", [])
    assert _public("93.184.216.34") and _public("2606:2800:220:1::")
    for private in (
        "10.1.2.3",
        "127.0.0.1",
        "169.254.169.254",
        "192.168.0.1",
        "::1",
        "fe80::1%eth0",
        "::ffff:10.0.0.1",
        "0.0.0.0",
        "224.0.0.1",
    ):
        assert not _public(private), private


def test_the_examples_readme_names_every_image_url_error_code():
    """examples/README.md tells HTTP clients which `code` a refused image URL gets: the codes it
    names (backticked, less the gateway's image_url_* settings) are exactly the ones the gateway
    answers with (services/gateway/image_urls.py, http_openai.py)."""
    import re
    from pathlib import Path

    from services.gateway.config import GatewaySettings

    repo = Path(__file__).resolve().parents[2]
    code = r"(?:unsupported_image_url|image_url_\w+)"
    source = "".join((repo / "services/gateway" / f).read_text() for f in ("image_urls.py", "http_openai.py"))
    raised = set(re.findall(rf'"({code})"', source))
    readme = (repo / "examples/README.md").read_text()
    named = {t for t in re.findall(rf"`({code})`", readme) if t not in GatewaySettings.model_fields}
    assert len(raised) >= 4 and named == raised, (named, raised)
