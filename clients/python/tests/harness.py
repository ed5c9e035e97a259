"""A throwaway PostgreSQL cluster and real outboxd servers on it, for the tests and bench.py.

PostgreSQL refuses to run as root: as root the cluster is created and started as the
`postgres` user (runuser); otherwise as the current user. outboxd runs as the service
role `outboxd` (not a superuser: it refuses one) and migrates as the cluster's superuser.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

REPO = Path(__file__).resolve().parents[3]
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], Optional[T]], timeout: float, interval: float = 0.02) -> T:
    """Polls `check` until it returns something truthy, or fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def outboxd_bin() -> str:
    path = os.environ.get("OUTBOXD_BIN") or str(REPO / "target" / "debug" / "outboxd")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"no outboxd binary at {path}: build it (cargo build) or set OUTBOXD_BIN")
    return path


def pg_bindir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    if found:
        return found[-1]
    initdb = shutil.which("initdb")
    if initdb:
        return str(Path(initdb).parent)
    raise RuntimeError("PostgreSQL server binaries not found (apt-get install postgresql)")


class Cluster:
    """initdb + pg_ctl start on a free port; trust auth on loopback only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bindir = pg_bindir()
        self.data = root / "pgdata"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.user = "postgres" if self.as_root else pwd.getpwuid(os.geteuid()).pw_name

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [f"{self.bindir}/{args[0]}", *args[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd="/")

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.as_root:
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-sync")
        self._run(
            "pg_ctl",
            "start",
            "-w",
            "-t",
            "60",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "postgres.log"),
            "-o",
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
            # Commit times order the intents of an ordering key (Enqueue refuses ordered
            # intents without them).
            "-c max_connections=200 -c full_page_writes=off -c track_commit_timestamp=on",
        )

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w")
        except subprocess.CalledProcessError:
            pass

    def url(self, db: str = "app", user: Optional[str] = None) -> str:
        return f"postgres://{user or self.user}@127.0.0.1:{self.port}/{db}"

    def sql(self, query: str, db: str = "postgres") -> None:
        import psycopg

        with psycopg.connect(self.url(db), autocommit=True) as conn:
            conn.execute(query)


class Server:
    """One outboxd replica on the cluster's `app` database, on an ephemeral port."""

    def __init__(self, cluster: Cluster, name: str, env: Optional[dict[str, str]] = None) -> None:
        self.cluster = cluster
        self.name = name
        self.log_path = cluster.root / f"{name}.log"
        self.extra_env = env or {}
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.addr = ""

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update(
            {
                "NO_COLOR": "1",
                "OUTBOX_LOG__FORMAT": "json",
                "OUTBOX_DATABASE__URL": self.cluster.url("app", "outboxd"),
                "OUTBOX_DATABASE__FLEET_URL": self.cluster.url("app", "outboxd_fleet_login"),
                "OUTBOX_DATABASE__MIGRATION_URL": self.cluster.url("app"),
                "OUTBOX_METRICS__LISTEN_ADDR": "",
                **self.extra_env,
            }
        )
        return env

    def start(self) -> None:
        port = free_port()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [outboxd_bin(), "serve"],
                env={**self.env(), "OUTBOX_LISTEN_ADDR": f"127.0.0.1:{port}"},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def serving() -> Optional[str]:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"outboxd {self.name} exited: {self.log_path.read_text()[-3000:]}")
            for line in self.log_path.read_text().splitlines():
                if "outboxd serving gRPC" in line:
                    try:
                        fields = json.loads(line).get("fields", {})
                        return str(fields.get("listen.addr") or f"127.0.0.1:{port}")
                    except ValueError:
                        return f"127.0.0.1:{port}"
            return None

        self.addr = wait_for(f"outboxd {self.name} serving", serving, timeout=120, interval=0.05)

    def create_key(self, name: str, *scopes: str) -> str:
        args = [outboxd_bin(), "keys", "create", "--name", name, "--tenant", "default"]
        for scope in scopes or ("admin",):
            args += ["--scope", scope]
        out = subprocess.run(args, env=self.env(), check=True, capture_output=True, text=True)
        return out.stdout.strip().splitlines()[-1]

    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Stack:
    """A cluster with two outboxd replicas and an admin API key."""

    def __init__(self, root: Optional[Path] = None, env: Optional[dict[str, str]] = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="outboxd-py-"))
        self.cluster = Cluster(self.root)
        self.servers = [Server(self.cluster, "outboxd-a", env), Server(self.cluster, "outboxd-b", env)]
        self.api_key = ""

    def start(self) -> Stack:
        self.cluster.start()
        self.cluster.sql("CREATE ROLE outboxd LOGIN")
        # Work across tenants (sweeps) runs as a member of outboxd_fleet, which the first
        # migration creates and grants to the login named by OUTBOX_DATABASE__FLEET_URL.
        self.cluster.sql("CREATE ROLE outboxd_fleet_login LOGIN")
        self.cluster.sql("CREATE DATABASE app")
        self.cluster.sql("CREATE DATABASE shop")
        # The first replica migrates; the second starts on the migrated schema.
        for server in self.servers:
            server.start()
        self.api_key = self.servers[0].create_key("sdk-tests", "admin")
        return self

    @property
    def endpoints(self) -> list[str]:
        return [s.addr for s in self.servers]

    def stop(self, keep: bool = False) -> None:
        for server in self.servers:
            server.stop()
        self.cluster.stop()
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)
