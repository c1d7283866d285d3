"""modalmesh.flags: the public env-aware parser every server process uses, and the flags they share."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modalmesh.flags import EnvArgumentParser, add_process_arguments, env_name


def _parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="test")
    add_process_arguments(parser, port=8000, protocol="HTTP")
    parser.add_argument("--switch", action="store_true", help="a switch")
    parser.add_argument("--ratio", type=float, default=0.5, help="a ratio")
    parser.add_argument("--name", default=None, help="a name")
    parser.add_argument("--bare", type=int, default=7)  # no help text
    return parser


def test_env_variables_set_defaults_and_the_command_line_wins(monkeypatch):
    assert env_name("metrics_port") == "MODALMESH_METRICS_PORT"
    args = _parser().parse_args([])
    assert (args.host, args.port, args.metrics_port, args.grace_period, args.log_level) == \
        ("127.0.0.1", 8000, 9400, 30.0, "INFO")
    monkeypatch.setenv("MODALMESH_PORT", "9001")
    monkeypatch.setenv("MODALMESH_RATIO", "0.25")
    monkeypatch.setenv("MODALMESH_SWITCH", "Yes")
    monkeypatch.setenv("MODALMESH_NAME", "from-env")
    args = _parser().parse_args([])
    assert (args.port, args.ratio, args.switch, args.name) == (9001, 0.25, True, "from-env")
    assert _parser().parse_args(["--port", "9002"]).port == 9002
    monkeypatch.setenv("MODALMESH_SWITCH", "off")
    assert _parser().parse_args([]).switch is False


@pytest.mark.parametrize("var, value, says", [
    ("MODALMESH_PORT", "eighty", "MODALMESH_PORT='eighty' is not a valid value for --port"),
    ("MODALMESH_SWITCH", "maybe", "MODALMESH_SWITCH='maybe': expected 1/0"),
])
def test_a_bad_env_value_fails_parsing_naming_the_variable(monkeypatch, capsys, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_help_shows_defaults():
    text = _parser().format_help()
    assert "HTTP port (0 picks a free one) (default: 8000)" in " ".join(text.split())
    assert "(default: 0.5)" in text and "--bare BARE           default: 7" in text  # a flag without help still shows it
    assert "a name (default" not in " ".join(text.split())  # None is no default worth showing
    assert "a switch (default" not in " ".join(text.split())
    assert "MODALMESH_<FLAG>" in text


def test_help_shows_the_defaults_the_environment_set(monkeypatch, capsys):
    monkeypatch.setenv("MODALMESH_GRACE_PERIOD", "5")
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["--help"])
    assert exit_.value.code == 0
    assert "(default: 5.0)" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["services.gateway", "services.vae"])
def test_every_server_shows_its_defaults_in_help(module):
    """The gateway and the services share the parser and the process flags (they once re-declared them)."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "(default: 127.0.0.1)" in text and "(default: 9400)" in text and "(default: INFO)" in text
    assert "MODALMESH_" in text
