"""Automatic prefix caching: KV blocks shared between prompts that start alike.

First the allocator against a model of the pool (thousands of random schedules of
prompts, continuations from mid-block, preemption-like releases and pressure):
a shared block is never written, a match only ever returns blocks that hold the
prompt's tokens, reference counts equal holders. Then the engine: later
sessions reuse earlier prompts' blocks, concurrent newcomers prefill a shared
system prompt once, a continued turn copies a block others share before writing
into it, and the tokens are the reference's (float for float on the quantized
CPU path, whose attention is batch-invariant).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.engine.conftest import run_all, tokens_of
from tests.engine.test_attention_cpu import SEEDED, quantized_tiny  # noqa: F401 (fixture)
from tests.engine.test_core import GREEDY, reference_greedy, request
from wsinfer.engine.blocks import ROOT, BlockAllocator
from wsinfer.engine.core import EngineConfig, EngineCore
from wsinfer.engine.model import LoadedModel

# --- the allocator, model-based ------------------------------------------------------------

SIZE = 4  # tokens per block: small, so that prompts over a 3-token alphabet share often


class PoolModel:
    """What the pool should look like: each block's written tokens and who holds it."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.a = allocator
        self.content: dict[int, list[int]] = {}
        self.holders: dict[int, list[int]] = {}  # holder -> its blocks, in order
        self.tokens: dict[int, list[int]] = {}  # holder -> tokens whose KV it has
        self.chains: dict[int, list[int]] = {}
        self.next_holder = 0

    def write(self, holder: int, position: int, token: int) -> None:
        block = self.holders[holder][position // SIZE]
        # The property the whole cache rests on: nobody else reads a block being written.
        assert self.a.refs(block) == 1, f"block {block} written while shared"
        assert block not in self.a._key_of, f"block {block} written while findable"
        slot = self.content.setdefault(block, [])
        del slot[position % SIZE :]
        slot.append(token)

    def start(self, tokens: list[int]) -> None:
        a = self.a
        nodes, shared = a.match(tokens, a.limit_for(len(tokens)))
        for i, block in enumerate(shared):
            assert self.content[block] == tokens[i * SIZE : (i + 1) * SIZE], "matched wrong KV"
        a.share(shared)
        fresh = a.allocate(-(-len(tokens) // SIZE) - len(shared))
        if fresh is None:
            a.release(shared)
            return
        holder = self.next_holder
        self.next_holder += 1
        self.holders[holder], self.tokens[holder], self.chains[holder] = shared + fresh, [], nodes
        self.tokens[holder] = tokens[: len(shared) * SIZE]
        self.extend(holder, tokens[len(shared) * SIZE :])

    def extend(self, holder: int, more: list[int]) -> None:
        """Compute ``more`` tokens (prefill or decode), then register full blocks."""
        tokens, blocks = self.tokens[holder], self.holders[holder]
        need = -(-(len(tokens) + len(more)) // SIZE) - len(blocks)
        if need > 0:
            got = self.a.allocate(need)
            if got is None:
                return
            blocks += got
        for token in more:
            self.write(holder, len(tokens), token)
            tokens.append(token)
        chain = self.chains[holder]
        for i in range(len(chain), len(tokens) // SIZE):
            parent = chain[-1] if chain else ROOT
            chain.append(self.a.register(parent, tokens[i * SIZE : (i + 1) * SIZE], blocks[i]))

    def continue_from(self, holder: int, cut: int, more: list[int]) -> None:
        """A retained turn continued from token ``cut`` (the engine's mid-block case)."""
        tokens, blocks = self.tokens[holder], self.holders[holder]
        cut = min(cut, len(tokens))
        keep = -(-cut // SIZE)
        self.a.release(blocks[keep:])
        del blocks[keep:], tokens[cut:]
        del self.chains[holder][cut // SIZE :]
        if cut % SIZE:
            block = blocks[-1]
            if not self.a.writable(block):
                fresh = self.a.allocate(1)
                if fresh is None:
                    self.a.release(blocks[-1:])
                    del blocks[-1:], tokens[(keep - 1) * SIZE :]
                else:
                    self.content[fresh[0]] = list(self.content[block][: cut % SIZE])
                    self.a.release([block])
                    blocks[-1] = fresh[0]
        self.extend(holder, more)

    def finish(self, holder: int) -> None:
        self.a.release(self.holders.pop(holder))
        del self.tokens[holder], self.chains[holder]

    def check(self) -> None:
        a = self.a
        held: dict[int, int] = {}
        for blocks in self.holders.values():
            assert len(set(blocks)) == len(blocks)
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        free, idle = set(a._free), set(a._idle)
        assert len(free) == len(a._free) and not free & idle
        for b in range(1, a.num_blocks):
            assert a.refs(b) == held.get(b, 0), f"block {b}: refs {a.refs(b)}"
            assert (b in free) + (b in idle) + (b in held) == 1, f"block {b} lost or doubled"
            if b in free:
                assert b not in a._key_of
            if b in idle:
                assert b in a._key_of
        for b, (_, tokens) in a._key_of.items():
            assert self.content[b] == list(tokens), f"block {b} registered under other tokens"
        assert a.max_idle is None or len(idle) <= a.max_idle
        assert 0 not in held and 0 not in free and 0 not in idle  # the scratch block


def random_schedule(seed: int) -> None:
    rng = random.Random(seed)
    allocator = BlockAllocator(rng.randint(4, 24), SIZE, 1, rng.choice([None, 0, 3]))
    model = PoolModel(allocator)
    bases = [[rng.randint(0, 2) for _ in range(20)] for _ in range(3)]

    def prompt() -> list[int]:
        base = rng.choice(bases)[: rng.randint(1, 20)]
        return base + [rng.randint(0, 2) for _ in range(rng.randint(0, 6))]

    for _ in range(60):
        op = rng.random()
        holders = list(model.holders)
        if op < 0.35 or not holders:
            model.start(prompt())
        elif op < 0.55:
            model.extend(rng.choice(holders), [rng.randint(0, 2) for _ in range(rng.randint(1, 5))])
        elif op < 0.7:
            holder = rng.choice(holders)
            cut = rng.randint(0, len(model.tokens[holder]))
            model.continue_from(holder, cut, [rng.randint(0, 2) for _ in range(rng.randint(1, 4))])
        else:
            model.finish(rng.choice(holders))
        model.check()
    for holder in list(model.holders):
        model.finish(holder)
    model.check()
    assert allocator.free_blocks == allocator.num_blocks - 1


@pytest.mark.parametrize("seeds", [range(k, 3000, 10) for k in range(10)], ids=str)
def test_the_allocator_never_shares_a_block_being_written_nor_matches_other_tokens(
    seeds: range,
) -> None:
    for seed in seeds:
        random_schedule(seed)


def test_a_match_follows_the_chain_not_the_block_alone() -> None:
    a = BlockAllocator(10, SIZE)
    blocks = a.allocate(3)
    assert blocks is not None
    node = ROOT
    tokens = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1]
    for i, b in enumerate(blocks):
        node = a.register(node, tokens[i * SIZE : (i + 1) * SIZE], b)
    assert a.match(tokens + [5], 9)[1] == blocks
    assert a.match(tokens, a.limit_for(len(tokens)))[1] == blocks[:2]  # one token computed
    assert a.match([1, 1, 1, 1, 1, 1, 1, 1], 9)[1] == blocks[:1]  # same block, other parent
    assert a.match([1, 1, 1, 2, 2, 2, 2, 2], 9)[1] == []
    a.release(blocks)
    assert a.free_blocks == 9 and a.cached_blocks == 3  # idle, still findable
    assert a.match(tokens + [5], 9)[1] == blocks
    taken = a.allocate(8)  # the 6 never-used blocks first, then the least recently idle
    assert taken is not None and set(taken) >= {blocks[1], blocks[2]}
    assert a.match(tokens + [5], 9)[1] == blocks[:1]


def test_misuse_is_refused() -> None:
    a = BlockAllocator(4, SIZE)
    [b] = a.allocate(1) or []
    with pytest.raises(ValueError, match="full block"):
        a.register(ROOT, [1, 2], b)
    a.release([b])
    with pytest.raises(RuntimeError, match="nobody holds"):
        a.register(ROOT, [1, 2, 3, 4], b)
    with pytest.raises(RuntimeError, match="released more often"):
        a.release([b])


# --- the engine ----------------------------------------------------------------------------

SYSTEM = [(7 * i) % 251 + 3 for i in range(200)]  # a long shared beginning


def greedy(n: int) -> object:
    return dataclasses.replace(GREEDY, max_new_tokens=n)


def test_a_later_session_starts_from_an_earlier_ones_blocks(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(prefill_chunk_tokens=64))
    first = SYSTEM + [11, 12, 13]
    core.add(request("a", first, greedy(8), cache_key="one"))
    outs = run_all(core)["a"]
    answer = tokens_of(outs)
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 0
    before = core.prefill_tokens
    second = SYSTEM + [21, 22]  # another session, another question
    core.add(request("b", second, greedy(8), cache_key="two"))
    outs = run_all(core)["b"]
    shared = len(SYSTEM) // 16 * 16
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == shared
    assert core.prefill_tokens - before == len(second) - shared
    assert tokens_of(outs) == reference_greedy(tiny, second, 8)
    # The whole conversation resent without a session (any OpenAI client): a hit too.
    third = first + answer + [31]
    core.add(request("c", third, greedy(4)))
    outs = run_all(core)["c"]
    assert (
        outs[-1].usage is not None and outs[-1].usage.cached_tokens == (len(third) - 1) // 16 * 16
    )
    assert tokens_of(outs) == reference_greedy(tiny, third, 4)
    # A prompt of whole cached blocks: its last block is computed again (its last
    # token's logits pick the first new token), into a block of its own.
    aligned = SYSTEM[:192]
    core.add(request("d", aligned, greedy(4)))
    outs = run_all(core)["d"]
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 176
    assert tokens_of(outs) == reference_greedy(tiny, aligned, 4)
    hits = shared + (len(third) - 1) // 16 * 16 + 176
    assert core.prefix_cache_hits == hits
    assert core.prefix_cache_queries == len(first) + len(second) + len(third) + len(aligned)


def test_newcomers_sharing_a_system_prompt_prefill_it_once(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(max_batch_size=8, prefill_chunk_tokens=64))
    prompts = [SYSTEM + [40 + i, 41 + i, 42 + i] for i in range(8)]
    for i, ids in enumerate(prompts):
        core.add(request(f"r{i}", ids, greedy(6), cache_key=f"s{i}"))
    outputs = run_all(core)
    shared = len(SYSTEM) // 16 * 16
    assert core.prefill_tokens == len(prompts[0]) + 7 * (len(prompts[0]) - shared)
    for i, ids in enumerate(prompts):
        usage = outputs[f"r{i}"][-1].usage
        assert usage is not None and usage.cached_tokens == (0 if i == 0 else shared)
        assert tokens_of(outputs[f"r{i}"]) == reference_greedy(tiny, ids, 6), f"r{i}"


def test_without_prefix_caching_only_a_sessions_own_cache_counts(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(prefix_caching=False))
    for rid in ("a", "b"):
        core.add(request(rid, SYSTEM + [5], greedy(3), cache_key=rid))
        outs = run_all(core)[rid]
        assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 0
    assert core.pool.cached_blocks == 0


def test_a_turn_continued_inside_a_shared_block_writes_into_a_copy(tiny: LoadedModel) -> None:
    """Session ``a`` regenerates from inside a block that ``b``, running, shares: ``a``
    must write into a copy, and ``b``'s KV (and tokens) stay the reference's."""
    core = EngineCore(tiny, EngineConfig(prefill_chunk_tokens=512))
    core.add(request("a1", SYSTEM, greedy(10), cache_key="a"))
    answer = tokens_of(run_all(core)["a1"])
    kept = core.store.lru.get("a")
    assert kept is not None
    held = kept.blocks
    conversation = SYSTEM + answer  # 210 tokens: blocks 0-12 full and registered
    core.add(request("b", conversation + [77] * 20, greedy(30), cache_key="b"))
    first = core.step()  # b admitted, sharing a's 13 full blocks
    block = held[12]  # tokens 192-207: SYSTEM's tail and the answer's first 8 tokens
    assert core._seqs["b"].blocks[12] == block and core.pool.blocks.refs(block) == 2
    kv = core.pool.k[:, block].clone()
    regenerate = SYSTEM + answer[:3] + [99]  # a new reply after the answer's 3rd token
    core.add(request("a2", regenerate, greedy(10), cache_key="a"))
    outputs = run_all(core)
    assert core._seqs == {}
    assert torch.equal(core.pool.k[:, block], kv), "a shared block was written"
    assert tokens_of(outputs["a2"]) == reference_greedy(tiny, regenerate, 10)
    b = tokens_of(first + outputs["b"])
    assert b == reference_greedy(tiny, conversation + [77] * 20, 30)


def test_a_preempted_row_finds_its_own_blocks_again(tiny: LoadedModel) -> None:
    per_block = EngineCore(tiny, EngineConfig(max_batch_size=1)).pool.block_bytes
    config = EngineConfig(max_batch_size=3, kv_pool_bytes=40 * per_block, prefill_chunk_tokens=64)
    core = EngineCore(tiny, config)
    prompts = [[i] + SYSTEM[:150] for i in range(3)]  # nothing shared but with themselves
    for i, ids in enumerate(prompts):
        core.add(request(f"r{i}", ids, greedy(120)))
    outputs = run_all(core)
    assert core.preemptions > 0
    for i, ids in enumerate(prompts):
        assert tokens_of(outputs[f"r{i}"]) == reference_greedy(tiny, ids, 120), f"r{i}"
    assert core.prefix_cache_queries == sum(map(len, prompts))  # counted once per request


def test_a_seeded_turn_draws_the_same_bits_from_shared_blocks(
    quantized_tiny: LoadedModel,  # noqa: F811
) -> None:
    """On the quantized CPU path a prefix's KV is the same bits however it was computed,
    so a cache hit changes no draw: tokens and log-probabilities float for float."""
    config = EngineConfig(max_batch_size=8, quantized_cpu_weights=True, prefill_chunk_tokens=48)
    prompt = SYSTEM[:100] + [3, 1, 4, 1, 5]

    def draw(core: EngineCore, rid: str) -> tuple[list[int], list[float]]:
        core.add(request(rid, prompt, SEEDED))
        outputs = run_all(core)[rid]
        entries = [e.logprob for out in outputs for e in out.logprobs]
        return tokens_of(outputs), entries

    cold = draw(EngineCore(quantized_tiny, config), "cold")
    core = EngineCore(quantized_tiny, config)
    core.add(request("other", SYSTEM[:100] + [8, 8], dataclasses.replace(SEEDED, seed=3)))
    run_all(core)
    assert draw(core, "warm") == cold
    assert core.prefix_cache_hits == 96
