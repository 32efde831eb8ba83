"""Attacks on a live coordinator, each bounded and on loopback: what a caller sends must not make the daemon hold
memory, descriptors or log lines without bound. Each attack records the daemon's resident memory and open
descriptors (from /proc) before, during and after, and requires them near the baseline: the bounds are an order of
magnitude below what the same attack made an unbounded coordinator hold, and above the noise of a Python heap."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2

import ifrt
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import ResourceExhausted
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA
from tests.resources import open_fds, rss_bytes

COORDINATOR = "/ifrt.topology.v1.Coordinator/"
HEALTH = "/grpc.health.v1.Health/"
MiB = 1 << 20
GROWTH = 48 * MiB
"""Most the daemon's resident memory may grow by over an attack (the unbounded daemon grew by 250 MiB and more)."""
OWN = (("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1),
       ("grpc.max_send_message_length", -1))
"""Options of an attacker's channel: a connection of its own, messages of any size."""


class Resources:
    """The daemon's memory and descriptors at the baseline, to compare with later."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rss, self.fds = rss_bytes(pid), open_fds(pid)

    def grown(self) -> tuple[int, int]:
        """(bytes of resident memory, descriptors) gained since the baseline."""
        return rss_bytes(self.pid) - self.rss, open_fds(self.pid) - self.fds

    def assert_near(self, when: str, fds: int = 16, growth: int = GROWTH) -> None:
        memory, descriptors = self.grown()
        assert memory < growth, f"{when}: the coordinator grew by {memory / MiB:.0f} MiB"
        assert descriptors <= fds, f"{when}: the coordinator holds {descriptors} more descriptors"


def settle() -> None:
    """Waits out one round of the daemon's collection of garbage (CoordinatorConfig.gc_interval_s, 1 s)."""
    time.sleep(2)


def member(address: str, **kwargs) -> ifrt.Client:
    """A discovered process (the only one of its cluster), with its session."""
    client = ifrt.Client(address, process_id=0, num_processes=1, timeout=60, **kwargs)
    client.discover()
    return client


def as_member(client: ifrt.Client, token: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata for raw calls on behalf of ``client``."""
    return ((SECRET_METADATA, client.process_secret),) + (((TOKEN_METADATA, token),) if token else ())


async def code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def forever() -> AsyncIterator[bytes]:
    """A request stream that never sends anything (until its call is cancelled)."""
    await asyncio.Event().wait()
    yield b""


# 1. The health service needs no token: it costs an unauthenticated caller kilobytes.

@pytest.mark.serial  # the daemon's RSS: with other tests' load, more refused names are in memory at once
def test_health_watches_with_huge_names_hold_nothing(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), "--max-request-bytes", str(8 * MiB),
                                    num_processes=1)
    before = Resources(coordinator.pid)

    async def attack() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            watch = channel.unary_stream(HEALTH + "Watch")
            huge = health_pb2.HealthCheckRequest(service="s" * (6 * MiB)).SerializeToString()
            calls = [watch(huge) for _ in range(24)]
            await asyncio.sleep(4)  # the unbounded daemon holds every name while its watch is open
            before.assert_near("while 24 watches of 6 MiB names were open")
            codes = []
            for call in calls:
                try:
                    async for _ in call:
                        pass
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    codes.append(e.code())
                call.cancel()
            return codes

    assert asyncio.run(asyncio.wait_for(attack(), 60)) == [grpc.StatusCode.INVALID_ARGUMENT] * 24
    settle()
    before.assert_near("after the watches were refused")


def test_health_watches_per_connection_are_limited_and_checks_still_answer(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), num_processes=1)

    async def attack() -> tuple[list[int], grpc.StatusCode, int]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            watch = channel.unary_stream(HEALTH + "Watch")
            request = health_pb2.HealthCheckRequest(service="").SerializeToString()
            calls = [watch(request) for _ in range(6)]
            first = []
            for call in calls:
                try:
                    first.append(health_pb2.HealthCheckResponse.FromString(await call.read()).status)
                except grpc.RpcError as e:
                    first.append(e.code())
            check = channel.unary_unary(HEALTH + "Check")
            answer = health_pb2.HealthCheckResponse.FromString(await check(request, timeout=10))
            for call in calls:
                call.cancel()
            return first, answer.status

    first, status = asyncio.run(asyncio.wait_for(attack(), 60))
    serving = health_pb2.HealthCheckResponse.SERVING
    assert sorted(first, key=str) == sorted([serving] * 4 + [grpc.StatusCode.INVALID_ARGUMENT] * 2, key=str)
    assert status == serving  # --max-health-watches-per-connection 4 held two watches back, not the service


def test_a_health_check_that_never_sends_its_request_is_ended(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), "--first-message-timeout", "1",
                                    num_processes=1)

    async def attack() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            return await code(channel.stream_unary(HEALTH + "Check")(forever(), timeout=20))

    started = time.monotonic()
    assert asyncio.run(attack()) == grpc.StatusCode.INVALID_ARGUMENT
    assert time.monotonic() - started < 15  # ended by the coordinator, not by the caller's own deadline


# 3. Unknown methods: no label, no log line of the caller's text.

def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def metrics_port(coordinator) -> int:
    coordinator.wait_for_log("serving metrics on http://")
    line = next(line for line in coordinator.log.splitlines() if "serving metrics on http://" in line)
    return int(line.rsplit(":", 1)[1].split("/")[0])


def test_calls_of_unknown_methods_and_refused_calls_cost_no_labels_and_few_log_lines(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), "--metrics-port", "0",
                                    "--metrics-bind", "127.0.0.1", num_processes=1)
    port = metrics_port(coordinator)
    before, log_before, metrics_before = Resources(coordinator.pid), len(coordinator.log), len(scrape(port))

    async def attack() -> set[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            codes = set()
            for i in range(400):
                name = f"{i:04d}" + "m" * 4000
                codes.add(await code(channel.unary_unary(COORDINATOR + name)(b"", timeout=10)))
                codes.add(await code(channel.unary_unary(f"/{name[:3000]}/{name[:3000]}")(b"", timeout=10)))
                codes.add(await code(channel.unary_unary(COORDINATOR + "Register")(b"", timeout=10)))
            return codes

    assert asyncio.run(asyncio.wait_for(attack(), 60)) == {grpc.StatusCode.UNIMPLEMENTED,
                                                            grpc.StatusCode.UNAUTHENTICATED}
    metrics = scrape(port)
    assert "mmmm" not in metrics and 'method="unknown"' in metrics
    assert len(metrics) - metrics_before < 16 << 10, "the scrape grew with the callers' method names"
    log = coordinator.log[log_before:]
    assert "mmmm" not in log
    assert log.count("refused Register") <= 2, "one line per refused call"
    before.assert_near("after 1,200 unknown and refused calls")


# 5. A key-value get that waits leaves nothing behind, and its key is checked.

def test_waiting_gets_of_keys_nobody_sets_leave_nothing_behind(start_coordinator):
    coordinator = start_coordinator("--kv-max-key-bytes", str(64 << 10), num_processes=1)
    client = member(coordinator.address)
    before = Resources(coordinator.pid)

    async def attack() -> set[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            get = channel.unary_unary(COORDINATOR + "KeyValueGet")
            codes = set()
            for batch in range(12):
                calls = [get(pb.KeyValueGetRequest(client_uid=client.client_uid, key=f"{batch}/{i}/" + "k" * 60_000,
                                                   wait_ms=50).SerializeToString(),
                             metadata=as_member(client), timeout=30) for i in range(50)]
                codes |= set(await asyncio.gather(*(code(c) for c in calls)))
            too_long = pb.KeyValueGetRequest(client_uid=client.client_uid, key="k" * MiB, wait_ms=50)
            codes.add(await code(get(too_long.SerializeToString(), metadata=as_member(client), timeout=30)))
            return codes

    with client:
        assert asyncio.run(asyncio.wait_for(attack(), 60)) == {grpc.StatusCode.DEADLINE_EXCEEDED,
                                                                grpc.StatusCode.INVALID_ARGUMENT}
        settle()
        before.assert_near("after 600 waits on 60 KB keys nobody set")
        with pytest.raises(ifrt.InvalidArgument, match="key of 1048577 bytes: expected 1 to 65536 bytes"):
            client.kv_try_get("k" * (MiB + 1))


# 6. Barriers, watches and a session's backlog are limited.

async def cancel_unknown_barriers(address: str, client: ifrt.Client, batches: int) -> list[grpc.StatusCode]:
    """A member cancels ``batches`` x 100 barriers nobody started, each named with 1,006 bytes; every call's code."""
    async with grpc.aio.insecure_channel(address, options=OWN) as channel:
        cancel = channel.unary_unary(COORDINATOR + "CancelBarrier")
        codes = []
        for batch in range(batches):
            calls = [cancel(pb.CancelBarrierRequest(client_uid=client.client_uid,
                                                    name=f"{batch:02d}/{i:02d}/" + "b" * 1000).SerializeToString(),
                            metadata=as_member(client), timeout=30) for i in range(100)]
            codes += await asyncio.gather(*(code(c) for c in calls))
        return codes


def test_cancels_of_unknown_barriers_stop_at_the_barrier_limit(start_coordinator):
    coordinator = start_coordinator("--max-barriers", "50", num_processes=1)
    client = member(coordinator.address)
    before = Resources(coordinator.pid)

    with client:
        codes = asyncio.run(asyncio.wait_for(cancel_unknown_barriers(coordinator.address, client, 40), 60))
        assert codes.count(grpc.StatusCode.OK) == 50 and codes.count(grpc.StatusCode.INVALID_ARGUMENT) == 3950
        with pytest.raises(ifrt.InvalidArgument, match=r"expected at most 50 barriers \(the coordinator's "
                                                       r"--max-barriers\)"):
            client.cancel_barrier("one more")
        before.assert_near("after 4,000 cancels of unknown barriers")


def session_stream(channel: grpc.aio.Channel, client: ifrt.Client, messages: list[pb.SessionRequest],
                   hold: asyncio.Event) -> grpc.aio.StreamStreamCall:
    """A raw session of ``client`` that sends ``messages`` after its SessionOpen, then stays open until ``hold``."""
    async def requests() -> AsyncIterator[bytes]:
        yield pb.SessionRequest(open=pb.SessionOpen(client_uid=client.client_uid)).SerializeToString()
        for message in messages:
            yield message.SerializeToString()
        await hold.wait()

    return channel.stream_stream(COORDINATOR + "Session")(requests(), metadata=as_member(client))


def test_watches_are_limited_in_length_and_number(start_coordinator):
    coordinator = start_coordinator("--max-watches-per-session", "8", num_processes=1)
    client = member(coordinator.address)
    before = Resources(coordinator.pid)

    async def attack() -> list[str]:
        hold = asyncio.Event()
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            huge = [pb.SessionRequest(watch=pb.WatchKeys(prefix=f"{i}/" + "p" * MiB)) for i in range(60)]
            many = [pb.SessionRequest(watch=pb.WatchKeys(prefix=f"w{i}/")) for i in range(12)]
            call = session_stream(channel, client, huge + many, hold)
            acked = []
            try:
                async with asyncio.timeout(5):
                    async for raw in call:
                        event = pb.SessionEvent.FromString(raw)
                        if event.WhichOneof("kind") == "watching":
                            acked.append(event.watching.prefix)
            except TimeoutError:
                pass
            before.assert_near("with 60 watches of 1 MiB prefixes on one session")
            hold.set()
            call.cancel()
            return acked

    with client:
        assert asyncio.run(asyncio.wait_for(attack(), 60)) == [f"w{i}/" for i in range(8)]
        assert "ignored a watch of a prefix of 1048578 bytes: expected at most 1024" in coordinator.log
        assert "expected at most 8 (the coordinator's --max-watches-per-session)" in coordinator.log


def test_sessions_that_read_nothing_hold_at_most_their_backlog(start_coordinator):
    # Every change is journaled once (the memory store's share) but queued for each watching session: 16 sessions
    # that never read would hold 16 copies of everything; each holds at most --max-session-backlog-bytes.
    coordinator = start_coordinator("--max-session-backlog-bytes", str(MiB), "--max-sessions-per-process", "32",
                                    num_processes=1)
    client = member(coordinator.address)
    before = Resources(coordinator.pid)

    async def attack() -> set[grpc.StatusCode]:
        hold = asyncio.Event()
        # No window growth on the attacker's side (gRPC's BDP probing grows it under load): what it does not read
        # stays on the coordinator's side of the connection, where the bound must hold it.
        options = (*OWN, ("grpc.http2.bdp_probe", 0))
        async with grpc.aio.insecure_channel(coordinator.address, options=options) as channel:
            calls = [session_stream(channel, client, [pb.SessionRequest(watch=pb.WatchKeys(prefix="big/"))], hold)
                     for _ in range(16)]
            for call in calls:
                await call.read()  # attached; from here on the session's events are never read
            for i in range(32):
                await asyncio.to_thread(client.kv_set, "big/value", bytes([i]) * (MiB // 2), allow_overwrite=True)
            await asyncio.sleep(2.5)
            before.assert_near("after 16 MiB of changes to 16 sessions that read nothing", growth=64 * MiB)
            hold.set()
            codes = set()
            for call in calls:  # reading again: the backlog was dropped and the session ended, naming the flag
                try:
                    async with asyncio.timeout(20):
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    codes.add(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    assert "--max-session-backlog-bytes" in e.details()
                    codes.add(e.code())
            return codes

    with client:
        assert asyncio.run(asyncio.wait_for(attack(), 60)) == {grpc.StatusCode.INVALID_ARGUMENT}


def test_an_overlong_request_id_is_refused(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    with member(coordinator.address) as client, grpc.insecure_channel(coordinator.address) as channel:
        increment = channel.unary_unary(COORDINATOR + "KeyValueIncrement")
        with pytest.raises(grpc.RpcError) as info:
            increment(pb.KeyValueIncrementRequest(client_uid=client.client_uid, key="n", amount=1,
                                                  request_id="r" * MiB).SerializeToString(),
                      metadata=as_member(client), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == ("request_id is 1048576 bytes long: expected at most 1024 (the coordinator's "
                                        "--max-string-bytes)")
        assert client.kv_try_get("n") is None  # nothing was added


# 7. Sessions that never open are ended; one connection's streams are limited.

def test_session_streams_that_never_open_are_ended(start_coordinator):
    coordinator = start_coordinator("--first-message-timeout", "1", "--max-concurrent-streams", "1024",
                                    num_processes=1)
    before = Resources(coordinator.pid)

    async def attack() -> set[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            session = channel.stream_stream(COORDINATOR + "Session")
            calls = [session(forever(), timeout=40) for _ in range(3000)]

            async def end(call) -> grpc.StatusCode:
                try:
                    async for _ in call:
                        pass
                except grpc.RpcError as e:
                    return e.code()
                return grpc.StatusCode.OK

            await asyncio.sleep(2)
            before.assert_near("with 3,000 session streams open on one connection")
            return set(await asyncio.gather(*(end(c) for c in calls)))

    started = time.monotonic()
    # Ended by the coordinator a second after they began, or refused at once past --max-concurrent-streams (1024)
    assert asyncio.run(asyncio.wait_for(attack(), 60)) <= {grpc.StatusCode.INVALID_ARGUMENT,
                                                            grpc.StatusCode.UNAVAILABLE}
    assert time.monotonic() - started < 30
    settle()
    before.assert_near("after 3,000 session streams that never opened")


# 8. Idle and silent connections are closed and capped; a real process gets in.

def test_by_default_connections_are_capped_at_what_the_job_uses(start_coordinator):
    coordinator = start_coordinator(num_processes=2)  # a process and an agent each, and 128: 132
    before = Resources(coordinator.pid)
    host, port = coordinator.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(300)]
    try:
        time.sleep(1)  # the coordinator accepts what it accepts
        _, descriptors = before.grown()
        assert descriptors <= 132 + 8, f"{descriptors} connections held by a 2-process job's coordinator"
    finally:
        for sock in silent:
            sock.close()


def test_idle_and_silent_connections_are_closed_and_capped(start_coordinator):
    coordinator = start_coordinator("--max-connection-idle", "1", "--max-connections", "64", num_processes=1)
    before = Resources(coordinator.pid)
    host, port = coordinator.address.rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(100)]
    idle = [grpc.insecure_channel(coordinator.address, options=OWN) for _ in range(100)]
    try:
        for channel in idle[:40]:
            grpc.channel_ready_future(channel).result(timeout=20)  # HTTP/2 up, pings answered, no call
        _, descriptors = before.grown()
        assert descriptors <= 64 + 8, f"{descriptors} connections held past --max-connections 64"
        deadline = time.monotonic() + 20
        while before.grown()[1] > 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        before.assert_near("after 100 silent and 100 idle connections sat for their idle timeout", fds=4)
        with member(coordinator.address) as client:  # a real process, while the attacker's sockets are still open
            assert client.topology.generation == 1
    finally:
        for s in silent:
            s.close()
        for channel in idle:
            channel.close()


# 9. Noise: a caller that goes away mid-write is no internal error.

def test_a_session_cancelled_while_events_are_written_logs_no_traceback(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    client = member(coordinator.address)

    async def cancel_mid_write() -> None:
        hold = asyncio.Event()
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            for attempt in range(5):
                call = session_stream(channel, client, [pb.SessionRequest(watch=pb.WatchKeys(prefix=""))], hold)
                await call.read()  # attached
                # Events the session does not read: the coordinator's write waits for the flow-control window
                await asyncio.to_thread(
                    lambda a=attempt: [client.kv_set(f"flood/{a}/{i}", b"v" * (256 << 10)) for i in range(24)])
                call.cancel()

    with client:
        asyncio.run(asyncio.wait_for(cancel_mid_write(), 60))
        time.sleep(0.5)
        assert "Traceback" not in coordinator.log and "internal error" not in coordinator.log, coordinator.log
        assert client.kv_try_get("flood/4/23") == b"v" * (256 << 10)  # the coordinator went on serving


# 10. Byte budgets: what members and token holders make the coordinator hold adds up (docs/security.md).

class Peak:
    """The daemon's largest resident memory while the block runs (sampled every 10 ms): an answer built and sent in
    one call leaves no trace afterwards, only while it is held."""

    def __init__(self, pid: int) -> None:
        self.pid, self.most, self._stop = pid, rss_bytes(pid), threading.Event()

    def __enter__(self) -> Peak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.most = max(self.most, rss_bytes(self.pid))

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_values_past_the_key_value_bytes_are_refused_and_hold_nothing(start_coordinator):
    # 1,000 values of 1 MiB took an unbounded coordinator from 67 to 2,432 MB (the store and its journal).
    coordinator = start_coordinator("--kv-max-bytes", str(8 * MiB), num_processes=1)
    client = member(coordinator.address)
    before = Resources(coordinator.pid)

    async def attack() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            put = channel.unary_unary(COORDINATOR + "KeyValueSet")
            codes = []
            for batch in range(10):
                calls = [put(pb.KeyValueSetRequest(client_uid=client.client_uid, key=f"big/{batch}/{i}",
                                                   value=bytes([i]) * MiB).SerializeToString(),
                             metadata=as_member(client), timeout=30) for i in range(30)]
                codes += await asyncio.gather(*(code(c) for c in calls))
            return codes

    with client:
        codes = asyncio.run(asyncio.wait_for(attack(), 60))
        assert codes.count(grpc.StatusCode.OK) == 7 and codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 293
        settle()
        before.assert_near("after 300 values of 1 MiB")
        with pytest.raises(ResourceExhausted, match=r"storing 1048576 bytes at key 'one more' would pass the "
                                                         r"coordinator's --kv-max-bytes of 8388608 bytes; \d+ bytes "
                                                         r"are held"):
            client.kv_set("one more", b"x" * MiB)
        assert client.kv_delete("big/", prefix=True) == 7
        client.kv_set("one more", b"x" * MiB)  # room again


def test_a_listing_past_the_reply_bytes_is_refused_before_it_is_built(start_coordinator):
    # One KeyValueDir of a big store built a 1.05 GB answer.
    coordinator = start_coordinator("--max-reply-bytes", str(6 * MiB), num_processes=1)
    client = member(coordinator.address)

    async def attack() -> set[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            listing = channel.unary_unary(COORDINATOR + "KeyValueDir")
            request = pb.KeyValueDirRequest(client_uid=client.client_uid, prefix="big/").SerializeToString()
            codes = set()
            for _ in range(3):
                calls = [listing(request, metadata=as_member(client), timeout=30) for _ in range(8)]
                codes |= set(await asyncio.gather(*(code(c) for c in calls)))
            return codes

    with client:
        for i in range(24):
            client.kv_set(f"big/{i}", bytes([i]) * MiB)
        settle()
        before = Resources(coordinator.pid)
        with Peak(coordinator.pid) as peak:
            assert asyncio.run(asyncio.wait_for(attack(), 60)) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert peak.most - before.rss < GROWTH, f"the coordinator grew by {(peak.most - before.rss) / MiB:.0f} MiB"
        with pytest.raises(ResourceExhausted, match=r"the listing of 24 keys under 'big/' \(25166\d+ bytes\) "
                                                         r"would pass the coordinator's --max-reply-bytes of 6291456 "
                                                         r"bytes: list a narrower prefix"):
            client.kv_dir("big/")
        assert sorted(client.kv_dir("big/2")) == ["big/2", "big/20", "big/21", "big/22", "big/23"]


def test_swaps_of_big_values_deleted_at_once_hold_at_most_the_answer_bytes(start_coordinator):
    # 1,500 swaps of 1 MiB values from as many caller ids, each key deleted right after, left the store empty and the
    # coordinator at 3,105 MB: every answer remembered (1,024 callers) and kept in the journal (64 for every caller).
    coordinator = start_coordinator("--max-answer-bytes", str(8 * MiB), num_processes=1)
    before = Resources(coordinator.pid)

    async def attack() -> set[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            swap = channel.unary_unary(COORDINATOR + "KeyValueCompareSet")
            delete = channel.unary_unary(COORDINATOR + "KeyValueDelete")

            async def one(i: int) -> grpc.StatusCode:
                key = f"torchrun/run/{i}"
                swapped = await code(swap(pb.KeyValueCompareSetRequest(
                    client_uid=f"agent-{i}", key=key, desired=bytes([i % 256]) * MiB,
                    request_id="r1").SerializeToString(), timeout=30))
                if swapped is not grpc.StatusCode.OK:
                    return swapped
                return await code(delete(pb.KeyValueDeleteRequest(client_uid=f"agent-{i}", key=key)
                                         .SerializeToString(), timeout=30))

            codes = set()
            for batch in range(15):
                codes |= set(await asyncio.gather(*(one(batch * 20 + i) for i in range(20))))
            return codes

    assert asyncio.run(asyncio.wait_for(attack(), 60)) == {grpc.StatusCode.OK}
    settle()
    # The journal holds up to 32 MiB of superseded entries (then it is compacted) and the answers' 8 MiB; the
    # unbounded coordinator held 300 MiB of answers and 400 MiB of journal after the same 300 swaps.
    before.assert_near("after 300 swaps of 1 MiB values, each deleted at once", growth=2 * GROWTH)


def test_cancels_of_unknown_barriers_stop_at_the_barrier_bytes(start_coordinator):
    # Cancelled unknown barriers held 5.2 KB each, 5.2 GB at --max-barriers.
    coordinator = start_coordinator("--max-barrier-bytes", str(MiB), num_processes=1)
    client = member(coordinator.address)
    before = Resources(coordinator.pid)

    with client:
        codes = asyncio.run(asyncio.wait_for(cancel_unknown_barriers(coordinator.address, client, 20), 60))
        kept = MiB // (3 * 1006 + 1024)  # each: its name three times (barrier, error, journal) and 1 KiB
        assert codes.count(grpc.StatusCode.OK) == kept
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2000 - kept
        with pytest.raises(ResourceExhausted, match=r"keeping barrier 'one more/b+'\.\.\. \(1009 characters\) \(4051 "
                                                    r"bytes\) would pass the coordinator's --max-barrier-bytes of "
                                                    r"1048576 bytes; \d+ bytes are held"):
            client.cancel_barrier("one more/" + "b" * 1000)
        before.assert_near("after 2,000 cancels of unknown barriers")


def test_one_process_holds_at_most_its_sessions(start_coordinator):
    # One process could open any number of sessions, each holding up to --max-session-backlog-bytes.
    coordinator = start_coordinator("--max-sessions-per-process", "2", num_processes=1)
    client = member(coordinator.address)

    async def attack() -> list[str]:
        hold = asyncio.Event()
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            calls = []
            for _ in range(12):
                call = session_stream(channel, client, [], hold)
                await call.read()  # attached
                calls.append(call)
            ended = []
            for call in calls[:-2]:
                try:
                    async with asyncio.timeout(10):
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    ended.append("closed")
                except grpc.RpcError as e:
                    ended.append(f"{e.code().name}: {e.details()}")
            for call in calls[-2:]:  # the newest two are still open
                assert not call.done()
            hold.set()
            return ended

    with client:
        ended = asyncio.run(asyncio.wait_for(attack(), 60))
        assert set(ended) == {"RESOURCE_EXHAUSTED: this process opened a newer session: it may hold at most 2 at "
                              "once (the coordinator's --max-sessions-per-process); this one, its oldest, ends"}
        client.kv_set("still", b"served")  # the process itself goes on
        assert client.kv_try_get("still") == b"served"


def test_sessions_that_read_nothing_hold_at_most_the_backlog_bytes_together(start_coordinator):
    # Each session watching a prefix of its own holds its own events: 16 sessions held 16 backlogs.
    coordinator = start_coordinator("--max-session-backlog-bytes", str(8 * MiB), "--max-backlog-bytes",
                                    str(4 * MiB), "--max-sessions-per-process", "32", num_processes=1)
    client = member(coordinator.address)

    async def attack() -> list[str]:
        hold = asyncio.Event()
        options = (*OWN, ("grpc.http2.bdp_probe", 0))
        async with grpc.aio.insecure_channel(coordinator.address, options=options) as channel:
            calls = [session_stream(channel, client, [pb.SessionRequest(watch=pb.WatchKeys(prefix=f"p{i}/"))], hold)
                     for i in range(16)]
            for call in calls:
                await call.read()  # attached; from here on the session's events are never read
            for round_ in range(8):
                for i in range(16):
                    await asyncio.to_thread(client.kv_set, f"p{i}/value", bytes([round_]) * (MiB // 2),
                                            allow_overwrite=True)
            await asyncio.sleep(1)
            hold.set()
            ended = []
            for call in calls:
                try:
                    async with asyncio.timeout(20):
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    ended.append("closed")
                except grpc.RpcError as e:
                    ended.append(e.code().name + (" --max-backlog-bytes" if "--max-backlog-bytes" in e.details()
                                                  else ""))
            return ended

    with client:
        ended = asyncio.run(asyncio.wait_for(attack(), 90))
        # 64 MiB of events, 4 MiB to each session: all of them past --max-backlog-bytes, none past its own bound
        assert ended.count("RESOURCE_EXHAUSTED --max-backlog-bytes") >= 12, ended
        assert "INVALID_ARGUMENT" not in ended


def big_registration(uid: str) -> bytes:
    """Process 0's RegisterRequest of 64 devices with 64 attributes of a kilobyte each (4 MiB)."""
    devices = [pb.LocalDevice(local_id=d, platform="cpu", kind="cpu",
                              attributes={f"{uid}-{a:02d}": "v" * 1000 for a in range(64)}) for d in range(64)]
    return pb.RegisterRequest(client_uid=uid, hostname="host-0", process_id=0, num_processes=1, plugin="cpu",
                              devices=devices).SerializeToString()


@pytest.mark.serial  # the daemon's RSS: with other tests' load, freed registrations are returned later
def test_leaving_and_registering_again_holds_at_most_the_registration_bytes(start_coordinator):
    # Each leave and re-register kept the old registration's request in memory and in the journal for good.
    coordinator = start_coordinator("--max-registration-bytes", str(10 * MiB), num_processes=1)
    before = Resources(coordinator.pid)

    async def attack() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            register = channel.unary_unary(COORDINATOR + "Register")
            leave = channel.unary_unary(COORDINATOR + "Leave")
            codes = []
            for cycle in range(30):
                uid = f"incarnation-{cycle}"
                codes.append(await code(register(big_registration(uid), timeout=30)))
                if codes[-1] is grpc.StatusCode.OK:
                    await code(leave(pb.LeaveRequest(client_uid=uid).SerializeToString(), timeout=30))
            return codes

    codes = asyncio.run(asyncio.wait_for(attack(), 60))
    assert codes == [grpc.StatusCode.OK] * 2 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 28, codes
    settle()
    # Two registrations of 4 MiB are kept (the journal's, the current one's devices), and the device cache: the
    # unbounded coordinator held 30 of each (500 MB)
    before.assert_near("after 30 registrations of 4 MiB, each leaving before the next", growth=2 * GROWTH)
    assert "--max-registration-bytes" in coordinator.log


class SilentHttp2:
    """A raw HTTP/2 client that sends gRPC calls and never lets an answer's bytes through (a stream window of 0):
    what gRPC clients cannot do, and an attacker can."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        initial_window_size = (4).to_bytes(2, "big") + (0).to_bytes(4, "big")
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + self._frame(4, 0, 0, initial_window_size)
                          + self._frame(4, 1, 0, b""))  # our settings, and the ack of the server's
        self._stream = 1

    @staticmethod
    def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    @staticmethod
    def _literal(name: str, value: str) -> bytes:
        """An HPACK literal header field without indexing (both strings shorter than 127 bytes, no Huffman)."""
        assert len(name) < 127 and len(value) < 127
        return bytes([0, len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

    def call(self, method: str, request: bytes, metadata: tuple[tuple[str, str], ...]) -> None:
        headers = b"".join(self._literal(k, v) for k, v in (
            (":method", "POST"), (":scheme", "http"), (":path", COORDINATOR + method), (":authority", "x"),
            ("content-type", "application/grpc"), ("te", "trailers"), *metadata))
        message = b"\0" + len(request).to_bytes(4, "big") + request
        self.sock.sendall(self._frame(1, 4, self._stream, headers)  # END_HEADERS
                          + self._frame(0, 1, self._stream, message))  # END_STREAM
        self._stream += 2

    def close(self) -> None:
        self.sock.close()


def test_answers_nobody_reads_hold_at_most_the_pending_reply_bytes(start_coordinator):
    # A caller asking again and again for a 1 MiB value and never reading the answers made the coordinator hold one
    # answer per call it opened.
    coordinator = start_coordinator("--max-pending-reply-bytes", str(8 * MiB), num_processes=1)
    client = member(coordinator.address)
    with client:
        client.kv_set("big", b"v" * MiB)
        settle()
        before = Resources(coordinator.pid)
        silent = SilentHttp2(coordinator.address)
        try:
            get = pb.KeyValueTryGetRequest(client_uid=client.client_uid, key="big").SerializeToString()
            for _ in range(200):
                silent.call("KeyValueTryGet", get, as_member(client))
            coordinator.wait_for_log("--max-pending-reply-bytes")
            time.sleep(1)
            before.assert_near("while 200 answers of 1 MiB were asked for and none read")
            with pytest.raises(ResourceExhausted, match=r"the answer to key-value try-get of 'big' \(1048582 bytes\) "
                                                        r"would pass the coordinator's --max-pending-reply-bytes of "
                                                        r"8388608 bytes; 7340074 bytes are held"):
                client.kv_try_get("big")
        finally:
            silent.close()
        deadline = time.monotonic() + 20  # the attacker's calls end with its connection, and their answers go
        while time.monotonic() < deadline:
            try:
                assert client.kv_try_get("big") == b"v" * MiB
                break
            except ResourceExhausted:
                time.sleep(0.2)
        assert client.kv_try_get("big") == b"v" * MiB


def test_watches_of_all_sessions_hold_at_most_the_watch_bytes(start_coordinator):
    # Each session could watch 1,024 prefixes of a kilobyte (1 MiB a session, 2 sessions a process, any process).
    coordinator = start_coordinator("--max-watch-bytes", str(8 * 1128), num_processes=1)
    client = member(coordinator.address)

    async def attack() -> list[str]:
        hold = asyncio.Event()
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            watches = [pb.SessionRequest(watch=pb.WatchKeys(prefix=f"{i:04d}/" + "p" * 995)) for i in range(12)]
            call = session_stream(channel, client, watches, hold)
            acked = []
            try:
                async with asyncio.timeout(3):
                    async for raw in call:
                        event = pb.SessionEvent.FromString(raw)
                        if event.WhichOneof("kind") == "watching":
                            acked.append(event.watching.prefix[:4])
            except TimeoutError:
                pass
            hold.set()
            call.cancel()
            return acked

    with client:
        assert asyncio.run(asyncio.wait_for(attack(), 60)) == [f"{i:04d}" for i in range(8)]
        assert ("ignored a watch of 1128 bytes while sessions watch prefixes of 9024 bytes: expected at most 9024 "
                "(the coordinator's --max-watch-bytes)") in coordinator.log
