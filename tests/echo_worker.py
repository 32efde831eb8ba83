"""A job process for transfer tests: discovers, then sends back every array it receives from process 0.

Settings come from IFRT_* variables; ``--count N`` arrays are echoed, then it exits.
"""

import argparse

import ifrt

parser = argparse.ArgumentParser()
parser.add_argument("--count", type=int, required=True)
args = parser.parse_args()

with ifrt.Client(timeout=60) as client, client.channels() as channels:
    topology = client.discover()
    peer = topology.process(0)
    source = next(d.id for d in topology.devices if d.process_id == peer.process_id)
    print("ready", flush=True)
    for _ in range(args.count):
        channels.send(channels.recv(source, timeout=60), source)
    client.barrier("echo-done", timeout=60)
