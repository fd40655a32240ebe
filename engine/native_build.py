"""Builds the C++ CPU kernels (``engine/native_*.cpp``) into the wsinfer cache, one
library per CPU variant, and loads the best one this CPU runs.

Variants are llama.cpp's idea for its CPU backends: one build per instruction set
(AVX-512 VNNI, AVX-512, AVX2, and a portable one with the compiler's defaults),
chosen at run time from the CPU's flags, so that a cache or an image built on one
x86 machine runs fast on another. ``wsinfer prepare`` builds them at install time;
a start builds only where no built variant fits this CPU, and says so first.

A library is named by what decides its bits and its ABI: the sources' content
(the header they share, ``native.h``, included), torch's version, Python's extension
ABI, the compiler flags and the compiler's version; never a path, so checkouts and
venvs sharing one cache share its builds.
A build runs in a private directory (sources copied in) and its library is renamed
into place whole; builders take turns on an ``flock`` that the kernel releases when
its holder dies, so a build killed at any moment leaves nothing a later start
waits on; the next builder removes what it left.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import structlog

log = structlog.get_logger("wsinfer.engine.native")

HERE = Path(__file__).parent
# Every file a build reads: the four it compiles, then the header they all include.
# The bindings and the layer stack first: that file includes pybind11 and torch's
# casters and takes longest, so a parallel build starts it first.
SOURCES = tuple(
    HERE / name
    for name in (
        "native_layers.cpp",
        "native_quant.cpp",
        "native_cpu.cpp",
        "native_sampling.cpp",
        "native.h",
    )
)
# -fopenmp: at::parallel_for is inline; without it the kernels run on one thread
# (the OpenMP runtime is torch's own, already loaded). -fno-trapping-math: GCC
# vectorizes no loop with a conditional float expression otherwise (the SiLU's exp
# ran one element at a time); it changes no result, only lets the compiler compute
# both sides of a select. -fPIC and C++20 as torch.utils.cpp_extension builds.
COMMON_FLAGS = (
    "-O3",
    "-fopenmp",
    "-fno-trapping-math",
    "-fPIC",
    "-std=c++20",
    "-DTORCH_API_INCLUDE_EXTENSION_H",
)
LOCK_WAIT_S = 900.0  # a builder that holds the lock this long is stuck, not slow
# Measured on a 2-core AMD EPYC (2.45 GHz): the four compiles take ~55 CPU-seconds
# in all, the longest (native_layers.cpp) ~22 s; a build is bounded by both.
BUILD_CPU_S, LONGEST_COMPILE_S = 55.0, 22.0

# /proc/cpuinfo's names of what each x86-64 micro-architecture level may use
# (GCC's -march=x86-64-v2/v3/v4).
_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its compiler flags and the CPU flags they need."""

    name: str
    flags: tuple[str, ...]
    requires: frozenset[str]


# Best first. native_quant.cpp's #if branches are what differ: VNNI's dot products,
# AVX-512's wide registers, AVX2's maddubs, plain C++ for the rest. x86-64-vN tunes
# for no particular CPU (-mtune=generic).
PORTABLE = Variant("portable", (), frozenset())
X86_VARIANTS = (
    Variant("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), _X86_V4 | {"avx512_vnni"}),
    Variant("avx512", ("-march=x86-64-v4",), _X86_V4),
    Variant("avx2", ("-march=x86-64-v3",), _X86_V3),
    PORTABLE,
)


class BuildError(RuntimeError):
    """The kernels could not be built here (no compiler, a failed compile)."""


def variants_for(machine: str | None = None) -> tuple[Variant, ...]:
    """Every variant of this architecture, best first (elsewhere: the portable one)."""
    machine = (machine or platform.machine()).lower()
    return X86_VARIANTS if machine in ("x86_64", "amd64") else (PORTABLE,)


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo names them (``Features`` on ARM); none elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        field, _, value = line.partition(":")
        if field.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def runnable(variants: Sequence[Variant], flags: frozenset[str]) -> list[Variant]:
    """The variants whose every required flag the CPU has, best first."""
    return [variant for variant in variants if variant.requires <= flags]


@dataclass(frozen=True)
class Choice:
    variant: Variant
    build: bool  # no built variant fits this CPU: this one must be built first
    why: str


def choose(variants: Sequence[Variant], flags: frozenset[str], built: set[str]) -> Choice:
    """The best variant this CPU runs whose library is built; where none is, the best
    one it runs, to build. ``why`` names what each better variant lacked."""
    passed = []
    for variant in variants:
        missing = sorted(variant.requires - flags)
        if missing:
            passed.append(f"{variant.name}: the CPU lacks {' '.join(missing)}")
        elif variant.name in built:
            return Choice(variant, False, _why("the best built variant this CPU runs", passed))
        else:
            passed.append(f"{variant.name}: not built")
    fits = runnable(variants, flags)
    return Choice(
        fits[0] if fits else PORTABLE, True, _why("no built variant fits this CPU", passed)
    )


def _why(verdict: str, passed: list[str]) -> str:
    return f"{verdict} ({'; '.join(passed)})" if passed else verdict


def compiler() -> str:
    """The C++ compiler torch's extension builder would use: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def compiler_identity() -> str | None:
    """The compiler's version text (part of a library's name); None without one."""
    try:
        done = subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def compiled(sources: Sequence[Path]) -> list[Path]:
    """The files of ``sources`` a build compiles (the rest are headers they include)."""
    return [path for path in sources if path.suffix == ".cpp"]


def library_stem(variant: Variant, sources: Sequence[Path] = SOURCES) -> str:
    """The name a variant's library shares whatever compiled it: sources and headers,
    torch, Python's ABI, flags. Also the prefix of the module's name."""
    import torch

    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    built_with = [torch.__version__, str(sysconfig.get_config_var("EXT_SUFFIX"))]
    digest.update("\n".join([*built_with, *COMMON_FLAGS, *variant.flags]).encode())
    return f"wsinfer_native_{variant.name}_{digest.hexdigest()[:16]}"


def library_name(variant: Variant, identity: str, sources: Sequence[Path] = SOURCES) -> str:
    """The module (and file) name of ``variant`` built by the compiler ``identity``."""
    return f"{library_stem(variant, sources)}_{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


def native_dir(cache: Path) -> Path:
    return cache / "native"


def find_library(
    cache: Path, variant: Variant, identity: str | None, sources: Sequence[Path] = SOURCES
) -> Path | None:
    """``variant``'s library built by this compiler; else one an other compiler built
    of the same sources and flags (a compiler upgrade, or an image without one):
    it runs as well, and a start does not rebuild for it (``wsinfer prepare`` does)."""
    directory = native_dir(cache)
    if identity is not None:
        exact = directory / f"{library_name(variant, identity, sources)}.so"
        if exact.is_file():
            return exact
    others = sorted(
        directory.glob(f"{library_stem(variant, sources)}_*.so"), key=lambda p: p.stat().st_mtime
    )
    return others[-1] if others else None


def build_seconds(jobs: int | None = None) -> int:
    """About how long a build takes here, from this machine's measured compiles."""
    jobs = jobs or _jobs()
    return int(round(max(LONGEST_COMPILE_S, BUILD_CPU_S / jobs) / 5.0) * 5)


def _jobs() -> int:
    try:
        cores = len(os.sched_getaffinity(0))  # a container's or taskset's share
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, len(compiled(SOURCES))))


def build(
    cache: Path, variant: Variant, sources: Sequence[Path] = SOURCES, *, hint: str = ""
) -> Path:
    """``variant``'s library in the cache, built now unless it is there already
    (or another process builds it while this one waits its turn)."""
    identity = compiler_identity()
    if identity is None:
        raise BuildError(f"no C++ compiler ({compiler()}) to build the native CPU kernels")
    directory = native_dir(cache)
    directory.mkdir(parents=True, exist_ok=True)
    name = library_name(variant, identity, sources)
    target = directory / f"{name}.so"
    with build_lock(directory):
        remove_leftovers(directory)
        if target.is_file():
            return target
        seconds = build_seconds()
        log.info(
            f"building the native CPU kernels for {variant.name}, about {seconds} s, once{hint}",
            variant=variant.name,
            library=str(target),
        )
        started = time.monotonic()
        scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=directory))
        try:
            os.replace(_compile(scratch, name, variant, sources), target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log.info("native CPU kernels built", variant=variant.name, seconds=_since(started))
    return target


def _since(started: float) -> float:
    return round(time.monotonic() - started, 1)


@contextmanager
def build_lock(directory: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Builders take turns here. An flock, not a file whose existence is the lock:
    the kernel releases it when its holder exits or is killed."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, wait_s)
        yield
    finally:
        os.close(fd)  # releases the lock with the descriptor


def _acquire(fd: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not said:
                log.info("waiting for another process building the native CPU kernels")
                said = True
            if time.monotonic() > deadline:
                raise BuildError(f"another build has held the lock for {wait_s:.0f} s") from None
            time.sleep(0.2)


def remove_leftovers(directory: Path) -> None:
    """Scratch directories of builds that died (only the lock's holder builds, and
    it holds the lock now): their compilers, still running if the build was killed,
    then their files."""
    for scratch in directory.glob(".build-*"):
        _kill_compilers_in(scratch)
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_compilers_in(scratch: Path) -> None:
    """Processes working in ``scratch``: a killed build's compilers (they outlive it
    and would compete with this build for the cores)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    wanted = str(scratch.resolve())
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "cwd") == wanted:
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:  # gone, or not ours to look at
            continue


def _compile(scratch: Path, name: str, variant: Variant, sources: Sequence[Path]) -> Path:
    """Compile ``sources`` (copied into ``scratch``, headers too: the commands name no
    checkout) in parallel, then link ``scratch/name.so``."""
    from torch.utils import cpp_extension

    for path in sources:
        shutil.copyfile(path, scratch / path.name)
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    includes = [*cpp_extension.include_paths("cpu"), python_include]
    flags = [*COMMON_FLAGS, *variant.flags, f"-DTORCH_EXTENSION_NAME={name}"]
    flags += [f"-isystem{include}" for include in includes]
    units = compiled(sources)
    commands = [[compiler(), *flags, "-c", path.name, "-o", f"{path.stem}.o"] for path in units]
    _run_all(commands, scratch, _jobs())
    library = scratch / f"{name}.so"
    link = [compiler(), "-shared", *(f"{path.stem}.o" for path in units), "-o", library.name]
    link += [f"-L{cpp_extension.TORCH_LIB_PATH}", "-lc10", "-ltorch_cpu", "-ltorch"]
    _run_all([[*link, "-ltorch_python"]], scratch, 1)
    return library


def _run_all(commands: list[list[str]], cwd: Path, jobs: int) -> None:
    """Run ``commands`` in ``cwd``, ``jobs`` at a time, in order; each one's output
    into a log file there, shown where it fails. Any failure or interruption stops
    the rest (no compiler is left running)."""
    pending = list(enumerate(commands))
    running: dict[int, subprocess.Popen[bytes]] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                index, command = pending.pop(0)
                with open(cwd / f"step{index}.log", "wb") as out:
                    running[index] = subprocess.Popen(
                        command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT
                    )
            for index, process in list(running.items()):
                if process.poll() is not None:
                    del running[index]
                    if process.returncode != 0:
                        raise BuildError(_failure(commands[index], cwd / f"step{index}.log"))
            time.sleep(0.05)
    finally:
        for process in running.values():
            process.kill()
            process.wait()


def _failure(command: list[str], output: Path) -> str:
    source = next((arg for arg in command if arg.endswith(".cpp")), "the link")
    text = output.read_text(errors="replace").strip()
    return f"{command[0]} failed on {source}: {text[-3000:]}"


def load(path: Path) -> ModuleType:
    """A built library as a module, straight from its file. Its module name is the
    file's (the TORCH_EXTENSION_NAME it was compiled with)."""
    import torch  # noqa: F401  (the library's symbols resolve against torch's)

    name = path.name.removesuffix(".so")
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def to_build(which: str, flags: frozenset[str] | None = None) -> list[Variant]:
    """``best``: the variant a start here loads; ``cpu``: every one this CPU runs;
    ``all``: every one of this architecture (an image for other machines)."""
    variants = variants_for()
    fits = runnable(variants, cpu_flags() if flags is None else flags)
    choices = {"best": fits[:1], "cpu": fits, "all": list(variants)}
    if which not in choices:
        raise ValueError(f"which variants: one of {', '.join(choices)}, not {which!r}")
    return choices[which]


def load_best(cache: Path, *, hint: str = "") -> ModuleType:
    """The best built variant this CPU runs, loaded (built first where none fits);
    which one and why, in one log line."""
    flags, variants = cpu_flags(), variants_for()
    identity = compiler_identity()
    built = {
        v.name: p for v in runnable(variants, flags) if (p := find_library(cache, v, identity))
    }
    choice = choose(variants, flags, set(built))
    path = build(cache, choice.variant, hint=hint) if choice.build else built[choice.variant.name]
    module = load(path)
    log.info(
        f"native CPU kernels: {choice.variant.name}",
        why=choice.why,
        library=str(path),
    )
    return module
