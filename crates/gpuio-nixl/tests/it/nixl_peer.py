"""A NIXL agent written with NIXL's own Python API, the peer of gpuio's interoperability test.

It registers a buffer of its own (byte i = (7 i + 3) mod 251) and prints one JSON line: its
metadata (hex), the buffer's address and length. Then it reads one line, gpuio's agent's
metadata and a region of its memory (byte i = (13 i + 5) mod 253); reads that region whole and
checks it; writes 4096 bytes (byte i = (3 i + 1) mod 256) at offset 8192 of it; and prints
"ok" (or raises).
"""

import json
import sys

import numpy as np
from nixl_cu13 import nixl_agent, nixl_agent_config

N = 1 << 20


def wait(agent, handle):
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise SystemExit(f"transfer ended in {state}")


agent = nixl_agent("nixl-python", nixl_agent_config(backends=["UCX"]))
mine = ((np.arange(N, dtype=np.int64) * 7 + 3) % 251).astype(np.uint8)
agent.register_memory([(mine.ctypes.data, N, 0, "")], "DRAM")
print(json.dumps({"metadata": agent.get_agent_metadata().hex(), "addr": mine.ctypes.data, "len": N}),
      flush=True)

theirs = json.loads(sys.stdin.readline())
name = agent.add_remote_agent(bytes.fromhex(theirs["metadata"]))
got = np.zeros(theirs["len"], dtype=np.uint8)
out = ((np.arange(4096, dtype=np.int64) * 3 + 1) % 256).astype(np.uint8)
agent.register_memory([(got.ctypes.data, got.nbytes, 0, ""), (out.ctypes.data, 4096, 0, "")],
                      "DRAM")
local = agent.get_xfer_descs([(got.ctypes.data, got.nbytes, 0)], "DRAM")
remote = agent.get_xfer_descs([(theirs["addr"], theirs["len"], 0)], "DRAM")
wait(agent, agent.initialize_xfer("READ", local, remote, name))
want = ((np.arange(theirs["len"], dtype=np.int64) * 13 + 5) % 253).astype(np.uint8)
if not np.array_equal(got, want):
    raise SystemExit(f"read {np.count_nonzero(got != want)} wrong bytes from gpuio's agent")
local = agent.get_xfer_descs([(out.ctypes.data, 4096, 0)], "DRAM")
remote = agent.get_xfer_descs([(theirs["addr"] + 8192, 4096, 0)], "DRAM")
wait(agent, agent.initialize_xfer("WRITE", local, remote, name))
print("ok", flush=True)
# Keep the agent (and its memory) up until gpuio's side is done with it.
sys.stdin.readline()
