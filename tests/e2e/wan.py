"""A wide-area network on one machine: each peer in its own network namespace behind a shaped link.

Used by the end-to-end tests (``tests/e2e/test_wan.py``) and the benchmarks (``bench/``); standard library
only, no pytest. Needs root, ``ip`` (iproute2) and ``/dev/net/tun``; :func:`wan_available` says why not.

Topology (one run; addresses from the RFC 2544 benchmarking range 198.18.0.0/15, one /24 block per run)::

    host (root namespace): control plane listening on P = <block>.1 (an address on ``lo``)
      ├── tun hw<pid>-<k> ══ link emulator process ══ tun wan0 in namespace hywan-<pid>-<k>-<name>  (peer k)
      └── …

* Each peer's namespace has its loopback, one tun device ``wan0`` with the peer's address, and routes to
  P only (plus the block's public half, below): **no default route**, so a peer reaches the control plane
  and nothing else. Another private peer's address is unroutable there (connect fails at once with
  ENETUNREACH).
* The link is not a veth pair with ``tc netem``: the kernel our tests run on (6.18) is built without
  ``sch_netem`` and the hosts have no iptables/nft, so the link is a pair of tun devices joined by a small
  userspace emulator (one process per link, :func:`_run_link`) that delays, drops and rate-limits every
  packet, per direction (about 12 % of a core at 50 Mbit/s; it tops out near 180 Mbit/s). It is also the
  firewall: it passes only what the policy below allows, whatever ``net.ipv4.ip_forward`` says.
* **Shape** (:class:`LinkShape`, defaults 50 Mbit/s, 40 ms RTT, 0.5 % loss): each direction gets half the
  RTT as one-way delay and the full loss rate, independently; so a round trip takes ``rtt_ms`` and a packet
  is lost with probability ``loss`` in each direction (a request-and-answer loses one of its two packets
  with about ``2 × loss``). The rate is a serialisation rate per direction (``upload_mbit`` may set the
  namespace-to-host direction apart, as on consumer lines); each direction holds at most ``queue_packets``
  packets (in the queue and in flight, netem's default limit of 1000), the rest is dropped at the tail.
* **Policy.** A *private* peer (the default) is behind NAT: it opens connections to the control plane (and
  to public peers); nobody opens one to it (the emulator drops TCP SYNs coming in, unless ``inbound=True``;
  UDP is not filtered).
  A *public* peer (``public=True``: a server with a public address, such as a data node) takes its address
  from the block's upper half, which every namespace routes to; the host forwards between the links for it
  (``forwarding`` is switched on for our tun devices only, never globally). Packets between two private
  peers are dropped by the emulator even if something routed them.
* **Names** carry the pid of the process that made them (namespaces ``hywan-<pid>-…``, devices
  ``hw<pid>-<k>``, P's label ``lo:hw<pid>``), so concurrent runs never collide; :meth:`Wan.close` (also at
  interpreter exit) removes all of it, and :func:`wipe_leftovers` (run by every :class:`Wan` on entry)
  removes what runs that died left. Tun devices go by themselves with their emulator process, which the
  kernel kills when its parent dies. ``python tests/e2e/wan.py wipe`` does the wiping by hand.

Usage (``bench/cluster.py``'s ``training_cluster(wan=...)`` does all of this)::

    with Wan() as wan:                                   # or Wan(rate_mbit=10, rtt_ms=150, loss=0.01)
        # the control plane: `hypha-server --host {wan.host_address}` (and ALLOWED_HOSTS naming it)
        node = wan.add("data-node", public=True)         # `hypha-data-node ... --host {node.address}`
        trainer = wan.add("trainer-1", rtt_ms=200)       # one link's shape set apart
        argv = trainer.command(["hypha-worker-daemon", "--server", f"http://{wan.host_address}:{port}",
                                "--ps-host", trainer.address, ...])   # → ip netns exec <ns> hypha-...
        wan.counters("trainer-1")   # {"up": {"bytes": …, "packets": …, "lost": …, …}, "down": {…}}
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import ipaddress
import json
import os
import random
import re
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

#: The RFC 2544 benchmarking range: never routed on the internet, rarely used on a host. One /24 per run.
ADDRESS_RANGE = ipaddress.ip_network("198.18.0.0/15")
#: Private peers take links 1..31 (addresses below .128), public peers links 32..63 (the block's upper half).
PRIVATE_LINKS = range(1, 32)
PUBLIC_LINKS = range(32, 64)
NAMESPACE_PREFIX = "hywan"
#: The namespace-side device of every link.
NAMESPACE_DEVICE = "wan0"
#: Seconds an ``ip`` command may take.
IP_TIMEOUT = 15.0


class WanError(RuntimeError):
    """Setting up or tearing down the WAN failed (an ``ip`` command, the emulator of a link)."""


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """The shape of one peer's link. Each direction: ``rtt_ms / 2`` of delay, ``loss`` (0..1) of random
    loss, ``rate_mbit`` (``upload_mbit`` for namespace → host when given) of serialisation rate, at most
    ``queue_packets`` packets held."""

    rate_mbit: float = 50.0
    rtt_ms: float = 40.0
    loss: float = 0.005
    upload_mbit: float | None = None
    queue_packets: int = 1000

    def __post_init__(self) -> None:
        if self.rate_mbit <= 0 or (self.upload_mbit is not None and self.upload_mbit <= 0):
            raise ValueError("rates must be positive")
        if self.rtt_ms < 0 or not 0 <= self.loss < 1 or self.queue_packets < 1:
            raise ValueError("rtt_ms >= 0, 0 <= loss < 1 and queue_packets >= 1 are required")


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer of a :class:`Wan`: a namespace and its link.

    ``address``: the peer's IP (bind servers to it; other peers reach it only if ``public``);
    ``host_address``: the control plane's address as the peer sees it (the same P for every peer);
    ``link_address``: the host's end of the link."""

    name: str
    namespace: str
    address: str
    host_address: str
    link_address: str
    device: str
    public: bool
    inbound: bool
    shape: LinkShape

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the peer's namespace (the environment passes through unchanged)."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.namespace, *argv]

    def host_url(self, port: int, scheme: str = "http") -> str:
        """The URL of a host service on ``port`` as the peer reaches it."""
        return f"{scheme}://{self.host_address}:{port}"

    def url(self, port: int, scheme: str = "http") -> str:
        """The URL of a service of this peer on ``port`` (reachable by others only for a public peer)."""
        return f"{scheme}://{self.address}:{port}"


def _ip(*arguments: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["ip", *arguments], capture_output=True, text=True, timeout=IP_TIMEOUT, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise WanError(f"ip {' '.join(arguments)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def wan_available() -> tuple[bool, str]:
    """``(True, "")`` if a :class:`Wan` can be built here, else ``(False, why)`` (for a test's skip)."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "no `ip` (iproute2) on PATH"
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as error:
        return False, f"cannot open /dev/net/tun: {error.strerror}"
    probe = f"{NAMESPACE_PREFIX}-{os.getpid()}-probe"
    try:
        done = _ip("netns", "add", probe, check=False)
        if done.returncode != 0:
            return False, f"cannot create a network namespace: {done.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, f"cannot create a network namespace: {error}"
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _ip("netns", "del", probe, check=False)
    return True, ""


def _kill_namespace_processes(namespace: str) -> None:
    done = _ip("netns", "pids", namespace, check=False)
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def wipe_leftovers() -> list[str]:
    """Remove the namespaces, devices and addresses of runs whose process is gone (killed outright, say);
    kill what still runs in their namespaces. Returns what was removed."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{NAMESPACE_PREFIX}-(\d+)-.*", name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(f"namespace {name}")
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        match = re.match(r"\d+: (hw(\d+)-\d+)[:@]", line)
        if match and not _pid_alive(int(match.group(2))):
            _ip("link", "del", match.group(1), check=False)
            removed.append(f"device {match.group(1)}")
    for line in _ip("-o", "-4", "addr", "show", "dev", "lo", check=False).stdout.splitlines():
        match = re.search(r"inet (\S+) .*\blo:hw(\d+)\b", line)
        if match and not _pid_alive(int(match.group(2))):
            _ip("addr", "del", match.group(1), "dev", "lo", check=False)
            removed.append(f"address {match.group(1)}")
    return removed


#: Every Wan not yet closed; the atexit hook closes them (a test's teardown that never ran).
_OPEN: list[Wan] = []


@atexit.register
def _close_leftovers() -> None:
    for wan in list(_OPEN):
        with contextlib.suppress(Exception):
            wan.close()


class Wan:
    """``with Wan() as wan: peer = wan.add("trainer-1")`` — see the module docstring.

    ``shape`` (or its fields as keywords) is every link's default; :meth:`add` may give a peer another.
    ``seed`` makes the links' random losses repeatable (link k uses ``seed + k``)."""

    def __init__(self, shape: LinkShape | None = None, *, seed: int | None = None, **shape_fields) -> None:
        if shape is not None and shape_fields:
            raise TypeError("give shape or its fields, not both")
        self.shape = shape or LinkShape(**shape_fields)
        self.seed = seed
        self.peers: dict[str, Peer] = {}
        self._links: dict[str, subprocess.Popen] = {}
        #: One question at a time on a link's pipes (:meth:`counters` may be called from several threads).
        self._link_locks: dict[str, threading.Lock] = {}
        self._block: ipaddress.IPv4Network | None = None
        self._pid = os.getpid()

    # --- lifecycle -----------------------------------------------------------------------------------

    def __enter__(self) -> Wan:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        """Claim an address block and put the control plane's address P on ``lo``."""
        available, why = wan_available()
        if not available:
            raise WanError(why)
        wipe_leftovers()
        _OPEN.append(self)
        blocks = list(ADDRESS_RANGE.subnets(new_prefix=24))
        start = self._pid % len(blocks)
        for offset in range(len(blocks)):
            block = blocks[(start + offset) % len(blocks)]
            if _ip("-o", "addr", "show", "to", str(block), check=False).stdout.strip():
                continue
            # Adding P is the claim: a second run adding the same address gets "File exists".
            done = _ip(
                "addr", "add", f"{block[1]}/32", "dev", "lo", "label", f"lo:hw{self._pid}", check=False
            )
            if done.returncode == 0:
                self._block = block
                return
        raise WanError(f"no free /24 in {ADDRESS_RANGE}")

    @property
    def host_address(self) -> str:
        """P: the control plane's address, the same for every peer. Bind the control plane to it."""
        if self._block is None:
            raise WanError("the Wan is not open")
        return str(self._block[1])

    def close(self) -> None:
        """Stop every link, kill what runs in the namespaces, delete them and P. Safe to call twice."""
        for process in self._links.values():
            with contextlib.suppress(OSError):
                process.kill()
        for process in self._links.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
        self._links.clear()
        self._link_locks.clear()
        for peer in self.peers.values():
            _kill_namespace_processes(peer.namespace)
            _ip("netns", "del", peer.namespace, check=False)
            _ip("link", "del", peer.device, check=False)  # gone with its emulator, unless that hung
        self.peers.clear()
        if self._block is not None:
            _ip("addr", "del", f"{self.host_address}/32", "dev", "lo", check=False)
            self._block = None
        with contextlib.suppress(ValueError):
            _OPEN.remove(self)

    # --- peers ---------------------------------------------------------------------------------------

    def add(
        self,
        name: str,
        *,
        shape: LinkShape | None = None,
        public: bool = False,
        inbound: bool | None = None,
        **shape_fields,
    ) -> Peer:
        """A new peer ``name`` in its own namespace behind a link of ``shape`` (default: the Wan's, with
        ``shape_fields`` replaced). ``public``: reachable from every peer (a server with a public address);
        ``inbound`` (default: ``public``): whether connections may be opened to it from outside."""
        if self._block is None:
            raise WanError("the Wan is not open")
        if name in self.peers:
            raise ValueError(f"peer {name!r} exists")
        shape = shape or dataclasses.replace(self.shape, **shape_fields)
        used = {int(ipaddress.ip_address(peer.address)) - int(self._block[0]) for peer in self.peers.values()}
        links = PUBLIC_LINKS if public else PRIVATE_LINKS
        link = next((k for k in links if 4 * k + 1 not in used), None)
        if link is None:
            raise WanError(f"no free {'public' if public else 'private'} link left in {self._block}")
        index = len(self.peers) + 1
        safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]
        peer = Peer(
            name=name,
            namespace=f"{NAMESPACE_PREFIX}-{self._pid}-{index}-{safe_name}",
            address=str(self._block[4 * link + 1]),
            host_address=self.host_address,
            link_address=str(self._block[4 * link]),
            device=f"hw{self._pid}-{index}",
            public=public,
            inbound=public if inbound is None else inbound,
            shape=shape,
        )
        # Registered before it exists, so that close() removes whatever part of it was made.
        self.peers[name] = peer
        _ip("netns", "add", peer.namespace)
        _ip("-n", peer.namespace, "link", "set", "lo", "up")
        host_fd = _open_tun(peer.device)
        namespace_fd = _open_tun(f"{peer.device}n")
        try:
            _ip("link", "set", f"{peer.device}n", "netns", peer.namespace)
            _ip("-n", peer.namespace, "link", "set", f"{peer.device}n", "name", NAMESPACE_DEVICE)
            self._links[name] = self._start_link(peer, host_fd, namespace_fd, seed_offset=link)
            self._link_locks[name] = threading.Lock()
        finally:
            # The emulator holds the devices now: they vanish when it exits.
            os.close(host_fd)
            os.close(namespace_fd)
        self._configure(peer)
        return peer

    def counters(self, name: str) -> dict[str, dict[str, int]]:
        """What peer ``name``'s link has carried since it was made, per direction (``"up"``: namespace →
        host, ``"down"``: host → namespace): ``bytes`` and ``packets`` delivered (whole IP packets, headers and
        TCP retransmissions included), and the packets dropped: ``lost`` (the random loss), ``queue`` (over
        the queue limit), ``refused`` (by the policy). Asked of the link's emulator over its pipes (about a
        millisecond)."""
        process = self._links.get(name)
        if process is None or process.stdin is None or process.stdout is None:
            raise WanError(f"no link named {name!r}")
        with self._link_locks[name]:
            try:
                process.stdin.write(b"counters\n")
                process.stdin.flush()
                line = process.stdout.readline()
            except OSError as error:
                raise WanError(f"the link emulator of {name} is gone: {error}") from error
        if not line:
            raise WanError(f"the link emulator of {name} is gone (exit {process.poll()})")
        return json.loads(line)

    def _configure(self, peer: Peer) -> None:
        block = self._block
        assert block is not None
        _sysctl(f"net/ipv6/conf/{peer.device}/disable_ipv6", "1")
        # Forwarding for our devices only (a public peer's traffic crosses two links), never the global
        # switch; the emulators drop what the policy forbids, so this opens no path between private peers.
        _sysctl(f"net/ipv4/conf/{peer.device}/forwarding", "1")
        _ip("addr", "add", peer.link_address, "peer", f"{peer.address}/32", "dev", peer.device)
        _ip("link", "set", peer.device, "up")
        inside = ["-n", peer.namespace]
        device = NAMESPACE_DEVICE
        _ip(*inside, "addr", "add", peer.address, "peer", f"{peer.link_address}/32", "dev", device)
        _ip(*inside, "link", "set", device, "up")
        # No default route: P, and the public half of the block (all of it for a public peer, which
        # answers everyone), and nothing else.
        _ip(*inside, "route", "add", f"{self.host_address}/32", "dev", device)
        reachable = block if peer.public else ipaddress.ip_network(f"{block[128]}/25")
        _ip(*inside, "route", "add", str(reachable), "dev", device)

    def _start_link(self, peer: Peer, host_fd: int, namespace_fd: int, *, seed_offset: int):
        block = self._block
        assert block is not None
        shape = peer.shape
        config = {
            "host_fd": host_fd,
            "namespace_fd": namespace_fd,
            "delay": shape.rtt_ms / 2000.0,
            "loss": shape.loss,
            "down_bps": shape.rate_mbit * 1e6,
            "up_bps": (shape.upload_mbit or shape.rate_mbit) * 1e6,
            "queue_packets": shape.queue_packets,
            "seed": None if self.seed is None else self.seed + seed_offset,
            "block": str(block),
            "allowed": [peer.host_address, peer.link_address],
            "address": peer.address,
            "public": peer.public,
            "inbound": peer.inbound,
        }
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "link", json.dumps(config)],
            pass_fds=(host_fd, namespace_fd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        # The emulator says "ready" once it owns the devices (a failure shows in its stderr).
        line = process.stdout.readline() if process.stdout else b""
        if line.strip() != b"ready":
            process.kill()
            raise WanError(f"the link emulator of {peer.name} did not start (exit {process.wait()})")
        return process


def _sysctl(key: str, value: str) -> None:
    Path("/proc/sys", key).write_text(value)


TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def _open_tun(name: str) -> int:
    """A non-persistent tun device ``name`` (it exists while a descriptor of it is open)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _die_with_parent() -> None:
    # Between fork and exec: the kernel SIGKILLs the emulator when the process that started it dies, and
    # its tun devices go with it.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# --- the link emulator (a child process per link) --------------------------------------------------------


class _Direction:
    """One direction of a link: packets read from ``source`` are written to ``target`` after their
    serialisation at ``bps`` and ``delay`` seconds, unless lost, refused by ``accept`` or over the queue."""

    def __init__(self, source: int, target: int, *, bps: float, delay: float, loss: float, queue: int,
                 accept, rng: random.Random) -> None:  # fmt: skip
        self.source, self.target = source, target
        self.bits_per_second, self.delay, self.loss, self.limit = bps, delay, loss, queue
        self.accept = accept
        self.rng = rng
        self.held: deque[tuple[float, bytes]] = deque()
        self.busy_until = 0.0
        self.counters = {"bytes": 0, "packets": 0, "lost": 0, "queue": 0, "refused": 0}

    def receive(self) -> None:
        for _ in range(256):
            try:
                packet = os.read(self.source, 65536)
            except BlockingIOError:
                return
            if not self.accept(packet):
                self.counters["refused"] += 1
                continue
            if self.rng.random() < self.loss:
                self.counters["lost"] += 1
                continue
            if len(self.held) >= self.limit:
                self.counters["queue"] += 1
                continue
            now = time.monotonic()
            # Packets leave one after another at the link's rate, then travel for the delay: arrival times
            # never decrease, so a FIFO is the whole schedule.
            self.busy_until = max(now, self.busy_until) + len(packet) * 8 / self.bits_per_second
            self.held.append((self.busy_until + self.delay, packet))

    def deliver(self, now: float) -> None:
        while self.held and self.held[0][0] <= now:
            packet = self.held.popleft()[1]
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self.target, packet)
                self.counters["bytes"] += len(packet)
                self.counters["packets"] += 1


def _policy(config: dict):
    """The two filters of a link: (namespace → host, host → namespace)."""
    block = ipaddress.ip_network(config["block"])
    prefix = block.network_address.packed[:3]
    allowed = {ipaddress.ip_address(address).packed for address in config["allowed"]}
    public, inbound = config["public"], config["inbound"]

    def in_block(address: bytes) -> bool:
        return address[:3] == prefix

    def public_address(address: bytes) -> bool:
        return address[:3] == prefix and address[3] >= 128

    def outgoing(packet: bytes) -> bool:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return False
        destination = packet[16:20]
        return destination in allowed or public_address(destination) or (public and in_block(destination))

    def incoming(packet: bytes) -> bool:
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return False
        source = packet[12:16]
        if not (source in allowed or public_address(source) or (public and in_block(source))):
            return False
        if not inbound and packet[9] == 6:  # TCP: no new connection in (behind NAT)
            header = (packet[0] & 0x0F) * 4
            if len(packet) > header + 13 and packet[header + 13] & 0x12 == 0x02:  # SYN without ACK
                return False
        return True

    return outgoing, incoming


def _run_link(config: dict) -> None:
    rng = random.Random(config["seed"])
    outgoing, incoming = _policy(config)
    host_fd, namespace_fd = config["host_fd"], config["namespace_fd"]
    common = {"delay": config["delay"], "loss": config["loss"], "queue": config["queue_packets"], "rng": rng}
    up = _Direction(namespace_fd, host_fd, bps=config["up_bps"], accept=outgoing, **common)
    down = _Direction(host_fd, namespace_fd, bps=config["down_bps"], accept=incoming, **common)
    selector = selectors.DefaultSelector()
    selector.register(namespace_fd, selectors.EVENT_READ, up)
    selector.register(host_fd, selectors.EVENT_READ, down)
    # The parent's questions: a line "counters" is answered with one JSON line; EOF closes the link.
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    questions = b""
    while True:
        now = time.monotonic()
        due = [direction.held[0][0] for direction in (up, down) if direction.held]
        for key, _ in selector.select(max(0.0, min(due) - now) if due else None):
            if key.data is None:
                chunk = os.read(key.fd, 4096)
                if not chunk:
                    return
                *lines, questions = (questions + chunk).split(b"\n")
                for line in lines:
                    if line.strip() == b"counters":
                        sys.stdout.write(json.dumps({"up": up.counters, "down": down.counters}) + "\n")
                        sys.stdout.flush()
            else:
                key.data.receive()
        now = time.monotonic()
        up.deliver(now)
        down.deliver(now)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "link":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            _run_link(json.loads(sys.argv[2]))
    elif len(sys.argv) == 2 and sys.argv[1] == "wipe":
        print("\n".join(wipe_leftovers()) or "nothing left over")
    else:
        sys.exit(f"usage: {sys.argv[0]} wipe  (remove what dead runs left)")
