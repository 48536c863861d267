"""Compile the CPU kernels (every ``csrc/*.c``) once per machine into the extension module
``_specbatch_cpu`` and import it.

The library is built with the system C compiler for the CPU it runs on (``-march=native``) into
a cache folder keyed by the sources, the flags, the compiler and the CPU's feature flags, so a
second start only loads it. Set ``SPECBATCH_CPU_KERNELS=0`` to run the pure-torch path, and
``SPECBATCH_KERNEL_CACHE`` to move the cache (default ``~/.cache/specbatch/kernels``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
# the AVX2 build on a CPU that also has AVX-512 (tests exercise both paths on such a machine)
AVX2_ONLY = ("-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16")
MODULE = "_specbatch_cpu"


class KernelBuildError(RuntimeError):
    """The kernels cannot be built or loaded on this machine (the message says why)."""


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    env = os.environ.get("SPECBATCH_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specbatch" / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    return cc


def library_path(avx2_only: bool = False, csrc: Path = CSRC, defines: tuple[str, ...] = ()) -> Path:
    """Where the library for this machine lives; built there first if it is not.
    ``avx2_only`` builds the AVX2 path even where the CPU has AVX-512; ``csrc`` is the folder
    of the sources (another version of them, for a benchmark's A/B); ``defines`` are macros
    for the compiler (a test build of a path this CPU would not take)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KernelBuildError(f"only built on Linux x86-64, this is {platform.platform()}")
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        raise KernelBuildError("the CPU has no AVX2 and FMA")
    build_flags = (*FLAGS, *(AVX2_ONLY if avx2_only else ()), *(f"-D{m}" for m in defines))
    cc = _compiler()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the C compiler '{cc}' does not run: {e}") from e
    digest = hashlib.sha256()
    sources = sorted(csrc.glob("*.c"))
    for path in (*sources, *sorted(csrc.glob("*.h"))):
        digest.update(path.name.encode() + path.read_bytes())
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise KernelBuildError(f"no Python headers (Python.h) under {include}")
    digest.update(" ".join((*build_flags, version, include, *sorted(flags))).encode())
    out_dir = cache_dir()
    lib = out_dir / f"{MODULE}-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    cmd = [cc, *build_flags, f"-I{include}", "-o", tmp, *map(str, sources), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelBuildError(f"compiling failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
        os.replace(tmp, lib)  # atomic: parallel builders race harmlessly
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load_module(
    avx2_only: bool = False, csrc: Path = CSRC, defines: tuple[str, ...] = ()
) -> ModuleType:
    import torch  # noqa: F401  (torch's OpenMP runtime must be the one the module binds to)

    path = library_path(avx2_only, csrc, defines)
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as e:
        raise KernelBuildError(f"cannot load {path}: {e}") from e
    return module
