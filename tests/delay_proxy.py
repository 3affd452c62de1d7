"""A TCP forwarder that delays what a host sends: ``tc netem delay`` without netem.

``python -m tests.delay_proxy LISTEN TARGET PORT...`` listens on ``LISTEN:PORT`` for each port
and forwards every connection to ``TARGET:PORT``. ``SIGUSR1`` delays each byte sent towards the
target by :data:`DELAY_S` from then on, ``SIGUSR2`` stops delaying. Order is kept and
throughput is not limited, as netem's delay on the host's outgoing interface would do: every
request reaches the server 200 ms late. This machine's kernel has no ``sch_netem`` (see
:mod:`tests.netns`), so the partition test puts this on the path of a host it delays.
"""

import asyncio
import functools
import signal
import sys

DELAY_S = 0.2
READY = "delay proxy listening"


class Proxy:
    def __init__(self, target: str) -> None:
        self.target = target
        self.delay_s = 0.0

    async def serve(self, listen: str, ports: list[int]) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self._set, DELAY_S)
        loop.add_signal_handler(signal.SIGUSR2, self._set, 0.0)
        for port in ports:
            await asyncio.start_server(functools.partial(self._forward, port=port), listen, port)
        print(READY, flush=True)
        await asyncio.Event().wait()

    def _set(self, delay_s: float) -> None:
        self.delay_s = delay_s
        print(f"delay {delay_s * 1000:.0f} ms", flush=True)

    async def _forward(
        self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter, port: int
    ) -> None:
        try:
            server, to_server = await asyncio.open_connection(self.target, port)
        except OSError:
            to_client.close()
            return
        await asyncio.gather(
            self._pipe(client, to_server, delayed=True),
            self._pipe(server, to_client, delayed=False),
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            # Each chunk leaves at its arrival plus the delay of that moment, in order.
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((loop.time() + (self.delay_s if delayed else 0.0), chunk))
            queue.put_nowait((0.0, b""))
            await sender
        except OSError:
            sender.cancel()
        finally:
            writer.close()


def main() -> None:
    listen, target, *ports = sys.argv[1:]
    asyncio.run(Proxy(target).serve(listen, [int(port) for port in ports]))


if __name__ == "__main__":
    main()
