"""The coordinator's pure core: every decision it makes, as deterministic code without I/O (no gRPC, asyncio,
sockets, threads, files or clocks: time arrives as data). ``state.ClusterState`` is its face: the shell around it
(``coordinator/``) turns calls into its events and carries out the effects it returns. tests/test_core.py fails when
a module here imports I/O or a module outside the core and ifrt's plain values."""
