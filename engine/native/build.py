"""Compile the native sources (`block_gemm.c`, `decode_step.c`) with the system C compiler at
first use into one library, and load it with ctypes.

The shared library is cached under `PREFIXGATE_NATIVE_CACHE` (default
`~/.cache/prefixgate/native`), named by a hash of the source, the compiler command and the
OpenMP runtime it links, so an edited source or another torch rebuilds it. It links the OpenMP
runtime torch ships (`torch/lib/libgomp.so.1`) when there is one, so torch's ops and these
kernels share one thread pool. Nothing is downloaded; with no compiler, or
`PREFIXGATE_NATIVE_GEMM=off`, `load_library()` returns None and the engine keeps torch's kernels
(one warning in the log says why).

`PREFIXGATE_NATIVE_GEMM`: "auto" (default: the widest code the CPU runs: BF16 dot products for
products of 5-8 rows, beside AVX-512 float panels and AVX2; else AVX-512 float panels, AVX2, or
the scalar code), "avx512" (AVX-512 float products, no bfloat16 rounding), "avx2" (no AVX-512),
"scalar" (force the portable code) or "off" (no native library).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "block_gemm.c", HERE / "panels_avx512.c", HERE / "tiles_bf16.c",
           HERE / "decode_step.c", HERE / "argmax.c")
HEADERS = (HERE / "block_gemm.h", HERE / "blocks_avx512.h")
NativeMode = Literal["auto", "avx512", "avx2", "scalar", "off"]
NATIVE_MODES: tuple[str, ...] = get_args(NativeMode)
_CFLAGS = ("-O3", "-fPIC", "-fopenmp", "-std=c11", "-Wall", "-Wextra", "-Werror")


class NativeBuildError(RuntimeError):
    """The native library could not be compiled or loaded (the message says why)."""


@dataclass(frozen=True, slots=True)
class NativeSettings:
    """What the environment asks of the native kernels (validated)."""

    mode: NativeMode
    cache_dir: Path

    def __post_init__(self) -> None:
        if self.mode not in NATIVE_MODES:
            raise ValueError(
                f"PREFIXGATE_NATIVE_GEMM must be one of {NATIVE_MODES}, got {self.mode!r}"
            )

    @classmethod
    def from_env(cls) -> NativeSettings:
        mode = os.environ.get("PREFIXGATE_NATIVE_GEMM", "auto").strip().lower() or "auto"
        default_cache = Path.home() / ".cache" / "prefixgate" / "native"
        cache = os.environ.get("PREFIXGATE_NATIVE_CACHE") or str(default_cache)
        return cls(mode, Path(cache))  # type: ignore[arg-type]  # checked in __post_init__


def torch_openmp_runtime() -> Path | None:
    """The libgomp torch loaded (its own copy in torch/lib), or None (then the system one)."""
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return lib if lib.is_file() else None


def _compiler() -> str:
    wanted = os.environ.get("CC") or "gcc"
    cc = shutil.which(wanted) or (None if "CC" in os.environ else shutil.which("cc"))
    if cc is None:
        raise NativeBuildError(f"no C compiler found ({wanted!r} is not on PATH)")
    return cc


def _compile_commands(cc: str, tmp: Path, out: Path, gomp: Path | None) -> list[list[str]]:
    objects = [str(tmp / f"{source.stem}.o") for source in SOURCES]
    compiles = [
        [cc, *_CFLAGS, "-c", str(source), "-o", obj]
        for source, obj in zip(SOURCES, objects, strict=True)
    ]
    if gomp is None:  # no private runtime in torch: link the system's (same as torch's then)
        return [*compiles, [cc, "-shared", "-fopenmp", *objects, "-o", str(out), "-lm"]]
    link = [cc, "-shared", *objects, "-o", str(out), str(gomp), f"-Wl,-rpath,{gomp.parent}"]
    return [*compiles, [*link, "-lm"]]


def _cache_key(cc: str, gomp: Path | None) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(repr((_CFLAGS, version.stdout.splitlines()[:1], str(gomp))).encode())
    return digest.hexdigest()[:16]


def build_library(cache_dir: Path) -> Path:
    """The compiled library's path, compiling it into `cache_dir` when it is not there yet."""
    cc = _compiler()
    gomp = torch_openmp_runtime()
    target = cache_dir / f"native-{_cache_key(cc, gomp)}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        out = Path(tmp) / "native.so"
        for cmd in _compile_commands(cc, Path(tmp), out, gomp):
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise NativeBuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(out, target)  # atomic: a concurrent build writes the same bytes
    return target


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The native kernels (built on first call), or None when off or unbuildable (logged)."""
    settings = NativeSettings.from_env()
    if settings.mode == "off":
        log.warning("PREFIXGATE_NATIVE_GEMM=off: int8/int4 layers use torch's kernels")
        return None
    try:
        import torch  # noqa: F401  # torch's libgomp must be loaded before ours resolves it

        return ctypes.CDLL(str(build_library(settings.cache_dir)))
    except (NativeBuildError, OSError) as exc:
        log.warning("native int8/int4 kernels unavailable, using torch's kernels: %s", exc)
        return None
