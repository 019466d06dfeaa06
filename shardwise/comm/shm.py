"""Our own all-reduce for CPU tensors when every rank of the group runs on one host: through shared memory.

gloo over loopback TCP moves every byte through a socket: copied into the kernel by the sender, out of it by the
receiver, in segments each with its own wake-up. Here each rank's buffers (the data-parallel buckets) are files
under /dev/shm that every rank of the group maps, so a rank reads its peers' gradients where they lie.

    buffers = SharedBuffers.create(comm, [(numel, torch.float32), ...])   # collective
    buffers.local[k] ...; buffers.all_reduce_(k)                          # sum bucket k in place on every rank
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Sequence

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm
from shardwise.comm.ledger import CommLedger
from shardwise.errors import UserError

SHM_DIR_ENV = "SHARDWISE_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"
FIELD = "all_reduce = 'shm'"


def shm_dir() -> str:
    """Where the shared files go: /dev/shm, or `SHARDWISE_SHM_DIR` (any directory all ranks share, e.g. a tmpfs)."""
    return os.environ.get(SHM_DIR_ENV, DEFAULT_SHM_DIR)


class SharedBuffers:
    """Zero-filled buffers of the given sizes and dtypes, one set per rank of `comm`'s group, each rank's mapped by
    all; `local[k]` is this rank's buffer k (a CPU tensor, usable as any other). `all_reduce_(k)` sums buffer k
    over the group, in place.

    Two all-reduces of one `SharedBuffers` must not run at the same time (their barriers would pair up across
    buffers): the data-parallel runtime runs them in launch order on one communication thread.
    """

    def __init__(self, comm: Comm, local: list[torch.Tensor], peers: list[list[torch.Tensor]]):
        self.comm = comm
        self.local = local
        self.peers = peers          # peers[s][k]: rank s's buffer k (peers[rank] is `local`)
        self._token = torch.zeros(1)

    @classmethod
    def create(cls, comm: Comm, specs: Sequence[tuple[int, torch.dtype]], *,
               directory: str | None = None) -> "SharedBuffers":
        """Collective over `comm`'s group: every rank passes the same `specs` [(numel, dtype), ...].

        Rank 0 draws a name, each rank creates and reserves its files (`posix_fallocate`, so a full /dev/shm is an
        error here and never a SIGBUS later), every rank checks it runs on the same kernel (boot id) and sees the
        others' files (containers with separate /dev/shm do not), maps them, and after a barrier unlinks its own:
        the mappings live on, and nothing is left behind once the processes end. Each check is agreed by every
        rank before anyone acts on it, so a refusal is the same one line everywhere and no rank is left waiting
        in a barrier.
        """
        if not comm.carries_host_tensors:
            raise UserError(f"{FIELD}: the data-parallel group's backend is {comm.backend}; the shared-memory "
                            f"all-reduce is for CPU training over gloo. Use all_reduce = 'backend'")
        directory = directory or shm_dir()
        # Setup's collectives on a ledger of their own (as other build-time collectives): the run's ledger and its
        # per-step reports hold training's.
        run_comm, comm = comm, Comm(comm.group, CommLedger(), name=f"{comm.name}:shm-setup")
        # (token, host): rank 0's name for the files, and each rank's kernel. A directory shared over a network
        # would map incoherently across hosts, so ranks on two kernels are refused before any file is made.
        told = comm.all_gather_object((secrets.token_hex(6) if comm.rank == 0 else None, _boot_id()))
        token, hosts = told[0][0], {host for _, host in told}
        if len(hosts) > 1:
            raise UserError(f"{FIELD}: the ranks of the data-parallel group run on {len(hosts)} hosts; the "
                            f"shared-memory all-reduce needs them on one. Use all_reduce = 'backend'")
        path = lambda s, k: os.path.join(directory, f"shardwise-{token}-r{s}-b{k}")  # noqa: E731
        made: list[str] = []
        try:
            problem = _reserve([(path(comm.rank, k), n * dtype.itemsize) for k, (n, dtype) in enumerate(specs)],
                               made, directory)
            _agree(comm, problem)
            # every rank's files exist now (the agreement above is a collective): a missing one is another /dev/shm
            missing = next((path(s, k) for s in range(comm.size) for k in range(len(specs))
                            if not os.path.exists(path(s, k))), None)
            _agree(comm, None if missing is None else
                   f"{FIELD}: this rank does not see {missing}, which another rank of its data-parallel group "
                   f"created: the ranks do not share {directory} (other hosts, or containers with their own "
                   f"/dev/shm). Use all_reduce = 'backend', or set {SHM_DIR_ENV} to a directory they share")
            peers = [[torch.from_file(path(s, k), shared=True, size=n, dtype=dtype) for k, (n, dtype) in
                      enumerate(specs)] for s in range(comm.size)]
            comm.barrier()              # every rank has mapped every file: the names are no longer needed
        finally:
            for p in made:
                _unlink(p)
        return cls(run_comm, peers[comm.rank], peers)

    def all_reduce_(self, index: int) -> None:
        """Sum buffer `index` over the group, in place on every rank; blocking (one at a time: see the class).

            buffers[s][k] : [n_k]   rank s's buffer k, mapped by every rank of the group
            chunk r of a buffer   : [r*c, min((r+1)*c, n_k)),  c = ceil(n_k / W)

        On group rank r, for buffer k:
            1. barrier: every rank's buffer k holds its final values.
            2. rank r adds its peers' chunk r into its own chunk r (peers in group-rank order), then writes the sum
               into chunk r of every peer's buffer. Only rank r touches chunk r of any buffer in this phase, so no
               two ranks ever read and write the same bytes.
            3. barrier: every chunk has arrived everywhere. Until the next all-reduce's first barrier no rank
               touches another's buffer, so each owner may change its own freely (accumulate, zero, clip).
        Per rank that is about n_k reads and 2 (W-1)/W n_k writes, and two tiny collectives over the group's own
        backend (which also gives the barriers their timeout). Every chunk is summed once and copied, so all ranks
        hold the same bits; with two ranks the sum is a + b on both, bitwise the backend's.
        """
        rank, size = self.comm.rank, self.comm.size
        mine = self.local[index]
        n = mine.numel()
        per = -(-n // size)
        lo, hi = min(rank * per, n), min((rank + 1) * per, n)
        self._barrier()
        if hi > lo:
            own = mine[lo:hi]
            others = [self.peers[s][index][lo:hi] for s in range(size) if s != rank]
            for piece in others:
                own.add_(piece)
            for piece in others:
                piece.copy_(own)
        self._barrier()

    def _barrier(self) -> None:
        # A one-element all-reduce on the CPU backend, unrecorded: the ledger records the whole all-reduce once
        # (`Comm.shm_all_reduce`). It also orders memory: a peer's writes before it are visible after it.
        self.comm._explained(lambda: dist.all_reduce(self._token, group=self.comm.group))()


def _boot_id() -> str:
    """This kernel's boot id: equal for every process (and container) of one host, different across hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _reserve(files: list[tuple[str, int]], made: list[str], directory: str) -> str | None:
    """Create each file at its size with its pages reserved; the problem in one line, or None."""
    for path, size in files:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            return f"{FIELD}: cannot create {path}: {e.strerror}. Use all_reduce = 'backend', or set {SHM_DIR_ENV}"
        made.append(path)
        try:
            if size:
                os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                return f"{FIELD}: cannot reserve {size} bytes in {path}: {e.strerror}"
            need = sum(s for _, s in files)
            return (f"{FIELD}: {directory} is full: each rank needs {need / 2**20:.1f} MiB there for its gradient "
                    f"buckets. Enlarge it (docker run --shm-size=...), lower bucket_cap_mb, or use all_reduce = "
                    f"'backend'")
        finally:
            os.close(fd)
    return None


def _agree(comm: Comm, problem: str | None) -> None:
    """Every rank raises the first rank's problem, or none does."""
    problems = [p for p in comm.all_gather_object(problem) if p]
    if problems:
        raise UserError(problems[0])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
