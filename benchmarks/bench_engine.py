"""Benchmark EngineCore against transformers' own generation, side by side.

    python benchmarks/bench_engine.py [--model SPEC] [--device cpu|cuda] [--batches 1,4,8,16]

Prints markdown tables:

(a) aggregate decode throughput at N concurrent requests (sampling, fixed
    number of new tokens each): EngineCore vs ``model.generate`` on a static
    batch of the same size vs transformers' continuous batching
    (``generate_batch`` with a persistent, warmed-up manager);
(b) multi-turn: time to first token of turn 2 on a long history, with the
    session's KV cache retained vs recomputed;
(c) with CUDA only: a 1B-class Llama (random weights, bfloat16) at batch
    1, 16, 64, 128, 256 (--gpu-batches), 128 new tokens (--gpu-new-tokens): EngineCore
    vs transformers ``generate`` with a static cache + torch.compile (measured in the
    same run), eager ``generate``, transformers CB, and the memory-bandwidth roofline;
    host syncs per decode step at each batch.

    python benchmarks/bench_engine.py --device cuda --dtype bfloat16 --only c --no-cb
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from wsinfer.engine.core import EngineConfig, EngineCore, EngineRequest
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.engine.prompts import render_chat
from wsinfer.sessions.schema import GenerationParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a bicycle works.",
    "Give me three tips for learning Python.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What are prime numbers?",
    "How do airplanes stay in the air?",
]


# --- workloads -----------------------------------------------------------------


def chat_prompts(loaded: LoadedModel, n: int, tokens: int = 0) -> list[list[int]]:
    """``n`` chat prompts: the short questions, or (``tokens``) each a question after
    filler of about that many tokens, its first line its own (no shared prefix)."""
    if not tokens:
        return [
            render_chat(
                loaded.tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            )
            for i in range(n)
        ]
    filler = " ".join(f"Note {k}: the ledger lists a ship and its cargo." for k in range(tokens))
    ids = loaded.tokenizer.encode(filler, add_special_tokens=False)[:tokens]
    body = loaded.tokenizer.decode(ids)
    return [
        render_chat(loaded.tokenizer, [{"role": "user", "content": f"Copy {i}.\n{body}\n"
                                        f"{QUESTIONS[i % len(QUESTIONS)]}"}])
        for i in range(n)
    ]  # fmt: skip


def timed(fn: Callable[[], Any]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def best_rate(tokens: int, fn: Callable[[], Any], repeats: int) -> float:
    """tokens/s of the fastest of ``repeats`` runs: the least disturbed by other load."""
    return max(tokens / timed(fn) for _ in range(max(1, repeats)))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(core: EngineCore, prompts: list[list[int]], params: GenerationParams) -> int:
    for i, ids in enumerate(prompts):
        core.add(EngineRequest(f"bench-{time.perf_counter_ns()}-{i}", ids, params))
    tokens = 0
    while core.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in core.step())
    return tokens


def decode_rate(core: EngineCore, prompts: list[list[int]], params: GenerationParams) -> float:
    """tok/s of the decode steps alone: the tokens drawn once every prompt has its
    first token (its prefill done) over the time from then to the end."""
    names = [f"bench-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for name, ids in zip(names, prompts, strict=True):
        core.add(EngineRequest(name, ids, params))
    started: set[str] = set()
    since, tokens = 0.0, 0
    while core.has_unfinished():
        for out in core.step():
            if since:
                tokens += len(out.new_token_ids)
            elif out.new_token_ids:
                started.add(out.request_id)
        if not since and len(started) == len(names):
            sync()
            since = time.perf_counter()
    sync()
    return tokens / (time.perf_counter() - since) if since and tokens else 0.0


def run_generate(
    loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, **extra: Any
) -> None:
    """transformers generate on one left-padded static batch (``extra``: more kwargs)."""
    width = max(len(p) for p in prompts)
    pad = loaded.tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=loaded.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        loaded.model.generate(
            ids,
            attention_mask=mask.to(loaded.device),
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
            **extra,
        )


class TransformersCB:
    """transformers' continuous batching with a persistent manager (warm after the first call)."""

    def __init__(self, loaded: LoadedModel, new_tokens: int, max_batch: int) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.loaded = loaded
        # The persistent manager is sized by its first call unless told the real maximum.
        self.cb_config = ContinuousBatchingConfig(max_requests_per_batch=max_batch)
        self.config = GenerationConfig(
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            eos_token_id=-1,  # never stop early: every request makes new_tokens tokens
            pad_token_id=loaded.tokenizer.pad_token_id or 0,
        )

    def run(self, prompts: list[list[int]]) -> int:
        out = self.loaded.model.generate_batch(
            prompts,
            generation_config=self.config,
            continuous_batching_config=self.cb_config,
            persistent_manager=True,
            progress_bar=False,
        )
        return sum(len(r.generated_tokens) for r in out.values())

    def close(self) -> None:
        destroy = getattr(self.loaded.model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()


# --- (a) throughput ------------------------------------------------------------------


def throughput_table(
    loaded: LoadedModel,
    baseline: LoadedModel,
    batches: list[int],
    new_tokens: int,
    with_cb: bool,
    repeats: int = 1,
    previous: LoadedModel | None = None,
    config: EngineConfig | None = None,
    previous_config: EngineConfig | None = None,
    prompt_tokens: int = 0,
    with_generate: bool = True,
) -> list[str]:
    """EngineCore on ``loaded`` vs transformers on ``baseline`` (a separate copy of the model).

    ``previous``: a third copy for the previous core, measured in the same run: an
    ``EagerEngineCore`` (the eager transformers forward over a right-aligned KV batch,
    which every model used before the paged fast path and non-Llama models still use),
    or, with ``previous_config``, an ``EngineCore`` under that config (say, float32
    weights against ``config``'s quantized ones). The ratios are EngineCore's.
    """
    # No early EOS: every request makes exactly new_tokens tokens on every side.
    params = GenerationParams(max_new_tokens=new_tokens, temperature=0.7)
    config = config or EngineConfig(max(batches))
    engines: list[Any] = [EngineCore(dataclasses.replace(loaded, eos_token_ids=set()), config)]
    if previous is not None:
        other = dataclasses.replace(previous, eos_token_ids=set())
        if previous_config is None:
            engines.append(EagerEngineCore(other, config))
        else:
            engines.append(EngineCore(other, previous_config))
    cb = TransformersCB(baseline, new_tokens, max(batches)) if with_cb else None
    for i, core in enumerate(engines):
        warm(core, baseline, cb if i == 0 else None)
    rows = [
        "| streams | EngineCore tok/s | previous core | EngineCore / previous "
        "| generate (static) | engine / generate | transformers CB | engine / CB "
        "| engine N / engine 1 | engine / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    single = 0.0
    # The CPU's roofline: the bytes a step reads over the copy bandwidth these threads
    # reach, measured now (a shared machine moves both alike).
    bandwidth = copy_bandwidth(str(loaded.device)) if loaded.device.type == "cpu" else 0.0
    if bandwidth:
        print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
    for n in batches:
        prompts = chat_prompts(loaded, n, prompt_tokens)
        total = n * new_tokens
        if prompt_tokens:  # long prompts: the decode steps' rate, after every prefill
            rates = [
                max(decode_rate(e, prompts, params) for _ in range(max(1, repeats)))
                for e in engines
            ]
        else:
            rates = [
                best_rate(total, partial(run_engine, e, prompts, params), repeats) for e in engines
            ]
        ours = rates[0]
        static_cell, static_ratio = "n/a", "n/a"
        if with_generate:
            run = partial(run_generate, baseline, prompts, new_tokens)
            static = best_rate(total, run, repeats)
            static_cell, static_ratio = f"{static:.1f}", f"{ours / static:.2f}x"
        single = single or ours
        previous_cell, previous_ratio = "n/a", "n/a"
        if len(rates) > 1:
            previous_cell, previous_ratio = f"{rates[1]:.1f}", f"{ours / rates[1]:.2f}x"
        cb_cell, cb_ratio = "n/a", "n/a"
        if cb is not None:
            cb_rate = best_rate(total, partial(cb.run, prompts), repeats)
            cb_cell, cb_ratio = f"{cb_rate:.1f}", f"{ours / cb_rate:.2f}x"
        fraction = "n/a"
        if bandwidth:
            context = sum(map(len, prompts)) // n + new_tokens // 2  # the mean over the run
            limit = n * bandwidth / step_bytes(engines[0], n, context)
            fraction = f"{ours / limit:.2f} (of {limit:.0f})"
        rows.append(
            f"| {n} | {ours:.1f} | {previous_cell} | {previous_ratio} | {static_cell} "
            f"| {static_ratio} "
            f"| {cb_cell} | {cb_ratio} | {ours / single:.2f}x | {fraction} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    if cb is not None:
        cb.close()
    return rows


def warm(core: EngineCore, loaded: LoadedModel, cb: TransformersCB | None) -> None:
    prompts = chat_prompts(loaded, 2)
    run_engine(core, prompts, GenerationParams(max_new_tokens=8, temperature=0.7))
    run_generate(loaded, prompts, 8)
    if cb is not None:
        cb.run(prompts)


# --- (b) multi-turn TTFT ------------------------------------------------------------


def long_history(loaded: LoadedModel, target_tokens: int) -> list[dict[str, str]]:
    """A synthetic conversation of about ``target_tokens`` tokens."""
    filler = (
        "Here is some more context about the project: the service streams tokens over "
        "WebSockets, keeps sessions in Redis and resumes them after disconnects. "
    )
    messages: list[dict[str, str]] = []
    while len(render_chat(loaded.tokenizer, messages or [{"role": "user", "content": ""}])) < (
        target_tokens
    ):
        messages.append({"role": "user", "content": filler * 4})
        messages.append({"role": "assistant", "content": "Understood. " + filler * 2})
    messages.append({"role": "user", "content": "Please summarise what I told you."})
    return messages


def time_to_first_token(core: EngineCore, request: EngineRequest) -> tuple[float, list[int]]:
    sync()
    start = time.perf_counter()
    core.add(request)
    first = 0.0
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            if out.new_token_ids and not first:
                sync()
                first = time.perf_counter() - start
            tokens += out.new_token_ids
    return first, tokens


def multiturn_table(loaded: LoadedModel, history_tokens: int, repeats: int = 3) -> list[str]:
    params = GenerationParams(max_new_tokens=16, temperature=0.0)
    messages = long_history(loaded, history_tokens)
    turn1 = render_chat(loaded.tokenizer, messages)
    core = EngineCore(loaded)
    with_kv, without_kv, cached = [], [], 0
    for r in range(repeats):
        key = f"session-{r}"
        first = EngineRequest(f"t1-{r}", turn1, params, cache_key=key)
        _, answer = time_to_first_token(core, first)
        reply = loaded.tokenizer.decode(answer, skip_special_tokens=True)
        follow = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And in one word?"},
        ]
        turn2 = render_chat(loaded.tokenizer, follow)
        hit, _ = time_to_first_token(core, EngineRequest(f"t2-{r}", turn2, params, cache_key=key))
        cached = core.store.length(key) and len(turn2)
        miss, _ = time_to_first_token(core, EngineRequest(f"t2-miss-{r}", turn2, params))
        with_kv.append(hit)
        without_kv.append(miss)
    hit, miss = min(with_kv), min(without_kv)
    return [
        "| turn-2 prompt tokens | TTFT with retained KV | TTFT recomputed | ratio |",
        "|---|---|---|---|",
        f"| {cached} | {hit * 1000:.0f} ms | {miss * 1000:.0f} ms | {hit / miss:.3f} |",
    ]


# --- (c) GPU ------------------------------------------------------------------------------


def gpu_model(
    tokenizer_source: LoadedModel, device: str = "cuda", smoke: bool = False
) -> LoadedModel:
    """A Llama-3.2-1B-shaped model with random bf16 weights (vocab kept to the tokenizer's).

    ``smoke``: a tiny model of the same shape family, to check the code path without a GPU.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = tokenizer_source.tokenizer
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128 if smoke else 2048,
        intermediate_size=256 if smoke else 8192,
        num_hidden_layers=2 if smoke else 16,
        num_attention_heads=4 if smoke else 32,
        num_key_value_heads=2 if smoke else 8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    return LoadedModel(model, tok, "llama-1b-random", torch.device(device), set(), 4096)


def copy_bandwidth(device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in bytes/s (each byte read once and written once),
    with the threads torch runs on. 1 GiB: far past a GPU's L2 and any CPU's L3."""
    size = 2**30
    src = torch.ones(size, dtype=torch.uint8, device=device)  # touched: no lazy first pages
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = timed(lambda: [dst.copy_(src) for _ in range(10)]) / 10
    return 2 * src.numel() / seconds


def step_bytes(core: EngineCore, batch: int, context: int) -> int:
    """The bytes one decode step of ``batch`` rows of ``context`` tokens must read, as
    this core holds the model: every weight tensor it multiplies by once (the
    quantized blocks where it uses them; not the embedding table, of which a step
    reads one row per token, nor the rotary tables), plus each row's K and V."""
    model: Any = core.model
    seen: set[int] = set()
    total = 0

    def walk(value: Any, depth: int) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = id(storage)
            if key not in seen and value.data_ptr() not in seen:
                seen.update((key, value.data_ptr()))
                total += value.numel() * value.element_size()
        elif depth > 0 and isinstance(value, (list, tuple)):
            for item in value:
                walk(item, depth - 1)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
            for name, item in vars(value).items():
                # The table itself is looked up, not read: a tied head reaches it
                # through the head, which multiplies by all of it.
                if name not in ("cos", "sin", "embed", "config"):
                    walk(item, depth - 1)

    walk(model, 6)
    pool = core.pool
    kv_per_token = 2 * pool.k.shape[0] * pool.k[0, 0, 0].numel() * pool.k.element_size()
    return total + kv_per_token * context * batch


def roofline(loaded: LoadedModel, batch: int, context: int, bandwidth: float) -> float:
    """tok/s if each decode step only had to stream the weights and the batch's KV once."""
    cfg = loaded.model.config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * context * batch
    return batch / ((weights + kv) / bandwidth)


def syncs_per_step(core: EngineCore, prompts: list[list[int]], steps: int = 20) -> float | None:
    """Host-device synchronisations per steady decode step (CUDA only; the engine aims for one).

    Counted with torch's sync debug mode, which warns at every synchronising CUDA call.
    """
    if core.device.type != "cuda":
        return None
    params = GenerationParams(max_new_tokens=steps + 8, temperature=0.7)
    ids = [f"sync-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        core.add(EngineRequest(rid, prompt, params))
    while core.num_waiting:  # past the prefill: only decode steps are counted
        core.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                core.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    return sum("synchroniz" in str(w.message) for w in caught) / steps


class StaticCompiled:
    """transformers ``generate`` with a static KV cache and its forward compiled.

    On CUDA, ``generate`` compiles the decode forward of a static cache by itself
    (``torch.compile(mode="reduce-overhead")``: CUDA graphs); the ``CompileConfig`` only
    makes that explicit. ``compile=False`` (the CPU stand-in) runs the static cache eagerly.
    A compile failure is reported, not raised: the cell says n/a and why.
    """

    def __init__(self, loaded: LoadedModel, compile: bool) -> None:
        self.loaded = loaded
        self.compile = compile
        self.failure: str | None = None

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        from transformers import CompileConfig

        extra: dict[str, Any] = {"cache_implementation": "static"}
        if self.compile:
            extra["compile_config"] = CompileConfig(mode="reduce-overhead")
        else:
            extra["disable_compile"] = True
        run_generate(self.loaded, prompts, new_tokens, **extra)

    def rate(self, prompts: list[list[int]], new_tokens: int) -> float | None:
        """tok/s after one untimed run of the same shape (it compiles); None on failure."""
        if self.failure is not None:
            return None
        try:
            self.run(prompts, new_tokens)  # the cache's length is part of the compiled shape
            return best_rate(len(prompts) * new_tokens, partial(self.run, prompts, new_tokens), 1)
        except Exception as exc:  # noqa: BLE001 - any compile error is a result to report
            self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print(f"static+compile generate failed: {self.failure}", file=sys.stderr)
            return None


@dataclasses.dataclass
class GpuRow:
    streams: int
    engine: float | None = None
    syncs: float | None = None
    idle_ms: float | None = None  # GPU time per step spent waiting for the host
    static: float | None = None
    eager: float | None = None
    cb: float | None = None
    roofline: float = 0.0
    errors: list[str] = dataclasses.field(default_factory=list)

    def attempt(self, what: str, measure: Callable[[], float | None]) -> float | None:
        """``measure()``, or None with the error noted: one failing cell (say, out of
        memory at batch 256) must not cost the rest of a GPU run."""
        try:
            return measure()
        except Exception as exc:  # noqa: BLE001 - reported in the table's notes
            self.errors.append(f"{what} at {self.streams}: {type(exc).__name__}: {exc}"[:300])
            print(self.errors[-1], file=sys.stderr)
            release_memory()
            return None

    def cells(self) -> str:
        def fmt(value: float | None, spec: str = ".0f") -> str:
            return "n/a" if value is None else format(value, spec)

        def ratio(a: float | None, b: float | None) -> float | None:
            return None if a is None or not b else a / b

        return (
            f"| {self.streams} | {fmt(self.engine)} | {fmt(self.static)} "
            f"| {fmt(ratio(self.engine, self.static), '.2f')}x | {fmt(self.eager)} "
            f"| {fmt(self.cb)} | {fmt(ratio(self.engine, self.cb), '.2f')}x "
            f"| {self.roofline:.0f} | {fmt(ratio(self.engine, self.roofline), '.3f')} "
            f"| {fmt(ratio(self.static, self.roofline), '.3f')} | {fmt(self.syncs, '.2f')} "
            f"| {fmt(self.idle_ms, '.3f')} |"
        )


GPU_HEADER = [
    "| streams | EngineCore tok/s | generate static+compile | engine / static+compile "
    "| generate eager | transformers CB | engine / CB | roofline tok/s | engine / roofline "
    "| static+compile / roofline | host syncs / step | GPU idle ms / step |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def gpu_table(
    tokenizer_source: LoadedModel,
    new_tokens: int,
    device: str = "cuda",
    smoke: bool = False,
    batches: tuple[int, ...] = (1, 16, 64, 128, 256),
    with_cb: bool = True,
    compile_baseline: bool | None = None,
) -> list[str]:
    """EngineCore first (all batches, with its host syncs per step), then the transformers
    baselines on the same weights once the engine is gone: an engine that sizes its KV
    pool from free memory must not starve them, nor they it."""
    loaded = gpu_model(tokenizer_source, device, smoke)
    bandwidth = copy_bandwidth(device)
    rows = [GpuRow(n) for n in batches]
    params = GenerationParams(max_new_tokens=new_tokens, temperature=0.7)
    core = EngineCore(loaded, EngineConfig(max_batch_size=max(batches)))
    warm(core, loaded, None)
    for row in rows:
        prompts = chat_prompts(loaded, row.streams)
        context = max(len(p) for p in prompts) + new_tokens // 2
        row.roofline = roofline(loaded, row.streams, context, bandwidth)
        total = row.streams * new_tokens
        idle, steps = core.gpu_idle_seconds, core.steps
        # No name may outlive the loop holding the core (a partial over it would keep its
        # KV pool, most of the GPU, alive through the baselines below).
        row.engine = row.attempt(
            "EngineCore", partial(best_rate, total, partial(run_engine, core, prompts, params), 1)
        )
        if core.device.type == "cuda" and core.steps > steps:
            row.idle_ms = 1000 * (core.gpu_idle_seconds - idle) / (core.steps - steps)
        row.syncs = row.attempt("host syncs", partial(syncs_per_step, core, prompts))
        print(f"engine, {row.streams} streams: {row.cells()}", file=sys.stderr)
    del core
    release_memory()
    if compile_baseline is None:
        compile_baseline = device.startswith("cuda")
    static = StaticCompiled(loaded, compile_baseline)
    baselines(loaded, rows, new_tokens, static, with_cb)
    weights = sum(p.numel() for p in loaded.model.parameters()) / 1e9
    mode = "compiled" if static.compile else "not compiled (CPU stand-in)"
    notes = [f"static+compile generate: {mode}", *(e for row in rows for e in row.errors)]
    if static.failure:
        notes.append(f"static+compile generate failed: {static.failure}")
    return [
        f"Copy bandwidth {bandwidth / 1e9:.0f} GB/s; weights {weights:.2f} B params (bf16); "
        f"{new_tokens} new tokens per stream, sampling",
        "",
        *GPU_HEADER,
        *(row.cells() for row in rows),
        "",
        *notes,
    ]


def baselines(
    loaded: LoadedModel, rows: list[GpuRow], new_tokens: int, static: StaticCompiled, with_cb: bool
) -> None:
    run_generate(loaded, chat_prompts(loaded, 2), 8)  # warm-up
    cb = TransformersCB(loaded, new_tokens, max(r.streams for r in rows)) if with_cb else None
    if cb is not None:
        cb.run(chat_prompts(loaded, 2))
    for row in rows:
        prompts = chat_prompts(loaded, row.streams)
        total = row.streams * new_tokens
        row.static = static.rate(prompts, new_tokens)
        eager = partial(run_generate, loaded, prompts, new_tokens)
        row.eager = row.attempt("eager generate", partial(best_rate, total, eager, 1))
        if cb is not None:
            batching = partial(best_rate, total, partial(cb.run, prompts), 1)
            row.cb = row.attempt("transformers CB", batching)
        print(f"baselines, {row.streams} streams: {row.cells()}", file=sys.stderr)
    if cb is not None:
        cb.close()


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--history-tokens", type=int, default=1500)
    parser.add_argument("--no-cb", action="store_true", help="skip transformers' own CB")
    parser.add_argument(
        "--previous",
        choices=["eager", "float32", "kv-float32", "none"],
        default="eager",
        help="section a's previous core: the eager core, EngineCore with float32 CPU weights "
        "(against --quantized), EngineCore with a float32 KV pool (against --kv-dtype), "
        "or none",
    )
    parser.add_argument("--kv-dtype", default="auto", help="section a's EngineCore KV pool")
    parser.add_argument(
        "--prompt-tokens", type=int, default=0, help="section a: each prompt about this long"
    )
    parser.add_argument(
        "--no-generate", action="store_true", help="section a: skip transformers' generate"
    )
    parser.add_argument("--no-previous", action="store_true", help="--previous none")
    parser.add_argument(
        "--quantized", action="store_true", help="EngineCore multiplies the GGUF's Q4_1 blocks"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell; the best counts")
    parser.add_argument("--only", choices=["a", "b", "c"], help="run one section")
    parser.add_argument("--gpu-batches", default="1,16,64,128,256", help="section c's batches")
    parser.add_argument("--gpu-new-tokens", type=int, default=128, help="section c's length")
    args = parser.parse_args(argv)
    for name in ("transformers", "ContinuousBatchingLogger"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    weights = "quantized (GGUF Q4_1)" if args.quantized else args.dtype
    print(
        f"# bench_engine: {loaded.name} on {args.device} ({weights}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )
    if args.only in (None, "a"):
        batches = [int(b) for b in args.batches.split(",")]
        print(f"## (a) throughput, sampling, {args.new_tokens} new tokens per stream\n")
        baseline = load_model(args.model, device=args.device, dtype=args.dtype)
        copy = partial(load_model, args.model, device=args.device, dtype=args.dtype)
        kind = "none" if args.no_previous else args.previous
        previous = None if kind == "none" else copy()
        config = EngineConfig(
            max(batches), quantized_cpu_weights=args.quantized, kv_dtype=args.kv_dtype
        )
        previous_config = {
            "float32": EngineConfig(max(batches)),
            "kv-float32": dataclasses.replace(config, kv_dtype="float32"),
        }.get(kind)
        decode_only = "; decode steps only (after every prefill)" if args.prompt_tokens else ""
        print(f"prompts: {args.prompt_tokens or 'short'} tokens, KV pool {args.kv_dtype}, "
              f"previous core: {kind}{decode_only}\n")  # fmt: skip
        table = throughput_table(
            loaded, baseline, batches, args.new_tokens, not args.no_cb, args.repeats,
            previous, config, previous_config, args.prompt_tokens, not args.no_generate,
        )  # fmt: skip
        print("\n".join(table) + "\n")
        del baseline, previous
    if args.only in (None, "b"):
        print(f"## (b) multi-turn time to first token, ~{args.history_tokens}-token history\n")
        print("\n".join(multiturn_table(loaded, args.history_tokens)) + "\n")
    if args.only in (None, "c") and torch.cuda.is_available():
        print("## (c) GPU: 1B-class Llama, random weights, bfloat16\n")
        sizes = tuple(int(b) for b in args.gpu_batches.split(","))
        table = gpu_table(loaded, args.gpu_new_tokens, batches=sizes, with_cb=not args.no_cb)
        print("\n".join(table) + "\n")
    elif args.only == "c":
        print("## (c) skipped: CUDA is not available\n")


if __name__ == "__main__":
    main()
