"""Job key files (issue 36, items 8 and 9): a client outside the job fails closed without the job's key,
and key files of jobs that are gone are removed (discovery/keyfiles.py)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from rollout_sdk import DiscoveryError, RolloutClient, SamplingParams
from rollout_sdk.auth import JobSecret
from rollout_sdk.discovery import keyfiles
from rollout_sdk.discovery.store import ServerRecord, StoreDiscovery, StoreKeys, register_server, seal
from test_faults import until
from test_launch import _client_env, _env, _start_service, _tagged, _wait_gone, tag  # noqa: F401 (tag: fixture)


def _record(address: str, dp: int) -> ServerRecord:
    return ServerRecord(
        address=address, dp_rank=dp, tp_size=1, global_rank=dp, node_rank=0, pid=os.getpid(), backend="f", model="m"
    )


def _job_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> JobSecret:
    """A live job's key file where a job of this user writes it (the job's agent: this process)."""
    _client_env(monkeypatch, XDG_RUNTIME_DIR=str(tmp_path))
    key = JobSecret.generate()
    d = keyfiles.key_dir()
    keyfiles.private_dir(d)
    key.write(d / keyfiles.key_file_name(os.getpid(), "run", "0"))
    return key


async def test_a_client_outside_the_job_finds_its_key_and_a_forged_member_gets_nothing(
    fake_servers, tmp_path, monkeypatch
) -> None:
    """Item 8: the client holds no key in its environment; it finds the job's key file (same user, same
    machine), so a forged member record in the store reaches no request (before: 50 of 100)."""
    import torch.distributed as dist

    key = _job_key(tmp_path, monkeypatch)
    real, second, forged = await fake_servers(3)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys = StoreKeys("rollout_sdk/a0")

    def put(name: str, body: bytes) -> None:
        store.set(name, seal(key.store_key, name, body))

    put(StoreKeys.latest(), keys.prefix.encode())
    put(keys.num_servers, b"1")
    register_server(store, keys, _record(real.address, 0), key.store_key)
    disc = StoreDiscovery(f"127.0.0.1:{store.port}")
    async with RolloutClient(discovery=disc) as client:
        # the attacker registers its server as a member (unsealed, then sealed with a key of its own); then
        # the job registers a second server: the watcher handles registrations in order
        for k, body in enumerate(
            [msgspec.msgpack.encode(_record(forged.address, 1)), seal(JobSecret.generate().store_key, "x", b"y")],
            start=int(store.add(keys.members, 0)) + 1,
        ):
            store.set(keys.member(k), body)
            store.add(keys.members, 1)
        register_server(store, keys, _record(second.address, 1), key.store_key)
        await until(lambda: len(client.servers) == 2, "the job's second server joins")
        rs = await asyncio.gather(
            *(client.generate([1, 2, i], sampling=SamplingParams(max_new_tokens=2)) for i in range(100))
        )
    by_server = collections.Counter(r.server_id for r in rs)
    assert forged.server_id not in by_server
    assert sum(by_server.values()) == 100
    assert len(forged.engine.requests_seen) == 0
    assert {c.address for c in client.servers} == {real.address, second.address}


async def test_a_client_without_the_jobs_key_refuses_the_store_in_one_line(tmp_path, monkeypatch) -> None:
    """Item 8: with no key anywhere (another user's job, a forged store), nothing is trusted unchecked."""
    import torch.distributed as dist

    _client_env(monkeypatch, XDG_RUNTIME_DIR=str(tmp_path))
    other = JobSecret.generate()  # a job whose key this client cannot find
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    keys = StoreKeys("rollout_sdk/a0")
    latest = StoreKeys.latest()
    for body in (seal(other.store_key, latest, keys.prefix.encode()), keys.prefix.encode()):  # sealed, then bare
        store.set(latest, body)
        with pytest.raises(DiscoveryError, match="ROLLOUT_SDK_JOB_KEY_FILE") as info:
            await StoreDiscovery(f"127.0.0.1:{store.port}").open(timeout=5.0)
        assert "\n" not in str(info.value)


def test_key_files_of_jobs_that_are_gone_are_removed(tmp_path) -> None:
    """Item 9, by construction: a dead agent, a recycled pid (another start time) and an earlier attempt of
    a live agent are stale; the live agent's current file and files that are not key files stay."""
    d = tmp_path / "keys"
    keyfiles.private_dir(d)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = keyfiles.key_file_name(os.getpid(), "run", "1")
    start = keyfiles.process_start_time(os.getpid())
    names = [
        keyfiles.key_file_name(dead.pid, "run", "0"),  # no such process (pids are not reused this fast)
        f"job-{os.getpid()}-{int(start or 0) + 1}-run-a1.key",  # this pid, another process's start time
        f"job-{os.getpid()}-{start}-run-a0.key",  # an earlier attempt of the live agent
        live,
        "notes.txt",
    ]
    for n in names:
        (d / n).write_text("k")
    removed = {p.name for p in keyfiles.remove_stale(d)}
    assert removed == set(names[:3]) if start else removed == {names[0]}
    assert sorted(p.name for p in d.iterdir()) == sorted([live, "notes.txt"])


def test_a_rank_killed_with_sigkill_leaves_a_key_file_the_next_job_removes(
    sdk_home,
    tag,  # noqa: F811
    tmp_path,
) -> None:
    """Item 9: local rank 0 killed with SIGKILL runs no ``finally``: its job's key file stays until its
    torchrun agent is gone; then the next job (or client) of this user removes it.  The job keeps its key
    in a directory of this test's (``XDG_RUNTIME_DIR``): no other test's client cleans it up meanwhile."""
    env = dict(_env(sdk_home, tag), XDG_RUNTIME_DIR=str(tmp_path))
    job = _start_service(env, "--tp", "1", "--engine", "fake", nproc=2)
    try:
        files = list(keyfiles.key_dir(env).glob(f"job-{job.proc.pid}-*.key"))
        assert len(files) == 1, files
        rank0 = next(
            pid for pid in _tagged(tag) if b"LOCAL_RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        )
        os.kill(rank0, signal.SIGKILL)
        assert job.proc.wait(timeout=60) != 0
        assert _wait_gone(tag, 30) == []
        assert files[0].exists()  # nobody ran the rank's cleanup
        assert all(p != files[0] for p in keyfiles.live_key_files(env))  # what a job start or a client runs
        assert not files[0].exists()
    finally:
        job.close()
