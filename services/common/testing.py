"""Test helpers shared by the services' tests (never imported by a service)."""

from __future__ import annotations

import asyncio
import threading


class ServiceThread:
    """A service (`create_server(settings)` of a services/*/server.py) served on its own event loop
    thread, for synchronous tests: `service`, `address` (loopback), `close()`; a context manager."""

    def __init__(self, create_server, settings, name: str = "service") -> None:
        self.settings = settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()

        async def start():
            service = await create_server(settings)
            await service.start()
            return service

        self.service = asyncio.run_coroutine_threadsafe(start(), self._loop).result(60)
        self.address = f"127.0.0.1:{self.service.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.stop(0), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
