"""Where an estimator keeps its data and runs: horovod.spark.common.store's API over pyarrow filesystems.

A store is a prefix path with fixed places under it: ``intermediate_train_data.<idx>`` and
``intermediate_val_data.<idx>`` (the DataFrame as Parquet, written by Spark), and ``runs/<run_id>/``
(``checkpoint``, rewritten after every epoch, and ``logs/``). Stores are pickled to the ranks, which write
checkpoints through them.

- ``LocalStore``: a path of this machine (or one every executor mounts at the same place), ``file://`` optional.
- ``FilesystemStore``: any URL pyarrow's ``FileSystem.from_uri`` knows (``file://``, ``s3://``, ``gs://``,
  ...); only local paths are tested here.
- ``HDFSStore`` (``hdfs://``) and ``DBFSLocalStore`` (``dbfs:/``) are written after Horovod's but cannot be
  tested on this project's machines (no Hadoop, no Databricks): they raise naming what is missing (libhdfs
  and Hadoop's CLASSPATH; the ``/dbfs`` FUSE mount) rather than failing later.

``Store.create(prefix_path)`` picks the class from the path, as Horovod's does.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

WHERE = "rvod.spark.common.store"


class Store:
    """The store API the estimators use (Horovod's names)."""

    @staticmethod
    def create(prefix_path: str, *args: Any, **kwargs: Any) -> Store:
        """The store for ``prefix_path``: HDFSStore for ``hdfs://``, DBFSLocalStore for ``dbfs:/``,
        LocalStore for a plain path or ``file://``, FilesystemStore for other URLs."""
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if DBFSLocalStore.matches(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        if "://" not in prefix_path or LocalStore.matches(prefix_path):
            return LocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    def get_filesystem(self):
        raise NotImplementedError

    def get_train_data_path(self, idx: Any = None) -> str:
        raise NotImplementedError

    def get_val_data_path(self, idx: Any = None) -> str:
        raise NotImplementedError

    def get_test_data_path(self, idx: Any = None) -> str:
        raise NotImplementedError

    def saving_runs(self) -> bool:
        raise NotImplementedError

    def get_runs_path(self) -> str:
        raise NotImplementedError

    def get_run_path(self, run_id: str) -> str:
        raise NotImplementedError

    def get_checkpoint_path(self, run_id: str) -> str | None:
        raise NotImplementedError

    def get_checkpoint_filename(self) -> str:
        raise NotImplementedError

    def get_logs_path(self, run_id: str) -> str | None:
        raise NotImplementedError

    def get_logs_subdir(self) -> str:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def write(self, path: str, data: bytes) -> None:
        raise NotImplementedError

    def get_full_path(self, path: str) -> str:
        raise NotImplementedError

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        raise NotImplementedError

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        raise NotImplementedError


class FilesystemStore(Store):
    """A store on a pyarrow filesystem, rooted at ``prefix_path``.

    ``train_path``/``val_path``/``test_path``/``runs_path`` replace the default places; ``save_runs=False``
    keeps no checkpoints or logs; ``checkpoint_filename`` names each run's checkpoint (default ``checkpoint``:
    ``torch.save`` bytes for TorchEstimator, a ``.keras`` archive for KerasEstimator).
    """

    PREFIX = ""

    def __init__(self, prefix_path: str, train_path: str | None = None, val_path: str | None = None,
                 test_path: str | None = None, runs_path: str | None = None, save_runs: bool = True,
                 checkpoint_filename: str | None = None, **filesystem_kwargs: Any):
        self.prefix_path = prefix_path
        self._scheme = prefix_path.split("://", 1)[0] if "://" in prefix_path else "file"
        self._fs, self._root = self._open(prefix_path, **filesystem_kwargs)
        self._train_path = train_path or self._path("intermediate_train_data")
        self._val_path = val_path or self._path("intermediate_val_data")
        self._test_path = test_path or self._path("intermediate_test_data")
        self._runs_path = runs_path or self._path("runs")
        self._save_runs = save_runs
        self._checkpoint_filename = checkpoint_filename

    def _open(self, prefix_path: str, **filesystem_kwargs: Any):
        from pyarrow import fs

        if filesystem_kwargs:
            raise TypeError(f"{WHERE}: {type(self).__name__} takes no filesystem options "
                            f"{sorted(filesystem_kwargs)}")
        return fs.FileSystem.from_uri(prefix_path)

    def _path(self, key: str) -> str:
        return posixpath.join(self._root, key)

    @classmethod
    def matches(cls, path: str) -> bool:
        return bool(cls.PREFIX) and path.startswith(cls.PREFIX)

    def get_filesystem(self):
        return self._fs

    @property
    def fs(self):
        return self._fs

    def get_train_data_path(self, idx: Any = None) -> str:
        return self._train_path if idx is None else f"{self._train_path}.{idx}"

    def get_val_data_path(self, idx: Any = None) -> str:
        return self._val_path if idx is None else f"{self._val_path}.{idx}"

    def get_test_data_path(self, idx: Any = None) -> str:
        return self._test_path if idx is None else f"{self._test_path}.{idx}"

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self._runs_path, run_id)

    def get_checkpoint_filename(self) -> str:
        return self._checkpoint_filename or "checkpoint"

    def get_checkpoint_path(self, run_id: str) -> str | None:
        return posixpath.join(self.get_run_path(run_id), self.get_checkpoint_filename()) if self._save_runs else None

    def get_logs_subdir(self) -> str:
        return "logs"

    def get_logs_path(self, run_id: str) -> str | None:
        return posixpath.join(self.get_run_path(run_id), self.get_logs_subdir()) if self._save_runs else None

    def exists(self, path: str) -> bool:
        from pyarrow import fs

        return self._fs.get_file_info(path).type != fs.FileType.NotFound

    def read(self, path: str) -> bytes:
        with self._fs.open_input_stream(path) as stream:
            return stream.read()

    def write(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (its folders made as needed), replacing it whole."""
        self._fs.create_dir(posixpath.dirname(path), recursive=True)
        temporary = f"{path}.part-{os.getpid()}"
        with self._fs.open_output_stream(temporary) as stream:
            stream.write(data)
        self._fs.move(temporary, path)

    def delete(self, path: str) -> None:
        """Remove ``path`` (a file or a folder) if it exists."""
        from pyarrow import fs

        kind = self._fs.get_file_info(path).type
        if kind == fs.FileType.Directory:
            self._fs.delete_dir(path)
        elif kind != fs.FileType.NotFound:
            self._fs.delete_file(path)

    def get_full_path(self, path: str) -> str:
        """``path`` as a URL Spark can read and write."""
        return f"{self._scheme}://{path}"

    def get_full_path_fn(self) -> Callable[[str], str]:
        return self.get_full_path

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """A context giving a local folder for a rank's outputs (logs), copied to the run by ``sync_fn``."""

        @contextlib.contextmanager
        def local_run_path() -> Iterator[str]:
            folder = tempfile.mkdtemp(prefix="rvod-run-")
            try:
                yield folder
            finally:
                shutil.rmtree(folder, ignore_errors=True)

        return local_run_path

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A function copying a local folder's files into this run's folder of the store."""
        run_path = self.get_run_path(run_id)
        store = self

        def sync(local_root: str) -> None:
            for folder, _, files in os.walk(local_root):
                relative = os.path.relpath(folder, local_root)
                for name in files:
                    with open(os.path.join(folder, name), "rb") as file:
                        target = posixpath.normpath(posixpath.join(run_path, relative, name))
                        store.write(target, file.read())

        return sync


class LocalStore(FilesystemStore):
    """A store in a folder of the local filesystem (``file://`` optional); with several hosts, the folder
    must be shared by all of them (NFS) at the same path."""

    PREFIX = "file://"

    def _open(self, prefix_path: str, **filesystem_kwargs: Any):
        from pyarrow import fs

        if filesystem_kwargs:
            raise TypeError(f"{WHERE}: LocalStore takes no filesystem options {sorted(filesystem_kwargs)}")
        path = prefix_path[len(self.PREFIX):] if self.matches(prefix_path) else prefix_path
        return fs.LocalFileSystem(), os.path.abspath(path)

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        run_path = self.get_run_path(run_id)

        @contextlib.contextmanager
        def local_run_path() -> Iterator[str]:
            os.makedirs(run_path, exist_ok=True)
            yield run_path

        return local_run_path

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        def sync(local_root: str) -> None:
            """Outputs were written into the run's folder itself: nothing to copy."""

        return sync


class HDFSStore(FilesystemStore):
    """A store on HDFS (``hdfs://[host[:port]]/path``) through pyarrow's HadoopFileSystem, which needs
    libhdfs (``ARROW_LIBHDFS_DIR`` or ``HADOOP_HOME``), Java, and Hadoop's jars on ``CLASSPATH``
    (``hadoop classpath --glob``). Not tested here: this project's machines have no Hadoop."""

    PREFIX = "hdfs://"

    def __init__(self, prefix_path: str, host: str = "default", port: int = 0, user: str | None = None,
                 kerb_ticket: str | None = None, extra_conf: dict[str, str] | None = None, **kwargs: Any):
        self._connect = {"host": host, "port": port, "user": user, "kerb_ticket": kerb_ticket,
                         "extra_conf": extra_conf}
        super().__init__(prefix_path, **kwargs)

    def _open(self, prefix_path: str, **filesystem_kwargs: Any):
        from pyarrow import fs

        if filesystem_kwargs:
            raise TypeError(f"{WHERE}: HDFSStore takes no filesystem options {sorted(filesystem_kwargs)}")
        rest = prefix_path[len(self.PREFIX):]
        authority, _, path = rest.partition("/")
        host, port = self._connect["host"], self._connect["port"]
        if authority:
            host, _, given_port = authority.partition(":")
            port = int(given_port) if given_port else port
        try:
            filesystem = fs.HadoopFileSystem(host, port, user=self._connect["user"],
                                             kerb_ticket=self._connect["kerb_ticket"],
                                             extra_conf=self._connect["extra_conf"])
        except (OSError, RuntimeError) as error:
            raise RuntimeError(
                f"{WHERE}: HDFSStore({prefix_path!r}) cannot reach HDFS: pyarrow's HadoopFileSystem needs "
                "libhdfs (set ARROW_LIBHDFS_DIR or HADOOP_HOME), Java (JAVA_HOME) and Hadoop's jars on CLASSPATH "
                f"(`hadoop classpath --glob`); pyarrow said: {error}") from error
        return filesystem, "/" + path

    def get_full_path(self, path: str) -> str:
        return f"hdfs://{path}" if self._connect["host"] == "default" else \
            f"hdfs://{self._connect['host']}:{self._connect['port']}{path}"


class DBFSLocalStore(LocalStore):
    """A store on Databricks' DBFS (``dbfs:/path``), reached through the ``/dbfs`` FUSE mount of the
    Databricks runtime as Horovod's DBFSLocalStore does. Not tested here: there is no Databricks runtime."""

    PREFIX = "dbfs:/"

    def _open(self, prefix_path: str, **filesystem_kwargs: Any):
        if not os.path.isdir("/dbfs"):
            raise RuntimeError(f"{WHERE}: DBFSLocalStore({prefix_path!r}) needs the /dbfs FUSE mount of a Databricks "
                               "runtime, and this machine has none; use a LocalStore on a shared path instead")
        local = "/dbfs/" + prefix_path[len(self.PREFIX):].lstrip("/")
        return super()._open(local, **filesystem_kwargs)

    def get_full_path(self, path: str) -> str:
        return "dbfs:/" + path[len("/dbfs/"):] if path.startswith("/dbfs/") else f"file://{path}"
