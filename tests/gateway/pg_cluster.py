"""A throwaway PostgreSQL cluster for tests that must stop and restart the server.

`PgCluster.start_new()` runs initdb + pg_ctl (as the `postgres` account when root) on a free
port; `stop()` / `start()` simulate an outage; `new_database()` gives each test its own
database; `destroy()` removes everything. `pg_bin()` is None when PostgreSQL is not installed
(callers skip then).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import free_port


def pg_bin() -> Path | None:
    """The folder of initdb/pg_ctl, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class PgCluster:
    """One PostgreSQL server on 127.0.0.1 that a test may stop and start."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="prefixgate-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.root, user="postgres")
            self.root.chmod(0o700)
        self.data = self.root / "data"
        self.port = free_port()

    @classmethod
    def start_new(cls, bindir: Path) -> PgCluster:
        cluster = cls(bindir)
        subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(cluster.data), "-U",
                                     "postgres", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True, timeout=120)
        cluster.start()
        return cluster

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+pg8000://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        subprocess.run(_as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o",
                                     options, "-l", str(self.root / "log"), "-w", "start"]),
                       check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        subprocess.run(_as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                                     "immediate", "-w", "stop"]),
                       check=True, capture_output=True, timeout=120)

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        from sqlalchemy import create_engine, text

        name = "t" + uuid.uuid4().hex[:12]
        engine = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return self.url(name)

    def destroy(self) -> None:
        subprocess.run(_as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                                     "immediate", "-w", "stop"]), capture_output=True,
                       timeout=120)
        shutil.rmtree(self.root, ignore_errors=True)


def started_cluster() -> Iterator[PgCluster]:
    """A module fixture's body: a fresh cluster for the module, destroyed after it; the module's
    tests skip when the pg8000 driver or PostgreSQL's binaries are missing."""
    pytest.importorskip("pg8000", reason="the pg8000 driver is not installed")
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) on this machine")
    cluster = PgCluster.start_new(bindir)
    yield cluster
    cluster.destroy()
