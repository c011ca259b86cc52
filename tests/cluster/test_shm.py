"""The shm transport's ring (cluster/shm.py) without Ray: tensors cross it bit for bit, its names are gone
once both ends hold it, a peer that dies (or fails a step) never leaves the other end waiting, and what does
not fit is a clear error."""
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from raymoe.cluster.shm import SHM_DIR, Ring, RingError, unlink
from raymoe.stages.errors import RaymoeError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def path():
    p = f"{SHM_DIR}/raymoe-test-{uuid.uuid4().hex[:8]}"
    yield p
    unlink(p)


def names(path) -> list[str]:
    base = os.path.basename(path)
    return [n for n in os.listdir(SHM_DIR) if n.startswith(base)]


def test_tensors_cross_bit_for_bit_and_the_names_go(path):
    rx = Ring.create(path, 2, 4096)
    assert sorted(names(path)) == sorted(os.path.basename(path) + s for s in ("", ".full", ".free"))
    tx = Ring.attach(path, 2, 4096)
    assert names(path) == []                     # held only by the two ends from here on
    g = torch.Generator().manual_seed(0)
    sent = [torch.randn(3, 7, generator=g), torch.randn(1, 16, generator=g), torch.tensor([[float("nan"), -0.0]]),
            torch.arange(10, dtype=torch.int64), torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
            torch.randn(32, 32, generator=g)]    # exactly a slot
    for pair in (sent[0:2], sent[2:4], sent[4:6]):  # the sender may be up to 2 (the slots) ahead; the ring wraps
        for t in pair:
            tx.send(t)
        for want in pair:
            got = rx.recv()
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    rx.close()
    tx.close()


def test_oversized_activation_is_a_clear_error(path):
    rx = Ring.create(path, 2, 1024)
    tx = Ring.attach(path, 2, 1024)
    with pytest.raises(RaymoeError, match="1028 bytes .* does not fit the shm transport's slots of 1024 bytes"):
        tx.send(torch.zeros(257))
    tx.send(torch.ones(256))                     # nothing was consumed by the refusal
    assert torch.equal(rx.recv(), torch.ones(256))


def test_a_failed_step_is_passed_on(path):
    rx = Ring.create(path, 3, 1024)
    tx = Ring.attach(path, 3, 1024)
    tx.send_failure()
    tx.send_failure(out_of_memory=True)
    tx.send(torch.ones(4))
    with pytest.raises(RingError, match="the previous stage failed"):
        rx.recv()
    with pytest.raises(MemoryError):
        rx.recv()
    assert torch.equal(rx.recv(), torch.ones(4))  # the ring stays in step


def test_a_chains_end_is_read_only_where_one_may_come(path):
    rx = Ring.create(path, 3, 1024)
    tx = Ring.attach(path, 3, 1024)
    assert not rx.ready()
    tx.send_end()
    tx.send_end()
    tx.send(torch.ones(4))
    assert rx.ready()
    assert rx.recv(end_ok=True) is None
    with pytest.raises(RingError, match="out of step: a chain's end"):
        rx.recv()
    assert torch.equal(rx.recv(end_ok=True), torch.ones(4))
    assert not rx.ready()


def peer(path: str, code: str) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        from raymoe.cluster.shm import Ring
        {code}
    """)
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_receiver_is_not_left_waiting_when_the_sender_dies(path):
    rx = Ring.create(path, 2, 1024)
    p = peer(path, f"""
        tx = Ring.attach({path!r}, 2, 1024)
        tx.send(torch.full((4,), 7.0))
        print("sent", flush=True)
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    """)
    assert p.stdout.readline() == "sent\n"
    assert torch.equal(rx.recv(), torch.full((4,), 7.0))
    with pytest.raises(RingError, match="the previous stage is gone"):
        rx.recv()                               # EOF when it dies, not a wait forever
    assert p.wait(timeout=30) == -9
    assert names(path) == []


def test_sender_is_not_left_waiting_when_the_receiver_dies(path):
    p = peer(path, f"""
        rx = Ring.create({path!r}, 2, 1024)
        print("created", flush=True)
        time.sleep(1)
        os.kill(os.getpid(), 9)
    """)
    assert p.stdout.readline() == "created\n"
    tx = Ring.attach(path, 2, 1024)
    assert names(path) == []
    with pytest.raises(RingError, match="the next stage is gone"):
        for _ in range(3):                      # 2 slots fill; the third send waits for a receiver that dies
            tx.send(torch.ones(4))
    assert p.wait(timeout=30) == -9


def test_a_full_shm_dir_is_refused_at_creation(path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(RaymoeError, match="no room in /dev/shm for the shm transport's ring"):
        Ring.create(path, 2, 1 << 20)
    assert names(path) == []


def test_a_node_without_the_shm_dir_is_refused():
    with pytest.raises(RaymoeError, match="--transport shm needs /nonexistent-shm .* use --transport gloo"):
        Ring.create("/nonexistent-shm/ring", 2, 1024)
