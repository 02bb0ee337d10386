# make demo: create .venv, install monarch, run the main example on a local 4-process mesh.
# make test: create/update .venv, run the whole test suite but the cluster, data-plane, OpInfo and end-to-end tiers.
# make test-dataplane: the data-plane tier (marked `dataplane`): one-sided transfers (monarch.rdma), to_mesh and
#   its examples, shared-memory collectives.
# make test-opinfo: the OpInfo tier (marked `opinfo`): torch's OpInfo samples of every op monarch claims, sharded
#   on a real mesh against plain torch (about 2 minutes).
# make test-e2e: the end-to-end tier (marked `end_to_end`): tests/end_to_end, models and examples trained on
#   real meshes against plain torch, and the DTensor programs of tests/dtensor on real meshes (about 3 minutes).
# make test-cluster: the cluster tier (tests/cluster): the launchers (attach agents, Kubernetes manifests) and
#   meshes across test hosts made of network namespaces with a real sshd and Slurm (those need root and
#   .ci/cluster-packages; they skip with one line otherwise).
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
# the venv's MPICH mpiexec must come before any system-wide mpiexec of another MPI
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: demo test test-opinfo test-e2e test-dataplane test-cluster bench clean pyverbs

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 -m "not cluster and not dataplane and not opinfo and not end_to_end"

test-opinfo: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m opinfo

test-e2e: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m "end_to_end and not cluster"

# rdma-core's pyverbs (Debian's python3-pyverbs, built for the system python3) where its extension modules fit
# the venv's python: a .pth adds a directory holding only a link to it (never the rest of dist-packages)
SYSTEM_PYVERBS := /usr/lib/python3/dist-packages/pyverbs
pyverbs: $(VENV)/.installed
	@suffix=$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))'); \
	site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	if [ -e "$(SYSTEM_PYVERBS)/device$$suffix" ]; then \
	  mkdir -p $(VENV)/system-pyverbs && ln -sfn $(SYSTEM_PYVERBS) $(VENV)/system-pyverbs/pyverbs && \
	  echo "$(abspath $(VENV))/system-pyverbs" > "$$site/system-pyverbs.pth"; \
	else rm -rf "$$site/system-pyverbs.pth" $(VENV)/system-pyverbs; fi

test-dataplane: $(VENV)/.installed pyverbs
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "dataplane and not cluster"

$(VENV)/.installed-cluster: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,cluster]'
	touch $@

test-cluster: $(VENV)/.installed-cluster pyverbs
	$(PY) -m pytest -q -p no:cacheprovider -m cluster tests/cluster

bench: $(VENV)/.installed
	$(PY) benchmarks/actors.py
	$(PY) benchmarks/eager_ops.py
	$(PY) benchmarks/train_vs_ddp.py
	$(PY) benchmarks/models.py
	$(PY) benchmarks/telemetry_overhead.py
	$(PY) benchmarks/heartbeat.py
	$(PY) benchmarks/controller_memory.py
	$(PY) benchmarks/checkpoint.py

clean:
	rm -rf $(VENV) build *.egg-info .hypothesis
