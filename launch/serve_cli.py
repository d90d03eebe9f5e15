"""`mgrpo serve`: run a vLLM server that training can push weights into, in the foreground.

    mgrpo serve --model DIR [--host 127.0.0.1] [--port 8000] [--tp N] [--dp N]
                [--api-key K | env VLLM_API_KEY] [--allow-remote] [--url-file PATH] [vLLM args ...]

Starts `python -m vllm.entrypoints.openai.api_server` with our worker extension and the weight
transfer backend (gloo on CPU, nccl on GPU), waits for /health, prints the URL (and, with
--url-file, writes it there atomically -- how `mgrpo launch slurm` collects its servers -- and
removes the file again when it stops), and stays until
Ctrl-C / SIGTERM, then stops the server's whole process group. Arguments it does not know go to
vLLM unchanged (put them after `--` to be explicit).

Security: the server runs in vLLM's dev mode, whose endpoints load weights and run worker methods
(/update_weights, /collective_rpc, ...). It binds loopback by default; another address needs
--allow-remote AND an API key, which is then required on every route but /health.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from launch.cli_help import doc_description
from megatron_grpo.rollout.server import LOOPBACK_HOSTS

__all__ = ["add_serve_parser", "check_bind", "check_port", "run_serve", "RemoteBindRefused"]

# vLLM options that would override our own if passed through (-> our option that sets them): the
# security-relevant ones, and vLLM's spellings of --tp/--dp, which would skip check_serving_layout
_RESERVED_VLLM_OPTIONS = {"--host": "--host", "--port": "--port", "--api-key": "--api-key", "--model": "--model",
                          "--middleware": "--middleware", "--tensor-parallel-size": "--tp", "-tp": "--tp",
                          "--data-parallel-size": "--dp", "-dp": "--dp"}


class RemoteBindRefused(ValueError):
    """A non-loopback bind without --allow-remote and an API key."""


def check_bind(host: str, allow_remote: bool, api_key: str | None) -> None:
    """Refuse to expose the dev-mode endpoints beyond this machine unless asked twice."""
    if host in LOOPBACK_HOSTS:
        return
    why = (f"--host {host} would expose the server beyond this machine, and it runs in vLLM's dev "
           "mode: its /update_weights, /init_weight_transfer_engine and /collective_rpc endpoints "
           "let anyone who reaches the port replace the model's weights or run worker methods.")
    missing = []
    if not allow_remote:
        missing.append("--allow-remote")
    if not api_key:
        missing.append("an API key (--api-key K, or VLLM_API_KEY in the environment, which keeps it "
                       "out of `ps`), then required on every route but /health")
    if missing:
        raise RemoteBindRefused(f"{why} To do it anyway, give {' and '.join(missing)}. "
                                "Without them, keep the default --host 127.0.0.1.")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "serve", allow_abbrev=False,
        help="run a vLLM server (with our weight-sync extension) in the foreground",
        description=doc_description(__doc__) + " Unknown arguments are passed to vLLM.")
    s.add_argument("--model", required=True, help="HF checkpoint directory to serve")
    s.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback; others need --allow-remote and an API key)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    s.add_argument("--dp", type=int, default=1, help="data-parallel size")
    s.add_argument("--api-key", default=None,
                   help="bearer token for every route but /health (default: $VLLM_API_KEY)")
    s.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (needs an API key too)")
    s.add_argument("--served-model-name", default=None, help="model name in requests (default: dir name)")
    s.add_argument("--dtype", default="auto",
                   help="weights/activations dtype (vLLM's --dtype; default auto): the trainer's default, "
                        "bfloat16 with CUDA, float32 without (vLLM's own auto would serve a float32 "
                        "checkpoint in bfloat16 on CPU too)")
    s.add_argument("--max-model-len", type=int, default=4096, help="longest prompt+completion, tokens")
    s.add_argument("--max-num-seqs", type=int, default=32,
                   help="concurrent sequences (as `mgrpo train`'s serve.max_num_seqs)")
    s.add_argument("--max-audio-per-prompt", type=int, default=4, help="audio clips per request")
    s.add_argument("--max-audio-seconds", type=float, default=600.0,
                   help="longest clip the server accepts and decodes, seconds (vLLM's clip-size and decode "
                        "limits follow it): at least the data's longest recording (`mgrpo launch slurm` passes "
                        "data.max_audio_seconds)")
    s.add_argument("--weight-transfer", choices=["auto", "gloo", "nccl", "nccl_m2n", "none"], default="auto",
                   help="weight-sync backend (auto: gloo without CUDA, nccl with it; nccl_m2n: vLLM's "
                        "many-to-many engine for the multi-source push, needs nccl-extensions)")
    s.add_argument("--return-routed-experts", action="store_true",
                   help="return the experts every token was routed to (R3, for rollout.routing_replay=r3): "
                        "vLLM's --enable-return-routed-experts, captured by our worker extension on CPU")
    s.add_argument("--log", default=None, help="server log file (default: a new file in the temp dir)")
    s.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds to wait for /health (default: the config's serve.startup_timeout_s)")
    s.add_argument("--url-file", default=None,
                   help="once healthy, write the server's URL into this file (atomically: tmp + rename); "
                        "removed again on exit")
    s.set_defaults(func=run_serve, accepts_extra_args=True)
    return s


def _reserved_in(extra: list[str]) -> list[tuple[str, str, str]]:
    """(the argument as given, with its value; our option; its value, or N) for each pass-through
    argument vLLM would read as one of _RESERVED_VLLM_OPTIONS. vLLM's parser takes underscores for
    dashes and unambiguous prefixes (argparse abbreviations), so those count too."""
    found = []
    for i, arg in enumerate(extra):
        name, eq, value = arg.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if len(name) < 2 or name == "--":
            continue
        given = arg
        if not eq:
            value = extra[i + 1] if i + 1 < len(extra) else "N"
            given = f"{arg} {value}" if i + 1 < len(extra) else arg
        found += [(given, ours, value) for opt, ours in _RESERVED_VLLM_OPTIONS.items() if opt.startswith(name)]
    return found


def check_port(host: str, port: int) -> None:
    """Raise ValueError for a --port vLLM could not bind on ``host`` -- out of range, or in use --
    before vLLM starts (it would fail ~10 s in, deep in its log). The test bind sets SO_REUSEADDR as
    vLLM's own does, so a port whose old connections linger in TIME_WAIT still counts as free."""
    if port == 0:
        return  # ServerSpec picks a free one
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port}: must be 1-65535 (or 0 for a free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port}: address already in use on {host}; pick a free port "
                                 "or stop what is listening there") from None
            # anything else (an address not on this machine, a privileged port): vLLM's error says it


def resolve_dtype(dtype: str) -> str:
    """``auto`` -> what ``mgrpo train`` trains in by default (bfloat16 with CUDA, float32 without),
    so the rollout logprobs come from the trainer's numerics; vLLM's own ``auto`` downcasts a
    float32 checkpoint (the embedded tiny one) to bfloat16 on CPU. Anything else goes to vLLM."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def check_serving_layout(model_dir: str, tp: int, dp: int, tp_option: str = "--tp ") -> None:
    """Raise ValueError when vLLM cannot shard the checkpoint's text model over ``tp`` ranks (it
    splits the query heads, and splits the key/value heads or replicates them when ``tp`` is a
    multiple of their number), naming the sizes that would work, before vLLM starts.
    ``tp_option``: how the message spells the setting (``"--tp "``, ``"launch.serve_tp="``)."""
    if tp < 1 or dp < 1:
        raise ValueError(f"--tp and --dp must be >= 1, got --tp {tp} --dp {dp}")
    from model_bridge.config import ConfigError, read_omni_config

    try:
        t = read_omni_config(model_dir).text
    except ConfigError:
        return  # not a Qwen3-Omni config this checker reads: vLLM checks it

    def fits(n: int) -> bool:
        kv_ok = t.num_kv_heads % n == 0 if t.num_kv_heads >= n else n % t.num_kv_heads == 0
        return t.num_heads % n == 0 and kv_ok

    if not fits(tp):
        ok = [n for n in range(1, t.num_heads + 1) if fits(n)]
        raise ValueError(f"{tp_option}{tp} does not fit the checkpoint's text model ({t.num_heads} attention heads, "
                         f"{t.num_kv_heads} key/value heads): vLLM splits the heads over the TP ranks; use one "
                         f"of {tp_option}{', '.join(map(str, ok))}")


def _startup_timeout(seconds: float | None) -> float:
    """--startup-timeout, or the config's serve.startup_timeout_s (read here: the config loads torch,
    which `mgrpo --help` should not)."""
    if seconds is not None:
        return seconds
    from megatron_grpo.config import ServeConfig

    return ServeConfig.startup_timeout_s


def run_serve(args: argparse.Namespace) -> int:
    extra = [a for a in (getattr(args, "extra_args", None) or []) if a != "--"]
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    try:
        check_bind(args.host, args.allow_remote, api_key)
        if bad := _reserved_in(extra):
            same = sorted({ours for _, ours, _ in bad if ours in _RESERVED_VLLM_OPTIONS})
            parts = [f"pass {ours} {value} instead of {given} (mgrpo serve's own option, checked before "
                     "vLLM starts)" for given, ours, value in bad if ours not in _RESERVED_VLLM_OPTIONS]
            if same:
                parts.append(f"pass {', '.join(same)} as mgrpo serve's own option, not as a vLLM "
                             "pass-through argument")
            raise ValueError("; ".join(parts))
        if not Path(args.model, "config.json").exists():
            raise ValueError(f"--model {args.model!r} is not an HF checkpoint directory (no config.json)")
        check_serving_layout(args.model, args.tp, args.dp)
        check_port(args.host, args.port)
    except ValueError as e:
        print(f"mgrpo serve: error: {e}", file=sys.stderr)
        return 2

    from megatron_grpo.rollout.server import ServerError, ServerSpec, VLLMServer

    spec = ServerSpec(model=args.model, host=args.host, port=args.port,
                      served_model_name=args.served_model_name, dtype=resolve_dtype(args.dtype),
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_audio_per_prompt=args.max_audio_per_prompt, max_audio_seconds=args.max_audio_seconds,
                      tensor_parallel_size=args.tp, data_parallel_size=args.dp, api_key=api_key,
                      weight_transfer_backend=(None if args.weight_transfer == "none"
                                               else args.weight_transfer),
                      return_routed_experts=args.return_routed_experts, extra_args=extra)
    log = Path(args.log) if args.log else Path(tempfile.gettempdir()) / f"mgrpo-serve-{spec.port}.log"
    server = VLLMServer(spec, log)
    url_file = Path(args.url_file) if args.url_file else None

    def _on_sigterm(signum, frame):
        raise KeyboardInterrupt

    prev = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        print(f"[serve] starting vLLM for {args.model} on {server.url} (log {log})", flush=True)
        server.start(timeout=_startup_timeout(args.startup_timeout))
        print(f"[serve] {server.url}  model={spec.served_model_name}  "
              f"weight_transfer={spec.weight_transfer_backend or 'off'}  "
              f"auth={'api key' if api_key else 'none (loopback only)'}", flush=True)
        if url_file:
            _write_atomic(url_file, server.url + "\n")
        print("[serve] serving until Ctrl-C / SIGTERM", flush=True)
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(1.0)
        code = server.proc.returncode if server.proc is not None else 1
        print(f"mgrpo serve: error: vLLM exited with code {code}; log {log}:\n{server.log_tail()}",
              file=sys.stderr)
        return 1
    except ServerError as e:
        print(f"mgrpo serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("[serve] stopping vLLM", flush=True)
        return 0
    finally:
        if url_file:
            url_file.unlink(missing_ok=True)
        server.stop()
        signal.signal(signal.SIGTERM, prev)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
