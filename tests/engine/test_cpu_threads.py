"""The engine's threads follow what other work leaves of the machine, and a turn's
tokens do not depend on them."""

from __future__ import annotations

import os
import time

import pytest
import torch

from wsinfer.clock import ManualClock
from wsinfer.engine.core import EngineConfig, EngineCore, EngineRequest
from wsinfer.engine.cpu_threads import LOOK_EVERY_S, CpuTimes, ThreadShare, read_cpu_times
from wsinfer.engine.model import LoadedModel
from wsinfer.sessions.schema import GenerationParams


class Machine:
    """CPU seconds as the test says they were spent: by others, and by the engine."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.times: CpuTimes | None = CpuTimes(0.0, 0.0)
        self.reads = 0

    def read(self, cores: frozenset[int]) -> CpuTimes | None:
        self.reads += 1
        return self.times

    def spend(self, others: float, own: float = 1.0, seconds: float = LOOK_EVERY_S) -> None:
        """``others`` and ``own`` cores busy for ``seconds``."""
        self.clock.advance(seconds)
        if self.times is not None:
            busy = self.times.busy + (others + own) * seconds
            self.times = CpuTimes(busy, self.times.own + own * seconds)


def share(cores: int, limit: int, machine: Machine, set_to: list[int]) -> ThreadShare:
    return ThreadShare(
        limit,
        cores=frozenset(range(cores)),
        read=machine.read,
        clock=machine.clock,
        set_threads=set_to.append,
    )


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back_past_a_band() -> None:
    machine, set_to = Machine(ManualClock()), []
    threads = share(2, 2, machine, set_to)
    machine.spend(others=0.5)  # the frontend and Redis of a few streams: kept
    assert threads.look() == 2
    machine.spend(others=0.7)  # a neighbour at work: one thread left
    assert threads.look() == 1
    machine.spend(others=0.5)  # in the band: no change either way
    assert threads.look() == 1
    machine.spend(others=0.3)
    assert threads.look() == 2
    assert set_to == [1, 2]  # set only when it changed


def test_it_looks_every_half_second_and_never_below_one_or_above_its_limit() -> None:
    machine, set_to = Machine(ManualClock()), []
    threads = share(16, 16, machine, set_to)
    reads = machine.reads
    machine.spend(others=3.2, seconds=LOOK_EVERY_S / 2)
    assert threads.look() == 16 and machine.reads == reads  # too soon: not read
    machine.spend(others=3.2, seconds=LOOK_EVERY_S / 2)
    assert threads.look() == 13
    machine.spend(others=20.0)  # more than the machine: one thread still works
    assert threads.look() == 1
    machine.spend(others=0.0)
    assert threads.look() == 16
    limited = share(16, 4, machine, [])
    machine.spend(others=0.0)
    assert limited.look() == 4  # what it was given, never more


def test_without_proc_figures_the_threads_stay_as_given() -> None:
    machine, set_to = Machine(ManualClock()), []
    machine.times = None
    threads = share(2, 2, machine, set_to)
    machine.spend(others=2.0)
    assert threads.look() == 2 and set_to == []


def test_cpu_times_are_read_from_proc() -> None:
    if not os.path.exists("/proc/stat"):
        pytest.skip("needs /proc")
    cores = frozenset(os.sched_getaffinity(0))
    before = read_cpu_times(cores)
    until = time.process_time() + 0.1
    while time.process_time() < until:
        pass
    after = read_cpu_times(cores)
    assert before is not None and after is not None
    assert after.own - before.own >= 0.05
    assert after.busy - before.busy >= after.own - before.own - 0.02  # ours is in everyone's


def _tokens_and_logprobs(core: EngineCore, switch: list[int] | None) -> list[tuple[int, float]]:
    params = GenerationParams(max_new_tokens=24, temperature=0.8, seed=7, logprobs=True)
    ids = list(range(5, 40))
    core.add(EngineRequest(request_id="r", prompt_ids=ids, params=params))
    got, step = [], 0
    while core.has_unfinished():
        if switch is not None:
            torch.set_num_threads(switch[step % len(switch)])
        step += 1
        for out in core.step():
            assert out.logprobs is not None
            got += [(t, lp.logprob) for t, lp in zip(out.new_token_ids, out.logprobs, strict=True)]
    return got


def _same_whatever_threads(loaded: LoadedModel) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fixed = _tokens_and_logprobs(EngineCore(loaded, EngineConfig()), None)
        changing = _tokens_and_logprobs(EngineCore(loaded, EngineConfig()), [1, 2, 2, 1, 1])
    finally:
        torch.set_num_threads(before)
    assert len(fixed) == 24
    assert changing == fixed


def test_a_turn_is_the_same_whatever_threads_each_step_runs_on(tiny: LoadedModel) -> None:
    """Down to the logprobs: the threads may change at any step of a turn."""
    _same_whatever_threads(tiny)


def test_the_quantized_kernels_too(smol: LoadedModel) -> None:
    """The default model's Q4_1 kernels, as ``wsinfer serve`` runs them on a CPU."""
    _same_whatever_threads(smol)
