"""`mgrpo launch slurm`: the rendered sbatch scripts have the properties that matter (node counts,
GPU binding, torchrun arguments, signal, requeue, health wait, secrets), bad inputs get clear
errors, the health-wait entry fails readably, and SIGUSR1 reaches the ranks through torchrun.
No slurm needed: sbatch is faked where submission is tested."""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.cli import main
from model_bridge.spawn import free_port

REPO = Path(__file__).resolve().parents[2]
RECIPE_30B = "qwen3_omni_30b_a3b_audio_agent_4x8_h200"


def _env(**extra) -> dict:
    """This Python first on PATH (the scripts call `python -m launch.slurm...`), repo importable."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    env.update(extra)
    return env


def _launch(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["launch", "slurm", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _render_30b(capsys, out: Path, *overrides: str) -> dict[str, str]:
    rc, _, err = _launch(capsys, "--recipe", RECIPE_30B, "--dry-run", "--out", str(out),
                         f"trainer.run_dir={out.parent / 'run'}", *overrides)
    assert rc == 0, err
    return {p.name: p.read_text() for p in out.iterdir() if p.is_file() and p.name != "api_key"}


def sbatch_options(script: str) -> dict[str, str | bool]:
    """``#SBATCH --key=value`` / ``#SBATCH --flag`` lines as a dict (flags map to True)."""
    opts = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            k, _, v = line[len("#SBATCH "):].strip().partition("=")
            opts[k.lstrip("-")] = v if v else True
    return opts


@pytest.fixture
def rendered(tmp_path, capsys):
    out = tmp_path / "slurm"
    return out, _render_30b(capsys, out)


def test_30b_recipe_4_plus_2_nodes_sbatch_headers(rendered):
    out, files = rendered
    r, t = sbatch_options(files["rollout.sbatch"]), sbatch_options(files["train.sbatch"])
    assert (r["nodes"], r["ntasks-per-node"], r["gpus-per-node"]) == ("2", "1", "8")
    assert (t["nodes"], t["ntasks-per-node"], t["gpus-per-node"]) == ("4", "1", "8")
    assert t["signal"] == "USR1@120"                 # no "B:": the job steps (the ranks) get it
    assert t["requeue"] is True and r["requeue"] is True and t["open-mode"] == "append"
    assert r["signal"] == "B:USR1@60"                # the rollout shell requeues itself before its limit
    assert t["output"] == f"{out}/logs/train-%j.out" and r["output"] == f"{out}/logs/rollout-%j.out"
    assert t["job-name"] == "mgrpo-train" and r["job-name"] == "mgrpo-rollout"
    assert "partition" not in t and "time" not in t  # only when given


def test_30b_torchrun_and_gpu_binding(rendered):
    _, files = rendered
    t = files["train.sbatch"]
    srun = t[t.index("srun --ntasks-per-node=1"):t.index("CODE=$?")]
    assert "--gpus-per-node=8" in srun and "--kill-on-bad-exit=1" in srun
    assert "python -m launch.slurm.torchrun --nnodes=4 --nproc-per-node=8" in srun
    assert '--node-rank="$SLURM_NODEID"' in srun  # inside single quotes: each node's own id
    assert '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT"' in srun
    assert "-m launch.slurm.worker train" in srun and '"${TRAIN_ARGS[@]}"' in srun
    assert "export MASTER_PORT=29500" in t
    # rollout nodes: one server per node on all 8 GPUs as vLLM TP4 x DP2
    r = files["rollout.sbatch"]
    assert "srun --ntasks-per-node=1 --gpus-per-node=8" in r
    assert re.search(r"--tp 4 \\\n\s+--dp 2", r) and "--model /data/models/Qwen3-Omni-30B-A3B-Instruct" in r
    assert "--max-model-len 32768" in r and "--dtype bfloat16" in r
    assert "--max-audio-seconds 600 " in r  # the recipe's data.max_audio_seconds: every accepted row decodes


def test_rollout_nodes_decode_the_datas_longest_recording(tmp_path, capsys):
    files = _render_30b(capsys, tmp_path / "slurm", "data.max_audio_seconds=2400")
    assert "--max-audio-seconds 2400 " in files["rollout.sbatch"]
    files = _render_30b(capsys, tmp_path / "slurm2", "data.max_audio_seconds=2400", "serve.max_audio_seconds=3000")
    assert "--max-audio-seconds 3000 " in files["rollout.sbatch"]


def test_master_addr_is_the_first_host_of_the_nodelist(rendered, tmp_path):
    _, files = rendered
    line = next(ln for ln in files["train.sbatch"].splitlines() if ln.startswith("export MASTER_ADDR="))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/bash\n[ "$1 $2 $3" = "show hostnames gpu[07-10]" ] && '
                                   'printf "gpu07\\ngpu08\\ngpu09\\ngpu10\\n"\n')
    (fake / "scontrol").chmod(0o755)
    r = subprocess.run(["bash", "-c", f'{line}; echo "$MASTER_ADDR"'], capture_output=True, text=True,
                       env=_env(PATH=f"{fake}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu[07-10]"))
    assert r.stdout.strip() == "gpu07", r.stderr


def test_resume_health_wait_and_outcome_logic_present(rendered):
    _, files = rendered
    t = files["train.sbatch"]
    assert "ROLLOUT_SERVERS=2" in t and "HEALTH_TIMEOUT=1800" in t
    wait = t.index("python -m launch.slurm.node wait-servers")
    assert wait < t.index("srun --ntasks-per-node=1")  # servers first, then torchrun
    assert '--count "$ROLLOUT_SERVERS" --timeout "$HEALTH_TIMEOUT" --rollout-log "$ROLLOUT_LOG"' in t
    assert 'python -m launch.slurm.node has-checkpoint "$RUN_DIR"' in t
    # a run launched again with other nodes resumes at this job's layout (32 ranks), not the saved one
    resume = re.search(r'TRAIN_ARGS=\(--resume "\$RUN_DIR" (.*)\)', t)
    assert resume and re.fullmatch(r"parallel\.nproc=32 parallel\.tp=\d+ parallel\.pp=\d+ parallel\.ep=\d+ "
                                   r"parallel\.etp=\d+", resume.group(1)), t
    assert '"rollout.server_urls=$URLS"' in t  # fresh URLs also on resume
    assert 'scontrol requeue "$SLURM_JOB_ID"' in t and '"$RUN_DIR/PREEMPTED"' in t and '"$RUN_DIR/DONE"' in t
    assert t.count('cancel_rollout "') == 3  # servers missing, finished, failed
    assert 'rm -f "$SERVERS"/*.url' in files["rollout.sbatch"]  # stale URL files of a requeued rollout job


def test_health_timeout_override(tmp_path, capsys):
    files = _render_30b(capsys, tmp_path / "slurm", "launch.health_timeout_s=77")
    assert "HEALTH_TIMEOUT=77\n" in files["train.sbatch"]


def test_api_key_is_0600_and_in_no_script(rendered):
    out, files = rendered
    key_file = out / "api_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert len(key) >= 32
    for name, text in files.items():
        assert key not in text, name
    assert 'export VLLM_API_KEY="$(cat "$OUT/api_key")"' in files["train.sbatch"]
    assert 'export VLLM_API_KEY="$(cat "$OUT/api_key")"' in files["rollout.sbatch"]


def test_config_yaml_is_the_resolved_remote_config(rendered):
    from megatron_grpo.config import load_train_config

    out, _ = rendered
    cfg = load_train_config(out / "config.yaml")
    assert cfg.rollout.server == "remote" and cfg.parallel.nproc == 32 and cfg.rollout.api_key is None
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.pp) == (2, 8, 2)
    assert cfg.trainer.run_dir == str(out.parent / "run")


def test_nccl_knobs_come_from_config(rendered, tmp_path, capsys):
    _, files = rendered
    for text in files.values():
        assert "NCCL_IB_DISABLE" not in text and "NCCL_SOCKET_IFNAME=" not in text
    files = _render_30b(capsys, tmp_path / "s2", "launch.socket_ifname=ib0", "launch.nccl_ib=false",
                        "launch.env={NCCL_DEBUG: INFO}")
    for name in ("train.sbatch", "rollout.sbatch"):
        lines = files[name].splitlines()
        assert any(ln.startswith("export NCCL_IB_DISABLE=1") for ln in lines)
        assert any(ln.startswith("export NCCL_SOCKET_IFNAME=ib0") for ln in lines)
        assert any(ln.startswith("export GLOO_SOCKET_IFNAME=ib0") for ln in lines)
        assert any(ln.startswith("export NCCL_DEBUG=INFO") for ln in lines)
    assert "--ifname ib0" in files["rollout.sbatch"]  # the servers bind to ib0's address


def test_scripts_pass_bash_syntax_check(rendered, tmp_path, capsys):
    _, files = rendered
    files_cpu = _render_cpu(capsys, tmp_path / "cpu")
    for name, text in [*files.items(), *(("cpu-" + k, v) for k, v in files_cpu.items())]:
        if name.endswith(".sbatch"):
            p = tmp_path / name
            p.write_text(text)
            r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
            assert r.returncode == 0, f"{name}: {r.stderr}"


def test_no_requeue_no_signal(tmp_path, capsys):
    files = _render_30b(capsys, tmp_path / "slurm", "launch.requeue=false", "launch.signal=null",
                        "--partition=gpu")  # an option after the overrides still parses
    t, r = sbatch_options(files["train.sbatch"]), sbatch_options(files["rollout.sbatch"])
    assert "requeue" not in t and "requeue" not in r and "signal" not in t and "signal" not in r
    assert "scontrol requeue" not in files["train.sbatch"] and "scontrol requeue" not in files["rollout.sbatch"]
    assert t["partition"] == "gpu"


def _render_cpu(capsys, out: Path, *extra) -> dict[str, str]:
    rc, _, err = _launch(capsys, "--recipe", "tiny_cpu", "--dry-run", "--out", str(out),
                         f"trainer.run_dir={out.parent / 'run'}", *extra)
    assert rc == 0, err
    return {p.name: p.read_text() for p in out.iterdir() if p.is_file()}


def test_cpu_recipe_has_no_gpu_lines(tmp_path, capsys):
    files = _render_cpu(capsys, tmp_path / "slurm", "--partition", "debug", "--account", "proj1",
                        "--time", "0:30:00")
    t = sbatch_options(files["train.sbatch"])
    assert "gpus-per-node" not in t and "gpus-per-node" not in files["train.sbatch"].split("set -eo")[1]
    assert (t["nodes"], t["partition"], t["account"], t["time"]) == ("1", "debug", "proj1", "0:30:00")
    assert "exclusive" not in t
    assert "--nnodes=1 --nproc-per-node=2" in files["train.sbatch"]  # parallel.nproc ranks on CPU
    assert "export VLLM_CPU_KVCACHE_SPACE=1" in files["rollout.sbatch"]
    assert "--dtype float32" in files["rollout.sbatch"]


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("argv, message", [
    (["--trainer-nodes", "0"], "--trainer-nodes must be >= 1, got 0"),
    (["--rollout-nodes", "0"], "--rollout-nodes must be >= 1, got 0"),
    (["--time", "forever"], "--time: time limit 'forever' is not a slurm time"),
    (["--time", "2"], "--time 2 (120 s) is not longer than launch.signal='USR1@120'"),
    (["--trainer-nodes", "3"], "3 trainer node(s) x 8 rank(s) = 24 ranks: "),
    (["launch.signal=B:USR1@120"], "'B:' would signal only the batch shell"),
    (["launch.signal=TERM@60"], "the trainer checkpoints and exits on SIGUSR1 only"),
    (["launch.serve_tp=3"], "launch.serve_tp=3 does not divide the 8 GPU(s)"),
    (["launch.nccl_ibb=false"], "did you mean 'launch.nccl_ib'"),
])
def test_bad_inputs_get_clear_errors(tmp_path, capsys, argv, message):
    rc, _, err = _launch(capsys, "--recipe", RECIPE_30B, "--dry-run", "--out", str(tmp_path / "o"), *argv)
    assert rc == 2 and message in err, err
    assert not (tmp_path / "o").exists()  # nothing half-written


@pytest.mark.parametrize("nproc", ["64", "16"])
def test_nproc_override_that_is_not_the_node_world_is_refused(tmp_path, capsys, nproc):
    """On GPU nodes the launch runs trainer nodes x GPUs per node ranks: a different parallel.nproc
    would be replaced (64) or judged on a rank count the job never has (16)."""
    rc, _, err = _launch(capsys, "--recipe", RECIPE_30B, "--dry-run", "--out", str(tmp_path / "o"),
                         f"parallel.nproc={nproc}")
    assert rc == 2
    assert err.strip() == (f"mgrpo launch slurm: error: parallel.nproc={nproc}: under mgrpo launch slurm the rank "
                           "count is trainer nodes x GPUs per node = 4 x 8 = 32; drop the override (or change "
                           "--trainer-nodes / --gpus-per-node)")
    assert not (tmp_path / "o").exists()


def test_layout_is_checked_on_the_node_world(tmp_path, capsys):
    """8 nodes x 8 GPUs = 64 ranks fit PP4 x EP8 x ETP2 (64/4 = 16); the recipe's own nproc (32) would not."""
    files = _render_30b(capsys, tmp_path / "slurm", "--trainer-nodes", "8", "parallel.pp=4")
    assert "nproc: 64" in files["config.yaml"] and "parallel.nproc=64 " in files["train.sbatch"]
    _render_30b(capsys, tmp_path / "slurm2", "--trainer-nodes", "2", "parallel.nproc=16", "parallel.ep=4")


def test_config_and_recipe_exactly_one(tmp_path, capsys):
    rc, _, err = _launch(capsys, "--dry-run", "--out", str(tmp_path))
    assert rc == 2 and "give exactly one of --config FILE and --recipe NAME" in err
    with pytest.raises(SystemExit):
        main(["launch", "slurm", "--recipe", "tiny_cpu", "--config", "x.yaml", "--dry-run"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_unknown_recipe_lists_the_names(tmp_path, capsys):
    rc, _, err = _launch(capsys, "--recipe", "tiny_cpuu", "--dry-run", "--out", str(tmp_path))
    assert rc == 2 and "did you mean 'tiny_cpu'?" in err and RECIPE_30B in err


def test_missing_node_counts_are_named(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {steps: 2}\n")
    rc, _, err = _launch(capsys, "--config", str(cfg), "--dry-run", "--out", str(tmp_path / "o"))
    assert rc == 2 and "give --trainer-nodes (or launch.trainer_nodes" in err


def test_sbatch_missing_names_the_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    rc, _, err = _launch(capsys, "--recipe", RECIPE_30B, "--out", str(tmp_path / "o"))
    assert rc == 2 and "sbatch is not on PATH" in err and "--dry-run" in err


def _fake_sbatch(tmp_path, monkeypatch, fail_second: bool = False) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "sbatch").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        echo "sbatch $*" >> {calls}
        n=$(grep -c ^sbatch {calls})
        if [ "{int(fail_second)}" = 1 ] && [ "$n" = 2 ]; then echo "sbatch: error: Invalid account" >&2; exit 1; fi
        echo "$((4100 + n));clusterA"
        """))
    (bin_dir / "scancel").write_text(f'#!/bin/bash\necho "scancel $*" >> {calls}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_missing_model_dir_refused_before_submitting(tmp_path, capsys, monkeypatch):
    calls = _fake_sbatch(tmp_path, monkeypatch)
    rc, _, err = _launch(capsys, "--recipe", RECIPE_30B, "--out", str(tmp_path / "o"),
                         f"model.hf_dir={tmp_path / 'nope'}")
    assert rc == 2 and "is not an HF checkpoint directory" in err and "nope" in err
    assert not calls.exists()


def test_missing_data_file_refused_before_submitting(tmp_path, capsys, monkeypatch, tiny_ckpt):
    calls = _fake_sbatch(tmp_path, monkeypatch)
    missing = tmp_path / "no" / "train.jsonl"
    rc, _, err = _launch(capsys, "--recipe", "tiny_cpu", "--out", str(tmp_path / "o"), f"model.hf_dir={tiny_ckpt}",
                         f"data.train_jsonl={missing}", f"trainer.run_dir={tmp_path / 'run'}")
    assert rc == 2 and f"data.train_jsonl '{missing}' does not exist on this machine" in err
    assert not calls.exists()


def test_submission_rollout_first_trainer_after_it(tmp_path, capsys, monkeypatch, tiny_ckpt):
    calls = _fake_sbatch(tmp_path, monkeypatch)
    out = tmp_path / "o"
    data = tmp_path / "train.jsonl"
    data.write_text("")
    rc, stdout, err = _launch(capsys, "--recipe", "tiny_cpu", "--out", str(out), f"model.hf_dir={tiny_ckpt}",
                              f"data.train_jsonl={data}", f"trainer.run_dir={tmp_path / 'run'}")
    assert rc == 0, err
    lines = calls.read_text().splitlines()
    assert lines == [f"sbatch --parsable {out}/rollout.sbatch",
                     f"sbatch --parsable --dependency=after:4101 --export=ALL,MGRPO_ROLLOUT_JOB_ID=4101 "
                     f"{out}/train.sbatch"]
    jobs = json.loads((out / "jobs.json").read_text())
    assert (jobs["rollout"], jobs["train"]) == ("4101", "4102")
    assert "squeue -j 4101,4102" in stdout and f"{out}/logs/train-4102.out" in stdout
    assert (out / "api_key").read_text().strip() not in stdout + err


def test_refused_trainer_job_cancels_the_rollout_job(tmp_path, capsys, monkeypatch, tiny_ckpt):
    calls = _fake_sbatch(tmp_path, monkeypatch, fail_second=True)
    data = tmp_path / "train.jsonl"
    data.write_text("")
    rc, _, err = _launch(capsys, "--recipe", "tiny_cpu", "--out", str(tmp_path / "o"), f"model.hf_dir={tiny_ckpt}",
                         f"data.train_jsonl={data}", f"trainer.run_dir={tmp_path / 'run'}")
    assert rc == 1 and "Invalid account" in err
    assert calls.read_text().splitlines()[-1] == "scancel 4101"
    assert not (tmp_path / "o" / "jobs.json").exists()


# --------------------------------------------------------------------- what runs on the nodes


def test_rendered_health_wait_fails_naming_server_and_log(rendered, tmp_path):
    out, files = rendered
    t = files["train.sbatch"]
    block = t[t.index("if ! URLS=$(python -m launch.slurm.node wait-servers"):t.index("# ---- 5.")]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    (out / "servers" / "rollout-node-7.url").write_text(dead + "\n")
    script = (f'OUT={out}; ROLLOUT_SERVERS=2; HEALTH_TIMEOUT=2; ROLLOUT_LOG="$OUT/logs/rollout-991.out"\n'
              'cancel_rollout() { echo "CANCEL: $1"; }\n' + block)
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO, env=_env(), timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert time.monotonic() - t0 < 20
    assert "0 of 2 rollout servers ready after 2 s" in r.stderr
    assert f"rollout-node-7: {dead} NOT answering /health" in r.stderr
    assert "1 server(s) never wrote a URL file" in r.stderr
    assert f"{out}/logs/rollout-991.out" in r.stderr
    assert "CANCEL: the rollout servers did not come up" in r.stdout


def test_wait_servers_returns_the_healthy_urls(tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from launch.slurm.node import wait_servers

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        (tmp_path / "n1.url").write_text(url + "\n")
        (tmp_path / ".n2.url.tmp").write_text("http://half-written\n")  # ignored
        assert wait_servers(tmp_path, 1, timeout=10, poll_s=0.2) == [url]
    finally:
        srv.shutdown()


def test_node_serve_execs_mgrpo_serve_on_the_interface_address(tmp_path, monkeypatch):
    from launch.slurm import node

    seen = {}
    monkeypatch.setattr(node.os, "execv", lambda exe, argv: seen.update(argv=argv))
    monkeypatch.setattr(node.socket, "gethostname", lambda: "rollout-3.cluster")
    node.main(["serve", "--servers-dir", str(tmp_path / "s"), "--log-dir", str(tmp_path / "l"), "--ifname", "lo",
               "--", "--model", "/m", "--port", "8123"])
    argv = seen["argv"]
    assert argv[1:4] == ["-m", "launch.cli", "serve"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--allow-remote" in argv
    assert argv[argv.index("--url-file") + 1] == str(tmp_path / "s" / "rollout-3.url")
    assert argv[argv.index("--log") + 1] == str(tmp_path / "l" / "vllm-rollout-3.log")
    assert argv[-4:] == ["--model", "/m", "--port", "8123"]


def test_node_address_errors_name_the_interfaces(capsys):
    from launch.slurm import node

    assert node.node_address("lo") == "127.0.0.1"
    assert node.main(["address", "--ifname", "nosuch0"]) == 1
    err = capsys.readouterr().err
    assert "network interface 'nosuch0' (launch.socket_ifname)" in err and "lo" in err


def test_has_checkpoint(tmp_path):
    from launch.slurm import node

    assert node.main(["has-checkpoint", str(tmp_path)]) == 1
    ck = tmp_path / "checkpoints" / "step_00000002"
    ck.mkdir(parents=True)
    assert node.main(["has-checkpoint", str(tmp_path)]) == 1  # incomplete: no metadata
    from megatron_grpo.engine import checkpoint

    (ck / checkpoint.META_FILE).write_text(json.dumps({"format": checkpoint.CHECKPOINT_FORMAT, "step": 2}))
    assert node.main(["has-checkpoint", str(tmp_path)]) == 0


_WORKER = """\
import launch.slurm.worker  # noqa: F401  -- as under train.sbatch: SIGUSR1 ignored from the first line
import os, sys, time
import torch.distributed as dist
from megatron_grpo.engine.signals import PreemptionHandler

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
stop = PreemptionHandler().install()
open(f"{out}/ready{rank}", "w").write(str(os.getpid()))
for _ in range(600):  # "training steps"
    time.sleep(0.1)
    if stop.agreed():
        open(f"{out}/got{rank}", "w").write(stop.signal_name)
        break
dist.destroy_process_group()
"""


@pytest.mark.parametrize("delivery", ["agent_group", "every_process"])
def test_sigusr1_reaches_both_ranks_through_torchrun(tmp_path, delivery):
    """slurm's step signal hits the torchrun agent's process group (proctrack/pgid; torchrun's
    workers live in sessions of their own) or every process of the step (proctrack/cgroup): either
    way both ranks see SIGUSR1, stop after their step, and torchrun exits 0."""
    import psutil

    (tmp_path / "w.py").write_text(_WORKER)
    agent = subprocess.Popen(
        [sys.executable, "-m", "launch.slurm.torchrun", "--nnodes=1", "--nproc-per-node=2",
         f"--master-port={free_port()}", str(tmp_path / "w.py"), str(tmp_path)],
        cwd=REPO, env=_env(OMP_NUM_THREADS="1"), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0]
            time.sleep(0.1)
        if delivery == "agent_group":
            os.killpg(agent.pid, signal.SIGUSR1)
        else:
            for p in [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]:
                os.kill(p.pid, signal.SIGUSR1)
        log, _ = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode == 0, log
    assert [(tmp_path / f"got{r}").read_text() for r in (0, 1)] == ["SIGUSR1", "SIGUSR1"], log


# --------------------------------------------------------------------------- recipes and CLI


def test_30b_recipe_matches_the_example_yaml():
    from launch.recipes import get_recipe
    from megatron_grpo.config import load_train_config
    from megatron_grpo.configtree import to_dict

    rec = to_dict(get_recipe(RECIPE_30B))
    ex = to_dict(load_train_config(REPO / "examples" / "qwen3_omni_30b_a3b_audio_agent.yaml"))
    for d in (rec, ex):  # what the recipe adds on purpose: the servers and the nodes
        d.pop("launch"), d.pop("serve"), d["rollout"].pop("server_urls")
    assert rec == ex


def test_launch_is_listed_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "launch" in capsys.readouterr().out


def test_rollout_tp_that_does_not_fit_the_heads_refused_before_submitting(tmp_path, capsys, monkeypatch, tiny_ckpt):
    """3 GPUs per rollout node serve with TP3 by default; the tiny model's 4 query / 2 key-value
    heads cannot be split 3 ways: refused (a dry run warns and still writes the files)."""
    calls = _fake_sbatch(tmp_path, monkeypatch)
    data = tmp_path / "train.jsonl"
    data.write_text("")
    args = ["--recipe", "tiny_cpu", "--gpus-per-node", "3", "parallel.tp=1", f"model.hf_dir={tiny_ckpt}",
            f"data.train_jsonl={data}", f"trainer.run_dir={tmp_path / 'run'}"]
    msg = ("launch.serve_tp=3 does not fit the checkpoint's text model (4 attention heads, 2 key/value heads): "
           "vLLM splits the heads over the TP ranks; use one of launch.serve_tp=1, 2, 4")
    rc, _, err = _launch(capsys, *args, "--out", str(tmp_path / "o"))
    assert rc == 2 and err.strip() == f"mgrpo launch slurm: error: {msg}"
    assert not calls.exists()
    rc, _, err = _launch(capsys, *args, "--out", str(tmp_path / "dry"), "--dry-run")
    assert rc == 0 and f"[launch] warning: {msg} (without --dry-run the launch would stop here" in err
    assert (tmp_path / "dry" / "train.sbatch").exists()
