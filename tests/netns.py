"""Hosts in network namespaces on this machine, and partitions between them (issue 22).

A :class:`Network` is a bridge in the root namespace with one namespace per "host" hanging off
it by a veth pair, all on :data:`SUBNET`; the test process reaches every host through the
bridge's own address. Faults are ``iptables`` rules inside the partitioned host's namespace
(both directions of one peer and port), so a namespace deleted takes its rules with it:

- ``drop``: every packet of the flow is dropped, so open TCP connections hang as behind a dead
  switch (no reset, no FIN) and new ones time out.
- ``loss``: each packet of the flow is dropped with a probability (``-m statistic``), the same
  per-packet loss as ``tc netem loss`` on that flow.
- ``delay``: not here. This machine's kernel has no ``sch_netem`` (``tc qdisc add ... netem``
  answers "Specified qdisc kind is unknown") and no other qdisc delays, so delay is injected by
  :mod:`tests.delay_proxy` on the path instead.

Every name carries a random tag, so :func:`leftovers` can tell this network's namespaces,
links and rules from anything else on the machine, and :meth:`Network.close` removes them all
whatever state a failed test left them in.
"""

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

SUBNET = "10.213.47"
"""The private /24 of the test network: hosts are ``SUBNET.2`` and up, the bridge ``.1``."""
BRIDGE_ADDRESS = f"{SUBNET}.1"
NAME_PREFIX = "mln"
"""Every namespace and link this module makes starts with it (``ip link`` names <= 15)."""
COMMAND_TIMEOUT_S = 15.0


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), check=check, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )


def unavailable() -> str | None:
    """Why namespaces cannot be built here (not root, no ``ip``/``iptables``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make test installs iproute2 and iptables)"
    probe = f"{NAME_PREFIX}probe{uuid.uuid4().hex[:6]}"
    made = run(["ip", "netns", "add", probe], check=False)
    run(["ip", "netns", "delete", probe], check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    return None


def namespaces(prefix: str) -> list[str]:
    """The network namespaces on the machine whose names start with ``prefix``."""
    listed = (line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines())
    return [name for name in listed if name.startswith(prefix)]


def links(prefix: str) -> list[str]:
    """The links of the root namespace whose names start with ``prefix`` (``veth@peer``: veth)."""
    listed = (
        line.split(":")[1].strip().split("@")[0]
        for line in run(["ip", "-o", "link"]).stdout.splitlines()
    )
    return [name for name in listed if name.startswith(prefix)]


def remove_stale() -> list[str]:
    """Remove what networks of a killed test run left on the machine; what was removed.

    Every network is on :data:`SUBNET`, so a bridge left behind by a run killed before its
    cleanup routes the subnet away from the next network (whose servers then seem not to
    listen). Two runs at once cannot share the subnet either, so whatever of this module's is
    still here when a network is about to open is stale: the processes in its namespaces are
    killed, the namespaces and links deleted.
    """
    removed: list[str] = []
    for namespace in namespaces(NAME_PREFIX):
        for pid in run(["ip", "netns", "pids", namespace], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        run(["ip", "netns", "delete", namespace], check=False)
        removed.append(f"namespace {namespace}")
    for link in links(NAME_PREFIX):
        run(["ip", "link", "delete", link], check=False)
        removed.append(f"link {link}")
    return removed


@dataclass(frozen=True)
class Host:
    """One namespace: its name, its address on the bridge, and its end of the veth pair."""

    namespace: str
    address: str
    interface: str

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace (``ip netns exec`` execs, same pid)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def iptables(self, *rule: str, check: bool = True) -> None:
        run(self.wrap(["iptables", "-w", *rule]), check=check)


@dataclass
class Network:
    """A bridge and the hosts on it; :meth:`close` removes everything, even half-built."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"{NAME_PREFIX}{self.tag}br"

    def open(self) -> None:
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])

    def add(self, role: str) -> Host:
        """A new host named ``role`` (a few letters), at the next free address."""
        host = Host(
            namespace=f"{NAME_PREFIX}{self.tag}-{role}",
            address=f"{SUBNET}.{len(self.hosts) + 2}",
            interface=f"{NAME_PREFIX}{self.tag}{role}",
        )
        self.hosts[role] = host
        outside, inside = host.interface, f"{host.interface}i"
        run(["ip", "netns", "add", host.namespace])
        run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside])
        run(["ip", "link", "set", inside, "netns", host.namespace])
        run(["ip", "link", "set", outside, "master", self.bridge, "up"])
        run(host.wrap(["ip", "addr", "add", f"{host.address}/24", "dev", inside]))
        run(host.wrap(["ip", "link", "set", inside, "up"]))
        run(host.wrap(["ip", "link", "set", "lo", "up"]))
        return host

    def partition(self, host: Host, peer: Host, ports: Sequence[int], fault: str) -> None:
        """Inject ``fault`` (``drop`` or ``loss``) between ``host`` and ``peer``'s ``ports``,
        both directions, until :meth:`heal`."""
        match = ["-m", "statistic", "--mode", "random", "--probability", "0.1"]
        extra = match if fault == "loss" else []
        for port in ports:
            host.iptables("-A", "OUTPUT", "-p", "tcp", "-d", peer.address, "--dport", str(port),
                          *extra, "-j", "DROP")  # fmt: skip
            host.iptables("-A", "INPUT", "-p", "tcp", "-s", peer.address, "--sport", str(port),
                          *extra, "-j", "DROP")  # fmt: skip

    def heal(self, host: Host) -> None:
        """Remove every fault of ``host``."""
        host.iptables("-F", "INPUT")
        host.iptables("-F", "OUTPUT")

    def close(self) -> None:
        """Delete every namespace (its veth end and rules go with it) and the bridge."""
        for host in self.hosts.values():
            run(["ip", "netns", "delete", host.namespace], check=False)
            run(["ip", "link", "delete", host.interface], check=False)
        run(["ip", "link", "delete", self.bridge], check=False)

    def leftovers(self) -> list[str]:
        """What of this network is still on the machine: namespaces, links, root rules."""
        mine = f"{NAME_PREFIX}{self.tag}"
        found = [f"namespace {name}" for name in namespaces(mine)]
        found += [f"link {name}" for name in links(mine)]
        found += [
            f"root rule {line}"
            for line in run(["iptables", "-w", "-S"]).stdout.splitlines()
            if SUBNET in line
        ]
        return found


POSTGRES_PORT = 5432
MARIADB_PORT = 3306
REDIS_PORT = 6379
SERVER_PORTS = {"postgresql": POSTGRES_PORT, "mysql": MARIADB_PORT}


def postgres_bin() -> str:
    versions = sorted(os.listdir("/usr/lib/postgresql"), key=int)
    return f"/usr/lib/postgresql/{versions[-1]}/bin"


@dataclass
class DatabaseHost:
    """A private database server (PostgreSQL or MariaDB) and Redis, inside ``host``.

    Private servers rather than the machine's: those listen on the loopback of the root
    namespace, which no other namespace can reach. Durability is off (a test database).
    """

    host: Host
    backend: str
    folder: str
    """Owned by the server's user (``postgres``/``mysql``), outside pytest's private tmp."""
    procs: list[tuple[subprocess.Popen[bytes], signal.Signals]] = field(default_factory=list)
    """Each server process, and the signal that stops it."""

    @property
    def server_user(self) -> str:
        return "postgres" if self.backend == "postgresql" else "mysql"

    @property
    def database_url(self) -> str:
        if self.backend == "postgresql":
            return f"postgresql+asyncpg://postgres@{self.host.address}:{POSTGRES_PORT}/postgres"
        return f"mysql+aiomysql://root@{self.host.address}:{MARIADB_PORT}/moorline"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.host.address}:{REDIS_PORT}/0"

    def start(self) -> None:
        data = f"{self.folder}/data"
        os.mkdir(data)
        shutil.chown(data, user=self.server_user)
        if self.backend == "postgresql":
            run(["runuser", "-u", "postgres", "--", f"{postgres_bin()}/initdb", "-D", data,
                 "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])  # fmt: skip
            with open(f"{data}/pg_hba.conf", "a") as hba:
                hba.write(f"host all all {SUBNET}.0/24 trust\n")
            server = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups",
                      f"{postgres_bin()}/postgres", "-D", data,
                      "-c", f"listen_addresses={self.host.address}",
                      "-c", f"unix_socket_directories={self.folder}",
                      "-c", "fsync=off", "-c", "synchronous_commit=off",
                      "-c", "full_page_writes=off", "-c", "max_connections=300"]  # fmt: skip
        else:
            # skip-grant-tables: root may connect from any address without a grant, and the
            # server starts on an empty data directory (no mariadb-install-db, 7-10 s here).
            server = ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=mysql",
                      f"--bind-address={self.host.address}", f"--port={MARIADB_PORT}",
                      f"--socket={self.folder}/mysqld.sock", "--skip-grant-tables",
                      "--skip-log-bin", "--innodb-flush-log-at-trx-commit=0",
                      "--innodb-buffer-pool-size=128M", "--max-connections=500"]  # fmt: skip
        redis = ["redis-server", "--bind", self.host.address, "--port", str(REDIS_PORT),
                 "--save", "", "--appendonly", "no", "--protected-mode", "no",
                 "--dir", self.folder]  # fmt: skip
        # SIGQUIT: PostgreSQL's immediate shutdown, which takes its backends with it (after a
        # SIGKILL they would linger, and the namespace with them).
        server_stop = signal.SIGQUIT if self.backend == "postgresql" else signal.SIGKILL
        for argv, name, stop in (
            (server, "database", server_stop),
            (redis, "redis", signal.SIGKILL),
        ):
            with open(f"{self.folder}/{name}.log", "wb") as log:
                proc = subprocess.Popen(self.host.wrap(argv), stdout=log, stderr=subprocess.STDOUT)
            self.procs.append((proc, stop))

    def stop(self) -> None:
        for proc, stop in self.procs:
            if proc.poll() is None:
                proc.send_signal(stop)
        for proc, _ in self.procs:
            try:
                proc.wait(COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
