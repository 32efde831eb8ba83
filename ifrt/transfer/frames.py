"""The transfer protocol's bytes: frame headers, reading and checking a frame, the token challenge, and the addresses
a hello is checked against. ``ifrt.transfer`` builds the endpoint and the channels on them; ``ifrt.preflight`` probes
with them."""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import math
import socket
import struct
import time
from typing import NamedTuple

import numpy as np

from ifrt.errors import TransferError
from ifrt.hostport import split_host_port

MAGIC = b"IFRT"
VERSION = 1
HELLO, ARRAY = 1, 2
# magic, version, kind, ndim, dtype length, sequence, source device, destination device, payload bytes
HEADER = struct.Struct("!4sBBBBQqqQ")
MAX_NDIM = 32
MAX_DIMENSION = (1 << 63) - 1  # numpy's dimensions are signed 64-bit
ALLOWED_KINDS = "biufc"  # bool, integers, floats, complex: plain bytes, nothing to unpickle
CHUNK = 4 << 20
CHALLENGE_BYTES = 32  # the token challenge, and its HMAC-SHA256 answer, are both this long
PLAIN, KEYED = 0, 1
"""A HELLO's sequence field: how the connection proves its sender. PLAIN: the cluster token's challenge, or the
address it connects from (what a pre-flight probe sends); KEYED: the pair key's challenge (``ifrt.transfer_keys``)."""
ADMITTED, REFUSED = b"\x01", b"\x00"
"""An endpoint's verdict on a KEYED hello's answer: the sender fetches its key again after a REFUSED."""


def recv_exactly(sock: socket.socket, buffer: memoryview, what: str, deadline: float | None = None) -> None:
    """Fills ``buffer`` from ``sock`` (by ``deadline``, when given); TransferError if the peer closes first."""
    got = 0
    while got < len(buffer):
        if deadline is not None:  # the whole read, not each recv: a peer sending a byte at a time gets no longer
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        n = sock.recv_into(buffer[got:], min(CHUNK, len(buffer) - got))
        if n == 0:
            raise TransferError(f"the peer closed the connection mid-frame: got {got} of {len(buffer)} bytes of {what}")
        got += n


def encode_header(kind: int, seq: int, src: int, dst: int, array: np.ndarray | None = None) -> bytes:
    """The header (and dtype and shape) of one frame; the payload follows it."""
    if array is None:
        return HEADER.pack(MAGIC, VERSION, kind, 0, 0, seq, src, dst, 0)
    dtype = array.dtype.str.encode()
    return (HEADER.pack(MAGIC, VERSION, kind, array.ndim, len(dtype), seq, src, dst, array.nbytes) + dtype
            + struct.pack(f"!{array.ndim}Q", *array.shape))


class Header(NamedTuple):
    """A frame's header as read and checked: a HELLO has no dtype, an empty shape and no payload."""

    kind: int
    seq: int
    src: int
    dst: int
    dtype: np.dtype | None = None
    shape: tuple[int, ...] = ()
    nbytes: int = 0


def read_header(conn: socket.socket, hello: bool, deadline: float | None = None) -> Header:
    """One frame's header from ``conn`` (by ``deadline``, when given): a HELLO (``hello``) or an ARRAY's, whose payload
    ``read_payload`` reads next. TransferError for anything that is not the frame expected (bad magic, kind, dtype,
    shape or length): a peer's header never raises anything else."""
    raw = bytearray(HEADER.size)
    recv_exactly(conn, memoryview(raw), "a frame header", deadline)
    magic, version, kind, ndim, dtype_len, seq, src, dst, nbytes = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        raise TransferError(f"bad frame header: magic {magic!r} version {version}, expected {MAGIC!r} "
                            f"version {VERSION}")
    if kind != (HELLO if hello else ARRAY):
        raise TransferError(f"unexpected frame kind {kind}: expected {'HELLO' if hello else 'ARRAY'}")
    if hello:
        if ndim or dtype_len or nbytes:
            raise TransferError(f"bad hello: ndim {ndim}, dtype length {dtype_len}, {nbytes} payload bytes (expected "
                                "none)")
        return Header(kind, seq, src, dst)
    if ndim > MAX_NDIM or not 0 < dtype_len <= 16:
        raise TransferError(f"bad array header: ndim {ndim} (at most {MAX_NDIM}), dtype length {dtype_len}")
    meta = bytearray(dtype_len + 8 * ndim)
    recv_exactly(conn, memoryview(meta), "an array header", deadline)
    dtype = plain_dtype(bytes(meta[:dtype_len]), seq)
    shape = struct.unpack(f"!{ndim}Q", meta[dtype_len:])
    if any(n > MAX_DIMENSION for n in shape):
        raise TransferError(f"frame {seq}'s shape {shape} has a dimension over {MAX_DIMENSION}: no array has it")
    if math.prod(shape) * dtype.itemsize != nbytes:  # exact: Python's integers do not wrap around
        raise TransferError(f"frame {seq} says {nbytes} payload bytes for shape {shape} of {dtype}")
    return Header(kind, seq, src, dst, dtype, shape, nbytes)


def plain_dtype(text: bytes, seq: int) -> np.dtype:
    """The dtype ``text`` names, if it is a plain numeric one written as a sender writes it (``dtype.str``);
    TransferError otherwise (subarray, structured, object or unparsable dtypes: numpy raises many kinds of errors
    for text it does not take, and none of them may end the thread that reads a peer)."""
    try:
        name = text.decode("ascii")
        dtype = np.dtype(name)
    except Exception as e:  # TypeError, ValueError, SyntaxError, ...: all mean "not a dtype"
        raise TransferError(f"bad dtype {text!r} in frame {seq}: {type(e).__name__}: {e}") from None
    if (dtype.kind not in ALLOWED_KINDS or dtype.shape != () or dtype.fields is not None or dtype.hasobject
            or dtype.itemsize == 0 or dtype.str != name):
        raise TransferError(f"dtype {text!r} in frame {seq} is not a plain numeric type written as dtype.str")
    return dtype


def read_payload(conn: socket.socket, header: Header) -> np.ndarray:
    """The array whose ``header`` was just read from ``conn``; TransferError if it cannot be held or the peer stops."""
    seq, nbytes = header.seq, header.nbytes
    try:
        array = np.empty(header.shape, dtype=header.dtype)
    except (ValueError, MemoryError) as e:  # too big for this process, or for numpy
        raise TransferError(f"frame {seq}'s array of shape {header.shape} of {header.dtype} ({nbytes} bytes) cannot "
                            f"be held here: {type(e).__name__}: {e}") from e
    recv_exactly(conn, memoryview(array.reshape(-1).view(np.uint8)), f"frame {seq}'s {nbytes}-byte payload")
    return array


def read_frame(conn: socket.socket, hello: bool,
               deadline: float | None = None) -> tuple[int, int, int, int, np.ndarray | None]:
    """One whole frame from ``conn``: (kind, sequence, source, destination, array); a HELLO (``hello``) has no
    array. TransferError for anything that is not the frame expected."""
    header = read_header(conn, hello, deadline)
    return header.kind, header.seq, header.src, header.dst, None if hello else read_payload(conn, header)


def ip_of(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an address (an IPv4 address mapped into IPv6 as the IPv4 one), or None if it is not one."""
    try:
        address = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def addresses_of(host: str) -> set:
    """The addresses ``host`` (an address, or a name to resolve) stands for; empty if it resolves to none."""
    literal = ip_of(host)
    if literal is not None:
        return {literal}
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {ip_of(str(info[4][0])) for info in infos} - {None}


def connect(address: str, timeout: float, source_host: str | None = None) -> socket.socket:
    """A TCP connection to a transfer endpoint at ``address`` ("host:port"), from ``source_host`` when given and
    usable (a process's transfer connections leave from its own endpoint's host, which is what a peer checks)."""
    host, port = split_host_port(address)
    target = (host, int(port))
    if source_host:
        try:
            return socket.create_connection(target, timeout=timeout, source_address=(source_host, 0))
        except OSError as e:  # that address cannot reach the target (say, loopback toward another host)
            if e.errno not in (errno.EADDRNOTAVAIL, errno.EINVAL, errno.ENETUNREACH, errno.EAFNOSUPPORT):
                raise
    return socket.create_connection(target, timeout=timeout)


def token_proof(key: bytes, challenge: bytes) -> bytes:
    """What answers a challenge: an HMAC of it under the cluster token (the token itself never crosses the wire)."""
    return hmac.new(key, b"ifrt-transfer:" + challenge, hashlib.sha256).digest()
