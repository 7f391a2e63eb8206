"""A small asyncio client for bots, tests and benchmarks.

    async with await ChatClient.connect("ws://127.0.0.1:8765/ws") as client:
        session_id = (await client.open_session(system="You are a support agent.")).session_id
        turn = await client.chat(session_id, "My router blinks orange.")
        async for text in turn:
            print(text, end="")
        done = await turn.result()
    A reply that calls functions (a session opened with `tools=[...]`) ends with `done.tool_calls`; answer them
    with `client.send_tool_results(session_id, {call.id: result})`, a turn like any other.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from chatd.api.websocket.protocol import (
    AuthOk,
    ChatDelta,
    ChatDone,
    ErrorMessage,
    SessionClosed,
    SessionReady,
    parse_server_message,
)


class ChatError(Exception):
    """An `error` message from the server."""

    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


ServerEvent = ChatDelta | ChatDone | ErrorMessage | ChatError  # ChatError: the connection was lost


class TurnStream:
    """One turn's reply: iterate for text deltas, then await `result()` for the `chat.done`."""

    def __init__(self, turn_id: str):
        self.turn_id = turn_id
        self.deltas: list[str] = []
        self.last_seq = -1  # of the last delta received: what chat.resume continues after
        self._events: asyncio.Queue[ServerEvent] = asyncio.Queue()
        self._final: ServerEvent | None = None

    def __aiter__(self) -> TurnStream:
        return self

    async def __anext__(self) -> str:
        if self._final is not None:
            raise StopAsyncIteration
        event = await self._events.get()
        if isinstance(event, ChatDelta):
            self.deltas.append(event.delta.content)
            self.last_seq = event.seq
            return event.delta.content
        self._final = event
        raise StopAsyncIteration

    async def result(self) -> ChatDone:
        async for _ in self:
            pass
        return _checked(self._final)


class ChatClient:
    """The websocket protocol from the client's side, replies parsed into the protocol's models."""

    def __init__(self, websocket: ClientConnection):
        self._websocket = websocket
        self._turns: dict[str, TurnStream] = {}
        self._replies: asyncio.Queue[AuthOk | SessionReady | SessionClosed | ErrorMessage | ChatError] = \
            asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, **connect_kwargs: Any) -> ChatClient:
        """Connect; with `api_key`, authenticate with an Authorization: Bearer header."""
        if api_key is not None:
            connect_kwargs.setdefault("additional_headers", {})["Authorization"] = f"Bearer {api_key}"
        return cls(await connect(url, **connect_kwargs))

    async def authenticate(self, api_key: str) -> None:
        """Authenticate with an `auth` message (what a browser does)."""
        await self._send({"type": "auth", "token": api_key})
        await self._reply()

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._websocket.close()
        await self._reader

    async def open_session(self, system: str | None = None, session_id: str | None = None,
                           **tool_fields: Any) -> SessionReady:
        """Open a new session (or resume one by id); `tool_fields` are tools, tool_choice, parallel_tool_calls
        and response_format for every turn of a new session."""
        await self._send({"type": "session.open", "session_id": session_id, "system": system, **tool_fields})
        return await self._reply()

    async def close_session(self, session_id: str) -> None:
        await self._send({"type": "session.close", "session_id": session_id})
        await self._reply()

    async def chat(self, session_id: str, content: str, turn_id: str | None = None, tool_fields: dict | None = None,
                   **params: Any) -> TurnStream:
        """Send a message; `params` are max_new_tokens, temperature, top_p, seed and stop; `tool_fields`
        (tools, tool_choice, parallel_tool_calls, response_format) replace the session's for this turn."""
        return await self._request(session_id, {"content": content}, turn_id, tool_fields, params)

    async def send_tool_results(self, session_id: str, results: dict[str, str], turn_id: str | None = None,
                                tool_fields: dict | None = None, **params: Any) -> TurnStream:
        """Answer the calls of the session's last reply (call id -> what the function returned): the model
        goes on from them."""
        tool_results = [{"call_id": call_id, "content": content} for call_id, content in results.items()]
        return await self._request(session_id, {"tool_results": tool_results}, turn_id, tool_fields, params)

    async def _request(self, session_id: str, body: dict[str, Any], turn_id: str | None, tool_fields: dict | None,
                       params: dict[str, Any]) -> TurnStream:
        stream = TurnStream(turn_id or secrets.token_urlsafe(8))
        self._turns[stream.turn_id] = stream
        await self._send({"type": "chat.request", "session_id": session_id, "turn_id": stream.turn_id, **body,
                          **(tool_fields or {}), "params": params})
        return stream

    async def cancel(self, turn_id: str) -> None:
        await self._send({"type": "chat.cancel", "turn_id": turn_id})

    async def resume(self, turn_id: str, last_seq: int = -1) -> TurnStream:
        """After a reconnect: the deltas of a turn after `last_seq`, then the rest of its stream."""
        stream = TurnStream(turn_id)
        stream.last_seq = last_seq
        self._turns[turn_id] = stream
        await self._send({"type": "chat.resume", "turn_id": turn_id, "last_seq": last_seq})
        return stream

    async def _send(self, message: dict[str, Any]) -> None:
        await self._websocket.send(json.dumps(message))

    async def _reply(self):
        return _checked(await self._replies.get())

    async def _read(self) -> None:
        """Route each server message, parsed into its model, to the turn it belongs to or to the
        request/reply queue. When the connection is lost, whatever still waits gets a retryable
        `disconnected` error."""
        try:
            async for frame in self._websocket:
                message = parse_server_message(frame)
                stream = self._turns.get(getattr(message, "turn_id", None) or "")
                if stream is None:
                    self._replies.put_nowait(message)
                    continue
                stream._events.put_nowait(message)
                if isinstance(message, ChatDone | ErrorMessage):
                    del self._turns[stream.turn_id]
        except ConnectionClosed:
            pass
        lost = ChatError("disconnected", "the connection to the server was lost", retryable=True)
        for stream in self._turns.values():
            stream._events.put_nowait(lost)
        self._turns.clear()
        self._replies.put_nowait(lost)


def _checked(message):
    """The message, or the `ChatError` it stands for."""
    if isinstance(message, ChatError):
        raise message
    if isinstance(message, ErrorMessage):
        raise ChatError(message.code, message.message, message.retryable)
    return message
