"""Imported by the forkserver before torch (cuvild/intake/forks.py): OpenMP reads its wait
policy when its library loads, so a worker forked from there gets passive waits as a spawned
one does (cuvild/workers/worker.py `_pin`). Importing this sets them in the importing process."""

import os

from cuvild.workers.worker import OMP_ENV

os.environ.update(OMP_ENV)
