"""HTTP for people and monitoring, the node's and the coordinator's (`--http HOST:PORT`): an aiohttp
app served on one address; an address that cannot be had is one line (`ConfigError`)."""

from __future__ import annotations

from aiohttp import web

from ..config import ConfigError
from ..preflight import parse_http


class HttpServer:
    def __init__(self, runner: web.AppRunner, site: web.TCPSite, address: str):
        self.runner, self.site, self.address = runner, site, address

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_http(app: web.Application, address: str) -> HttpServer:
    """Serve `app` on `address` (HOST:PORT; port 0: a free one, named in `HttpServer.address`)."""
    host, port = parse_http(address)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"--http {address}: cannot listen: {e.strerror}") from None
    bound = runner.addresses[0][1] if port == 0 else port  # the sockets' (host, port, ...) names
    return HttpServer(runner, site, f"{host}:{bound}")
