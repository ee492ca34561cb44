"""Unit tests of peerd/netchange.py (our own address went away) and Channels.renew; the whole behaviour, with real
daemons in network namespaces, is tests/test_renumber.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from peerd import channels as channels_mod
from peerd import netchange
from peerd.channels import Channels
from peerd.netchange import SourceWatch, is_local, source_for, still_local


def test_the_kernel_names_a_source_without_sending_anything() -> None:
    assert source_for("127.0.0.1") == "127.0.0.1"
    assert still_local("127.0.0.1")
    assert not still_local("192.0.2.77")  # TEST-NET-1: never an address of this machine
    assert is_local("127.0.0.1") and not is_local("192.0.2.77") and not is_local("localhost")  # names: no lookup


def _watch(monkeypatch: pytest.MonkeyPatch, sources: dict[str, str], local: set[str]) -> SourceWatch:
    monkeypatch.setattr(netchange, "source_for", lambda host, port=9: sources.get(host))
    monkeypatch.setattr(netchange, "still_local", lambda address: address in local)
    return SourceWatch()


def test_a_source_that_is_gone_is_reported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    sources = {"198.51.100.1": "10.0.0.4", "198.51.100.2": "10.0.0.4"}
    local = {"10.0.0.4"}
    watch = _watch(monkeypatch, sources, local)
    assert watch.sample(["198.51.100.1:7000", "198.51.100.2:7000"]) is None
    sources.update({"198.51.100.1": "10.0.0.9", "198.51.100.2": "10.0.0.9"})  # a new lease; the old is dropped
    local ^= {"10.0.0.4", "10.0.0.9"}
    assert watch.sample(["198.51.100.1:7000", "198.51.100.2:7000"]) == ("10.0.0.4", "10.0.0.9")
    assert watch.sample(["198.51.100.1:7000"]) is None  # the new source is the known one now


def test_a_new_source_beside_the_old_one_is_not_a_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """IPv6 privacy addresses rotate while the old one stays usable: its connections are alive."""
    sources = {"2001:db8::1": "2001:db8:1::a"}
    watch = _watch(monkeypatch, sources, {"2001:db8:1::a", "2001:db8:1::b"})
    watch.sample(["[2001:db8::1]:7000"])
    sources["2001:db8::1"] = "2001:db8:1::b"
    assert watch.sample(["[2001:db8::1]:7000"]) is None


def test_no_route_names_and_loopback_say_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    sources = {"198.51.100.1": "10.0.0.4"}
    watch = _watch(monkeypatch, sources, set())
    watch.sample(["198.51.100.1:7000"])
    del sources["198.51.100.1"]  # a cut link: no route at all
    assert watch.sample(["198.51.100.1:7000", "peer.example:7000", "127.0.0.1:7000", "0.0.0.0:7000"]) is None
    assert set(watch.sources) == {"198.51.100.1"}


def test_renew_gives_new_channels_and_closes_the_old_ones_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channels_mod, "RETIRE_S", 0.05)

    async def run() -> None:
        pool = Channels()
        old = pool.channel("127.0.0.1:9")
        assert pool.channel("127.0.0.1:9") is old
        assert pool.renew() == 1 and pool.renewed == 1
        new = pool.channel("127.0.0.1:9")
        assert new is not old
        await asyncio.sleep(0.3)
        with pytest.raises(grpc.aio.UsageError):  # closed: the calls still on it met their deadlines long ago
            await old.unary_unary("/x.Y/Z")(b"", timeout=0.1)
        await pool.close()

    asyncio.run(run())


def test_close_also_closes_channels_still_retiring() -> None:
    async def run() -> None:
        pool = Channels()
        old = pool.channel("127.0.0.1:9")
        pool.renew()
        await pool.close()  # long before RETIRE_S
        with pytest.raises(grpc.aio.UsageError):
            await old.unary_unary("/x.Y/Z")(b"", timeout=0.1)

    asyncio.run(run())
