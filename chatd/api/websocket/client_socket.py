"""The gateway's view of one websocket client, over the ASGI websocket that uvicorn hands FastAPI.

The gateway reads frames, sends JSON text and closes with a code; it never sees the server library.
A client that has gone away ends the iteration, and a send to it raises `ClientGone`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState


class ClientGone(Exception):
    """The client closed the connection or it broke."""


class ClientSocket:
    """A websocket client as the gateway uses it: headers, address, frames in, text out, close."""

    def __init__(self, websocket: WebSocket):
        self._websocket = websocket

    @property
    def headers(self) -> Mapping[str, str]:
        return self._websocket.headers

    @property
    def remote_address(self) -> tuple[str, int]:
        client = self._websocket.client
        return (client.host, client.port) if client else ("unknown", 0)

    async def __aiter__(self) -> AsyncIterator[str | bytes]:
        while True:
            try:
                message = await self._websocket.receive()
            except (WebSocketDisconnect, RuntimeError, OSError):  # RuntimeError: received after the close
                return
            if message["type"] == "websocket.disconnect":
                return
            yield message["text"] if message.get("text") is not None else message.get("bytes") or b""

    async def send(self, text: str) -> None:
        try:
            await self._websocket.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as error:  # RuntimeError: sent after the close
            raise ClientGone(str(error)) from error

    async def close(self, code: int, reason: str) -> None:
        if self._websocket.application_state != WebSocketState.DISCONNECTED:
            try:
                await self._websocket.close(code, reason)
            except (WebSocketDisconnect, RuntimeError, OSError):
                pass  # already closed by the client
