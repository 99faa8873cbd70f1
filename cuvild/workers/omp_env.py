"""Imported by the forkserver before torch (cuvild/intake/forks.py): OpenMP reads its wait
policy when its library loads, so a worker forked from there waits as a spawned one does
(cuvild/workers/worker.py `omp_env`, `_pin`). Importing this sets them in the importing
process."""

from cuvild.workers.worker import omp_env

omp_env()
