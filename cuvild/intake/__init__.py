"""Intake: untrusted model archives in, registered models out.

`safe_load.py` loads a torch.export archive without running anything it carries (its checks of
the program JSON in `schema_checks.py`, its grammars for expressions in `grammar.py`, its
checks of payloads in `payload_checks.py`); `summary.py` describes an accepted program (in a
child process under memory and CPU limits); `registry.py` stores archives and the index.
"""
