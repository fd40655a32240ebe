"""The benchmark scripts run, on the tiny model, and print their tables.

Numbers are not checked here (performance goals live in the benchmarks' own
tables); what is checked is that every section still runs, including the GPU
section on its small CPU stand-in, so a GPU session does not spend its device
time finding out that a script broke.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.models import tiny_model_dir
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


def test_throughput_table_has_a_row_per_batch_size(bench_engine: ModuleType) -> None:
    table = bench_engine.throughput_table(
        tiny(), tiny(), [1, 3], new_tokens=4, with_cb=False, unpacked=tiny()
    )
    rows = data_rows(table)
    assert [row[0] for row in rows] == ["1", "3"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0 for row in rows)
    assert rows[0][-1] == "1.00x"  # engine N / engine 1


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
