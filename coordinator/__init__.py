"""The ifrt-coordinator daemon: a pure admission state machine with gRPC around it."""
