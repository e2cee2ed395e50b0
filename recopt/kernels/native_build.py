"""Building recopt's small native C libraries (`cpu_fused`, `cpu_id_map`) at first use.

Each library is one C source plus the headers it includes, without torch headers, so it
compiles in about a second with the system C compiler. The shared object is cached per
source text, flags and machine in a per-user temporary directory and loaded with ctypes;
its functions get the ctypes signatures given. A missing compiler is a `RuntimeError`, a
failed compile a `subprocess.CalledProcessError`: the callers fall back to torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# A function's ctypes result type (None: void) and argument types.
Signatures = Mapping[str, tuple[type | None, list[type]]]


def cache_dir() -> str:
    """Where built libraries are kept (one directory per user)."""
    return os.path.join(tempfile.gettempdir(), f"recopt-native-{os.getuid()}")


def build_library(
    source: Path, headers: Sequence[Path], flags: Sequence[str], signatures: Signatures
) -> ctypes.CDLL:
    """Compile ``source`` (once per source, headers, flags and machine), load it, type it.

    Args:
        source: the C file.
        headers: the files it includes (copied beside it for the build, hashed with it).
        flags: the compiler's flags (``-shared -fPIC`` among them).
        signatures: every function to declare, by name.

    Raises:
        RuntimeError: no C compiler (cc/gcc) on PATH.
        subprocess.CalledProcessError: the compiler refused the source or the flags.
    """
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    files = [source, *headers]
    texts = [f.read_text() for f in files]
    key = hashlib.sha256(
        "\0".join([*texts, *flags, platform.machine(), platform.node()]).encode()
    ).hexdigest()[:16]
    directory = cache_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{source.stem}_{key}.so")
    if not os.path.exists(path):
        build_dir = tempfile.mkdtemp(dir=directory)  # the source beside its headers, as hashed
        for file, text in zip(files, texts, strict=True):
            with open(os.path.join(build_dir, file.name), "w") as f:
                f.write(text)
        tmp = path + f".{os.getpid()}.tmp"
        try:
            subprocess.run(
                [compiler, *flags, os.path.join(build_dir, source.name), "-o", tmp, "-lm"],
                check=True,
                capture_output=True,
            )
            os.replace(tmp, path)  # atomic: concurrent builders never see a partial library
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    library = ctypes.CDLL(path)
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(library, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return library


def address(tensor: torch.Tensor | None) -> int | None:
    """A tensor's data pointer as a ctypes pointer argument (None: NULL)."""
    return None if tensor is None else tensor.data_ptr()


class LazyLibrary:
    """One native library, built at the first `available()` call (thread-safe), or never.

    Args:
        what: its name in the warning logged when it cannot be built.
        build: compiles and loads it (`build_library`).
    """

    def __init__(self, what: str, build: Callable[[], ctypes.CDLL]) -> None:
        self._what = what
        self._build = build
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._failed = False

    def available(self) -> bool:
        """Whether the library is built and loaded (builds it on the first call)."""
        with self._lock:
            if self._library is None and not self._failed:
                try:
                    self._library = self._build()
                except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
                    self._failed = True
                    logger.warning("recopt %s unavailable (%s); using torch ops", self._what, err)
        return self._library is not None

    def get(self, caller: str) -> ctypes.CDLL:
        """The loaded library.

        Raises:
            RuntimeError: it is not loaded (``caller`` should have asked `available()`).
        """
        if self._library is None:
            raise RuntimeError(f"{caller}: {self._what} not loaded; call available() first")
        return self._library
