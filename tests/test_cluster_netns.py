"""Two network "nodes" (tests/netns.py: two network namespaces joined by a veth pair, 192.168.250.1 and .2),
one rank each, launched as launchers/README.md documents for nodes without ssh: `deepspeed --hostfile H --no_ssh
--node_rank i --master_addr <node 0>` on each node, GLOO_SOCKET_IFNAME naming the node's interface. They train
as the 2-rank run on one node does; killing every process of one node ends the other within seconds (its
collective with the dead rank fails), and resume=auto on both nodes finishes exactly."""

import re
import subprocess
import time
from pathlib import Path

import pytest

import netns
from support import free_port
from fault_runs import TAG, assert_same_run, complete, overrides, reference
from inject_fault import python_with_fault
from pretrieve.utils.run_dir import latest_checkpoint
from test_launchers import BIN, CONFIG, PRETRAIN_SH, _env

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def nodes():
    with netns.made_or_skipped(netns.two_nodes) as made:
        yield made


def _launch(nodes, folder: Path, run_dir: Path, manifest: Path, *extra: str, **env) -> list[subprocess.Popen]:
    """The same command on both nodes, as on two machines (a fresh rendezvous port); each node's output to
    FOLDER/node<i>.log. Without GLOO_SOCKET_IFNAME gloo binds the address the host name resolves to, which is
    not in a namespace: it falls back to loopback, and node 0 then dials 127.0.0.1 for node 1."""
    hostfile = folder / "hostfile"
    hostfile.write_text("".join(f"{node.address} slots=1\n" for node in nodes))
    port, launched = free_port(), []
    for i, node in enumerate(nodes):
        with open(folder / f"node{i}.log", "w") as log:
            launched.append(subprocess.Popen(
                node.command(str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(i),
                             "--master_addr", nodes[0].address, "--master_port", port, "--no_python",
                             str(PRETRAIN_SH), str(CONFIG), f"run_dir={run_dir}", *overrides(manifest, *extra)),
                env=_env(GLOO_SOCKET_IFNAME=node.interface, **env), stdout=log, stderr=subprocess.STDOUT))
    return launched


def _wait(launched: list[subprocess.Popen], folder: Path) -> None:
    codes = [node.wait(timeout=600) for node in launched]
    assert codes == [0] * len(launched), "".join((folder / f"node{i}.log").read_text()[-2000:] for i in (0, 1))


def _sent(node: netns.Node) -> int:
    """Bytes this node's veth end has sent."""
    return int(subprocess.run(node.command("cat", f"/sys/class/net/{node.interface}/statistics/tx_bytes"),
                              capture_output=True, text=True, check=True).stdout)


def test_two_netns_nodes_train_as_one_job(nodes, tmp_path, tmp_path_factory, wiki_shards):
    manifest = wiki_shards / "manifest.json"
    uninterrupted = reference("two_ranks", tmp_path_factory, manifest)
    before = [_sent(node) for node in nodes]
    run = tmp_path / "run"
    _wait(_launch(nodes, tmp_path, run, manifest), tmp_path)
    assert_same_run(run, uninterrupted)
    # ZeRO-2 exchanges gradient and parameter partitions every step (2.1 M parameters): megabytes each way
    assert all(_sent(node) - sent > 2**20 for node, sent in zip(nodes, before))


def test_a_killed_node_ends_the_other_and_resume_is_exact(nodes, tmp_path, tmp_path_factory, wiki_shards):
    """Node 1's rank is held after step 5 (step 4 is the last checkpoint) and every process of node 1 (its
    launcher, rank, DataLoader worker) is killed -9: node 0 must end on its own, non-zero, soon; no step 5
    checkpoint was made, so `latest` names step 4, and both nodes started again with resume=auto finish exactly."""
    manifest = wiki_shards / "manifest.json"
    uninterrupted = reference("two_ranks", tmp_path_factory, manifest)
    run, mark = tmp_path / "run", tmp_path / "held"
    launched = _launch(nodes, tmp_path, run, manifest, PRETRIEVE_PYTHON=str(python_with_fault(tmp_path)),
                       FAULT_AT="step", FAULT_STEP="5", FAULT_DO="pause", FAULT_RANK="1", FAULT_MARK=str(mark))
    try:
        deadline = time.time() + 600
        while not mark.exists():
            assert all(node.poll() is None for node in launched) and time.time() < deadline, \
                (tmp_path / "node0.log").read_text()[-2000:] + (tmp_path / "node1.log").read_text()[-2000:]
            time.sleep(0.05)
        killed = time.time()
        assert nodes[1].kill_all() >= 3  # launcher, rank, DataLoader worker
        code = launched[0].wait(timeout=600)
        took = time.time() - killed
        while nodes[0].pids():  # what the launcher left behind would still be training
            assert time.time() - killed < 600
            time.sleep(0.1)
        took_all = time.time() - killed
    finally:
        for node in nodes:
            node.kill_all()
        for node in launched:
            node.wait()
    print(f"node 1 killed: node 0's launcher ended {took:.1f} s later, its last process {took_all:.1f} s later")
    assert code != 0 and re.search(r"Connection (closed|reset) by peer", (tmp_path / "node0.log").read_text())
    assert took_all < 60, f"node 0 took {took_all:.0f} s to end after node 1 was killed"
    assert latest_checkpoint(run) == TAG(4) and complete(run, TAG(4))

    _wait(_launch(nodes, tmp_path, run, manifest, "resume=auto"), tmp_path)
    assert_same_run(run, uninterrupted)
