"""The shared memory registry's count of changes (ortcapture.serving.shm_version) and the lookups an ingress replica
answers itself with it (shm_store.ActorRegistry, issue 45): in process, the actor's class driven without Ray.

Each request naming a region used to call the registry actor (0.7-0.9 cores in the actor and ~8 % of a busy tier
replica's CPU at 32 gRPC clients on an H100). Now a replica on the actor's node calls it only when the count moved or
a name is new — and never answers from what it remembers once the actor's process is gone.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import pytest

from ortcapture.serving import shm, shm_store, shm_version
from ortcapture.serving.shm import ShmError
from ortcapture.serving.shm_store import ActorRegistry, RegistryActor, ShmStore

pytest.importorskip("ray")  # ActorRegistry's calls catch Ray's errors (the serve extra; not in the older-ORT venvs)
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"),
                                reason="/dev/shm and /proc (Linux)")


def run(coro):
    return asyncio.run(coro)


class _Remote:
    """``actor.call.remote(...)`` of a :class:`RegistryActor` in this process (what Ray's handle does), counted."""

    def __init__(self, actor: RegistryActor):
        self.actor, self.calls = actor, []

    def remote(self, method, *args):
        self.calls.append(method)

        async def answer():
            return self.actor.call(method, *args)
        return answer()


class _Handle:
    def __init__(self, actor):
        self.call = _Remote(actor)


def _replica(handle) -> ActorRegistry:
    r = ActorRegistry("test-shm")
    r._actor = handle
    return r


@pytest.fixture()
def obj():
    key = f"/ortc-test-{uuid.uuid4().hex[:12]}"
    path = os.path.join(shm.SHM_DIR, key[1:])
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    yield key
    os.unlink(path)


@pytest.fixture()
def actor(monkeypatch):
    monkeypatch.setattr(shm_store, "node_id", lambda: "node-a")
    a = RegistryActor()
    yield a
    a.version.close()


def test_lookups_call_the_actor_only_when_its_count_moved_or_a_name_is_new(actor, obj):
    handle = _Handle(actor)
    a, b = _replica(handle), _replica(handle)  # two ingress replicas on the actor's node
    run(a.register("r", obj, 0, 64))
    first = run(a.lookup(["r", "nope"]))
    assert set(first) == {"r"} and a.calls == 1
    for _ in range(5):  # the same registered names, nothing changed: answered here
        assert run(a.lookup(["r"])) == first
    assert a.calls == 1
    # a name that is not registered is asked every time (only registered regions are remembered: names from
    # clients' requests never grow the replica's memory)
    assert run(a.lookup(["nope", "r"])) == first and run(a.lookup(["other"])) == {} and a.calls == 3
    run(b.unregister("r"))  # through another replica
    assert run(a.lookup(["r"])) == {} and a.calls == 4
    again = run(b.register("r", obj, 8, 32))
    got = run(a.lookup(["r"]))["r"]
    assert got == again and got.offset == 8 and got.generation != first["r"].generation and a.calls == 5
    with pytest.raises(ShmError, match="registered already"):  # a refused change counts nothing and says so
        run(b.register("r", obj, 0, 4))
    assert run(a.lookup(["r"]))["r"] == again and a.calls == 5


def test_names_from_requests_never_grow_a_replicas_memory(actor, obj):
    """A review: every name asked for was remembered, registered or not, until the count moved — 200 requests
    naming 1 MB region names held 210 MB in a replica (the body cap allowed ~256 GiB). Only registered regions are
    remembered now, at most MAX_KNOWN of them."""
    a = _replica(_Handle(actor))
    run(a.register("r", obj, 0, 64))
    for i in range(50):
        assert run(a.lookup([f"{i}-" + "a" * 100_000, "r"])).keys() == {"r"}
    assert run(a.lookup([f"x{i}" for i in range(20_000)])) == {}
    assert list(a._known) == ["r"]


def test_a_late_reply_from_a_replaced_actor_is_not_remembered(actor, obj, monkeypatch):
    """A review: a reply of the old actor arriving after this replica moved to a new one (its call had failed) made
    the replica read the old actor's count again and answer from the old registry. Replies are now remembered only
    from the handle this replica uses."""
    a = _replica(_Handle(actor))
    run(a.register("r", obj, 0, 64))
    old_reply = actor.call("lookup", ["r"])
    fresh = RegistryActor()
    try:
        a._forget()
        a._actor, a._made = _Handle(fresh), a._made + 1  # what _handle(fresh=True) does after a RayActorError
        fresh.call("register", "r", obj, 16, 16)
        assert run(a.lookup(["r"]))["r"].offset == 16
        a._remember({**old_reply, "handle": a._made - 1}, ["r"])  # the old actor's late reply
        assert a._reader.path == fresh.version.path
        assert run(a.lookup(["r"]))["r"].offset == 16
    finally:
        fresh.version.close()


def test_a_session_replica_never_makes_the_registry(monkeypatch):
    """``create=False`` (the session replica's CUDA region sweep): with no registry running, a lookup answers
    "nothing is registered" instead of making one — a server that stopped must not get a registry back."""
    import ray

    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: (_ for _ in ()).throw(ValueError("none")))
    reg = ActorRegistry("test-shm", create=False)
    assert run(reg.lookup(["r"])) == {} and reg._actor is None
    with pytest.raises(ShmError, match="registry is gone"):
        run(reg.register("r", "/k", 0, 1))


def test_without_reading_the_count_every_lookup_calls_the_actor(actor, obj):
    """``read_count=False`` is the behaviour before the count (benchmarks/ingress_costs.py times both)."""
    handle = _Handle(actor)
    before = ActorRegistry("test-shm", read_count=False)
    before._actor = handle
    run(before.register("r", obj, 0, 64))
    for _ in range(3):
        assert set(run(before.lookup(["r"]))) == {"r"}
    assert before.calls == before.lookups == 3 and before._reader is None


def test_a_count_is_read_on_the_actors_node_only(actor, obj, monkeypatch):
    """A replica on another node cannot see the actor's /dev/shm: every lookup is a call, as before."""
    handle = _Handle(actor)
    monkeypatch.setattr(shm_store, "node_id", lambda: "node-b")
    far = _replica(handle)
    run(far.register("r", obj, 0, 64))
    for _ in range(3):
        assert set(run(far.lookup(["r"]))) == {"r"}
    assert far.calls == 3 and far._reader is None


def test_nothing_is_answered_from_memory_once_the_actors_process_is_gone(actor, obj):
    """The actor dies (SIGKILL: its file stays); another replica makes a new registry and a client registers the
    name again. A replica that remembered the old registry's answer must ask: its reader sees the process gone —
    reaped or a zombie — and closes."""
    handle = _Handle(actor)
    a = _replica(handle)
    run(a.register("r", obj, 0, 64))
    run(a.lookup(["r"]))
    for reap in (True, False):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            reader = shm_version.VersionReader(actor.version.path, child.pid)
            assert reader.read() == actor.version.version
            child.kill()
            if reap:
                child.wait(10)
            else:  # a zombie until waited for
                deadline = time.monotonic() + 10
                while open(f"/proc/{child.pid}/stat", "rb").read().rpartition(b")")[2].split()[0] != b"Z":
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            assert reader.read() is None and reader.read() is None  # closed for good
        finally:
            child.kill()
            child.wait(10)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    a._reader.close()
    a._reader = shm_version.VersionReader(actor.version.path, child.pid)  # as if the actor had been that process
    child.kill()
    child.wait(10)
    calls = a.calls
    assert set(run(a.lookup(["r"]))) == {"r"} and a.calls == calls + 1  # asked (here: the same actor answers)
    assert a._reader is not None and a._reader.pid == os.getpid()  # and reads the answering actor's count again


def test_the_store_reads_and_sweeps_through_the_remembered_lookups(actor, obj):
    """ShmStore.regions and its per-second sweep: no actor call while nothing changed; an unregistration through
    another replica closes this replica's descriptor at its next sweep."""
    handle = _Handle(actor)
    a, b = ShmStore(_replica(handle)), ShmStore(_replica(handle))
    run(a.register("r", obj, 0, 64, "127.0.0.1"))
    a.maps.read(shm.Ref(run(a.regions(["r"]))["r"], 0, 4))
    calls = len(handle.call.calls)
    for _ in range(5):
        run(a.regions(["r"]))
        run(a.sweep())
    assert len(handle.call.calls) == calls
    run(b.unregister("r"))
    run(a.sweep())
    assert a.maps.names() == []
    a.close()
    b.close()


def test_version_files_are_the_servers_own_and_the_dead_ones_are_swept(tmp_path):
    vf = shm_version.VersionFile()
    try:
        name = os.path.basename(vf.path)
        with pytest.raises(ShmError, match="refused"):  # no client can register it as a region
            shm.check_key("/" + name)
        assert vf.bump() == 1 and shm_version.VersionReader(vf.path, os.getpid()).read() == 1
        for bad in ("/tmp/x", os.path.join(shm.SHM_DIR, "ortc-other")):
            with pytest.raises(ValueError):
                shm_version.VersionReader(bad, os.getpid())
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait(10)
        stale = os.path.join(shm.SHM_DIR, f"{shm_version.PREFIX}-{child.pid}-{uuid.uuid4().hex}")
        open(stale, "wb").close()
        other = shm_version.VersionFile()  # a new registry sweeps the files of registries whose process is gone
        assert other.path != vf.path  # and counts in a file of its own
        other.close()
        assert not os.path.exists(stale) and os.path.exists(vf.path)
    finally:
        vf.close()
    assert not os.path.exists(vf.path)
