"""A TCP proxy that delays every packet, for a Redis "far away" in tests and benchmarks: each chunk of bytes read from
either side is written to the other `delay_s` later, in order. It runs its own asyncio loop in a thread, so that
a test, a benchmark or a server in another process can all go through it."""

from __future__ import annotations

import asyncio
import threading
import time

from chatd.cli.server_process import free_port


class DelayProxy:
    """`127.0.0.1:port` forwards to `127.0.0.1:target_port`, each way `delay_s` late (a round trip: twice that)."""

    def __init__(self, target_port: int, delay_s: float):
        self.target_port, self.delay_s = target_port, delay_s
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def url(self, database: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{database}"

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the delaying proxy did not start")
        return self

    def __exit__(self, *_) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", self.port))
        self._started.set()
        self._loop.run_forever()
        self._server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read as it comes, deliver each chunk `delay_s` after it was read, in order."""
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await chunks.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        delivering = asyncio.create_task(deliver())
        try:
            while data := await reader.read(1 << 16):
                chunks.put_nowait((time.monotonic() + self.delay_s, data))
        except ConnectionError:
            pass
        finally:
            chunks.put_nowait((0.0, b""))
            await asyncio.gather(delivering, return_exceptions=True)
