"""How an engine rides out a Redis outage: back off, keep its turns, catch up.

Generation state lives in the engine's memory and the token log in Redis.
While Redis is unreachable the engine does not step (its output could not be
published) and retries with backoff; a step whose publish failed is
published again first. The ``PUBLISH`` script is idempotent per claim (a
per-turn publish number), so a retry of a publish that did reach Redis before
the connection broke adds nothing twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
import structlog

from wsinfer.sessions.connect import Backoff, is_outage

log = structlog.get_logger("wsinfer.engine")


class OutageGuard:
    """Runs one engine iteration; turns Redis outages into backoff and recovery."""

    def __init__(self, engine_id: str, recover: Callable[[], None]) -> None:
        self.engine_id = engine_id
        self.recover = recover  # re-create what a Redis without persistence lost
        self.backoff = Backoff(max_s=2.0)

    def run(self, iteration: Callable[[], bool]) -> bool:
        """The iteration's result; True (go on) after an outage it rode out."""
        try:
            if self.backoff.down:
                self.recover()
            result = iteration()
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc) and not is_outage(exc):
                raise
            self._failed(exc)  # Redis came back empty: recover() makes the group again
            return True
        except (redis.RedisError, ConnectionError) as exc:
            if not is_outage(exc):
                raise
            self._failed(exc)
            return True
        lasted = self.backoff.reset()
        if lasted is not None:
            log.warning("redis reachable again", engine=self.engine_id, down_s=round(lasted, 1))
        return result

    def _failed(self, exc: BaseException) -> None:
        if not self.backoff.down:  # one line per outage, not one per retry
            log.warning("redis unavailable; retrying", engine=self.engine_id, error=str(exc))
        time.sleep(self.backoff.failed())
