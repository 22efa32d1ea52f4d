"""A one-node SLURM cluster for tests, from Debian's `slurm-wlm` and `munge`: munged, slurmctld and
slurmd started as root with every file in one temporary directory (nothing under /etc is touched),
and stopped afterwards. SLURM's commands find it through SLURM_CONF in `Cluster.env`.

    python tests/support/slurm.py DIR      # starts one and leaves it running (for trying things by hand)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

DAEMONS = ("munged", "slurmctld", "slurmd")


def unavailable() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "SLURM's daemons start as root, and this is not root"
    missing = [d for d in DAEMONS if shutil.which(d) is None and not pathlib.Path("/usr/sbin", d).exists()]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge (as .ci/run does)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: pathlib.Path, node: str, cpus: int) -> str:
    return f"""\
ClusterName=jaxllm-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=5
MessageTimeout=20
JobRequeue=1
SchedulerParameters=defer
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class Cluster:
    """One node, `cpus` CPUs (more than the machine has is fine: slurmd takes the config's word)."""

    def __init__(self, root: str | pathlib.Path, cpus: int = 8):
        self.root = pathlib.Path(root).absolute()
        self.node = socket.gethostname()
        self.cpus = cpus
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}
        self._procs: list[subprocess.Popen] = []

    def start(self, timeout: float = 90.0) -> Cluster:
        for d in ("state", "spool"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "slurm.conf").write_text(_config(self.root, self.node, self.cpus))
        self._daemon(["munged", "--force", "--foreground", f"--socket={self.root}/munge.socket",
                      f"--key-file={key}", f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
                      f"--seed-file={self.root}/munged.seed"])  # fmt: skip
        self._wait_for(lambda: (self.root / "munge.socket").exists(), timeout, "munged")
        self._daemon(["slurmctld", "-D", "-i"])
        self._wait_for(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld")
        self._daemon(["slurmd", "-D", "-N", self.node])
        self._wait_for(lambda: self._ok(["sinfo", "-h", "-o", "%T"], "idle"), timeout, "slurmd")
        return self

    def _daemon(self, command: list[str]) -> None:
        log = open(self.root / f"{command[0]}.out", "ab")  # noqa: SIM115 - held by the daemon
        self._procs.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=log, start_new_session=True))

    def _ok(self, command: list[str], word: str) -> bool:
        out = subprocess.run(command, env=self.env, capture_output=True, text=True)
        return out.returncode == 0 and word in out.stdout

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not ready():
            if time.time() > deadline or any(p.poll() is not None for p in self._procs):
                self.stop()
                logs = "\n".join(f"{p.name}:\n{p.read_text()[-1500:]}" for p in sorted(self.root.glob("*.log")))
                raise RuntimeError(f"{what} did not start within {timeout:.0f} s\n{logs}")
            time.sleep(0.5)

    def command(self, *args: str, check: bool = True, env: dict | None = None, cwd=None) -> str:
        """A SLURM command against this cluster (with more `env`, from `cwd`); its output."""
        out = subprocess.run(list(args), env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        fields = {}
        for word in self.command("scontrol", "show", "job", job_id).split():
            if "=" in word:
                key, value = word.split("=", 1)
                fields.setdefault(key, value)
        return fields

    def stop(self) -> None:
        """Cancels every job, then stops the daemons (and anything they left running)."""
        if self._procs and self._procs[0].poll() is None:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--partition=test"], env=self.env,
                           capture_output=True, timeout=30)  # fmt: skip
        for p in reversed(self._procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs = []


if __name__ == "__main__":
    cluster = Cluster(sys.argv[1]).start()
    print(f"export SLURM_CONF={cluster.env['SLURM_CONF']}")
