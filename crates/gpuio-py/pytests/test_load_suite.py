"""The load bench's child script (crates/gpuio-bench/peers/load_suite.py) on the host: it
writes checkpoints safetensors reads, both loaders it times agree with the checksums it wrote,
and a checkpoint whose bytes changed is reported as a wrong load, never timed as a right one."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(
    os.path.dirname(__file__), "..", "..", "gpuio-bench", "peers", "load_suite.py"
)


def _run(*args):
    out = subprocess.run(
        [sys.executable, SCRIPT, *map(str, args)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", ["large", "small"])
def test_checkpoints_load_right_and_changed_bytes_are_caught(tmp_path, shape):
    made = _run("make", tmp_path, shape, "numpy")
    assert os.path.getsize(made["path"]) > made["bytes"] > 0
    from safetensors.numpy import load_file

    assert len(load_file(made["path"])) == made["tensors"]
    prefix = tmp_path / shape
    for loader in ("gpuio", "gpuio-direct", "safetensors"):
        for temp in ("warm", "cold"):
            got = _run("load", loader, prefix, "cpu", temp, 1)
            assert got["correct"] is True and got["first_s"] > 0, got
            assert len(got["hot_s"]) == (1 if temp == "warm" else 0)
    with open(made["path"], "r+b") as f:
        f.seek(-5, os.SEEK_END)
        last = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x10]))
    for loader in ("gpuio", "gpuio-direct", "safetensors"):
        assert _run("load", loader, prefix, "cpu", "warm", 0)["correct"] is False
