"""The scenarios added for the comparison with llama-server, on Stopline's servers ("ours" and "baseline").

``disconnect_busy``: a second client streams without pause while the measured
client's connection is dropped mid-generation; the time is from the drop until
``/metrics`` shows only the other client's generation still active. It is the
case in which llama-server's request handler never notices that its client left
(see ``bench/llama_server.py``).
"""

from __future__ import annotations

import time

from .client import Call, Session
from .llama_server import DISCONNECT_BUSY, NONSTREAM
from .scenarios import LONG_GENERATION, Bench, share
from .servers import Target


class TrafficBench(Bench):
    """:class:`Bench` plus the disconnect-under-traffic scenario."""

    def supports(self, scenario: str) -> bool:
        return scenario != NONSTREAM  # Stopline's protocol streams every request

    async def run(self, scenario: str, target: Target, part: int = 0, parts: int = 1) -> None:
        if scenario != DISCONNECT_BUSY:
            if self.supports(scenario):
                await super().run(scenario, target, part, parts)
            return
        wanted = share(self.plan.requests, part, parts)
        if target.slots < 2 or wanted <= 0:
            return
        start, run = await self._open_run(scenario, target)
        await self._wait_idle(target)
        streamer = await Session.open(target.ws_url)
        background: Call | None = None
        started = time.monotonic()
        try:
            while self._more(run, wanted, started):
                if background is None or background.ended:
                    if background is not None:
                        streamer.forget(background)
                    background = await streamer.generate(
                        "background", **self._generate_fields(self.plan.short_tokens, LONG_GENERATION)
                    )
                    await background.wait_tokens(1)
                records = await self._disconnect_sample(target, None, DISCONNECT_BUSY, others=1)
                # Only samples during which the other client was streaming the whole time count.
                self._keep(scenario, run, records if not background.ended else [])
        finally:
            await self._end_sampling(target, run)
            if background is not None and not background.ended:
                await streamer.cancel(background)
                await background.wait_end()
            await streamer.close()
        target.windows.append((scenario, start, time.monotonic_ns()))
        self.runs.append(run)
