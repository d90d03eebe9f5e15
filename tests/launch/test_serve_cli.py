"""`mgrpo serve` refuses unsafe binds before starting anything; the command line it would run; the
API-key middleware guards the dev-mode routes. No vLLM is started here."""
import asyncio
import json

import pytest
import torch

from launch.cli import build_parser, main
from launch.serve_cli import RemoteBindRefused, check_bind, check_port
from megatron_grpo.rollout.server import (
    AUTH_MIDDLEWARE,
    DEFAULT_WORKER_EXTENSION,
    RequireApiKey,
    ServerError,
    ServerSpec,
    build_command,
)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


def _serve(capsys, *argv):
    rc = main(["serve", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("extra, missing", [
    ([], ["--allow-remote", "API key"]),
    (["--allow-remote"], ["API key"]),
    (["--api-key", "k"], ["--allow-remote"]),
])
def test_remote_bind_refused_without_allow_remote_and_key(capsys, model_dir, extra, missing):
    rc, err = _serve(capsys, "--model", str(model_dir), "--host", "0.0.0.0", *extra)
    assert rc == 2
    assert "dev mode" in err and "/update_weights" in err  # says why
    for m in missing:
        assert m in err
    if "--allow-remote" not in missing:
        assert "give --allow-remote" not in err


def test_check_bind():
    for host in ("127.0.0.1", "localhost", "::1"):
        check_bind(host, allow_remote=False, api_key=None)
    check_bind("0.0.0.0", allow_remote=True, api_key="secret")
    with pytest.raises(RemoteBindRefused):
        check_bind("10.1.2.3", allow_remote=True, api_key="")


def test_key_from_environment_counts(capsys, model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    check_bind("0.0.0.0", allow_remote=True, api_key="from-env")
    rc, err = _serve(capsys, "--model", str(model_dir), "--host", "0.0.0.0")  # no --allow-remote
    assert rc == 2 and "--allow-remote" in err and "API key" not in err.split("give")[1]


def test_security_options_cannot_be_smuggled_to_vllm(capsys, model_dir):
    rc, err = _serve(capsys, "--model", str(model_dir), "--", "--host", "0.0.0.0")
    assert rc == 2 and "--host" in err
    rc, err = _serve(capsys, "--model", str(model_dir), "--", "--middleware", "evil.Mw")
    assert rc == 2 and "--middleware" in err


@pytest.mark.parametrize("argv, message", [
    (["--tensor-parallel-size", "2"], "pass --tp 2 instead of --tensor-parallel-size 2"),
    (["--", "--tensor_parallel_size=2"], "pass --tp 2 instead of --tensor_parallel_size=2"),
    (["--", "-tp", "2"], "pass --tp 2 instead of -tp 2"),
    (["--", "--data-parallel-size=4"], "pass --dp 4 instead of --data-parallel-size=4"),
    (["--", "-dp", "4"], "pass --dp 4 instead of -dp 4"),
    (["--", "--data-par", "4"], "pass --dp 4 instead of --data-par 4"),  # vLLM takes abbreviations
])
def test_vllm_spellings_of_tp_and_dp_are_refused(capsys, model_dir, argv, message):
    """vLLM's own --tensor-parallel-size / --data-parallel-size would override --tp / --dp after
    serve checked those against the checkpoint."""
    rc, err = _serve(capsys, "--model", str(model_dir), *argv)
    assert rc == 2
    assert err.strip() == f"mgrpo serve: error: {message} (mgrpo serve's own option, checked before vLLM starts)"


def test_abbreviated_security_option_is_refused(capsys, model_dir):
    rc, err = _serve(capsys, "--model", str(model_dir), "--", "--hos", "0.0.0.0")
    assert rc == 2
    assert err.strip() == ("mgrpo serve: error: pass --host as mgrpo serve's own option, "
                           "not as a vLLM pass-through argument")


def test_port_out_of_range_or_in_use_is_refused_before_vllm(capsys, model_dir):
    import socket

    for port in (99999, -1):
        with pytest.raises(ValueError) as e:
            check_port("127.0.0.1", port)
        assert str(e.value) == f"--port {port}: must be 1-65535 (or 0 for a free one)"
    check_port("127.0.0.1", 0)  # picked later
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError) as e:
            check_port("127.0.0.1", port)
        assert str(e.value) == (f"--port {port}: address already in use on 127.0.0.1; pick a free port "
                                "or stop what is listening there")
        rc, err = _serve(capsys, "--model", str(model_dir), "--port", str(port))
        assert rc == 2 and err.strip() == f"mgrpo serve: error: {e.value}"
    check_port("127.0.0.1", port)  # free again


def test_missing_checkpoint_is_an_error(capsys, tmp_path):
    rc, err = _serve(capsys, "--model", str(tmp_path / "nope"))
    assert rc == 2 and "config.json" in err


def test_auto_dtype_is_the_trainers(monkeypatch):
    """`--dtype auto` serves in the trainer's default dtype, not vLLM's auto (bf16 for a float32
    checkpoint on CPU); an explicit dtype passes through."""
    import torch

    from launch.serve_cli import resolve_dtype

    assert resolve_dtype("float16") == "float16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto") == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_dtype("auto") == "bfloat16"


def test_max_audio_seconds_option():
    parser = build_parser()
    assert parser.parse_known_args(["serve", "--model", "m"])[0].max_audio_seconds == 600.0  # vLLM's own limit
    assert parser.parse_known_args(["serve", "--model", "m", "--max-audio-seconds", "1200"])[0].max_audio_seconds == 1200.0


def test_unknown_arguments_go_to_vllm():
    parser = build_parser()
    args, extra = parser.parse_known_args(["serve", "--model", "m", "--tp", "2", "--enable-prefix-caching",
                                           "--gpu-memory-utilization", "0.8"])
    assert args.tp == 2 and args.accepts_extra_args
    assert extra == ["--enable-prefix-caching", "--gpu-memory-utilization", "0.8"]
    with pytest.raises(SystemExit):  # other subcommands still reject unknown arguments
        main(["make-tiny", "--out", "x", "--bogus"])


def test_command_line_loads_extension_backend_and_guard(model_dir):
    spec = ServerSpec(model=str(model_dir), port=12345, api_key="s3cret", extra_args=["--foo", "1"])
    cmd = build_command(spec)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == DEFAULT_WORKER_EXTENSION
    assert json.loads(cmd[cmd.index("--weight-transfer-config") + 1]) == {"backend": "gloo"}
    assert cmd[cmd.index("--middleware") + 1] == AUTH_MIDDLEWARE
    assert json.loads(cmd[cmd.index("--media-io-kwargs") + 1]) == {"audio": {"audio_backend": "soundfile"}}
    assert "s3cret" not in " ".join(cmd) and "--api-key" not in cmd  # the key goes by environment
    assert cmd[-2:] == ["--foo", "1"] and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "s3cret" not in repr(spec)
    plain = build_command(ServerSpec(model=str(model_dir), port=12345, weight_transfer_backend=None,
                                     worker_extension=None))
    assert "--weight-transfer-config" not in plain and "--worker-extension-cls" not in plain
    assert "--middleware" not in plain


def test_routed_experts_flag_and_cpu_entry(model_dir):
    """R3: vLLM's flag; a CPU server starts through our entry (its config check is relaxed there);
    `mgrpo serve --return-routed-experts` sets it; no worker extension on CPU is refused."""
    cmd = build_command(ServerSpec(model=str(model_dir), port=12345, return_routed_experts=True))
    assert "--enable-return-routed-experts" in cmd
    assert cmd[2] == ("megatron_grpo.rollout.vllm_serve" if not torch.cuda.is_available()
                      else "vllm.entrypoints.openai.api_server")
    assert "--enable-return-routed-experts" not in build_command(ServerSpec(model=str(model_dir), port=12345))
    args = build_parser().parse_args(["serve", "--model", str(model_dir), "--return-routed-experts"])
    assert args.return_routed_experts
    if not torch.cuda.is_available():
        with pytest.raises(ServerError, match="needs our worker extension"):
            build_command(ServerSpec(model=str(model_dir), port=12345, return_routed_experts=True,
                                     worker_extension=None, weight_transfer_backend=None))


def _call(mw, path, headers=()):
    sent = []

    async def app(scope, receive, send):
        sent.append(("app", scope["path"]))

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request"}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "headers": [(k.encode(), v.encode()) for k, v in headers]}
    asyncio.run(RequireApiKey(app)(scope, receive, send) if mw is None else mw(scope, receive, send))
    return sent


def test_api_key_guards_dev_routes(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    for path in ("/update_weights", "/collective_rpc", "/pause", "/v1/chat/completions"):
        out = _call(None, path)
        assert out[0]["type"] == "http.response.start" and out[0]["status"] == 401, path
        assert _call(None, path, [("authorization", "Bearer wrong")])[0]["status"] == 401
        assert _call(None, path, [("authorization", "Bearer s3cret")]) == [("app", path)]
    assert _call(None, "/health") == [("app", "/health")]
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        RequireApiKey(lambda *a: None)


def test_tensor_parallel_size_that_does_not_fit_the_heads_fails_before_vllm(capsys, tiny_ckpt):
    """The tiny checkpoint has 4 query and 2 key/value heads: --tp 3 (and 8, more ranks than
    query heads) cannot shard it; the message names the sizes that can."""
    from launch.serve_cli import check_serving_layout

    for tp in (1, 2, 4):
        check_serving_layout(str(tiny_ckpt), tp, 1)
    rc, err = _serve(capsys, "--model", str(tiny_ckpt), "--tp", "3")
    assert rc == 2
    assert err.strip() == ("mgrpo serve: error: --tp 3 does not fit the checkpoint's text model (4 attention heads, "
                           "2 key/value heads): vLLM splits the heads over the TP ranks; use one of --tp 1, 2, 4")
    rc, err = _serve(capsys, "--model", str(tiny_ckpt), "--tp", "8")
    assert rc == 2 and "use one of --tp 1, 2, 4" in err
    rc, err = _serve(capsys, "--model", str(tiny_ckpt), "--dp", "0")
    assert rc == 2 and "--tp and --dp must be >= 1" in err


def test_each_server_start_is_marked_in_its_log():
    """A resumed run appends to the same vllm-server.log: every start writes one marked line with
    the time and the exact (shell-quoted) command first."""
    import re

    from megatron_grpo.rollout.server import start_banner

    line = start_banner(["python", "-m", "vllm", "--model", "/a dir/m"])
    assert re.fullmatch(r"\n===== mgrpo: starting the vLLM server at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d: "
                        r"python -m vllm --model '/a dir/m'\n", line), line
