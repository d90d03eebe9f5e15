"""A real one-node Slurm cluster on localhost for the launcher tests (`local_slurm` fixture).

Import it into a test module (`from slurm_local import local_slurm`); pytest's default (prepend)
import mode puts tests/launch/ on sys.path. There is deliberately no tests/launch/conftest.py:
several test modules do `from conftest import build_cached_tiny`, and a second rootless
conftest.py would shadow tests/conftest.py in sys.modules.

What the fixture does, once per session:

1. Installs Debian's `slurm-wlm` and `munge` (`apt-get install --no-install-recommends`, after an
   `apt-get update` when the package lists lack them) when `slurmctld` is missing. That needs root
   and apt-get; without them the tests skip, except under CI (`CI` set), where they fail: CI must
   run them.
2. Starts a private munged (own key, own socket) and writes a slurm.conf in a private temp dir:
   ports picked free, every state/spool/log/pid file in that dir, so it never touches /etc/slurm,
   the system munged or another cluster on the machine. Slurm's clients reach it through
   `SLURM_CONF`, set in `LocalSlurm.env`: pass that env to every subprocess that should talk to it
   (jobs inherit it, since sbatch exports the environment), or use `with cluster.activated():` for
   in-process code. It is deliberately not left in os.environ for the whole session, where later
   tests that happen to call a real sbatch would submit to this cluster.
3. Starts slurmctld and slurmd in the foreground (`-D`, Popen, new session) and waits until the
   node is idle.
4. At teardown: cancels every job left, ends any process that still carries this cluster's
   SLURM_CONF in its environment (job steps, slurmstepd), then stops slurmd, slurmctld and munged by
   pid (SIGTERM, then SIGKILL) and checks that they are gone.

Configuration choices (Slurm 22.05 on Debian 12, inside a container):
- proctrack/linuxproc + task/none and no cgroup.conf: the container's cgroups are not delegated to
  us (and under gVisor barely exist); nothing here needs cgroup enforcement.
- select/cons_tres with CR_CPU and a node that claims more CPUs than the hardware has
  (`SlurmdParameters=config_overrides`): the launcher's rollout job and trainer job must run at
  the same time on the one node, as they would on two nodes of a real cluster.
- Requeue: when a batch job is requeued (`scontrol requeue`, a USR1-preempted job that asks for it,
  `--requeue` after a node failure), slurmctld sets its BeginTime to now + the credential lifetime
  + 1 s, so it sits PENDING with Reason=BeginTime (default lifetime 120 s). We shorten that lifetime
  with `AuthInfo=...,cred_expire=N` (CRED_EXPIRE_S below); `LocalSlurm.release(jobid)` starts such a
  job at once (`scontrol update JobId=.. StartTime=now`) if a test cannot wait even that long.
- MinJobAge is long, so finished jobs stay visible to `scontrol show job` (there is no slurmdbd,
  hence no sacct) for the whole session.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from model_bridge.lifeline import guard_group, release
from model_bridge.spawn import free_port

CRED_EXPIRE_S = 5
NODE_CPUS = 16
DAEMONS = ("munged", "slurmctld", "slurmd")
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
})
_KV = re.compile(r"(?:^|\s)([A-Za-z][\w/:.]*)=(.*?)(?=\s+[A-Za-z][\w/:.]*=|$)")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str):
    """Skip locally; fail under CI, where the real-Slurm tests must run."""
    if _in_ci():
        pytest.fail(f"real Slurm unavailable under CI: {reason}", pytrace=False)
    pytest.skip(f"real Slurm unavailable: {reason}")


def _tail(path: Path, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError as e:
        return f"<{path}: {e}>"
    return "\n".join(lines[-n:])


def _have_slurm() -> bool:
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol"))


def ensure_installed(say=print) -> float | None:
    """Install slurm-wlm + munge with apt when missing. Returns the seconds it took (None: present)."""
    if _have_slurm():
        return None
    if os.geteuid() != 0:
        unavailable("slurmctld is not installed and we are not root (apt-get install "
                    "slurm-wlm munge needs root)")
    if not shutil.which("apt-get"):
        unavailable("slurmctld is not installed and there is no apt-get")
    t0 = time.monotonic()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    install = ["apt-get", *lock, "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]

    def run(cmd):
        say(f"[slurm] $ {' '.join(cmd)}")
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=900)
        return p

    policy = subprocess.run(["apt-cache", "policy", "slurm-wlm"], env=env, capture_output=True,
                            text=True)
    if "Candidate:" not in policy.stdout or "Candidate: (none)" in policy.stdout:
        p = run(["apt-get", *lock, "update"])
        if p.returncode:
            pytest.fail(f"apt-get update failed ({p.returncode}):\n{p.stdout[-3000:]}")
    p = run(install)
    if p.returncode:  # stale package lists (404s): refresh and try once more
        run(["apt-get", *lock, "update"])
        p = run(install)
    if p.returncode or not _have_slurm():
        pytest.fail(f"apt-get install slurm-wlm munge failed ({p.returncode}):\n{p.stdout[-3000:]}")
    dt = time.monotonic() - t0
    say(f"[slurm] installed slurm-wlm and munge in {dt:.1f} s")
    return dt


def parse_kv(text: str) -> dict[str, str]:
    """`scontrol show ... -o` line -> {key: value} (values may contain spaces)."""
    return {k: v for k, v in _KV.findall(text.strip())}


class LocalSlurm:
    """A running one-node cluster; every helper talks to it through `self.env` (SLURM_CONF)."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.logs = root / "log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.watchers: list[subprocess.Popen] = []
        self.env = dict(os.environ)
        self.env["SLURM_CONF"] = str(self.conf)
        for k in list(self.env):  # never inherit an enclosing allocation's view of the world
            if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and k != "SLURM_CONF":
                del self.env[k]
        self.timings: dict[str, float] = {}
        self.strays: list[int] = []

    # -- configuration and daemons ----------------------------------------------------------
    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(exist_ok=True)
        mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        self.conf.write_text(f"""\
# one-node test cluster written by tests/launch/slurm_local.py
ClusterName=mgrpotest
SlurmctldHost=localhost
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge.sock,cred_expire={CRED_EXPIRE_S}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=86400
SchedulerParameters=sched_interval=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
Waittime=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.logs / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        out.close()
        # its own group; the watcher ends it if this pytest process dies without calling stop()
        self.watchers.append(guard_group(self.procs[name].pid))

    def start(self, timeout: float = 60.0) -> None:
        r = self.root
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # munged refuses to run as root without --force; -F keeps it our child (we hold its pid)
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={r}/munge.sock",
                               f"--key-file={key}", f"--pid-file={r}/munged.pid",
                               f"--log-file={self.logs}/munged.log",
                               f"--seed-file={r}/munged.seed"])
        self._wait(lambda: (r / "munge.sock").exists(), 15, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: "UP" in self.run("scontrol", "ping", check=False).stdout, 30,
                   "slurmctld to answer `scontrol ping`")
        self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)])
        self._wait(lambda: self.node_state() == "idle", timeout, "node localhost to be idle")

    def _wait(self, ok, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for "
                                       f"{what}\n{self.diagnostics()}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                if ok():
                    return
            time.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                           f"{self.diagnostics()}")

    def diagnostics(self) -> str:
        parts = []
        for name in DAEMONS:
            p = self.procs.get(name)
            status = "not started" if p is None else (
                "running" if p.poll() is None else f"exited {p.returncode}")
            parts.append(f"--- {name} ({status}) stdout/stderr:\n{_tail(self.logs / f'{name}.out')}")
            log = self.logs / f"{name}.log"
            if log.exists():
                parts.append(f"--- {name}.log:\n{_tail(log)}")
        return "\n".join(parts)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values()) and self.node_state() in (
            "idle", "mixed", "allocated")

    def stop(self) -> list[str]:
        """Cancel jobs, end stray job processes, stop the daemons by pid. Returns problems."""
        problems = []
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(Exception):
                ids = self.run("squeue", "-h", "-o", "%A", check=False).stdout.split()
                if ids:
                    self.run("scancel", *ids, check=False)
                    end = time.monotonic() + 20
                    while time.monotonic() < end and self.run(
                            "squeue", "-h", "-t", "RUNNING,COMPLETING", "-o", "%A",
                            check=False).stdout.strip():
                        time.sleep(0.5)
        for name in reversed(DAEMONS):  # slurmd, slurmctld (and its slurmscriptd), munged
            p = self.procs.get(name)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(10)
            if p.poll() is None:
                problems.append(f"{name} (pid {p.pid}) did not exit")
        for w in self.watchers:
            release(w)
        # whatever still carries our SLURM_CONF was started through this cluster: a job's
        # process that outlived scancel, a slurmstepd, slurmctld's slurmscriptd helper
        self.strays = self._pids_with_our_conf()
        _terminate(self.strays)
        left = [pid for pid in self.strays if _exists(pid)]
        if left:
            problems.append(f"processes of this cluster survived SIGKILL: {left}")
        return problems

    def _pids_with_our_conf(self) -> list[int]:
        """Processes whose environment holds SLURM_CONF=<our conf>, other than this process and
        its descendants (the test's own children inherit SLURM_CONF too): job steps, slurmstepd,
        whatever a job left behind. All were started through this cluster."""
        needle = f"SLURM_CONF={self.conf}".encode() + b"\0"
        parent, hits = {}, []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if needle in (d / "environ").read_bytes() + b"\0":
                    hits.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
        me = os.getpid()

        def ours(pid: int) -> bool:
            seen = set()
            while pid > 1 and pid not in seen:
                if pid == me:
                    return True
                seen.add(pid)
                pid = parent.get(pid, 0)
            return False
        return [pid for pid in hits if not ours(pid)]

    # -- client helpers -------------------------------------------------------------------
    @contextlib.contextmanager
    def activated(self):
        """SLURM_CONF=<this cluster> in os.environ inside the block (for in-process callers)."""
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)
        try:
            yield self
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old

    def run(self, *cmd: str, check: bool = True, timeout: float = 30.0
            ) -> subprocess.CompletedProcess:
        p = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        if check and p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
        return p

    def node_state(self) -> str:
        p = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return p.stdout.strip().rstrip("*~#!%$@^-") if p.returncode == 0 else ""

    def sbatch(self, *args: str, script: str | None = None) -> int:
        """sbatch ARGS [script text on stdin]; returns the job id."""
        p = subprocess.run(["sbatch", "--parsable", *args], input=script, env=self.env,
                           capture_output=True, text=True, timeout=30)
        if p.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {p.stderr.strip()}")
        return int(p.stdout.strip().split(";")[0])

    def job(self, jobid: int | str) -> dict[str, str]:
        """`scontrol show job -o` as a dict ({} if Slurm no longer knows the job)."""
        p = self.run("scontrol", "show", "job", "-o", str(jobid), check=False)
        if p.returncode or not p.stdout.strip():
            return {}
        return parse_kv(p.stdout.splitlines()[0])

    def state(self, jobid: int | str) -> str | None:
        return self.job(jobid).get("JobState")

    def wait_state(self, jobid: int | str, states=("RUNNING",), timeout: float = 60.0,
                   fail_on_terminal: bool = True) -> dict[str, str]:
        """Poll until the job is in one of `states`; returns its scontrol record."""
        states = {states} if isinstance(states, str) else set(states)
        end = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < end:
            info = self.job(jobid)
            st = info.get("JobState")
            if st in states:
                return info
            if fail_on_terminal and st in TERMINAL_STATES:
                raise RuntimeError(f"job {jobid} ended {st} while waiting for {sorted(states)}: "
                                   f"{info}")
            time.sleep(0.5)
        raise TimeoutError(f"job {jobid} not in {sorted(states)} after {timeout:.0f} s: "
                           f"{info.get('JobState')} ({info.get('Reason')})")

    def wait_done(self, jobid: int | str, timeout: float = 300.0) -> dict[str, str]:
        return self.wait_state(jobid, TERMINAL_STATES, timeout, fail_on_terminal=False)

    def scancel(self, *args: str) -> None:
        self.run("scancel", *[str(a) for a in args])

    def release(self, jobid: int | str) -> None:
        """Start a requeued job now instead of after its BeginTime delay (see module doc)."""
        self.run("scontrol", "update", f"JobId={jobid}", "StartTime=now")


def _terminate(pids: list[int], grace: float = 10.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while pids and time.monotonic() < end:
        pids = [p for p in pids if _exists(p)]
        time.sleep(0.2)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie we happen to parent counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _terminal_printer(request):
    """print() through pytest's capture (apt can take a while on a cold machine)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def say(msg: str) -> None:
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            print(msg, file=sys.stderr, flush=True)
    return say


_SHARED: dict = {}
"""The one cluster of this pytest session. Each test module that imports `local_slurm` gets its own
fixture definition (pytest scopes fixtures by where they are defined), so the definitions share
the cluster through this module (imported once): the first to run starts it and stops it at the
end of the session; a start that failed is not retried."""


@pytest.fixture(scope="session")
def local_slurm(request):
    """A started one-node Slurm (LocalSlurm). Run Slurm commands with `cluster.env` (or through its
    helpers): SLURM_CONF is set there, not in os.environ, so tests that do not ask for this cluster
    never submit to it by accident. `with cluster.activated():` sets it in os.environ for code that
    calls sbatch in-process."""
    if "cluster" in _SHARED:
        yield _SHARED["cluster"]
        return
    if "error" in _SHARED:
        unavailable(_SHARED["error"]) if _SHARED.get("skip") else pytest.fail(_SHARED["error"],
                                                                             pytrace=False)
    say = _terminal_printer(request)
    try:
        if sys.platform != "linux":
            unavailable("needs Linux")
        if os.geteuid() != 0:
            unavailable("the test cluster runs slurmd/slurmctld as root; we are not root")
        t_apt = ensure_installed(say)
    except pytest.skip.Exception as e:
        _SHARED.update(error=str(e.msg).removeprefix("real Slurm unavailable: "), skip=True)
        raise
    except pytest.fail.Exception as e:
        _SHARED.update(error=str(e.msg))
        raise
    root = Path(tempfile.mkdtemp(prefix="mgrpo-slurm-", dir="/tmp"))  # short: unix sockets
    root.chmod(0o755)  # munged wants its socket dir searchable by all
    cluster = LocalSlurm(root)
    if t_apt is not None:
        cluster.timings["apt_install_s"] = t_apt
    cluster.write_config()
    t0 = time.monotonic()
    problems: list[str] = []
    try:
        try:
            cluster.start()
        except Exception as e:
            _SHARED["error"] = f"the local Slurm did not start: {e}"
            raise
        cluster.timings["daemon_start_s"] = time.monotonic() - t0
        say(f"[slurm] local cluster up in {cluster.timings['daemon_start_s']:.1f} s "
            f"(conf {cluster.conf})")
        _SHARED["cluster"] = cluster
        yield cluster
    finally:
        _SHARED.pop("cluster", None)
        t1 = time.monotonic()
        problems = cluster.stop()
        say(f"[slurm] local cluster stopped in {time.monotonic() - t1:.1f} s"
            + (f" (ended stray processes {cluster.strays})" if cluster.strays else ""))
        if problems:
            say(f"[slurm] teardown problems: {problems}; files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if problems:
        pytest.fail("local Slurm teardown: " + "; ".join(problems), pytrace=False)
