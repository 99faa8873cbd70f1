"""The server: the daemon process, the unix socket's front, the Open Inference Protocol and
cuvil.v1 control servicers, client shared-memory regions, systemd notification and TCP auth.

It turns gRPC calls into calls on the engine (cuvild/engine/) and the registry
(cuvild/intake/); nothing below it imports it.
"""
