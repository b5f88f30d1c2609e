"""Builds and loads the compiled CPU kernels of the "native" bundle (csrc/cpu_decode.c, plain C, no torch headers).

`native_library()` compiles the source once per machine with the system C compiler (`$CC` when set, else `gcc`,
else `cc`; about a second) into a cache folder keyed by the source, the flags, the compiler's version and the machine type
(`$HYBRID_SERVE_NATIVE_CACHE`, else `$XDG_CACHE_HOME/hybrid-serve/native`, else `~/.cache/hybrid-serve/native`),
under a file lock (processes that start together build it once; the others wait and load it), written to a
temporary name and renamed into place (a crash never leaves a half-written library). Later loads find it there.
The library is loaded with ctypes; `NativeBuildError` says what to install (or to choose kernel_backend='torch')
when it cannot be built. Nothing here falls back to another implementation.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "cpu_decode.c"
# portable flags: no -march (the source picks its instruction set per function at load time: target_clones);
# -ffp-contract=fast: a * b + c may run as one fused multiply-add (ISO C modes turn that off)
CFLAGS = ("-O3", "-std=c11", "-ffp-contract=fast", "-fno-math-errno", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300


class NativeBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded."""


P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# C function -> its argument types (pointers as addresses), in the order of csrc/cpu_decode.c; each returns an
# int64 status (0: done, -1: a slot, page or expert id out of range, nothing touched)
SIGNATURES = {
    "hs_ssu_f32": (P, I64, P, I64, I64, I64, I64, I64, P, I64, P, I64, P, P, I64, P, I64, P, P, F32, F32, P),
    "hs_ssd_scan_f32": (I64, I64, I64, I64, I64, P, I64, P, I64, P, P, I64, P, I64, P, P, P, P, P, P, I64, I64, P, P),
    "hs_conv_update_f32": (P, I64, P, I64, I64, I64, P, I64, P, P, P),
    "hs_decode_attention_f32": (P, I64, P, P, I64, P, I64, I64, P, P, P, I64, I64, I64, I64, F32, P, P),
    "hs_moe_experts_f32": (P, I64, I64, I64, I64, I64, P, P, P, P, I64, P, P, P),
    "hs_gated_norm_f32": (P, I64, P, I64, I64, I64, I64, P, F32, P),
    "hs_conv_varlen_f32": (P, I64, I64, I64, P, P, P, P, I64, P, P),
    "hs_add_rms_norm_f32": (P, I64, P, I64, I64, I64, P, F32, P, P),
    "hs_moe_route_f32": (P, I64, I64, P, I64, I64, F32, P, P, P),
}


def compiler() -> str:
    """The C compiler to build with: $CC when set (it must exist), else gcc, else cc (NativeBuildError when none
    is found)."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "cc"]
    for name in names:
        if shutil.which(name):
            return name
    raise NativeBuildError(
        f"kernel_backend='native' compiles its CPU kernels with a C compiler: {' or '.join(names)} not found "
        "(install gcc or set $CC), or choose kernel_backend='torch'"
    )


def cache_dir() -> Path:
    if os.environ.get("HYBRID_SERVE_NATIVE_CACHE"):
        return Path(os.environ["HYBRID_SERVE_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybrid-serve" / "native"


def _build_key(cc: str) -> str:
    """Hash of everything the library's bits depend on: source, flags, compiler version, machine type."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"C compiler {cc!r} does not run ({e}); fix it or choose kernel_backend='torch'") from e
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (*CFLAGS, version, platform.machine()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _compile(cc: str, target: Path) -> None:
    """Compiles SOURCE into target (via a temporary file in its folder, renamed into place)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeBuildError(
                f"building the native CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}\n"
                "fix the compiler setup or choose kernel_backend='torch'"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path() -> Path:
    """The built library for this machine: compiled under a file lock if not cached yet."""
    cc = compiler()
    folder = cache_dir() / _build_key(cc)
    target = folder / "cpu_decode.so"
    if target.exists():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not target.exists():
                _compile(cc, target)
    except OSError as e:
        raise NativeBuildError(
            f"cannot build the native CPU kernels in {folder} ({e}); set $HYBRID_SERVE_NATIVE_CACHE to a writable "
            "folder, or choose kernel_backend='torch'"
        ) from e
    return target


@functools.cache
def native_library() -> ctypes.CDLL:
    """The loaded library (built first if needed), argument types set; one load per process."""
    path = library_path()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeBuildError(
            f"loading {path} failed ({e}); delete it to rebuild, or choose kernel_backend='torch'"
        ) from e
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, I64
    return lib
