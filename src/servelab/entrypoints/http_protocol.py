"""uvicorn's h11 protocol with a header read timeout. uvicorn bounds only the idle time between requests
(--timeout-keep-alive), and a byte of a new request cancels that timer, so a client that sends its
headers a byte at a time (slowloris) would hold a connection forever. Here the headers of each request
must be complete within --header-read-timeout of the connection opening or the previous response ending;
otherwise the connection is closed."""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def header_timeout_protocol(header_read_timeout: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), bound to the timeout (uvicorn builds it per connection)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_read_timeout, self._on_header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _on_header_timeout(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.info("closing a connection whose request headers did not arrive within %g s "
                            "(--header-read-timeout)", header_read_timeout)
                self.transport.close()

    return HeaderTimeoutProtocol
