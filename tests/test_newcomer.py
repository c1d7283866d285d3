"""What a new user meets first: `modalmesh` help, errors at start-up, the default targets, the README.

Each test here holds one finding of trying the README as a newcomer: a one-line error (naming
the port or variable and the flag to change) where there was a traceback, fast help with the
defaults shown, the same default service in both layouts, the extras shown in the README.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _cli(*args: str, prelude: str = "", **kw) -> subprocess.CompletedProcess:
    """`modalmesh ARGS` in a fresh interpreter; `prelude` runs first (e.g. to hide a module)."""
    code = f"import sys\n{prelude}\nfrom modalmesh.ops.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120,
                          cwd=REPO, **kw)


@pytest.fixture
def busy_port():
    """A port held by a listening socket, as a running `make run` holds its ports."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


# ---- help ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [[], ["up"], ["demo"], ["health"], ["info"], ["generate"], ["decode"]])
def test_help_imports_no_torch_and_shows_defaults(command):
    code = ("import sys\nfrom modalmesh.ops.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)" % [*command, "--help"])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.stderr.strip().endswith("NO-TORCH"), result.stderr
    if command in (["up"], ["info"]):
        assert re.search(r"\(default:\s+(127\.0\.0\.1:50051|50051)\)", result.stdout), result.stdout


def test_service_help_shows_defaults():
    from modalmesh.service import build_parser

    text = " ".join(build_parser("vae", "").format_help().split())  # help wraps lines
    assert "(default: 50051)" in text and "(default: 9400)" in text and "(default: auto)" in text


# ---- one default service in both layouts ------------------------------------------------------
def test_client_defaults_reach_the_same_service_under_up_and_under_compose():
    import yaml  # noqa: F401 - pyyaml ships with the test environment (kubernetes-validate)

    from modalmesh.ops import cli, stack

    parser = cli.build_parser()
    defaults = {name: parser.parse_args([name, *extra]).target for name, extra in
                (("health", []), ("info", []), ("generate", ["x"]), ("decode", ["z.npy"]))}
    up = parser.parse_args(["up"])
    local = {s: f"127.0.0.1:{up.base_port + stack.SERVICES.index(s)}" for s in stack.SERVICES}
    published = {}
    for name, service in yaml.safe_load((REPO / "docker-compose.publish.yml").read_text())["services"].items():
        for mapping in service.get("ports", []):
            host_port = re.search(r":-(\d+)\}", mapping).group(1)
            published[name] = f"127.0.0.1:{host_port}"
    for command in ("health", "info", "generate"):
        assert defaults[command] == local["llm"] == published["llm"], command
    assert defaults["decode"] == local["vae"] == published["vae"]


# ---- start-up errors: one line, the port and the flag ---------------------------------------------
@pytest.mark.parametrize("flag,what", [("--base-port", "gRPC of llm"), ("--metrics-base-port", "metrics of llm")])
def test_up_on_a_taken_port_says_which_port_and_flag(busy_port, flag, what):
    other = "--metrics-base-port" if flag == "--base-port" else "--base-port"
    result = _cli("up", flag, str(busy_port), other, "0", "--no-default-models", "--services", "llm")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"port {busy_port} ({what})" in lines[0] and flag in lines[0], lines[0]


@pytest.mark.parametrize("flag,what", [("--port", "gRPC"), ("--metrics-port", "metrics")])
def test_service_on_a_taken_port_says_which_port_and_flag(busy_port, flag, what):
    other = "--metrics-port" if flag == "--port" else "--port"
    result = subprocess.run([sys.executable, "-m", "services.vae", flag, str(busy_port), other, "0", "--device", "cpu"],
                            capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    env = "MODALMESH_PORT" if flag == "--port" else "MODALMESH_METRICS_PORT"
    assert last.startswith(f"error: cannot bind the {what} port 127.0.0.1:{busy_port}") and flag in last and env in last


def test_a_service_that_fails_start_up_is_one_line_from_the_stack(busy_port):
    """The stack's own check passes (ephemeral ports), the child then fails: its one error line, not its log."""
    from modalmesh.ops.launcher import ServiceProcess

    proc = ServiceProcess("vae", ["--port", str(busy_port), "--metrics-port", "0", "--device", "cpu"]).start()
    with pytest.raises(RuntimeError):
        proc.wait_listening(timeout=60)
    assert proc.error_line().startswith(f"error: cannot bind the gRPC port 127.0.0.1:{busy_port}")


def test_env_values_are_validated_like_flags(monkeypatch, capsys):
    from modalmesh.service import build_parser

    monkeypatch.setenv("MODALMESH_DEVICE", "tpu")
    with pytest.raises(SystemExit) as exit_:
        build_parser("vae", "").parse_args([])
    assert exit_.value.code == 2
    assert "MODALMESH_DEVICE='tpu' is not a valid value for --device (choose from auto, cpu, cuda)" in capsys.readouterr().err
    monkeypatch.setenv("MODALMESH_DEVICE", "cpu")
    assert build_parser("vae", "").parse_args([]).device == "cpu"
    monkeypatch.setenv("MODALMESH_DTYPE", "float64")
    with pytest.raises(SystemExit):
        build_parser("vae", "").parse_args([])
    assert "MODALMESH_DTYPE" in capsys.readouterr().err


# ---- Ctrl-C, broken pipes ----------------------------------------------------------------------
def test_ctrl_c_during_start_up_stops_what_started_and_exits_130(monkeypatch, capsys, tmp_path):
    from modalmesh.ops import cli, stack

    started = []

    class Interrupted:
        """A service that is still loading when Ctrl-C arrives."""

        def __init__(self, service, flags, echo=False, module=None):
            self.service, self.stopped, self.grpc_port = service, False, 1
            started.append(self)

        def start(self):
            return self

        def wait_listening(self, timeout):
            return 1, 2

        def wait_serving(self, timeout, host):
            raise KeyboardInterrupt

        def error_line(self):
            return None

        def send_sigterm(self):
            self.stopped = True

        def terminate(self, timeout):
            self.stopped = True
            return 0

    monkeypatch.setattr(stack, "ServiceProcess", Interrupted)
    monkeypatch.setattr(stack, "GatewayProcess", lambda flags, echo=False: Interrupted("gateway", flags))
    code = cli.main(["up", "--base-port", "0", "--metrics-base-port", "0", "--no-default-models",
                     "--models-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130 and err == "modalmesh: interrupted\n"
    assert len(started) == 6 and all(p.stopped for p in started)  # four services, audio_llm, gateway


def test_info_into_a_closed_pipe_is_silent():
    """`modalmesh info | head`: the reader is gone before the JSON is written."""
    from modalmesh.ops.launcher import ServiceProcess

    with ServiceProcess("vae", ["--port", "0", "--metrics-port", "-1", "--device", "cpu"]) as service:
        service.wait_serving(timeout=60)
        read, write = os.pipe()
        os.close(read)
        try:
            result = subprocess.run([sys.executable, "-m", "modalmesh.ops.cli", "info", "--kind", "vae", "--target",
                                     service.target], stdout=write, stderr=subprocess.PIPE, text=True, env=ENV,
                                    timeout=60, cwd=REPO)
        finally:
            os.close(write)
    assert result.stderr == "" and result.returncode == 141


# ---- the [demo] extra ----------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["up", "demo"])
def test_without_models_and_without_the_demo_extra_says_which_extra(command, tmp_path):
    result = _cli(command, "--base-port", "0", "--metrics-base-port", "0", "--models-dir", str(tmp_path),
                  prelude="sys.modules['diffusers'] = None  # as if not installed")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1
    assert "pip install 'modalmesh[demo]'" in result.stderr and "--vae-model DIR" in result.stderr
    assert not any(tmp_path.iterdir()), "nothing is made before the check"


def test_the_demo_extra_is_not_needed_once_the_checkpoint_exists(tmp_path):
    from modalmesh.ops import stack

    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / ".modalmesh-tiny").write_text("{}")
    assert stack.default_checkpoints(tmp_path, ["vae"]) == {"vae": tmp_path / "vae"}


# ---- the README --------------------------------------------------------------------------------
def test_readme_shows_how_to_install_each_extra_and_run_the_cli_from_the_venv():
    readme = (REPO / "README.md").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in extras:
        assert f"pip install 'modalmesh[{extra}]'" in readme or f"'.[{extra}]'" in readme, extra
    assert ".venv/bin/modalmesh" in readme and "source .venv/bin/activate" in readme
    assert "docker compose" in readme and "docker-compose" in readme
    assert "## Prerequisites" in readme


SERVICES = ["llm", "vision_encoder", "audio_encoder", "vae", "gateway"]


@pytest.mark.parametrize("service", SERVICES)
def test_service_help_imports_no_torch_and_lists_every_flag_the_service_parses(service):
    """`python -m services.<name> --help` prints its flags from the service's flags module, before the
    model stack is imported (it took 2.8 s, importing torch); the text is the full parser's."""
    code = ("import runpy, sys\nsys.argv = ['x', '--help']\ntry:\n    runpy.run_module(%r, run_name='__main__')\n"
            "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)" % f"services.{service}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.stderr.strip().endswith("NO-TORCH"), result.stderr
    if service == "gateway":
        from services.gateway.config import build_parser as full
    else:
        import importlib

        from modalmesh.service import build_parser

        cls = {"llm": "services.llm.server:LLMService", "vae": "services.vae.server:VAEDecoderService",
               "vision_encoder": "services.vision_encoder.server:VisionEncoderService",
               "audio_encoder": "services.audio_encoder.server:AudioEncoderService"}[service]
        module, name = cls.split(":")
        service_cls = getattr(importlib.import_module(module), name)

        def full():
            parser = build_parser(service_cls.name, service_cls.description, max_message_mb=service_cls.max_message_mb)
            service_cls.add_arguments(parser)
            return parser
    assert result.stdout == full().format_help()
    assert "(default:" in result.stdout


@pytest.mark.parametrize("flag,what", [("--port", "HTTP"), ("--metrics-port", "metrics")])
def test_the_gateway_on_a_taken_port_says_which_port_and_flag_as_the_services_do(busy_port, flag, what):
    """The gateway runs in the services' process shell: a taken port is the same one line and exit 2 (it
    returned 1 for HTTP, and a taken metrics port was a traceback after HTTP was bound)."""
    other = "--metrics-port" if flag == "--port" else "--port"
    result = subprocess.run([sys.executable, "-m", "services.gateway", flag, str(busy_port), other, "0",
                             "--host", "127.0.0.1", "--llm", "127.0.0.1:9"], capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    env = "MODALMESH_PORT" if flag == "--port" else "MODALMESH_METRICS_PORT"
    assert last.startswith(f"error: cannot bind the {what} port 127.0.0.1:{busy_port}") and flag in last and env in last
