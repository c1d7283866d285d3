"""--compile-cache: Triton and inductor read their cache directories from it, in the service process and in the
processes it starts (the LLM's engine process and TP ranks), and a directory it cannot use stops start-up."""

import subprocess
import sys

import pytest

from modalmesh import compile_cache
from modalmesh.errors import ConfigError

PROBE = """
import subprocess, sys
from modalmesh import compile_cache
compile_cache.configure(sys.argv[1])
child = '''
try:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
except ImportError:  # torch < 2.6
    from torch._inductor.runtime.runtime_utils import cache_dir
print(cache_dir())
try:
    from triton import knobs  # Triton >= 3.4
    print(knobs.cache.dir)
except ImportError:
    try:
        from triton.runtime.cache import default_cache_dir
        print(default_cache_dir())
    except ImportError:
        print("no triton")
'''
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout, end="")
"""


def test_triton_and_inductor_cache_under_the_directory_in_a_child_process(tmp_path):
    root = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", PROBE, str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    inductor, triton = out.stdout.splitlines()
    assert inductor == str(root.resolve() / "inductor")  # what inductor itself resolves, in a grandchild
    assert triton in (str(root.resolve() / "triton"), "no triton")
    assert (root / "inductor").is_dir() and (root / "triton").is_dir()


def test_no_directory_leaves_the_libraries_defaults(monkeypatch):
    import os

    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert compile_cache.configure(None) is None and compile_cache.configure("") is None
    assert "TRITON_CACHE_DIR" not in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_a_directory_that_cannot_be_made_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--compile-cache .*cannot create it"):
        compile_cache.configure(str(blocker / "cache"))


def test_a_service_given_an_unusable_directory_exits_2_naming_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = subprocess.run([sys.executable, "-m", "services.vae", "--port", "0", "--metrics-port", "-1",
                          "--compile-cache", str(blocker / "cache")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "error: --compile-cache" in out.stderr and "cannot create it" in out.stderr
