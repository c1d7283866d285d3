"""modalmesh: the shared runtime every modalmesh service embeds.

Beside the runtime's modules, two packages are not part of it and are never imported by it:
``modalmesh.ops`` (the `modalmesh` command, the local stack and its launcher) and
``modalmesh.testing`` (tiny checkpoints for tests and the demo). ``modalmesh.process`` is the
child's half of launching (die with the launcher), used by services and tensor-parallel ranks.
"""

__version__ = "0.1.0"
