"""RDMABuffer between real meshes, through cross-memory attach (shm) and the owner's TCP door: round trips of
typed values at several sizes and offsets, memoryviews, handles that travel between meshes and the controller,
concurrent readers (processes and threads), RDMAAction over two owners, the argument checks, and random
offsets and sizes against plain slicing.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rdma_actors import T, Owner, Reader, backend

from monarch import rdma
from monarch.actor import ActorMesh
from monarch.rdma import RDMAAction, RDMABuffer

pytestmark = pytest.mark.slow
MiB = 1 << 20
_names = itertools.count()


def sample(dtype: torch.dtype, nbytes: int, seed: int = 0) -> torch.Tensor:
    """`nbytes` bytes of distinct-looking values of `dtype`."""
    g = torch.Generator().manual_seed(seed)
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    if dtype == torch.int64:
        return torch.randint(-1 << 62, 1 << 62, (n,), generator=g)
    if dtype == torch.complex64:
        return torch.randn(n, 2, generator=g).view(torch.complex64).reshape(n)
    return torch.randn(n, generator=g).to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def share(owner: ActorMesh[Owner], data: torch.Tensor) -> RDMABuffer:
    return owner.share.call_one(f"t{next(_names)}", data).get(timeout=T)


def one(mesh: ActorMesh, rank: int = 0) -> ActorMesh:
    return mesh.slice(gpus=rank)


CASES = [(torch.bool, 1), (torch.float32, 4096), (torch.bfloat16, 4096), (torch.int64, 4096),
         (torch.complex64, 4096), (torch.bool, 4096), (torch.float32, 3 * MiB), (torch.bfloat16, 5 * MiB - 2),
         (torch.complex64, 2 * MiB), (torch.float16, 16 * MiB + 4098)]  # the last one is copied in parallel parts


@pytest.mark.parametrize("dtype,nbytes", CASES, ids=[f"{d}-{n}" for d, n in CASES])
def test_round_trips_of_typed_values(owners: ActorMesh[Owner], readers: ActorMesh[Reader], via: str,
                                     dtype: torch.dtype, nbytes: int) -> None:
    owner, reader = one(owners), one(readers, 1)
    data = sample(dtype, nbytes)
    name = f"t{next(_names)}"
    buf = owner.share.call_one(name, data).get(timeout=T)
    assert buf.size() == nbytes and buf.backend == "shm"
    got, used = reader.read.call_one(buf, via).get(timeout=T)
    assert used == via and torch.equal(got, raw(data))
    typed, _ = reader.read.call_one(buf, via, 0, torch.empty_like(data)).get(timeout=T)
    assert typed.dtype == dtype and torch.equal(raw(typed), raw(data))
    offset = nbytes // 3
    tail, _ = reader.read.call_one(buf, via, offset).get(timeout=T)
    assert torch.equal(tail, raw(data)[offset:])
    new = sample(dtype, nbytes, seed=1)
    assert reader.write.call_one(buf, via, new).get(timeout=T) == via
    assert torch.equal(raw(owner.value.call_one(name).get(timeout=T)), raw(new))
    size = data.element_size()
    patch = raw(sample(dtype, max(nbytes // 4 // size, 1) * size, seed=2))  # valid values of dtype
    reader.write.call_one(buf, via, patch, nbytes - len(patch)).get(timeout=T)
    expected = raw(new).clone()
    expected[nbytes - len(patch):] = patch
    assert torch.equal(raw(owner.value.call_one(name).get(timeout=T)), expected)


def test_memoryviews_as_buffer_source_and_destination(owners: ActorMesh[Owner], readers: ActorMesh[Reader],
                                                      via: str) -> None:
    owner, reader = one(owners, 1), one(readers)
    data = bytes(range(256)) * 40 + b"tail"
    buf = owner.share_bytes.call_one("view", data).get(timeout=T)
    assert reader.read_view.call_one(buf, via).get(timeout=T) == data
    reader.write_view.call_one(buf, via, data[::-1]).get(timeout=T)
    assert owner.value.call_one("view").get(timeout=T) == data[::-1]
    with backend(via):
        dst = bytearray(len(data))
        buf.read_into(memoryview(dst)).get(timeout=T)
        assert bytes(dst) == data[::-1]
        buf.write_from(memoryview(b"\x07" * 5), offset=3).get(timeout=T)  # a read-only source
    assert owner.value.call_one("view").get(timeout=T)[:10] == data[::-1][:3] + b"\x07" * 5 + data[::-1][8:10]


def test_handles_travel_between_meshes_and_the_controller(owners: ActorMesh[Owner],
                                                          readers: ActorMesh[Reader]) -> None:
    data = sample(torch.float32, 64 * 1024)
    buf = share(one(owners), data)
    back = one(readers, 2).echo.call_one(buf).get(timeout=T)
    assert (back.size(), back.owner, back.backend) == (buf.size(), buf.owner, "shm")
    assert "rank 0 of mesh" in back.owner and repr(back) == repr(buf)
    dst = torch.empty(buf.size(), dtype=torch.uint8)
    back.read_into(dst).get(timeout=T)
    assert torch.equal(dst, raw(data))
    own, used = one(owners).read_own.call_one(back).get(timeout=T)
    assert used == "local" and torch.equal(own, raw(data))
    other, used = one(owners, 1).read_own.call_one(back).get(timeout=T)
    assert used == "shm" and torch.equal(other, raw(data))


def test_concurrent_readers_in_processes_and_threads(owners: ActorMesh[Owner], readers: ActorMesh[Reader],
                                                     via: str) -> None:
    data = raw(sample(torch.int64, 2 * MiB))
    buf = share(one(owners), data)
    sums = readers.read_repeatedly.call(buf, via, 3, 3).get(timeout=T).values()
    assert sums == [[int(data.to(torch.int64).sum())] * 9] * 3


def test_an_action_reads_and_writes_two_owners(owners: ActorMesh[Owner], readers: ActorMesh[Reader],
                                               via: str) -> None:
    a, b = sample(torch.float32, 8192), sample(torch.int64, 3 * 8192)
    reads = [share(one(owners, 0), a), share(one(owners, 1), b)]
    targets = [one(owners, r).share.call_one(f"target{r}{via}", torch.zeros(1000, dtype=torch.uint8))
               for r in (0, 1)]
    writes = [(f.get(timeout=T), torch.full((1000 - r,), r + 5, dtype=torch.uint8)) for r, f in enumerate(targets)]
    got = one(readers).act.call_one(reads, writes, via).get(timeout=T)
    assert torch.equal(got[0], raw(a)) and torch.equal(got[1], raw(b))
    for r in (0, 1):
        held = one(owners, r).value.call_one(f"target{r}{via}").get(timeout=T)
        assert held[:1000 - r].eq(r + 5).all() and held[1000 - r:].eq(0).all()
    with backend(via):  # the controller submits too, twice
        dsts = [torch.empty(x.size(), dtype=torch.uint8) for x in reads]
        action = RDMAAction().read_into(reads[0], dsts[0]).read_into(reads[1], dsts[1])
        for _ in range(2):
            action.submit().get(timeout=T)
            assert torch.equal(dsts[0], raw(a)) and torch.equal(dsts[1], raw(b))


def test_arguments_are_checked_before_any_transfer(owners: ActorMesh[Owner]) -> None:
    buf = share(one(owners), torch.arange(256, dtype=torch.uint8))
    matrix = torch.zeros(16, 16)
    with pytest.raises(ValueError, match=r"not contiguous.*t\.contiguous\(\)"):
        RDMABuffer(matrix.t())
    with pytest.raises(ValueError, match=r"not contiguous.*t\.contiguous\(\)"):
        buf.read_into(torch.zeros(16, 32, dtype=torch.uint8)[:, ::2])
    with pytest.raises(ValueError, match="cannot register an empty buffer"):
        RDMABuffer(torch.empty(0))
    with pytest.raises(ValueError, match="destination holds 255 bytes.*pass a larger destination"):
        buf.read_into(torch.empty(255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="destination holds"):
        buf.read_into(torch.empty(300, dtype=torch.uint8), offset=-1)
    with pytest.raises(ValueError, match="do not fit the buffer's 256 bytes"):
        buf.write_from(torch.empty(200, dtype=torch.uint8), offset=57)
    with pytest.raises(ValueError, match="local memory holds 255 bytes"):
        RDMAAction().read_into(buf, torch.empty(255, dtype=torch.uint8))
    local = torch.empty(256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one of them writes there"):
        RDMAAction().read_into(buf, local).write_from(buf, local[100:])
    with pytest.raises(ValueError, match="one of them writes there"):  # two reads into the same local bytes
        RDMAAction().read_remote(local, buf).read_remote(local, buf)
    RDMAAction().write_remote(buf, local).write_remote(buf, local)  # both only read the local bytes: fine
    RDMAAction().read_into(buf, local).read_into(buf, local)  # Monarch's earlier API merged these
    tail = torch.empty(56, dtype=torch.uint8)
    buf.read_into(tail, offset=200).get(timeout=T)  # exactly the bytes from the offset to the end
    assert tail.tolist() == list(range(200, 256))


def test_a_transfer_runs_when_its_future_is_waited_for(owners: ActorMesh[Owner]) -> None:
    """As in Monarch: a read issued first but awaited after a write sees the written bytes."""
    buf = share(one(owners), torch.zeros(64, dtype=torch.uint8))
    seen = torch.empty(64, dtype=torch.uint8)
    read = buf.read_into(seen)
    write = buf.write_from(torch.full((64,), 7, dtype=torch.uint8))
    assert not read.done() and not write.done()
    write.get(timeout=T)
    read.get(timeout=T)
    assert seen.tolist() == [7] * 64
    assert not rdma.is_ibverbs_available() or rdma.get_rdma_backend() == "ibverbs"


def test_a_temporary_source_lives_until_its_write_ran(owners: ActorMesh[Owner]) -> None:
    """A write from a temporary that the caller let go of never reads freed memory: its Future keeps it."""
    n = 256 << 10
    buf = owners.slice(gpus=0).share.call_one("kept", torch.zeros(n, dtype=torch.uint8)).get(timeout=T)
    write = buf.write_from(torch.full((n,), 7, dtype=torch.uint8))
    churn = [torch.full((n,), 9, dtype=torch.uint8) for _ in range(16)]  # would take a freed source's memory
    write.get(timeout=T)
    assert owners.slice(gpus=0).value.call_one("kept").get(timeout=T).unique().tolist() == [7]
    assert len(churn) == 16


@st.composite
def programs(draw: st.DrawFn, size: int) -> list[tuple[str, int, int]]:
    """Reads (offset, spare room in the destination) and writes (offset, length), each by shm or tcp."""
    ops = []
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["read", "write"]))
        offset = draw(st.integers(0, size))
        room = draw(st.integers(0, 8)) if op == "read" else draw(st.integers(0, size - offset))
        ops.append((op + "/" + draw(st.sampled_from(["shm", "tcp"])), offset, room))
    return ops


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), size=st.integers(1, 5000))
def test_random_offsets_and_sizes_match_slicing(owners: ActorMesh[Owner], data: st.DataObject, size: int) -> None:
    seed = data.draw(st.integers(0, 1000))
    model = bytearray(raw(sample(torch.uint8, size, seed)).numpy().tobytes())
    buf = one(owners, 1).share_bytes.call_one("prop", bytes(model)).get(timeout=T)
    for op, offset, n in data.draw(programs(size)):
        kind, via = op.split("/")
        with backend(via):
            if kind == "read":
                dst = torch.full((size - offset + n,), 0xAB, dtype=torch.uint8)
                buf.read_into(dst, offset=offset).get(timeout=T)
                assert dst[:size - offset].numpy().tobytes() == model[offset:]
                assert dst[size - offset:].eq(0xAB).all()
            else:
                src = raw(sample(torch.uint8, n, seed + offset))
                buf.write_from(src, offset=offset).get(timeout=T)
                model[offset:offset + n] = src.numpy().tobytes()
    assert one(owners, 1).value.call_one("prop").get(timeout=T) == bytes(model)


def _huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of this process's mappings over `t`'s memory (/proc/self/smaps), in bytes."""
    start, end, inside, total = t.data_ptr(), t.data_ptr() + t.nbytes, False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) << 10
    return total


@pytest.mark.skipif("[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
                    reason="transparent huge pages are off in this kernel")
def test_a_large_registered_region_moves_onto_huge_pages_with_its_data() -> None:
    t = torch.arange(16 * MiB // 8, dtype=torch.int64)
    assert _huge_bytes(t) == 0
    buf = RDMABuffer(t)
    assert _huge_bytes(t) >= 12 * MiB  # the whole 2 MiB pages inside the region
    assert torch.equal(t, torch.arange(16 * MiB // 8, dtype=torch.int64))
    buf.drop().get(timeout=T)
