"""The engine replica's stream plumbing without Ray: the events connection between an engine
replica and its routers (`services.event_channel`, real sockets), a lagging reader getting one
message with every step it has not read (`merge`), and the loop's time accounting."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

import asyncio

from eagle2.tp_channel import free_port
from services.engine import LoopTimes
from services.event_channel import LOST, EventClient, EventServer, frame, merge


def event(ids, finished=False, t=0.0, steps=1):
    return {"token_ids": ids, "finished": finished, "finish_reason": "length" if finished
            else None, "num_steps": steps, "accepted_at_depth": {}, "time": t}


def test_merge_joins_tokens_in_order_keeps_the_first_time_and_the_last_totals():
    a, b, c = event([1, 2], t=1.0), event([3], t=2.0, steps=2), event([4, 5], True, 3.0, 3)
    m = merge(merge(a, b), c)
    assert m["token_ids"] == [1, 2, 3, 4, 5]
    assert m["time"] == 1.0  # the router's delivery time counts from the oldest token
    assert m["finished"] and m["finish_reason"] == "length" and m["num_steps"] == 3
    assert a["token_ids"] == [1, 2]  # the inputs are not changed


def test_merge_an_error_wins():
    err = {"error": "UNAVAILABLE", "message": "a model shard failed", "finished": True}
    assert merge(event([1]), err) is err


def test_loop_times_sum_per_step():
    t = LoopTimes()
    t.add(0.020, 0.001, 0.0002, 0.015, 0.0008)
    t.add(0.030, 0.002, 0.0003, 0.010, 0.0012)
    d = t.as_dict()
    assert d["loop_steps"] == 2 and d["loop_step_s"] == pytest.approx(0.05)
    assert d["loop_host_s"] == pytest.approx(0.003)
    assert d["loop_dispatch_s"] == pytest.approx(0.0005)
    assert d["loop_step_cpu_s"] == pytest.approx(0.025)
    assert d["loop_host_cpu_s"] == pytest.approx(0.002)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _next(box: asyncio.Queue) -> dict:
    return await asyncio.wait_for(box.get(), 10)


def test_one_frame_carries_a_step_of_every_request_of_a_router_and_only_its_own():
    async def main():
        server = EventServer()
        address = await server.start("127.0.0.1")
        a, b = EventClient("router-a"), EventClient("router-b")
        boxes = {sid: a.open(sid) for sid in ("s1", "s2")}
        boxes["s3"] = b.open("s3")
        for client, _sid in ((a, "s1"), (a, "s2"), (b, "s3")):
            server.opened(client.router_id)
        # events sent before a router connects wait for it (its first request's reply names
        # the address; the engine may step before the router reads it)
        server.send("router-a", [("s1", event([1])), ("s2", event([7]))])
        for client, sid in ((a, "s1"), (a, "s2"), (b, "s3")):
            await client.attach(sid, address)
        server.send("router-a", [("s1", event([2], True)), ("s2", event([8]))])
        server.send("router-b", [("s3", event([5], True))])
        got = {sid: [await _next(boxes[sid])] for sid in boxes}
        for sid in ("s1", "s2"):
            got[sid].append(await _next(boxes[sid]))
        assert [e["token_ids"] for e in got["s1"]] == [[1], [2]] and got["s1"][1]["finished"]
        assert [e["token_ids"] for e in got["s2"]] == [[7], [8]]
        assert got["s3"][0]["token_ids"] == [5] and boxes["s3"].empty()
        assert server.stats()["event_frames"] == 3 and server.stats()["event_messages"] == 5
        assert len(a.conns) == 1  # one connection a router and engine replica
        server.server.close()

    run(main())


def test_a_lost_engine_connection_fails_its_requests_with_unavailable():
    async def main():
        server = EventServer()
        address = await server.start("127.0.0.1")
        client = EventClient("r")
        box = client.open("s1")
        server.opened("r")
        await client.attach("s1", address)
        server.send("r", [("s1", event([3]))])
        assert (await _next(box))["token_ids"] == [3]
        for writer in list(server.writers.values()):  # the replica's side goes away
            writer.transport.abort()
        assert await _next(box) == LOST
        other = client.open("s2")  # a request to a replica that cannot be reached
        await client.attach("s2", ("127.0.0.1", free_port("127.0.0.1")))
        assert await _next(other) == LOST
        server.server.close()

    run(main())


def test_a_request_that_ends_before_its_router_connects_still_reaches_it():
    """A short request (one step, or refused) can end before the router has read its reply
    and connected: its events wait for the router."""
    async def main():
        server = EventServer()
        address = await server.start("127.0.0.1")
        server.opened("late")
        server.send("late", [("s1", event([9], True))])
        server.closed("late")  # the engine's call for it has ended
        client = EventClient("late")
        box = client.open("s1")
        await client.attach("s1", address)
        assert (await _next(box))["token_ids"] == [9]
        server.server.close()

    run(main())


def test_events_of_a_router_that_never_connects_are_dropped_after_a_while():
    async def main():
        server = EventServer(pending_ttl_s=0.05)
        await server.start("127.0.0.1")
        server.opened("gone")
        server.send("gone", [("s1", event([1]))])
        server.closed("gone")
        assert len(server.pending["gone"]) == 1
        await asyncio.sleep(0.2)
        assert "gone" not in server.pending and "gone" not in server.active
        server.opened("back")  # a router with a request open keeps its events meanwhile
        server.send("back", [("s2", event([2]))])
        await asyncio.sleep(0.2)
        assert len(server.pending["back"]) == 1
        server.server.close()

    run(main())


def test_the_server_drops_a_connection_whose_hello_is_too_big_and_serves_the_next():
    async def main():
        server = EventServer()
        host, port = await server.start("127.0.0.1")
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(frame(b"x" * 100_000))
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed on it
        client = EventClient("ok")
        box = client.open("s")
        server.opened("ok")
        await client.attach("s", (host, port))
        server.send("ok", [("s", event([4], True))])
        assert (await _next(box))["token_ids"] == [4]
        server.server.close()

    run(main())


def test_the_router_fails_a_request_whose_engine_call_ended_without_its_last_event():
    """services.router._watch: the engine's call ends only after the request's last event was
    sent, so if that event never comes the client gets UNAVAILABLE, not a hang; a call that
    fails (a dead replica) gives its status at once; a request that ends first cancels it."""
    from ray.exceptions import ActorDiedError

    from services.router import _watch

    async def ended():
        yield {"events": ("127.0.0.1", 1)}

    async def died():
        yield {"events": ("127.0.0.1", 1)}
        raise ActorDiedError()

    async def main():
        box = asyncio.Queue()
        await _watch(ended(), box, grace_s=0.01)
        late = box.get_nowait()
        assert late["error"] == "UNAVAILABLE" and "ended the stream early" in late["message"]
        await _watch(died(), box, grace_s=10)
        assert box.get_nowait()["error"] == "UNAVAILABLE"
        task = asyncio.ensure_future(_watch(ended(), box, grace_s=10))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert box.empty()

    run(main())


def test_a_router_that_stops_reading_is_cut_off_not_buffered_without_bound():
    async def main():
        server = EventServer(max_unsent=1 << 20)
        host, port = await server.start("127.0.0.1")
        _reader, writer = await asyncio.open_connection(host, port)
        writer.transport.pause_reading()  # a router that never reads
        writer.write(frame(b"stuck"))
        server.opened("stuck")
        while "stuck" not in server.writers:
            await asyncio.sleep(0.01)
        big = [("s", event(list(range(20_000))))]  # ~60 KB a frame
        for _ in range(2_000):
            server.send("stuck", big)
            if "stuck" not in server.writers or server.writers["stuck"].is_closing():
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("the connection was never closed")
        writer.close()
        server.server.close()

    run(main())
