"""Reader modes (who reads the checkpoint) and the collective choice among them.

- ``src``: one rank reads and scatters (the files may live on one node only).
- ``owners``: every rank reads its own shards straight from the mapped files
  (no transport; replicated tensors are read by each rank that holds them).
- ``node``: one reader per node scatters to the ranks of its node; nothing
  crosses between nodes.
- ``auto``: ranks all-gather the identity of the files they see (per file:
  name, st_dev, st_ino, st_size, st_mtime_ns) and their fingerprint (size, a
  sha1 of the header and of SAMPLES evenly spaced data blocks). A rank counts
  as reading the reader's files when its identity equals the reader's and,
  on another node, its fingerprint does too; owners or node only where every
  reader counts so, anything else is src. The reader's identity is that of
  the descriptors it already opened, and every other reader checks the
  descriptors it opens against it: files replaced while the load starts
  make it fall back to src (``fall_back``), never mix.

What auto accepts: it looks for one copy on a shared file system. On the
reader's node the identity is proof (a copy has another inode). Across hosts
it is not (two hosts' fresh disks unpacked alike can repeat device, inode and
mtime), so the sampled fingerprint must agree as well; a separate copy that
matches both is accepted, and bytes differing between the samples go unseen
(hashing every byte would cost a full read on every rank). ``readers="owners"``
/ ``"node"`` say the caller trusts the copies: they are checked against the
fingerprints alone, and then read.
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import struct
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointFileError, StreamloadError
from ..io.checkpoint import resolve_files
from ..io.remote import RemoteFile, RemotePath, opened_remote_identity, remote_identity
from ..options import env_text
from .collectives import solo
from .protocol import gather_or_raise


class ReaderMode(str, Enum):
    """Who reads; a str, so the public API keeps taking (and comparing with) the plain names."""

    AUTO = "auto"
    SRC = "src"
    OWNERS = "owners"
    NODE = "node"

    def __str__(self) -> str:
        return self.value


MODES = tuple(m.value for m in ReaderMode)


SAMPLES = 16  # data blocks hashed per file, evenly spaced
SAMPLE_BYTES = 4096


def _per_file(path: Any, describe: Callable[[Path], tuple]) -> tuple | None:
    """``describe`` of each safetensors file at ``path`` (a file or a directory),
    or None when this rank does not see the checkpoint."""
    if path is None or not isinstance(path, (str, os.PathLike)):
        return None
    p = Path(path)
    try:
        files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.suffix == ".safetensors")
        # Regular files only: opening a FIFO named *.safetensors would block this rank alone
        # before the all-gather. A NUL byte in the path is a ValueError, not an OSError.
        return tuple(describe(f) for f in files if f.is_file()) or None
    except (OSError, ValueError):
        return None


def _sampled_digest(f: Path) -> tuple:
    # Non-blocking open, then the type of what was opened: a file replaced by a FIFO after
    # the listing must not block (O_NONBLOCK changes nothing for a regular file's reads).
    with open(os.open(f, os.O_RDONLY | os.O_NONBLOCK), "rb") as h:
        st = os.fstat(h.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{f}: not a regular file")
        size = st.st_size
        head = h.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        digest = hashlib.sha1(head + h.read(min(n, 100_000_000)))
        start = 8 + n
        span = max(0, size - start - SAMPLE_BYTES)
        for k in range(SAMPLES if size > start else 0):
            h.seek(start + span * k // max(1, SAMPLES - 1))
            digest.update(h.read(SAMPLE_BYTES))
    return (f.name, size, digest.hexdigest())


def fingerprint(path: Any) -> tuple | None:
    """(file name, size, sha1 of its header and of SAMPLES data blocks) per
    safetensors file, or None when this rank does not see the checkpoint.

    The sampled blocks tell apart two versions of one model, whose headers
    are the same; mtimes are left out on purpose (copies of the same files
    on other nodes carry other mtimes). A few KiB read per file. Equal
    fingerprints do not prove equal bytes: see ``file_identity``."""
    if isinstance(path, RemotePath):
        return remote_identity(path)  # the ETag names the object's bytes
    return _per_file(path, _sampled_digest)


def _identity(name: str, st: os.stat_result) -> tuple:
    return (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_identity(path: Any) -> tuple | None:
    """(file name, st_dev, st_ino, st_size, st_mtime_ns) per file the loader opens at
    ``path`` (the index's files, else every safetensors file), or None when this rank
    does not see the checkpoint.

    Equal on two ranks only when both open the same files of one file system
    (a hard link or another path to them included): the proof ``auto`` needs
    before letting ranks read their own bytes. A copy has another inode (or
    device, on another node), even when its mtime was preserved. Taken by path,
    it says what an ``open`` would find now; ``opened_identity`` says what a
    rank that opened the files reads."""
    if isinstance(path, RemotePath):
        return remote_identity(path)  # (bucket/key, size, ETag): the same object
    if path is None or not isinstance(path, (str, os.PathLike)):
        return None
    try:
        files, _ = resolve_files(path)
        return tuple(_identity(f.name, f.stat()) for f in files) or None
    except (OSError, ValueError, StreamloadError):  # a NUL byte in the path is a ValueError
        return None


def opened_identity(source: Any) -> tuple | None:
    """``file_identity`` of the files ``source`` (an open Checkpoint) holds open, from their
    descriptors (``os.fstat``): the files it reads, whatever their paths name by now.
    None for a source that holds no files (a dict of tensors)."""
    files = getattr(source, "files", None)
    if not files:
        return None
    if all(isinstance(f, RemoteFile) for f in files):
        return opened_remote_identity(files)
    out = []
    for f in files:
        fd = int(getattr(f, "fileno", -1))
        if fd < 0:
            return None
        out.append(_identity(Path(f.path).name, os.fstat(fd)))
    return tuple(out)


def _first_difference(theirs: tuple | None, reference: tuple) -> tuple[str | None, str]:
    """(file name, how it differs) between a rank's fingerprint and the reader's."""
    if theirs is None:
        return None, "the checkpoint cannot be opened there"
    ref = {name: (size, digest) for name, size, digest in reference}
    got = {name: (size, digest) for name, size, digest in theirs}
    for name in sorted(set(ref) | set(got)):
        if name not in got:
            return name, "file missing"
        if name not in ref:
            return name, "file the reader does not have"
        if ref[name][0] != got[name][0]:
            return name, f"{got[name][0]} bytes, the reader's has {ref[name][0]}"
        if ref[name][1] != got[name][1]:
            return name, "header or sampled data differs"
    return None, "different files"


def node_key(node: str | None = None) -> str:
    """This process's node: ``node`` (the load's keyword), else STREAMLOAD_NODE, else torchrun's
    GROUP_RANK, else the host name."""
    return env_text("node", node) or os.environ.get("GROUP_RANK") or socket.gethostname()


@dataclass
class ReaderChoice:
    """The reader mode this load uses, why, and the node layout."""

    mode: ReaderMode
    reason: str
    nodes: list[list[int]] = field(default_factory=list)  # group ranks per node, in node order
    node_readers: list[int] = field(default_factory=list)  # reader group rank per node
    # What auto's choice rests on: the identity of the files the reader opened. Every other
    # rank that reads checks the files it opens against it (see ``proof_holds``).
    proof: tuple | None = None

    def reader_ranks(self, src: int, world: int) -> set[int]:
        """The group ranks that read the files in this mode (``src``: the designated reader)."""
        if self.mode is ReaderMode.OWNERS:
            return set(range(world))
        if self.mode is ReaderMode.NODE:
            return set(self.node_readers)
        return {src}

    def proof_holds(self, source: Any) -> bool:
        """Whether ``source``, the files this rank opened to read, are the reader's own
        (always, where the choice rests on no proof: src, or copies the caller trusts)."""
        return self.proof is None or opened_identity(source) == self.proof


def fall_back(choice: ReaderChoice, ranks: list[int]) -> ReaderChoice:
    """The ``src`` choice that replaces ``auto``'s when ``ranks`` opened other files than
    the reader's (replaced between the reader's open and theirs): the reader alone reads,
    from the files it holds open, so the load is one version throughout."""
    return ReaderChoice(
        ReaderMode.SRC,
        f"the files changed while the ranks opened them (ranks {ranks[:20]} opened other files "
        "than the reader's); auto does not mix them, the reader alone reads",
        choice.nodes,
    )


def choose(
    requested: str | ReaderMode,
    path: Any,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    has_source: bool,
    node: str | None = None,
    source: Any = None,
    identity: Future[tuple | None] | None = None,
) -> ReaderChoice:
    """Collective: every rank gets the same choice.

    Args:
        requested: one of MODES.
        path: what this rank was given (a path, a Checkpoint, a dict, None).
        src: the group rank of the designated reader.
        has_source: the reader was given an in-memory source (dict or open
            Checkpoint): only ``src`` can then read.
        node: this process's node id (the load's keyword; see ``node_key``).
        source: the checkpoint this rank already opened (the reader's): its identity is
            taken from the descriptors it reads, not from what its path names by now.
        identity: this rank's ``remote_identity`` of an object store's checkpoint, asked
            while the reader opened it (``open_source``); None: asked here.
    """
    if requested not in MODES:
        raise ValueError(f"readers must be one of {MODES}, not {requested!r}")
    requested = ReaderMode(requested)
    world = dist.get_world_size(group) if group is not None else 1
    single = solo(group)
    if single and requested is ReaderMode.OWNERS:
        # One process reads its shards itself: on a GPU this skips the scatter's device-to-device copy.
        if has_source:
            raise ValueError("readers='owners' needs the checkpoint as a path that every reader can open")
        return ReaderChoice(ReaderMode.OWNERS, "requested (single process)", [[0]])
    if single or requested is ReaderMode.SRC:
        return ReaderChoice(ReaderMode.SRC, "requested" if requested is ReaderMode.SRC else "single process")
    local: BaseException | None = None
    mine: tuple = (None, None, has_source, None)
    try:
        opened = opened_identity(source) if source is not None else None
        if isinstance(path, RemotePath):
            # An object's fingerprint is its identity (size and ETag): the reader's, of the objects
            # it opened; another rank's, asked while the reader opened them, else now.
            seen_files = opened or (identity.result() if identity is not None else fingerprint(path))
            ident = seen_files
        else:
            seen_files = fingerprint(path)
            ident = opened or file_identity(path)
        mine = (node_key(node), seen_files, has_source, ident)
    except BaseException as exc:  # noqa: BLE001 - raised on every rank by the all-gather below
        local = exc
    # An agreement: a failure describing this rank's files raises on every rank, instead of
    # leaving the others waiting in the all-gather this rank would have skipped.
    seen = gather_or_raise(mine, local, dist.get_rank() if group is not None else 0, group, device)
    has_source = bool(seen[src][2])
    keys = [s[0] for s in seen]
    order: list[str] = []
    for k in keys:
        if k not in order:
            order.append(k)
    nodes = [[r for r in range(world) if keys[r] == k] for k in order]
    reference = seen[src][1]
    sees = [s[1] is not None and s[1] == reference for s in seen]  # a copy that looks the same
    # The reader's files: the same (device, inode, size, mtime_ns). On the reader's host that is
    # proof; across hosts the tuple alone is not (two fresh disks unpacked alike repeat inodes and
    # keep mtimes), so there the sampled-data fingerprint must agree as well.
    same = [
        s[3] is not None and s[3] == seen[src][3] and (s[0] == seen[src][0] or sees[r])
        for r, s in enumerate(seen)
    ]
    if reference is None or has_source:
        if requested in (ReaderMode.OWNERS, ReaderMode.NODE):
            raise ValueError(
                f"readers={requested.value!r} needs the checkpoint as a path that every reader can open"
            )
        return ReaderChoice(
            ReaderMode.SRC,
            "only the reader has the checkpoint (in memory)"
            if has_source
            else "the reader's checkpoint could not be fingerprinted",
        )
    if requested is ReaderMode.OWNERS:
        if not all(sees):
            missing = [r for r in range(world) if not sees[r]]
            name, why = _first_difference(seen[missing[0]][1], reference)
            raise CheckpointFileError(
                f"readers='owners' but ranks {missing} do not see the same files as rank {src} "
                f"(rank {missing[0]}: {why})",
                str(Path(path) / name) if name and Path(str(path)).is_dir() else str(path),
            )
        return ReaderChoice(
            ReaderMode.OWNERS,
            "requested: every rank's copy is trusted (size, header and sampled data hashes checked)",
            nodes,
        )
    proof = seen[src][3] if requested is ReaderMode.AUTO else None
    if requested is ReaderMode.AUTO and all(same):
        return ReaderChoice(
            ReaderMode.OWNERS,
            "every rank opens the same files (device, inode, size and mtime)",
            nodes,
            proof=proof,
        )
    trusted = sees if requested is ReaderMode.NODE else same
    node_readers = []
    for ranks in nodes:
        seeing = [r for r in ranks if trusted[r]]
        node_readers.append(src if src in ranks else (seeing[0] if seeing else -1))
    if requested is ReaderMode.NODE or (
        requested is ReaderMode.AUTO and len(nodes) > 1 and all(r >= 0 for r in node_readers)
    ):
        if any(r < 0 for r in node_readers):
            raise ValueError("readers='node' but some node has no rank that sees the checkpoint")
        why = "trusting each node's copy" if requested is ReaderMode.NODE else "the same files"
        return ReaderChoice(
            ReaderMode.NODE,
            f"{len(nodes)} nodes, each with a rank that reads {why}",
            nodes,
            node_readers,
            proof=proof,
        )
    copies = [r for r in range(world) if sees[r] and not same[r]]
    if copies:
        return ReaderChoice(
            ReaderMode.SRC,
            f"ranks {copies} see copies of the files, not the reader's own (other device or inode); "
            "auto does not trust copies: pass readers='owners' or 'node' to read them",
            nodes,
        )
    return ReaderChoice(ReaderMode.SRC, f"only {sum(same)} of {world} ranks see the reader's files", nodes)
