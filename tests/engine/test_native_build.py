"""Building and choosing the C++ CPU kernels (engine/native_build.py): the variant a
CPU's flags pick, a library named by content (not by the checkout's path), builders
that take turns on an flock, and a build killed at any moment that never blocks the
next one. The tests that compile are slow (~30-60 s a build on two cores)."""

from __future__ import annotations

import ast
import fnmatch
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
import torch

from wsinfer.engine import native, native_build
from wsinfer.engine.native_build import PORTABLE, SOURCES, X86_VARIANTS, BuildError, choose

V3 = native_build._X86_V3 | {"sse", "sse2", "fpu", "cmov"}  # an AVX2 machine (this one)
V4 = V3 | native_build._X86_V4
VNNI = V4 | {"avx512_vnni"}
ALL = {variant.name for variant in X86_VARIANTS}


@pytest.mark.parametrize(
    ("flags", "built", "variant", "build"),
    [
        (VNNI, ALL, "avx512_vnni", False),
        (V4, ALL, "avx512", False),  # AVX-512 without VNNI
        (V3, ALL, "avx2", False),  # this machine: the AVX-512 builds cannot run here
        (VNNI, {"avx2", "portable"}, "avx2", False),  # the best one built, not a build
        (V3, {"portable"}, "portable", False),
        (V3, set(), "avx2", True),  # none built: the best one this CPU runs, built
        (VNNI, set(), "avx512_vnni", True),
        (V3 - {"f16c"}, {"avx2"}, "portable", True),  # a flag missing: AVX2's code would trap
        (frozenset(), ALL, "portable", False),  # no /proc/cpuinfo: only the portable one
        (frozenset(), set(), "portable", True),
    ],
)
def test_the_best_built_variant_whose_flags_the_cpu_has_is_chosen(
    flags: frozenset[str], built: set[str], variant: str, build: bool
) -> None:
    choice = choose(X86_VARIANTS, frozenset(flags), built)
    assert (choice.variant.name, choice.build) == (variant, build)


def test_the_choice_says_why() -> None:
    choice = choose(X86_VARIANTS, frozenset(V3), {"avx2", "avx512"})
    assert choice.why.startswith("the best built variant this CPU runs")
    assert "avx512: the CPU lacks avx512bw avx512cd avx512dq avx512f avx512vl" in choice.why
    assert "the CPU lacks avx512_vnni" in choice.why
    assert choose(X86_VARIANTS, frozenset(V3), set()).why.startswith("no built variant fits")


def test_variants_by_architecture_and_what_prepare_builds() -> None:
    assert native_build.variants_for("aarch64") == (PORTABLE,)
    assert native_build.variants_for("x86_64") == X86_VARIANTS
    if native_build.variants_for() == X86_VARIANTS:
        names = [v.name for v in native_build.to_build("cpu", frozenset(V3))]
        assert names == ["avx2", "portable"]
        assert [v.name for v in native_build.to_build("best", frozenset(V3))] == ["avx2"]
        assert len(native_build.to_build("all", frozenset())) == 4
    with pytest.raises(ValueError, match="one of best, cpu, all"):
        native_build.to_build("some")


def _copy_sources(to: Path) -> list[Path]:
    to.mkdir(parents=True)
    return [Path(shutil.copy(path, to / path.name)) for path in SOURCES]


def test_a_librarys_name_is_its_content_not_its_checkouts_path(tmp_path: Path) -> None:
    one, two = _copy_sources(tmp_path / "one"), _copy_sources(tmp_path / "two")
    avx2 = X86_VARIANTS[2]
    assert native_build.library_name(avx2, "g++ 12", one) == native_build.library_name(
        avx2, "g++ 12", two
    )
    assert native_build.library_name(avx2, "g++ 13", one) != native_build.library_name(
        avx2, "g++ 12", one
    )
    assert native_build.library_name(PORTABLE, "g++ 12", one) != native_build.library_name(
        avx2, "g++ 12", one
    )
    two[1].write_text(two[1].read_text() + "\n// changed\n")
    assert native_build.library_stem(avx2, one) != native_build.library_stem(avx2, two)


def test_the_shared_header_is_part_of_a_librarys_name_and_of_the_package(tmp_path: Path) -> None:
    """A change to native.h alone rebuilds (every source includes it), and the wheel
    ships it beside the sources (``wsinfer prepare`` compiles them where installed)."""
    one, two = _copy_sources(tmp_path / "one"), _copy_sources(tmp_path / "two")
    header = next(path for path in two if path.name == "native.h")
    assert [path.name for path in native_build.compiled(two)] == [
        path.name for path in two if path.suffix == ".cpp"
    ]
    header.write_text(header.read_text() + "\n// changed\n")
    avx2 = X86_VARIANTS[2]
    assert native_build.library_stem(avx2, one) != native_build.library_stem(avx2, two)
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text().splitlines()
    line = next(line for line in pyproject if line.startswith('"wsinfer.engine" = ['))
    shipped = ast.literal_eval(line.partition("=")[2].strip())  # package-data's patterns
    for path in SOURCES:
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in shipped), path.name


def _hold_lock(directory: Path) -> subprocess.Popen[str]:
    """A process holding the build lock until it is killed."""
    script = (
        "import sys, time\nfrom pathlib import Path\n"
        "from wsinfer.engine.native_build import build_lock\n"
        "with build_lock(Path(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_the_lock_dies_with_its_holder(tmp_path: Path) -> None:
    holder = _hold_lock(tmp_path)
    try:
        with (
            pytest.raises(BuildError, match="held the lock"),
            native_build.build_lock(tmp_path, wait_s=0.5),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()
    started = time.monotonic()
    with native_build.build_lock(tmp_path, wait_s=5):
        assert time.monotonic() - started < 1
    assert (tmp_path / ".lock").exists()  # still there, and it blocks nothing


def test_a_killed_builds_scratch_and_compilers_are_removed(tmp_path: Path) -> None:
    scratch = tmp_path / ".build-dead"
    scratch.mkdir()
    (scratch / "native_cpu.o").write_bytes(b"half")
    # Stands for a compiler its killed build left running (its cwd is the scratch).
    orphan = subprocess.Popen(["sleep", "600"], cwd=scratch)
    try:
        native_build.remove_leftovers(tmp_path)
        assert orphan.wait(timeout=5) != 0
    finally:
        orphan.kill()
    assert not scratch.exists()


def _fake_compiler(tmp_path: Path, compile_rc: int) -> str:
    script = tmp_path / "fakecc"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "fakecc 1.0"; exit 0; fi\n'
        f"echo 'error: no such thing'; exit {compile_rc}\n"
    )
    script.chmod(0o755)
    return str(script)


def test_a_build_is_announced_before_it_begins_and_a_failure_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path, 1))
    cache = tmp_path / "cache"
    with structlog.testing.capture_logs() as logs, pytest.raises(BuildError, match="no such thing"):
        native_build.build(cache, PORTABLE, hint="; `wsinfer prepare` does it at install")
    announced = logs[0]["event"]
    assert announced.startswith("building the native CPU kernels for portable, about ")
    assert announced.endswith(" s, once; `wsinfer prepare` does it at install")
    assert sorted(p.name for p in native_build.native_dir(cache).iterdir()) == [".lock"]


def test_without_a_build_the_torch_forward_stays_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("WSINFER_CACHE_DIR", str(tmp_path / "empty-cache"))
    native.kernels.cache_clear()
    try:
        with structlog.testing.capture_logs() as logs:
            assert native.kernels() is None
            assert native.kernels() is None
    finally:
        native.kernels.cache_clear()
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]["error"], logs
    assert warnings[0]["event"] == "native CPU kernels unavailable, using the torch forward"


# --- builds (slow) -----------------------------------------------------------------

BUILD = (
    "import sys\nfrom pathlib import Path\nfrom wsinfer.engine import native_build as b\n"
    "from wsinfer.logs import configure_logging\nconfigure_logging()  # the log on stderr\n"
    "sources = [Path(p) for p in sys.argv[3:]] or list(b.SOURCES)\n"
    "variant = next(v for v in b.variants_for() if v.name == sys.argv[2])\n"
    "print(b.build(Path(sys.argv[1]), variant, sources), flush=True)\n"
)


def _builder(cache: Path, variant: str, sources: list[Path] | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", BUILD, str(cache), variant, *map(str, sources or [])]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _best() -> str:
    return native_build.to_build("best")[0].name


def _processes_in(directory: Path) -> list[int]:
    """Processes whose working directory lies under ``directory`` (compilers)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(entry / "cwd").startswith(str(directory.resolve())):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_checkouts_building_at_once_make_one_library(tmp_path: Path) -> None:
    """Two builders at once, from sources in two places (two checkouts or venvs):
    one builds, the other waits its turn and finds the library made."""
    cache = tmp_path / "cache"
    one, two = _copy_sources(tmp_path / "one"), _copy_sources(tmp_path / "two")
    builders = [_builder(cache, _best(), one), _builder(cache, _best(), two)]
    outputs = [builder.communicate(timeout=600) for builder in builders]
    assert [builder.returncode for builder in builders] == [0, 0], outputs
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    assert sum("building the native CPU kernels for" in err for _, err in outputs) == 1, outputs
    assert sum("waiting for another process" in err for _, err in outputs) == 1, outputs
    assert [p.name for p in native_build.native_dir(cache).glob("*.so")] == [Path(paths.pop()).name]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_build_killed_at_random_moments_never_blocks_the_next(tmp_path: Path) -> None:
    """SIGKILL a build three times at random moments (importing torch, copying,
    compiling, linking): each time the next one starts at once, and the last one
    finishes, leaves no scratch or compiler behind, and computes what the engine's
    kernels compute."""
    cache = tmp_path / "cache"
    seed = random.randrange(1 << 30)
    # Up to 20 s: a build takes 18 to 33 s on the machines seen. One that ends before
    # its kill (a fast machine) is not a kill mid-build: its library goes, and the
    # next one starts from nothing again.
    delays = [random.Random(seed + i).uniform(0.2, 20.0) for i in range(3)]
    for delay in delays:
        builder = _builder(cache, _best())
        time.sleep(delay)
        builder.kill()
        builder.communicate()
        if builder.returncode == 0:
            shutil.rmtree(native_build.native_dir(cache))
    last = _builder(cache, _best())
    out, err = last.communicate(timeout=600)
    assert last.returncode == 0, (seed, err)
    assert "waiting for another process" not in err
    directory = native_build.native_dir(cache)
    assert not list(directory.glob(".build-*")) and not _processes_in(directory)
    built = native_build.load(Path(out.strip()))
    module = native.kernels()
    if module is not None:  # the engine's own build of the same variant: the same bits
        x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
        assert torch.equal(built.add_rms_norm(x, None, weight, 1e-5)[1],
                           module.add_rms_norm(x, None, weight, 1e-5)[1])  # fmt: skip
