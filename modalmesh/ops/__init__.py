"""Operator tools: what a person (or a test) runs around the services, not what a service runs.

    cli.py       the `modalmesh` command: up, demo, health, info, generate, decode
    stack.py     the four services as local processes (`modalmesh up`), drained on Ctrl-C
    launcher.py  ServiceProcess: start one service as a child, follow it to SERVING and back
    demo.py      `modalmesh demo`: the stack, three real requests, a few metrics, stop

The runtime (modalmesh/ outside ops/) and the services never import this package; a launched
child's own half of process lifetime (die with the launcher) is `modalmesh.process`.
"""
