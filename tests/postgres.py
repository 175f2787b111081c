"""A throwaway PostgreSQL server on 127.0.0.1 for the tests of workers sharing a storage.

Started from the machine's PostgreSQL binaries (Debian's ``postgresql`` package, which
``.ci/run`` installs) in a temporary directory, on a free port, with trust authentication;
stopped when the test session ends. As root it runs as the ``postgres`` user (``initdb``
refuses root).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from .net import free_port


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


class PostgresServer:
    def __init__(self, base: Path) -> None:
        initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            pytest.skip("PostgreSQL is not installed (apt-get install postgresql; .ci/run does)")
        self.pg_ctl, self.data, self.port = pg_ctl, base / "pgdata", free_port()
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(base, "postgres")
        self._run(initdb, "-D", str(self.data), "-A", "trust", "-U", "plora", "--no-sync")
        options = f"-p {self.port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off"
        self._run(pg_ctl, "-D", str(self.data), "-o", options, "-l", str(base / "server.log"), "-w", "start")

    def _run(self, *argv: str) -> None:
        subprocess.run([*self._as, *argv], check=True, capture_output=True)

    def new_database(self) -> str:
        """A fresh empty database; returns its SQLAlchemy URL."""
        import psycopg2

        name = f"t{uuid.uuid4().hex[:12]}"
        admin = psycopg2.connect(host="127.0.0.1", port=self.port, user="plora", dbname="postgres")
        admin.autocommit = True
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE {name}")
        admin.close()
        return f"postgresql+psycopg2://plora@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        self._run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop")
