"""The native engine's library: built once from ``nbmem/tracking/_native/allocations.cpp``, loaded with ctypes.

Tracked mode's dispatch mode costs each op a trip into Python; the native
engine (:mod:`nbmem.tracking.native_tracking`) counts allocations in C++ instead, by
wrapping the CPU allocator (the source says how). It is compiled on first use
against the installed torch's headers with the system's C++ compiler (``g++``, or ``$CXX``):
about 3 s on a 2-core machine, then cached under ``$NBMEM_CACHE`` (default
``~/.cache/nbmem``) by a hash of the source, the torch build and the
compiler, so a new torch gets a new build. No package is added for it:
torch ships the headers and ``torch.utils.cpp_extension`` knows the paths and
the ABI flag; ``ninja`` is not needed for one file.

>>> lib = library()                # doctest: +SKIP
>>> lib.nbmem_installed()          # doctest: +SKIP
0
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["NativeUnavailable", "library", "available", "SOURCE", "cache_dir", "build_shared"]

SOURCE = Path(__file__).with_name("_native") / "allocations.cpp"


class NativeUnavailable(RuntimeError):
    """The native engine can't be built or loaded here; the message says why and what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("NBMEM_CACHE") or Path.home() / ".cache" / "nbmem")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _command(compiler: str, source: Path, output: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libraries = cpp_extension.library_paths()
    return [
        compiler, "-O2", "-shared", "-fPIC", "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        str(source), "-o", str(output),
        *(f"-L{path}" for path in libraries), "-lc10", "-ltorch_cpu",
        *(f"-Wl,-rpath,{path}" for path in libraries),
    ]


def build_shared(source: Path, stem: str, error: type[Exception] = RuntimeError, instead: str = "") -> Path:
    """``source`` (one C++ file against torch's headers) built into ``$NBMEM_CACHE/<stem>-<key>.so``, or found there.

    The key hashes the source, the torch build and the compiler. Raises
    ``error`` saying why (no compiler, the compiler's own words) and, where
    given, ``instead``: what to do then.
    """
    import torch

    compiler = _compiler()
    tail = f": {instead}" if instead else ""
    if compiler is None:
        raise error(f"building {source.name} needs a C++ compiler (g++): install one (apt-get install g++) or set "
                    f"$CXX{tail}")
    key = hashlib.sha256(
        source.read_bytes() + f"{torch.__version__}|{torch.__file__}|{compiler}".encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        try:
            process = subprocess.run(_command(compiler, source, built), capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as failure:
            raise error(f"building {source.name} failed ({failure}){tail}") from None
        if process.returncode != 0:
            raise error(f"building {source.name} with {compiler} failed (exit {process.returncode}){tail}. The "
                        f"compiler said:\n{process.stderr[-2000:]}")
        os.replace(built, target)  # atomic: another process building the same key finds a whole file
    return target


def _build() -> Path:
    return build_shared(SOURCE, "allocations", NativeUnavailable,
                        "engine 'native' builds a small C++ library once; use engine='dispatch', the default")


@functools.cache
def library() -> ctypes.PyDLL:
    """The loaded library, built first if needed, its accounts empty; raises NativeUnavailable saying why not.

    PyDLL: every call holds the GIL, so a call is one step that Ctrl-C can't cut in two.
    """
    import torch  # noqa: F401  (loads libc10 and libtorch_cpu, which the library links against)

    from ..core.units import CUDA_BLOCK

    try:
        lib = ctypes.PyDLL(str(_build()))
    except OSError as error:
        raise NativeUnavailable(f"loading nbmem's native engine failed ({error}): use engine='dispatch'") from None
    i64, i32, pointer = ctypes.c_int64, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)
    signatures = {
        "nbmem_install": ((), ctypes.c_int),
        "nbmem_uninstall": ((), ctypes.c_int),
        "nbmem_installed": ((), ctypes.c_int),
        "nbmem_registered": ((), ctypes.c_int),
        "nbmem_unregister": ((), ctypes.c_int),
        "nbmem_storage_address": ((i64,), i64),
        "nbmem_reset": ((i64,), None),
        "nbmem_adopt": ((i64, i64, ctypes.c_int, i64), ctypes.c_int),
        "nbmem_release": ((i64, ctypes.py_object), None),
        "nbmem_classify": ((i64, i32, i32), ctypes.c_int),
        "nbmem_host": ((ctypes.c_int,), ctypes.c_int),
        "nbmem_host_reset": ((), None),
        "nbmem_forget": ((i64,), ctypes.c_int),
        "nbmem_block": ((i64, pointer), ctypes.c_int),
        "nbmem_set_module": ((i32,), None),
        "nbmem_reset_peak": ((), None),
        "nbmem_figures": ((pointer,), None),
        "nbmem_breakdown": ((pointer, i64, ctypes.c_int), i64),
        "nbmem_blocks": ((pointer, i64), i64),
        "nbmem_lines_start": ((ctypes.c_char_p,), None),
        "nbmem_lines_stop": ((), None),
        "nbmem_lines_here": ((), None),
        "nbmem_lines_forget": ((), None),
        "nbmem_lines": ((pointer, i64, ctypes.c_int), i64),
        "nbmem_line_where": ((i32, ctypes.POINTER(i32)), ctypes.c_char_p),
    }
    for name, (arguments, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = arguments
        function.restype = result
    lib.nbmem_reset(CUDA_BLOCK)
    return lib


def available() -> bool:
    """Whether the native engine can run here (builds it on the first call)."""
    try:
        library()
    except NativeUnavailable:
        return False
    return True
