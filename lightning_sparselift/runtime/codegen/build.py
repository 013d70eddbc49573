"""Build a generated C++ kernel with ``torch.utils.cpp_extension`` (the machine's compiler and
ninja) into a cache keyed by the hash of its source and flags, and load it; or write a generated
Triton module there and import it. A second run of the same model finds the library there and
compiles nothing."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from lightning_sparselift.runtime.codegen.spec import Unsupported

# fbgemm's CPU kernels use fused multiply-adds where the generated source writes std::fma; without
# FMA instructions std::fma is still exact (a libm call), only slower. Contraction stays off so the
# compiler fuses nothing the source does not say.
_BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno"]


def cache_dir() -> Path:
    """``SPARSELIFT_KERNEL_CACHE``, else ``~/.cache/lightning_sparselift/kernels``."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_sparselift" / "kernels"
    return Path(os.environ.get("SPARSELIFT_KERNEL_CACHE", default))


# the vector instructions the generated loops may use, by what /proc/cpuinfo lists (each lane's
# arithmetic is the same at any width, so the results are too): AVX-512 where the CPU has it, as
# fbgemm's own kernels use it there
_AVX512 = ("avx512f", "avx512vl", "avx512bw", "avx512dq")


def _cpu_flags() -> list[str]:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    if not {"avx2", "fma"} <= flags:
        return []
    if set(_AVX512) <= flags:
        return ["-mavx2", "-mfma", *(f"-m{f}" for f in _AVX512), "-mprefer-vector-width=512"]
    return ["-mavx2", "-mfma"]


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` that the system releases when its process dies (a build that
    was killed leaves nothing that blocks the next one)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(name: str, folder: Path, source: str, flags: list[str], openmp: bool) -> None:
    from torch.utils import cpp_extension

    source_file = folder / "kernel.cpp"
    if not source_file.exists() or source_file.read_text() != source:
        source_file.write_text(source)
    # cpp_extension's own lock file, left behind by a build that was killed, would make it wait
    # forever; under our lock no other build of this folder runs
    (folder / "lock").unlink(missing_ok=True)
    try:
        cpp_extension.load(name, [str(source_file)], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"] if openmp else None, build_directory=str(folder),
                           is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as error:
        raise Unsupported(f"the generated kernel did not build here ({str(error).strip().splitlines()[-1]})") \
            from error


@dataclass
class BuiltKernel:
    library: Any  # the loaded ctypes.CDLL (C++) or Python module (Triton)
    path: str
    key: str
    cached: bool  # found in the cache: nothing was compiled
    build_s: float  # compile (or load) time


def build(source: str, entry_points: dict[str, tuple[Any, list[Any]]], kind: str, openmp: bool = False
          ) -> BuiltKernel:
    """The loaded library of ``source`` (with ``openmp``: its OpenMP pragmas on, linking the libgomp
    torch has loaded), its ``entry_points`` (name -> ctypes result and argument types) declared;
    ``kind`` names its cache folder. :class:`Unsupported` when it cannot be built here."""
    flags = _BASE_FLAGS + _cpu_flags() + (["-fopenmp"] if openmp else [])
    key = hashlib.sha256("\n".join([source, *flags, torch.__version__]).encode()).hexdigest()[:20]
    # cpp_extension remembers, per process, the extension names it built and where: the cache
    # folder is part of the name so another cache (e.g. a test's) builds its own
    root = cache_dir()
    name = f"sparselift_{kind}_{key}_{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:6]}"
    folder = root / name
    library = folder / f"{name}.so"
    built = folder / "built"  # written once the library is complete: ranks may build the same source at once
    start = time.perf_counter()
    cached = built.exists()
    if not cached:
        folder.mkdir(parents=True, exist_ok=True)
        # ranks building the same source share the folder: one builds, the others wait and load it
        with _locked(folder / "build.lock"):
            cached = built.exists()
            if not cached:
                _compile(name, folder, source, flags, openmp)
                built.touch()
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as error:
        raise Unsupported(f"the generated kernel {library} did not load ({error})") from error
    for entry, (result, arguments) in entry_points.items():
        getattr(loaded, entry).restype, getattr(loaded, entry).argtypes = result, arguments
    return BuiltKernel(loaded, str(library), key, cached, time.perf_counter() - start)


# imported Triton modules by file and mode (``TRITON_INTERPRET`` is read when a kernel is decorated)
_modules: dict[tuple[str, str], Any] = {}


def build_triton(source: str, kind: str) -> BuiltKernel:
    """The imported Triton module of ``source``, written once into the cache (Triton compiles each
    kernel specialisation on its first launch, into its own cache). :class:`Unsupported` when
    Triton is not installed or the source does not import."""
    try:
        import triton
    except ImportError as error:
        raise Unsupported("Triton is not installed (the gpu extra installs it)") from error
    key = hashlib.sha256("\n".join([source, triton.__version__]).encode()).hexdigest()[:20]
    folder = cache_dir() / f"sparselift_triton_{kind}_{key}"
    path = folder / "kernel.py"
    start = time.perf_counter()
    cached = path.exists()
    if not cached:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"kernel.py.{os.getpid()}"  # ranks writing at once: each renames a complete file
        partial.write_text(source)
        partial.replace(path)
    mode = (str(path), os.environ.get("TRITON_INTERPRET", "0"))
    if mode not in _modules:
        spec = importlib.util.spec_from_file_location(f"sparselift_triton_{kind}_{key}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # a generated module that does not import is a build failure
            raise Unsupported(f"the generated Triton kernel {path} did not import ({error})") from error
        _modules[mode] = module
    return BuiltKernel(_modules[mode], str(path), key, cached, time.perf_counter() - start)
