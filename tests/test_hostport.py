"""host:port addresses: one split and one join for every caller, IPv6 literals in brackets."""

import pytest

from ifrt.errors import InvalidArgument
from ifrt.hostport import address_problem, check_address, join_host_port, split_host_port


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


@pytest.mark.parametrize("address", ["node001:8476", "10.0.0.2:1", "[fe80::1]:8476", "[fe80::1%eth0]:65535",
                                     "host_1.example.com:9000", "node-7.:80"])
def test_an_advertised_address_is_host_colon_port(address):
    assert address_problem(address) is None
    assert check_address(address, "address") == address


@pytest.mark.parametrize(("address", "why"), [
    ("node001", "it has no port"),
    (":8476", "it has no host"),
    ("node001:", "port '' is not a number from 1 to 65535"),
    ("node001:0", "port '0' is not a number from 1 to 65535"),
    ("node001:65536", "port '65536' is not a number from 1 to 65535"),
    ("node001:\uff18\uff10", "port '\uff18\uff10' is not a number"),  # fullwidth digits
    ("fe80::1:8476", "host 'fe80::1' has a colon: an IPv6 address goes in brackets"),
    ("[node001]:8476", "'[node001]' is not an IPv6 address in brackets"),
    ("node 1:8476", "host 'node 1' is not a host name or an address"),
    ("evil\n\x1b[31m:8476", "is not a host name or an address"),
    ("-node:8476", "is not a host name or an address"),
    ("a..b/c:8476", "is not a host name or an address"),
])
def test_anything_else_is_refused_naming_what_is_wrong_and_the_form_expected(address, why):
    assert why in address_problem(address)
    with pytest.raises(InvalidArgument) as refused:
        check_address(address, "the transfer endpoint address")
    assert str(refused.value).startswith(f"the transfer endpoint address {address!r} is not an address: ")
    assert "expected HOST:PORT" in str(refused.value)


@pytest.mark.parametrize("address", ["0.0.0.0:0", ":9000", "[::]:0", "127.0.0.1:9000"])
def test_where_to_listen_may_leave_the_host_empty_and_the_port_to_the_system(address):
    assert address_problem(address, bind=True) is None
