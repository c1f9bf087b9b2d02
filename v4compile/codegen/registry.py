"""The kernel registry: every generated kernel with a stable name, its source, launch configuration,
the graph region it replaced, and a disk cache keyed by the hash of its source."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import logs, progress

_LOG = logs.logger("kernels")


def cache_dir() -> Path:
    """Where generated kernel sources live (``V4COMPILE_CACHE`` or ``~/.cache/v4compile/kernels``)."""
    root = os.environ.get("V4COMPILE_CACHE") or Path.home() / ".cache" / "v4compile" / "kernels"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_names() -> list[str]:
    """Names of the kernels built before into this disk cache, by any process (one marker file per name): lets
    a tool answer for a name without compiling anything."""
    folder = cache_dir() / "names"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _remember_name(name: str) -> None:
    folder = cache_dir() / "names"
    folder.mkdir(exist_ok=True)
    (folder / name).touch()


@dataclass
class KernelRecord:
    """What a user may inspect about one kernel."""

    name: str
    backend: str
    op: str
    source: str
    source_hash: str
    path: str
    lowered: str | None = None
    launch: dict[str, Any] = field(default_factory=dict)
    regions: list[str] = field(default_factory=list)
    error: str | None = None
    launches: int = 0


class KernelBuildError(RuntimeError):
    """A generated kernel that could not be built."""


class KernelRegistry:
    """Builds kernels from generated source once per source hash and remembers them by stable name."""

    def __init__(self) -> None:
        self.records: dict[str, KernelRecord] = {}
        self._kernels: dict[str, Any] = {}
        self._failed: dict[str, str] = {}
        self._by_key: dict[tuple[str, Hashable], Any] = {}
        self._pending_regions: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def build(self, name: str, backend: str, op: str, make_source: Callable[[], str],
              loader: Callable[[Path], Any], key: Hashable = ()) -> Any:
        """Returns the kernel of ``name`` specialised by ``key``; on first use generates its source, writes it
        to the disk cache (one file per source hash) and loads it. Later calls cost one dict lookup."""
        built = self._by_key.get((name, key))
        if built is not None:
            return built
        kernel = self._build(name, backend, op, make_source(), loader)
        self._by_key[(name, key)] = kernel
        return kernel

    def _build(self, name: str, backend: str, op: str, source: str, loader: Callable[[Path], Any]) -> Any:
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        key = f"{name}:{digest}"
        with self._lock:
            if key in self._kernels:
                return self._kernels[key]
            if key in self._failed:
                raise KernelBuildError(f"kernel {name} failed to build: {self._failed[key]}")
            path = cache_dir() / f"{name.replace('.', '_')}_{digest}.py"
            if not path.exists() or path.read_text() != source:
                path.write_text(source)
            _remember_name(name)
            record = self.records.get(name) or KernelRecord(name, backend, op, source, digest, str(path),
                                                            regions=self._pending_regions.pop(name, []))
            record.source, record.source_hash, record.path = source, digest, str(path)
            self.records[name] = record
            try:
                kernel = loader(path)
            except Exception as exc:  # any build failure becomes a reported fallback
                record.error = self._failed[key] = f"{type(exc).__name__}: {exc}"
                raise KernelBuildError(f"kernel {name} failed to build: {record.error}") from exc
            record.error = None  # an earlier failure belonged to another specialisation of this name
            _LOG.info("built %s (%s, %s) from %s", name, backend, op, path)
            self._kernels[key] = kernel
            return kernel

    def launch(self, name: str, run: Callable[[], Any]) -> Any:
        """Runs a kernel launch; a kernel whose first launch fails is marked failed (it then falls back). A later
        launch that fails (a launch configuration or shape compiled for the first time) falls back for that call
        only: the kernel keeps serving the launches that work."""
        record = self.records.get(name)
        if record is not None and record.error:
            raise KernelBuildError(f"kernel {name} failed: {record.error}")
        if record is None:
            return run()
        try:
            if record.launches:
                return run()
            start = time.perf_counter()
            out = run()
            progress.log(f"kernel {name}: built and first launched ({time.perf_counter() - start:.1f} s)")
            return out
        except Exception as exc:  # first launch compiles (GPU) or first interprets (CPU): a build failure
            if record.launches:
                raise KernelBuildError(f"kernel {name} failed on this launch: {type(exc).__name__}: {exc}") from exc
            record.error = f"{type(exc).__name__}: {exc}"
            for key in [k for k in self._kernels if k.startswith(f"{name}:")]:
                self._failed[key] = record.error
                del self._kernels[key]
            for key in [k for k in self._by_key if k[0] == name]:
                del self._by_key[key]
            raise KernelBuildError(f"kernel {name} failed to build: {record.error}") from exc

    def note_launch(self, name: str, **launch: Any) -> None:
        """Records the launch configuration of the latest launch of ``name``."""
        record = self.records.get(name)
        if record is not None:
            record.launch = launch
            record.launches += 1
            if record.launches == 1:
                _LOG.info("%s: first launch %s", name, launch)

    def note_region(self, name: str, region: str) -> None:
        """Records that ``name`` replaced the graph region described by ``region``."""
        record = self.records.get(name)
        regions = record.regions if record is not None else self._pending_regions.setdefault(name, [])
        if region not in regions:
            regions.append(region)

    def set_lowered(self, name: str, lowered: str) -> None:
        """Stores the backend's lowered code (PTX/TTGIR, or TileLang's generated C/CUDA)."""
        if name in self.records:
            self.records[name].lowered = lowered


REGISTRY = KernelRegistry()


def load_module(path: Path) -> Any:
    """Imports a generated source file as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot import generated kernel {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_fallback(name: str, fast: Callable[[], Any], reference: Callable[[], Any],
                  instead: str = "the reference implementation") -> Any:
    """Runs ``fast``; if its kernel cannot be built, warns naming kernel, error and ``instead`` (what runs in its
    place) and runs ``reference``."""
    try:
        return fast()
    except KernelBuildError as exc:
        warnings.warn(f"v4compile: {exc}; using {instead} instead", RuntimeWarning, stacklevel=3)
        return reference()
