"""What a job's process does at start-up: discover the topology, then use it (here: print it as JSON).

Run by examples/local_cluster.py with IFRT_COORDINATOR, IFRT_PROCESS_ID and IFRT_NUM_PROCESSES set.
"""

import ifrt

topology = ifrt.discover(timeout=60)
print(topology.to_json())
