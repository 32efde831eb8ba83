"""XLA's coordination service, served by ifrt beside each JAX process: process 0 is no longer special.

JAX's distributed runtime is a client of XLA's coordination service, which ``jax.distributed.initialize`` starts
inside process 0: process 0's death (or the service's) aborts every other process from C++, whatever ifrt knows.
``ifrt.jax.initialize()`` instead starts JAX's client only, dialling a stand-in that runs in the same process on a
private Unix socket. The stand-in speaks XLA's protocol to JAX (``layouts``: each wire layout of the supported jaxlib
range) and answers from ifrt (``service``): registration and barriers are ifrt's barriers, key-values ifrt's
key-values under the start's own prefix, live tasks ifrt's agreed live set, and ``PollForError`` ifrt's own failure
decision. It lives exactly as long as its process, and a coordinator failover is a retried call to it, never an
error JAX sees. JAX's own topology exchange is checked against ifrt's topology on the way (``topology_check``).
"""
