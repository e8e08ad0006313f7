"""A client of the policy server for robot code and tests (openpi-client's protocol).

    client = PolicyClient("127.0.0.1", 8000, api_key=None)
    client.metadata                      # what the server expects and returns
    reply = client.infer(observation)    # {"actions": [H, A], "server_timing": {...}}

``infer`` raises ``ServerError`` with the server's message when the request was refused (the
connection stays usable). The same server also answers ``openpi_client.WebsocketClientPolicy``.
"""

from __future__ import annotations

import time
from typing import Any

import websockets
from websockets.sync.client import connect

from embodied_jax.errors import InputError
from embodied_jax.serve import wire


class ServerError(InputError, RuntimeError):
    """The server refused a request; the message names the field and what it expected."""


class PolicyClient:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None, connect_timeout: float = 60.0
    ):
        self.uri = host if host.startswith("ws") else f"ws://{host}:{port}"
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self._connection = connect(self.uri, compression=None, max_size=None, additional_headers=headers)
                break
            except (ConnectionRefusedError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.metadata = wire.unpackb(self._connection.recv())

    def infer(self, observation: dict[str, Any]) -> dict[str, Any]:
        self._connection.send(wire.packb(observation))
        reply = self._connection.recv()
        if isinstance(reply, str):
            raise ServerError(reply.removeprefix("error: "))
        return wire.unpackb(reply)

    def send_raw(self, data: bytes | str) -> bytes | str:
        """Send a message as is and return the reply frame (tests of malformed input)."""
        self._connection.send(data)
        return self._connection.recv()

    def close(self) -> None:
        try:
            self._connection.close()
        except websockets.ConnectionClosed:
            pass

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
