"""Two network "nodes" on one host: two Linux network namespaces joined by a veth pair, each with its own
address. A process started with `ip netns exec` sees only its node's interfaces, so two ranks in them reach each
other over that link alone, as ranks on two machines do. `offline_node()`: one namespace with no network at all,
an air-gapped compute node. Needs root; `available()` says why not."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "192.168.250.{}/30"  # exists only inside the two namespaces made here


@dataclass
class Node:
    name: str  # the namespace
    address: str  # its veth address
    interface: str  # its veth end: GLOO_SOCKET_IFNAME

    def command(self, *argv: str) -> list[str]:
        """argv run inside this node's network namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> list[int]:
        """Every process in this node's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=True).stdout
        return [int(pid) for pid in out.split()]

    def kill_all(self) -> int:
        """SIGKILL every process of this node, as a node that dies; returns how many there were."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)


def available() -> str | None:
    """None when two nodes can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"ptprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def made_or_skipped(make):
    """`make()` (two_nodes or offline_node), or the calling test skipped saying why namespaces can't be made."""
    import pytest

    why_not = available()
    if why_not:
        pytest.skip(why_not)
    return make()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _remove(node: Node) -> None:
    """Kill every process left in the node, then delete its namespace (and the veth end in it)."""
    try:
        for _ in range(50):  # killed processes leave the namespace once reaped
            if not node.kill_all():
                break
            time.sleep(0.1)
    except subprocess.CalledProcessError:
        pass  # never made
    subprocess.run(["ip", "netns", "del", node.name], capture_output=True)


@contextmanager
def two_nodes():
    """(node0, node1), linked; on exit every process left in them is killed and both namespaces are deleted.
    Names carry this process id, so runs side by side do not meet."""
    tag = f"pt{os.getpid()}"
    nodes = [Node(f"{tag}n{i}", SUBNET.format(i + 1).split("/")[0], f"v{tag}n{i}"[:15]) for i in (0, 1)]
    try:
        for node in nodes:
            _ip("netns", "add", node.name)
        _ip("link", "add", nodes[0].interface, "type", "veth", "peer", "name", nodes[1].interface)
        for i, node in enumerate(nodes):
            _ip("link", "set", node.interface, "netns", node.name)
            _ip("-n", node.name, "addr", "add", SUBNET.format(i + 1), "dev", node.interface)
            _ip("-n", node.name, "link", "set", node.interface, "up")
            _ip("-n", node.name, "link", "set", "lo", "up")
        yield tuple(nodes)
    finally:
        for node in nodes:
            _remove(node)


@contextmanager
def offline_node():
    """A node with no network: a namespace with its loopback alone, so no address outside it is reachable (no
    package index), while local rendezvous on 127.0.0.1 works. On exit its processes are killed and it is
    deleted."""
    node = Node(f"pt{os.getpid()}off", "127.0.0.1", "lo")
    try:
        _ip("netns", "add", node.name)
        _ip("-n", node.name, "link", "set", "lo", "up")
        yield node
    finally:
        _remove(node)
