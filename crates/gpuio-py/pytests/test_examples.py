"""The gpuio.ai examples run as users run them (a fresh process each) and check their own
results: every structure's example exits 0 and says ok, on whatever backend the machine has."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    "name", ["kv_cache", "engram", "graph_rag", "compression", "scheduling"]
)
def test_example_runs_and_checks_itself(name, tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *(
            [] if name == "scheduling" else ["--scratch", str(tmp_path)]
        )],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert f"{name}: ok" in out.stdout, out.stdout
    assert not list(tmp_path.iterdir()), "the example left files behind"
