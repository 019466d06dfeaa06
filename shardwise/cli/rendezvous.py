"""Nodes of a multi-node `shardwise train` find each other before torchrun starts, and say so.

torchrun's static rendezvous blocks in silence until every node has joined, then fails after ten minutes
with a launcher traceback. So each node's `shardwise train` first meets the others (`meet_other_nodes`) through a
small key-value store hosted by node 0 on `--master-port` (torch's TCPStore, the same kind torchrun uses).
"""

from __future__ import annotations

import argparse
import datetime
import socket
import time
from typing import Callable

from shardwise.errors import UserError

DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0
_POLL_S = 0.2
_ACK_POLL_S = 0.02
# Node k starts its torchrun this long after acknowledging, so that node 0 (polling every _ACK_POLL_S) has
# closed this store first: a torchrun client must meet node 0's torchrun store on the port, not this one.
_HANDOVER_S = 1.0
_JOINED, _GO, _ACKED = "shardwise/joined", "shardwise/go", "shardwise/acked"


def _nodes(n: int) -> str:
    return f"{n} more node" + ("" if n == 1 else "s")


def host_rendezvous(addr: str, port: int, nnodes: int, timeout_s: float,
                    say: Callable[[str], None] = print) -> None:
    """Node 0: wait for the other `nnodes - 1` nodes; UserError naming what is missing after `timeout_s`.

    Hosts the store, prints "waiting for N more node(s) at ADDR:PORT" whenever the count changes, sets "go" once
    all joined, waits until every node has read it, closes the store. Then every node starts torchrun on the same
    port; node 0's torchrun binds it again (TCPStore listens with SO_REUSEADDR), and the other nodes' torchrun
    clients retry until it does.
    """
    from torch.distributed import TCPStore

    try:
        store = TCPStore(addr, port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:        # DistNetworkError subclasses it: the port is taken, the address not ours
        raise UserError(f"--master-addr {addr} --master-port {port}: node 0 cannot listen there "
                        f"({str(e).splitlines()[0]}); choose a free port with --master-port.") from None
    try:
        deadline = time.monotonic() + timeout_s
        missing, said = nnodes - 1, None
        while missing > 0:
            if missing != said:
                say(f"shardwise train: node 0: waiting for {_nodes(missing)} at {addr}:{port} "
                    f"(timeout {timeout_s:g} s)")
                said = missing
            if time.monotonic() > deadline:
                raise UserError(f"rendezvous timed out after {timeout_s:g} s: {_nodes(missing)} of {nnodes - 1} "
                                f"did not join at {addr}:{port}; start them with --nnodes {nnodes} --node-rank K "
                                f"--master-addr {addr} --master-port {port}, or raise --rendezvous-timeout.")
            time.sleep(_POLL_S)
            missing = nnodes - 1 - store.add(_JOINED, 0)
        say(f"shardwise train: node 0: all {nnodes} nodes joined; starting the ranks")
        store.set(_GO, "1")
        # Keep the store up until every node has read "go": closing it earlier would fail their wait.
        while store.add(_ACKED, 0) < nnodes - 1:
            if time.monotonic() > deadline + timeout_s:
                raise UserError(f"rendezvous at {addr}:{port}: a node joined, then stopped answering.")
            time.sleep(_ACK_POLL_S)
    finally:
        del store


def _wait_until_listening(addr: str, port: int, timeout_s: float) -> None:
    """Poll node 0's port with plain TCP connects: TCPStore's own retries log a C++ stack trace per try.
    Raises ConnectionError after `timeout_s` (a RuntimeError, like the store's own errors, is not one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, timeout_s)):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise ConnectionError(f"nothing listens at {addr}:{port}") from None
            time.sleep(_POLL_S)


def join_rendezvous(addr: str, port: int, node_rank: int, timeout_s: float,
                    say: Callable[[str], None] = print) -> None:
    """Node `node_rank` > 0: join node 0's store and wait until every node has; UserError after `timeout_s`.

    Connects (retrying until the timeout: node 0 may start later), adds itself to "joined", waits for "go",
    acknowledges, disconnects, and returns `_HANDOVER_S` later, by when node 0 has closed this store.
    """
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        _wait_until_listening(addr, port, timeout_s)
        store = TCPStore(addr, port, is_master=False, timeout=timeout)
        store.add(_JOINED, 1)
        say(f"shardwise train: node {node_rank}: joined {addr}:{port}; waiting for the other nodes")
        store.wait([_GO], timeout)
        store.add(_ACKED, 1)
        del store
        time.sleep(_HANDOVER_S)
    except (ConnectionError, RuntimeError):   # nobody listens; DistStoreError: not all nodes came in time
        raise UserError(f"rendezvous timed out after {timeout_s:g} s: node {node_rank} could not meet node 0 and "
                        f"the other nodes at {addr}:{port}; start node 0 (--node-rank 0) with the same "
                        f"--master-addr/--master-port, or raise --rendezvous-timeout.") from None


def meet_other_nodes(args: argparse.Namespace, default_port: int) -> None:
    """`shardwise train`'s parsed flags: meet the other nodes (nothing to do on one node)."""
    if args.nnodes == 1:
        return
    def say(line: str) -> None:
        print(line, flush=True)          # before the launcher's own output, which follows right after

    addr, port = args.master_addr or "127.0.0.1", args.master_port or default_port
    if args.node_rank == 0:
        host_rendezvous(addr, port, args.nnodes, args.rendezvous_timeout, say)
    else:
        join_rendezvous(addr, port, args.node_rank, args.rendezvous_timeout, say)
