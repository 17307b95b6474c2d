"""2000 idle connections against the gateway's HTTP front (cap 1024): the connections past the cap
get a 503 at once and cost the gateway no handler, a request while it is full gets a 503 too, and
once the idle clients leave the front serves again at once. (The header-timeout sweep that closes
idle connections on its own is tested in tests/unit/test_openai_http.py.)"""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.reliability.conftest import record
from tests.unit.test_openai_http import http_stack

pytestmark = pytest.mark.anyio
IDLE = 2000
CAP = 1024
HEADER_TIMEOUT_S = 120.0  # no sweep during the test: the idle clients stay until they leave


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def _open(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        return await asyncio.open_connection(host, port)
    except OSError:
        return None


async def _first_bytes(reader: asyncio.StreamReader) -> bytes | None:
    """What the server wrote within 0.5 s (None: nothing yet, the connection is held open)."""
    try:
        return await asyncio.wait_for(reader.read(12), 0.5)
    except asyncio.TimeoutError:
        return None


async def test_idle_connections_past_the_cap_are_refused_and_swept():
    async with http_stack(http_max_connections=CAP, http_header_timeout_s=HEADER_TIMEOUT_S) as (_, client, base_url):
        host, port = base_url.split("//")[1].split("/")[0].split(":")
        t_open = time.monotonic()
        conns = []
        for _ in range(0, IDLE, 250):  # bursts of 250
            conns += [c for c in await asyncio.gather(*(_open(host, int(port)) for _ in range(250))) if c]
        opened_s = time.monotonic() - t_open
        firsts = await asyncio.gather(*(_first_bytes(reader) for reader, _ in conns))
        refused = sum(1 for b in firsts if b and b.startswith(b"HTTP/1.1 503"))
        held = sum(1 for b in firsts if b is None)
        with pytest.raises(openai.APIStatusError) as full:
            await client.models.list()
        for _, writer in conns:
            writer.close()
        t0 = time.monotonic()
        served_after = None
        while time.monotonic() - t0 < 5:
            try:
                await client.models.list()
                served_after = time.monotonic() - t0
                break
            except openai.APIStatusError:  # the server has not seen every close yet
                await asyncio.sleep(0.05)
    limit = 1.0
    ok = (
        refused >= IDLE - CAP - 250
        and held <= CAP + 250
        and refused + held == len(conns) == IDLE
        and full.value.status_code == 503
        and served_after is not None
        and served_after < limit
    )
    record(
        "http-idle-connections",
        f"{IDLE} idle HTTP connections against a cap of {CAP}",
        {
            "opened": len(conns),
            "opened_in_s": round(opened_s, 2),
            "refused_503": refused,
            "held": held,
            "request_while_full": full.value.status_code,
            "served_again_after_s": None if served_after is None else round(served_after, 3),
        },
        f"every connection opens; refused >= {IDLE - CAP - 250}, held <= {CAP + 250} (one burst over the "
        f"cap); a request while full gets 503; served again within {limit} s of the clients leaving",
        ok,
    )
    assert ok, (len(conns), refused, held, served_after)
