"""host:port addresses: one split and one join for every caller, IPv6 literals in brackets."""

import pytest

from ifrt.hostport import join_host_port, split_host_port


@pytest.mark.parametrize(("address", "expected"), [
    ("node001:8476", ("node001", "8476")),
    ("10.0.0.2:0", ("10.0.0.2", "0")),
    ("[fe80::1]:8476", ("fe80::1", "8476")),
    ("[::]:9000", ("::", "9000")),
    ("node001", ("node001", "")),
    (":8476", ("", "8476")),
    ("node001:", ("node001", "")),
    ("", ("", "")),
])
def test_an_address_splits_into_its_host_without_brackets_and_its_port(address, expected):
    assert split_host_port(address) == expected


@pytest.mark.parametrize(("host", "port", "expected"), [
    ("node001", 8476, "node001:8476"),
    ("10.0.0.2", "0", "10.0.0.2:0"),
    ("fe80::1", 8476, "[fe80::1]:8476"),
    ("::", 9000, "[::]:9000"),
])
def test_a_host_and_port_join_with_brackets_around_an_ipv6_literal(host, port, expected):
    assert join_host_port(host, port) == expected


@pytest.mark.parametrize("address", ["node001:8476", "10.0.0.2:1", "[fe80::1]:8476", "[::1]:65535"])
def test_joining_what_was_split_gives_the_address_back(address):
    assert join_host_port(*split_host_port(address)) == address
