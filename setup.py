"""Build hook: generate the gRPC stubs from proto/ whenever the package is built.

Everything else lives in pyproject.toml.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _protogen():
    spec = importlib.util.spec_from_file_location("_protogen", HERE / "modalmesh" / "_protogen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProtos(build_py):
    def run(self):
        super().run()
        # Editable installs import from the source tree, so the stubs go there.
        out_root = HERE if self.editable_mode else Path(self.build_lib)
        _protogen().generate(HERE / "proto", out_root)


setup(cmdclass={"build_py": BuildPyWithProtos})
