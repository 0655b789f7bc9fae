"""Types of the native module ``rvod._rvod`` (built from ``src/py/``).

Checked against the built module in CI (``tests/python/test_native_boundary.py``: every exported name is
here and every name here is exported, with the parameter names and defaults of its ``#[pyo3(signature)]``).
Only ``rvod.common`` (and the runner's build report and rendezvous) import this module.
"""

from collections.abc import Callable, Sequence
from typing import Any, final

__all__ = [
    "__version__",
    "COLLECTIVE_KINDS",
    "REDUCE_OPS",
    "DTYPES",
    "init",
    "launcher",
    "shutdown",
    "is_initialized",
    "topology",
    "submit",
    "poll",
    "wait",
    "add_process_set",
    "remove_process_set",
    "process_sets",
    "dynamic_process_sets",
    "transport_kind",
    "straggler_report",
    "note_elastic_reset",
    "build_info",
    "gpu_libraries",
    "device_stream",
    "capsule_device",
    "ucx_library",
    "start_timeline",
    "stop_timeline",
    "autotune_applied",
    "_set_tuned_values",
    "relabel_bool_as_uint8",
    "RendezvousServer",
    "StoreClient",
]

__version__: str

# Name -> code of what crosses the boundary, from the Rust types (src/types.rs).
COLLECTIVE_KINDS: dict[str, int]
REDUCE_OPS: dict[str, int]
DTYPES: dict[str, int]

def init(
    process_sets: Sequence[Sequence[int]] = ...,
    mpi: tuple[int, int, Callable[[bytes | None], bytes]] | None = None,
    dynamic_process_sets: bool = False,
) -> None: ...
def launcher() -> tuple[str, int, int] | None: ...
def shutdown(exiting: bool = False) -> None: ...
def is_initialized() -> bool: ...
def topology() -> tuple[int, int, int, int, int, int, bool]: ...
def submit(
    kind: int,
    names: str | Sequence[str],
    tensors: Any | Sequence[Any] | None,
    in_place: bool,
    reduce_op: int,
    prescale: float,
    postscale: float,
    root_rank: int,
    process_set_id: int,
    wait: bool = False,
    packed: bool = False,
    splits: Sequence[int] | None = None,
    stream: int | None = None,
    compression: int = 0,
) -> Any: ...
def poll(handle: int) -> bool: ...
def wait(handle: int, stream: int | None = None) -> tuple[list[Any | None], list[int] | None, int | None]: ...
def add_process_set(ranks: Sequence[int]) -> int: ...
def remove_process_set(process_set_id: int) -> bool: ...
def process_sets() -> list[tuple[int, list[int]]]: ...
def dynamic_process_sets() -> bool: ...
def transport_kind(process_set_id: int = 0) -> str | None: ...
def straggler_report(process_set_id: int) -> list[tuple[int, int, int, float, bool]] | None: ...
def note_elastic_reset() -> None: ...
def build_info() -> dict[str, Any]: ...
def gpu_libraries() -> dict[str, Any]: ...
def device_stream(ordinal: int) -> int: ...
def capsule_device(capsule: Any) -> tuple[int, int] | None: ...
def ucx_library() -> dict[str, Any]: ...
def start_timeline(file_path: str, mark_cycles: bool) -> None: ...
def stop_timeline() -> None: ...
def autotune_applied() -> list[dict[str, Any]]: ...

# Private (benches/autotune.py): every rank applies these knobs from the end of the global set's next round on,
# through autotune's path; only rank 0's call counts.
def _set_tuned_values(fusion_threshold: int, cycle_time_ms: float, cache_enabled: bool) -> None: ...
def relabel_bool_as_uint8(capsule: Any) -> bool: ...
@final
class RendezvousServer:
    def __new__(cls, host: str, port: int, secret: bytes) -> RendezvousServer: ...
    @property
    def port(self) -> int: ...
    def close(self) -> None: ...

@final
class StoreClient:
    def __new__(cls, host: str, port: int, secret: bytes, timeout: float) -> StoreClient: ...
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str, timeout: float) -> bytes: ...
    def try_get(self, key: str, timeout: float) -> bytes | None: ...
    def close(self) -> None: ...
