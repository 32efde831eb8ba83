"""Moving numpy arrays between devices of different processes over the topology's transfer endpoints.

Each process binds an ``Endpoint`` before it registers and advertises its address in the topology.
``Channels(topology)`` then sends to and receives from any device: a socket to a peer process is opened on
first use and reused; a transfer between two devices of the same process never touches a socket.

A frame (its bytes: ``ifrt.transfer.frames``) is a fixed header (magic, version, sequence number, source and destination
device, dtype, shape, payload length) followed by the raw array bytes. Sequence numbers run per (source,
destination) pair and connection, so a lost, repeated or reordered frame is an error, as is a bad header or a peer
that goes away mid-frame. A sender numbers and writes a frame in one step under the lock of its destination process,
so threads sending on the same pair put frames on the wire in sequence order. Every receive waits a finite time.

Who may send (``ifrt.transfer.handshake``): an endpoint made by a ``Client`` holds transfer keys
(``ifrt.transfer_keys``): a connection carries frames only once it proved, with the pair key only its process can
get, which process it is. Without keys (an ``Endpoint`` used without a client), the cluster's token (an HMAC of a
challenge) or, without a token, the address the process advertised is checked, as before keys existed. Either way a
peer has ``HANDSHAKE_TIMEOUT_S`` from its connection to its first frame, at most ``MAX_HANDSHAKES`` connections wait
in their handshake (a newer one closes the oldest), and running out of descriptors pauses accepting instead of ending
it. Repeated refusals are counted, not each logged.

Incarnations (``ifrt.transfer_keys``): a keyed connection proves which incarnation of its process it is. The endpoint
keeps, per process, the oldest incarnation it still accepts, raised by what the job's events say (``heard``: a
process restarted or replaced, a process declared failed) and by a proven hello of a later incarnation; raising it
closes that process's connections from older incarnations at once, and refuses their handshakes and any frame they
still send, each counted (``fenced``) and logged. A process told that it was itself declared failed sends nothing
more (``Channels.send`` raises), and a sender drops its connection to a peer that was replaced or declared failed.

What a connection sends is checked frame by frame: each frame's source device must be a device of the connection's
process, its destination one of this process's devices, its header well formed (dtype, shape, length). A frame that
breaks this fails that connection alone, at once: it is closed, logged (rate-limited), and the receives from its
process fail at once, naming their pair, until the process connects again (``ifrt.transfer.arrivals``). What the
endpoint holds for receives not made yet is bounded in bytes (``max_held_bytes``, 1 GiB by default).

Under ``ifrt run`` the agent binds each worker's port once and keeps it listening; a worker's endpoint adopts that
socket (``IFRT_TRANSFER_FDS``, ``adopted_listener``) instead of binding the address again, so nothing can take the
port between the agent's pick and the worker's endpoint, nor between a worker and its restart.
"""

from ifrt.local_address import local_address_toward
from ifrt.transfer.channels import Channels
from ifrt.transfer.endpoint import RECV_TIMEOUT_S, Endpoint, adopted_listener, wait_seconds

__all__ = ["RECV_TIMEOUT_S", "Channels", "Endpoint", "adopted_listener", "local_address_toward", "wait_seconds"]
