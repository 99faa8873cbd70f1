# cuvild: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard protos/*.proto)
PROTO_OUT := $(PROTOS:.proto=_pb2.py)
CONFIG ?= configs/cuvild.yaml
# The image (configs/kserve/Dockerfile) installs without the dev tools: EXTRAS=
EXTRAS ?= [dev]

.PHONY: setup run demo test lint bench genai-env proto clean

setup: $(STAMP) $(PROTO_OUT)
	@$(PY) -m compileall -q -j 0 cuvild partitioner runtimes protos > /dev/null

# compileall: the project's own modules as bytecode, written here once (0.48 -> 0.31 s to import
# the daemon, engine and worker modules on the 2-core dev host, where nothing had written them).

# Bytecode of the dependencies. Where PYTHONDONTWRITEBYTECODE is set (as on the dev and CI hosts)
# Python never writes it, and every process compiles what it imports from source again. Make's
# commands unset it: a module is compiled once, by the first process that imports it, into the
# venv this Makefile owns. Compiled ahead: torch, which every process imports (two at once
# when the suite starts, each compiling the same 1.4k files otherwise: 5.7 s ahead); an image's
# install (EXTRAS=, configs/kserve/Dockerfile) compiles everything, its user cannot write the
# venv. Compiling all of a dev install ahead (21k files, 6.3k of them imported by the whole
# suite: not transformers' 2.6k model files, kubernetes' or the OpenAI SDK's types) took 33 s
# of a 61 s setup on the 2-core dev host. Not compiled ahead in the image: packages that no
# process of cuvild imports (nncf's pandas and scikit-learn, pip, setuptools, narwhals).
unexport PYTHONDONTWRITEBYTECODE
UNIMPORTED := pandas|sklearn|pip|setuptools|narwhals
COMPILE_AHEAD := $(PY) -c "import compileall, re, sys, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'] + sys.argv[1], quiet=2, workers=0, rx=re.compile(r'/site-packages/($(UNIMPORTED))/'))"

# Reinstall only when the pinned dependencies change, with the pip pyproject.toml names
# ([tool.cuvild]; setuptools' notice that an install is editable left out). pip's own
# byte-compiling (one file at a time) is off: see above. Its errors are third-party files for
# newer Pythons (torch's py312 tests), which pip skips too.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile "$$($(PY) -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['tool']['cuvild']['pip'])")"
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -e '.$(EXTRAS)'
	$(COMPILE_AHEAD) $(if $(EXTRAS),/torch,/)
	touch $@

# inference.proto shares its package with tritonclient's own generated module, so ours is
# built into a private descriptor pool: a process may import both (clients, tests).
PRIVATE_POOL := sed -i 's/_descriptor_pool.Default().AddSerializedFile(/_descriptor_pool.DescriptorPool().AddSerializedFile(/' protos/inference_pb2.py

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	$(PRIVATE_POOL)

protos/%_pb2.py: protos/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $<
	if [ "$*" = inference ]; then $(PRIVATE_POOL); fi

run: setup
	$(VENV)/bin/cuvild --config $(CONFIG)

demo: setup
	$(PY) -m cuvild.client.demo

# Two pytest workers, each taking whole test files (those sharing a session daemon together:
# tests/conftest.py): on 2 cores the suite's daemons and workers leave a core idle half the
# time when run alone.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q --durations=10 -n $(TEST_WORKERS)

lint: setup
	$(VENV)/bin/ruff check cuvild partitioner runtimes tests

# SECTION=serving (or "serving models"): only those sections (tests/bench/run.py)
SECTION ?=
bench: setup genai-env
	$(PY) tests/bench/run.py $(SECTION)

# OpenVINO GenAI's environment for the generation bench (pinned in pyproject.toml's
# genai-bench extras; optimum-intel needs an older transformers than the project's).
GENAI_VENV := .venv-genai
genai-env: $(GENAI_VENV)/.installed
$(GENAI_VENV)/.installed: pyproject.toml
	test -x $(GENAI_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/pip install -q $$($(PYTHON) -c "import tomllib; x = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(x['genai-bench']))")
	$(GENAI_VENV)/bin/pip install -q --no-deps $$($(PYTHON) -c "import tomllib; x = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; print(' '.join(x['genai-bench-nodeps']))")
	touch $@

clean:
	rm -rf $(VENV) $(GENAI_VENV) protos/*_pb2.py protos/*_pb2.pyi protos/*_pb2_grpc.py .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
