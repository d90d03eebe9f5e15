"""What the generated sbatch scripts run on the nodes (``python -m launch.slurm.node COMMAND``).

Small Python entries instead of shell loops, so they are tested and their errors are readable:

* ``address [--ifname IF]``: the IPv4 address this node is reached at (``launch.socket_ifname``'s,
  else the first of ``hostname -I``);
* ``serve --servers-dir D --log-dir L [--ifname IF] -- MGRPO_SERVE_ARGS...``: runs
  ``mgrpo serve --host <address> --allow-remote --url-file D/<hostname>.url ...`` in this process
  (exec); the URL file appears once the server answers /health and goes when it stops;
* ``wait-servers --servers-dir D --count M --timeout S --rollout-log LOG [--rollout-job ID]``: waits
  until M URL files exist and each URL's /health answers 200, then prints ``[url1,url2,...]`` (for
  ``rollout.server_urls=``); after S seconds it fails naming the missing or unhealthy servers and
  the rollout job's log, and at once when the rollout job ID has ended (a crashed server);
* ``has-checkpoint RUN_DIR``: exit 0 when RUN_DIR holds a complete checkpoint (resume), printing the
  newest one's step and path; 1 otherwise;
* ``fit-time-limit --rollout-job ID --margin S``: lowers this (trainer) job's time limit so that it
  ends S seconds before the rollout job does, so its preemption signal fires while the servers are
  still up.

Only the standard library and ``requests`` at import time: these run on every node before torch.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["node_address", "interface_ipv4", "wait_servers", "ServersNotReady", "main"]


class ServersNotReady(RuntimeError):
    """Not every rollout server wrote its URL and answered /health within the timeout."""


def interface_ipv4(ifname: str) -> str:
    """IPv4 address of network interface `ifname` (Linux SIOCGIFADDR); ValueError naming the
    interfaces that exist otherwise."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except OSError as e:
        names = [n for _, n in socket.if_nameindex()]
        raise ValueError(f"network interface {ifname!r} (launch.socket_ifname) has no IPv4 address on "
                         f"{socket.gethostname()} ({e.strerror}); interfaces here: {', '.join(names)}") from e


def node_address(ifname: str | None = None) -> str:
    """The address other nodes reach this one at: `ifname`'s IPv4 when given, else the first
    address `hostname -I` prints, else the host name's non-loopback address."""
    if ifname:
        return interface_ipv4(ifname)
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
        v4 = [a for a in out if "." in a and not a.startswith("127.")]
        if v4:
            return v4[0]
    except (OSError, subprocess.SubprocessError):
        pass
    for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
        addr = info[4][0]
        if not addr.startswith("127."):
            return addr
    raise ValueError(f"found no non-loopback IPv4 address on {socket.gethostname()}: "
                     "set launch.socket_ifname to the cluster network's interface")


def _healthy(url: str, timeout: float = 5.0) -> bool:
    import requests

    try:
        return requests.get(f"{url}/health", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def _read_urls(servers_dir: Path) -> dict[str, str]:
    """{hostname: url} from the servers dir's ``*.url`` files (tmp files are ignored)."""
    out = {}
    if servers_dir.is_dir():
        for f in sorted(servers_dir.glob("*.url")):
            try:
                url = f.read_text().strip()
            except OSError:
                continue
            if url:
                out[f.stem] = url.rstrip("/")
    return out


_ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                           "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
"""Final job states; PREEMPTED is left out, since a preempted job may be on its way back (requeue)."""


def _job_ended(job_id: str) -> str | None:
    """The final state of slurm job `job_id` once it has ended ("gone" when squeue no longer knows
    it); None while it is pending, running or being requeued, or when squeue cannot tell."""
    try:
        r = subprocess.run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return "gone" if "invalid job id" in r.stderr.lower() else None
    state = r.stdout.strip().split("\n")[0].strip()
    if not state:
        return "gone"
    return state if state in _ENDED_STATES else None


def wait_servers(servers_dir: str | os.PathLike, count: int, timeout: float, rollout_log: str = "",
                 poll_s: float = 5.0, log=print, rollout_job: str = "") -> list[str]:
    """Wait for `count` URL files in `servers_dir`, each answering /health; return the URLs.
    With `rollout_job`, fail at once when that job has ended (its servers will not come)."""
    servers_dir = Path(servers_dir)
    t0 = time.monotonic()
    last_report = -1e9
    while True:
        urls = _read_urls(servers_dir)
        health = {host: _healthy(url) for host, url in urls.items()}
        ready = [urls[h] for h in sorted(urls) if health[h]]
        if len(ready) >= count:
            return ready
        ended = _job_ended(rollout_job) if rollout_job else None
        if ended:
            raise ServersNotReady(
                f"the rollout job {rollout_job} has ended ({ended}) with {len(ready)} of {count} servers "
                f"ready: they will not come up. See its log: {rollout_log or servers_dir.parent / 'logs'} "
                "(and the per-node vLLM logs next to it); docs/slurm.md, 'Troubleshooting'")
        elapsed = time.monotonic() - t0
        if elapsed >= timeout:
            lines = [f"{len(ready)} of {count} rollout servers ready after {timeout:.0f} s "
                     f"(launch.health_timeout_s) in {servers_dir}:"]
            for h in sorted(urls):
                lines.append(f"  {h}: {urls[h]} {'healthy' if health[h] else 'NOT answering /health'}")
            if len(urls) < count:
                lines.append(f"  {count - len(urls)} server(s) never wrote a URL file "
                             "(not started, still loading, or crashed)")
            lines.append(f"see the rollout job's log: {rollout_log or servers_dir.parent / 'logs'}"
                         " (and the per-node vLLM logs next to it); docs/slurm.md, 'Troubleshooting'")
            raise ServersNotReady("\n".join(lines))
        if elapsed - last_report >= 60:
            last_report = elapsed
            log(f"[wait-servers] {len(ready)}/{count} rollout servers ready "
                f"({elapsed:.0f} s of {timeout:.0f} s)", file=sys.stderr, flush=True)
        time.sleep(min(poll_s, max(0.1, timeout - elapsed)))


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    addr = node_address(args.ifname)
    host = socket.gethostname().split(".")[0]
    servers = Path(args.servers_dir)
    servers.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "launch.cli", "serve", "--host", addr, "--allow-remote",
            "--url-file", str(servers / f"{host}.url"),
            "--log", str(Path(args.log_dir) / f"vllm-{host}.log"), *rest]
    print(f"[rollout] {host}: serving on {addr}: {' '.join(argv[3:])}", flush=True)
    os.execv(sys.executable, argv)  # signals from slurm reach mgrpo serve directly
    return 1  # pragma: no cover


def _newest_checkpoint(run_dir: str):
    """``(step, path)`` of the newest complete checkpoint under `run_dir`, or None."""
    from megatron_grpo.engine.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _squeue_seconds(job_id: str, field: str) -> int | None:
    """A time field of `job_id` in seconds (``%L``: time left, ``%M``: time used); None when
    unlimited, unknown or not running."""
    from megatron_grpo.config import slurm_time_seconds

    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", field], capture_output=True, text=True,
                         timeout=30)
    text = out.stdout.strip()
    try:
        return slurm_time_seconds(text) if out.returncode == 0 and text else None
    except ValueError:  # UNLIMITED, NOT_SET, INVALID
        return None


def _fit_time_limit(rollout_job: str, margin: float) -> int:
    me = os.environ.get("SLURM_JOB_ID")
    if not me or not rollout_job:
        return 0
    try:
        rollout_left, my_left = _squeue_seconds(rollout_job, "%L"), _squeue_seconds(me, "%L")
        elapsed = _squeue_seconds(me, "%M") or 0
    except (OSError, subprocess.SubprocessError) as e:
        print(f"[fit-time-limit] squeue failed ({e}); time limit unchanged", file=sys.stderr)
        return 0
    if rollout_left is None or (my_left is not None and my_left <= rollout_left - margin):
        return 0
    new_min = max(1, int((elapsed + rollout_left - margin) // 60))
    r = subprocess.run(["scontrol", "update", f"JobId={me}", f"TimeLimit={new_min}"], capture_output=True,
                       text=True, timeout=30)
    if r.returncode == 0:
        print(f"[fit-time-limit] the rollout job {rollout_job} ends in {rollout_left} s: this job's time limit "
              f"is now {new_min} min, so it checkpoints and requeues before the servers stop", flush=True)
    else:
        print(f"[fit-time-limit] warning: the rollout job {rollout_job} ends in {rollout_left} s, before this "
              f"job; lowering its time limit failed ({r.stderr.strip()}). Give the rollout job the longer "
              "--time (docs/slurm.md, 'Time limits')", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m launch.slurm.node", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("address", help="print this node's cluster address")
    s.add_argument("--ifname", default=None)
    s = sub.add_parser("serve", help="exec mgrpo serve on this node's address, writing a URL file")
    s.add_argument("--servers-dir", required=True)
    s.add_argument("--log-dir", required=True)
    s.add_argument("--ifname", default=None)
    s = sub.add_parser("wait-servers", help="wait for the rollout servers; print their URLs")
    s.add_argument("--servers-dir", required=True)
    s.add_argument("--count", type=int, required=True)
    s.add_argument("--timeout", type=float, required=True)
    s.add_argument("--rollout-log", default="")
    s.add_argument("--rollout-job", default="", help="fail at once when this slurm job has ended")
    s.add_argument("--poll", type=float, default=5.0)
    s = sub.add_parser("has-checkpoint", help="exit 0 when RUN_DIR holds a complete checkpoint")
    s.add_argument("run_dir")
    s = sub.add_parser("fit-time-limit", help="end this job before the rollout job")
    s.add_argument("--rollout-job", default="")
    s.add_argument("--margin", type=float, default=300.0)
    args = p.parse_args(argv)
    try:
        if args.cmd == "address":
            print(node_address(args.ifname))
            return 0
        if args.cmd == "serve":
            return _serve(args, rest)
        if args.cmd == "wait-servers":
            urls = wait_servers(args.servers_dir, args.count, args.timeout, args.rollout_log, poll_s=args.poll,
                                rollout_job=args.rollout_job)
            print("[" + ",".join(urls) + "]")
            print(f"[wait-servers] all {len(urls)} rollout servers ready: {', '.join(urls)}", file=sys.stderr)
            return 0
        if args.cmd == "has-checkpoint":
            newest = _newest_checkpoint(args.run_dir)
            if newest is None:
                return 1
            print(f"step {newest[0]} ({newest[1]})")
            return 0
        if args.cmd == "fit-time-limit":
            return _fit_time_limit(args.rollout_job, args.margin)
    except (ValueError, ServersNotReady) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
