"""A job whose processes do not share the workdir or data.dir (as on nodes whose directory is a
local disk) stops before any step, on every process, naming the directory and the fix. Process 1
runs in its own mount namespace with an empty tmpfs over the directory."""

import os
import shutil
import socket
import subprocess

import pytest
from support.runs import ROOT, device_env, train_command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("field", ["--workdir", "data.dir"])
def test_a_directory_process_1_cannot_see_stops_the_job(tmp_path, field):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        why = "needs root and unshare(1) for a mount namespace"
        if os.environ.get("JAXLLM_REQUIRE_NAMESPACES"):  # CI: this test must run
            pytest.fail(f"JAXLLM_REQUIRE_NAMESPACES is set, but it {why}")
        pytest.skip(why)
    workdir, data = tmp_path / "run", tmp_path / "data"
    hidden = workdir if field == "--workdir" else data
    hidden.mkdir(parents=True)
    command = train_command(workdir, "--config.parallel.data=8", data_dir=data)
    port = _free_port()
    procs = []
    for i in range(2):
        env = {**device_env(4), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i)}  # fmt: skip
        isolated = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{hidden}" && exec "$@"', "sh"] if i else []
        procs.append(subprocess.Popen([*isolated, *command], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 1, out[-3000:]
        assert f"error: {field}={hidden} is not shared: process 1 " in out, out[-3000:]
        assert "on storage that every node of the job mounts at the same path" in out
    assert not (workdir / "checkpoints").exists() and "train:" not in outs[0]
