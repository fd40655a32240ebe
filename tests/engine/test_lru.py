"""The retained-KV LRU every core uses (engine/lru.py): order, budget, and
what is released when, without a model; then the eager core's store on it."""

from __future__ import annotations

from tests.engine.conftest import run_all, tokens_of
from tests.engine.test_core import GREEDY, reference_greedy, request
from wsinfer.engine.core import EngineConfig
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.lru import RetainedLRU
from wsinfer.engine.model import LoadedModel


def _lru(budget: int) -> tuple[RetainedLRU[list[int]], list[list[int]]]:
    released: list[list[int]] = []
    return RetainedLRU(budget, len, released.append), released


def test_over_budget_the_least_recently_put_goes_first_and_is_released() -> None:
    lru, released = _lru(5)
    assert lru.put("a", [1, 2]) and lru.put("b", [3, 4])
    assert lru.put("c", [5, 6])  # 6 bytes > 5: "a" goes
    assert released == [[1, 2]] and "a" not in lru and len(lru) == 2
    assert lru.used_bytes == 4 and list(lru.values()) == [[3, 4], [5, 6]]


def test_putting_a_key_again_replaces_and_releases_its_entry_and_makes_it_newest() -> None:
    lru, released = _lru(6)
    lru.put("a", [1, 2])
    lru.put("b", [3, 4])
    lru.put("a", [7])
    assert released == [[1, 2]] and list(lru.values()) == [[3, 4], [7]]
    assert lru.used_bytes == 3


def test_an_entry_larger_than_the_budget_is_refused_and_evicts_nothing() -> None:
    lru, released = _lru(3)
    lru.put("a", [1, 2])
    assert not lru.put("b", [1, 2, 3, 4])
    assert "b" not in lru and lru.get("a") == [1, 2] and released == []
    assert not lru.put("a", [1, 2, 3, 4])  # the old entry under the key is let go
    assert "a" not in lru and released == [[1, 2]] and lru.used_bytes == 0


def test_take_hands_the_entry_over_unreleased_and_drop_releases_it() -> None:
    lru, released = _lru(10)
    lru.put("a", [1, 2])
    lru.put("b", [3])
    assert lru.take("a") == [1, 2] and lru.take("a") is None
    lru.drop("b")
    lru.drop("missing")
    assert released == [[3]] and len(lru) == 0 and lru.used_bytes == 0


def test_evict_oldest_until_there_is_nothing_left() -> None:
    lru, released = _lru(10)
    lru.put("a", [1])
    lru.put("b", [2])
    lru.get("a")  # a look-up does not make it more recent
    assert lru.evict_oldest() and released == [[1]]
    assert lru.evict_oldest() and released == [[1], [2]]
    assert not lru.evict_oldest()


def test_a_size_counted_at_put_is_the_size_given_back() -> None:
    entry = [1, 2, 3]
    lru: RetainedLRU[list[int]] = RetainedLRU(10, len)
    lru.put("a", entry)
    entry.append(4)  # the entry changed while held: the budget still balances
    lru.take("a")
    assert lru.used_bytes == 0


def test_the_eager_core_keeps_a_sessions_kv_and_evicts_the_oldest_over_budget(
    tiny: LoadedModel,
) -> None:
    core = EagerEngineCore(tiny)
    core.add(request("a", [5] * 40, GREEDY, cache_key="a"))
    first = tokens_of(run_all(core)["a"])
    assert core.cached_length("a") == 40 + len(first) - 1  # the last draw has no KV yet
    follow = [5] * 40 + first + [7, 8]
    core.add(request("a2", follow, GREEDY, cache_key="a"))
    out = run_all(core)["a2"]
    assert out[-1].usage is not None and out[-1].usage.cached_tokens > 40
    assert tokens_of(out) == reference_greedy(tiny, follow, 12)
    size = core.store.used_bytes
    small = EagerEngineCore(tiny, EngineConfig(kv_cache_bytes=int(size * 1.5)))
    for key in ("x", "y"):
        small.add(request(key, [5] * 40, GREEDY, cache_key=key))
        run_all(small)
    assert small.cached_length("x") == 0 and small.cached_length("y") > 0
    assert len(small.store) == 1 and small.store.used_bytes <= small.store.budget_bytes
