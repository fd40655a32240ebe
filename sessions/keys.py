"""Every Redis key wsinfer uses, in one place.

Per-session keys carry the session id as a hash tag (``{sid}``) so that, on a
Redis Cluster, all of a session's keys live in one slot and the Lua scripts in
``scripts.py`` may touch them together. Global keys (the work queue, engine
registry, per-process control and wake-up streams) have no session in them.

On a cluster the work queues share one hash tag (``{q}``), so that an engine
reads the shared queue and its own queue in one XREADGROUP: they live on one
node, which carries one entry per turn (not per token), little next to the
session streams spread over every node. A frontend's wake-up stream carries
its own id as tag, spreading frontends over the nodes.
"""

from __future__ import annotations

PREFIX = "wsinfer"

# The work queue every engine reads through one consumer group.
QUEUE_TAG = "{q}"
REQUESTS = f"{PREFIX}:{QUEUE_TAG}:requests"
ENGINE_GROUP = "engines"
REQUESTS_MAXLEN = 100_000
# Sorted set: engine id -> last heartbeat (unix seconds).
ENGINES = f"{PREFIX}:{QUEUE_TAG}:engines"


def meta(session: str) -> str:
    """Hash: owner token hash, status, turn, seq, engine, lease epoch, KV handle."""
    return f"{PREFIX}:{{{session}}}:meta"


def conversation(session: str) -> str:
    """List of msgpack {role, content} messages (chat sessions)."""
    return f"{PREFIX}:{{{session}}}:conv"


def turn_input(session: str, turn: int) -> str:
    """Hash: the turn's input (new messages or prompt text) and params."""
    return f"{PREFIX}:{{{session}}}:t:{turn}:in"


def turn_prompt(session: str, turn: int) -> str:
    """String: msgpack list of the turn's prompt token ids (the token log's prefix)."""
    return f"{PREFIX}:{{{session}}}:t:{turn}:prompt"


def turn_stream(session: str, turn: int) -> str:
    """Stream of the turn's events (delta/paused/done): the token log's tail."""
    return f"{PREFIX}:{{{session}}}:t:{turn}:events"


def engine_requests(engine_id: str) -> str:
    """Work routed to one engine because it holds the session's KV cache."""
    return f"{PREFIX}:{QUEUE_TAG}:engine:{engine_id}:requests"


def engine_metrics(engine_id: str) -> str:
    """String: the engine's metrics exposition, as its heartbeat last wrote it, for
    the frontends' ``/metrics`` (one scrape sees every engine). With the queue's
    hash tag, so that one MGET reads every engine's on a cluster too."""
    return f"{PREFIX}:{QUEUE_TAG}:engine:{engine_id}:metrics"


def frontend_wake(frontend_id: str) -> str:
    """Stream a frontend adds to so its own blocking fan-in XREAD returns early."""
    return f"{PREFIX}:{{{frontend_id}}}:frontend:wake"


def frontend_wake_cold(frontend_id: str) -> str:
    """Stream a frontend adds to so its fan-in's XREAD of quiet streams is re-issued."""
    return f"{PREFIX}:{{{frontend_id}}}:frontend:wake:cold"


def session_wake(session: str) -> str:
    """Sharded pub/sub channel: "this session's stream grew" (cluster fan-in wake-ups)."""
    return f"{PREFIX}:{{{session}}}:wake"


def idempotency(key_hash: str) -> str:
    """String: the session a new-session generate with this idempotency key made."""
    return f"{PREFIX}:{{{key_hash}}}:idem"


def session_of(key: str) -> str:
    """The session id in a per-session key (its hash tag)."""
    return key[key.index("{") + 1 : key.index("}")]


def session_keys(session: str, turns: int) -> list[str]:
    """Every key one session owns, for TTL refresh and deletion."""
    keys = [meta(session), conversation(session)]
    for turn in range(1, turns + 1):
        keys += [turn_input(session, turn), turn_prompt(session, turn), turn_stream(session, turn)]
    return keys
