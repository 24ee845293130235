PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Re-install when the pinned dependencies change.
STAMP := $(VENV)/.installed

# `make model THINKING=1` writes the embedded model as a thinking one (<think> tokens,
# Qwen3's enable_thinking switch; served with --reasoning-parser qwen3); `make model
# ARCH=gpt_oss HARMONY=1` a gpt-oss-shaped one with gpt-oss' own tokenizer, served in
# the harmony format (docs/openai.md, "Reasoning"). `make serve` with the same serves it.
THINKING ?=
HARMONY ?=
SIZE ?= $(if $(HARMONY),nano,tiny)
# `make model ARCH=qwen3_moe` (or mixtral) writes a Mixture-of-Experts one of the size;
# `make serve ARCH=qwen3_moe` serves it (ARCH=qwen3_next: gated DeltaNet layers).
ARCH ?= llama
MODEL_DIR := models/flagstop-$(SIZE)$(if $(filter-out llama,$(ARCH)),-$(ARCH))$(if \
	$(THINKING),-thinking)$(if $(HARMONY),-harmony)
# `make serve MODEL=DIR` serves any local checkpoint of a supported architecture;
# `make serve TP=2` splits it over two tensor-parallel ranks (gloo on the CPU), and
# `make serve TP=2 EP=1` places an MoE model's whole experts on them (--expert-parallel);
# `make serve ROUTERS=2` runs two router processes on the router's ports (SO_REUSEPORT).
MODEL ?= $(MODEL_DIR)
TP ?= 1
EP ?=
ROUTERS ?= 1
# Speculative decoding: `make serve SPEC='{"method":"ngram","num_speculative_tokens":3}'`
# (docs/speculative.md; `make up SPEC=...` too).
SPEC ?=
# LoRA adapters at start-up, name=DIR,... (docs/lora.md); MAX_LORAS: slots (4 with LORA);
# MAX_LORA_RANK: the largest rank accepted (the executor's 16 unset; 64 for rank-64 ones).
LORA ?=
MAX_LORAS ?= $(if $(LORA),4)
MAX_LORA_RANK ?=
# The prefix cache's host tier, in bytes: `make serve KV_OFFLOAD_BYTES=8589934592`
# (docs/kv_tiers.md).
KV_OFFLOAD_BYTES ?=
# Prefill/decode disaggregation: `make serve PD=1` runs a prefill replica (scheduler
# :50054, executor :50055) beside the decode replica (:50052, :50053) behind the router,
# which prefills prompts with PD_THRESHOLD or more uncached tokens on the prefill one
# (PD_THRESHOLD=0: every prompt); `make up PD=1` the same in compose (docs/kv_tiers.md).
PD ?=
PD_THRESHOLD ?= 512
# The router's client-facing gRPC server: `make serve GRPC_SERVER=native` (pygrpc-native,
# plaintext only; docs/load_testing.md). `make up GRPC_SERVER=native` too.
GRPC_SERVER ?= grpcio
# tool_choice "auto": the embedded model's template writes Hermes tool calls (harmony's
# for HARMONY=1); for another model, TOOL_CALL_PARSER=<its family's> (docs/openai.md),
# and REASONING_PARSER=<its family's> for a thinking model.
TOOL_CALL_PARSER ?= $(if $(filter $(MODEL_DIR),$(MODEL)),$(if $(HARMONY),openai,hermes))
REASONING_PARSER ?= $(if $(filter $(MODEL_DIR),$(MODEL)),$(if \
	$(HARMONY),openai_gptoss,$(if $(THINKING),qwen3)))
# Nothing is ever fetched from a model hub.
export HF_HUB_OFFLINE := 1

# Docker users: `make up` (GPU executor: `make up GPU=1`; router processes: ROUTERS=N;
# two replicas behind the router: REPLICAS=2; a prefill and a decode replica: PD=1; a
# remote scheduling policy: `make up POLICY=fair-share` or POLICY=shortest-prompt-first),
# `make logs`, `make ps`, `make down`. Kubernetes: deploy/k8s (kustomize).
DOCKER_COMPOSE ?= docker compose
REPLICAS ?= 1
comma := ,
PROFILES := $(if $(POLICY),policy) $(if $(filter 2,$(REPLICAS)),replicas)
PROFILES += $(if $(PD),pd)
SCHEDULERS := scheduler:50052$(if $(filter 2,$(REPLICAS)),$(comma)scheduler-2:50052)$(if $(PD),$(comma)scheduler-prefill:50052)
COMPOSE := $(if $(strip $(PROFILES)),COMPOSE_PROFILES=$(subst $() ,$(comma),$(strip $(PROFILES)))) \
	$(if $(POLICY),SCHEDULER_POLICY=remote POLICY_STRATEGY=$(POLICY)) \
	$(if $(filter-out scheduler:50052,$(SCHEDULERS)),ROUTER_SCHEDULERS=$(SCHEDULERS)) \
	$(if $(PD),KV_ROLE=decode PD_THRESHOLD=$(PD_THRESHOLD)) \
	$(if $(filter-out 1,$(TP)),TP=$(TP)) $(if $(EP),EP=$(EP)) \
	$(if $(filter-out 1,$(ROUTERS)),ROUTERS=$(ROUTERS)) \
	$(if $(SPEC),SPEC='$(SPEC)') $(if $(filter-out grpcio,$(GRPC_SERVER)),GRPC_SERVER=$(GRPC_SERVER)) \
	$(DOCKER_COMPOSE) -f compose/compose.yaml $(if $(GPU),-f compose/compose.gpu.yaml)

.PHONY: venv test test-fast kernels-sm90 lint bench bench-executor bench-kv-tier bench-kv-groups bench-mla bench-recurrent bench-lora bench-replicas bench-structured bench-multimodal bench-sessions bench-llm-d bench-pooling eagle-head trained-model eagle-head-trained speculators-heads model proto serve up down logs ps clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,suffix-build]'
	CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(PY)) $(PY) -m pip install --quiet \
		--disable-pip-version-check --no-build-isolation -e '.[suffix]'
	touch $@

# Every test, in a random order (pytest-randomly); `make test SEED=N` repeats one.
ifndef SEED
SEED := $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
endif
# The Triton launches the kernel tests make are recorded, then each is compiled for
# the H200 (sm_90a) by Triton's own compiler, with its bf16 and FP8-KV variants
# (tools/compile_sm90.py; docs/kernels.md): a kernel that cannot compile fails the run.
LAUNCHES := .kernel_launches.json
# Two runs side by side: the `numeric` in-process tests (kernels and models against
# their references: no clock in them) and then the sm_90a compile, at nice 19, in the
# CPU the other tests leave idle (about 40 % of two cores: the stacks wait on their
# processes); those others in the foreground. Each prints its own report; either
# failing fails the target.
NUMERIC := -m "numeric and not processes"
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@echo "test order: --randomly-seed=$(SEED) (make test SEED=$(SEED) repeats it)"
	@rm -f $(LAUNCHES) $(LAUNCHES).rest
	@log=$$(mktemp); \
	( nice -n 19 env FLAGSTOP_KERNEL_LAUNCHES=$(LAUNCHES) $(PY) -m pytest -q -p randomly \
		--randomly-seed=$(SEED) -p no:cacheprovider $(NUMERIC) --durations=5 && \
	  nice -n 19 env -u TRITON_INTERPRET $(PY) -m tools.compile_sm90 $(LAUNCHES) ) \
		> $$log 2>&1 & numeric=$$!; \
	FLAGSTOP_KERNEL_LAUNCHES=$(LAUNCHES).rest $(PY) -m pytest -q -p randomly \
		--randomly-seed=$(SEED) -m "not (numeric and not processes)" --durations=15; rest=$$?; \
	wait $$numeric; numeric_rc=$$?; \
	echo "== numeric tests and the sm_90a compile (beside the others, at nice 19) =="; \
	cat $$log; rm -f $$log; \
	if [ -f $(LAUNCHES).rest ]; then env -u TRITON_INTERPRET $(PY) -m tools.compile_sm90 \
		$(LAUNCHES).rest || rest=1; fi; \
	[ $$rest -eq 0 ] && [ $$numeric_rc -eq 0 ]

# The same compile report, from a cold Triton cache, into bench/results/kernels_sm90.md
# (docs/kernels.md quotes it).
kernels-sm90: $(STAMP)
	FLAGSTOP_KERNEL_LAUNCHES=$(LAUNCHES) $(PY) -m pytest -q -m "not processes" tests/test_kernels.py \
		tests/test_lora.py tests/test_moe.py tests/test_quantization.py tests/test_executor_model.py \
		tests/test_mla.py
	env -u TRITON_INTERPRET TRITON_CACHE_DIR=$$(mktemp -d) \
		$(PY) -m tools.compile_sm90 $(LAUNCHES) --out bench/results/kernels_sm90.md

# The in-process tests only (no stack, service or rank started): a quick loop.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not processes"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The contracts live in protos/; their stubs are generated into the flagstop package.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/flagstop/v1/*.proto

model: $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json: $(STAMP) tools/make_model.py tools/make_vision_model.py \
		tools/make_pooling_model.py
	$(PY) -m tools.make_model --size $(SIZE) --arch $(ARCH) --out $(MODEL_DIR) \
		$(if $(THINKING),--thinking) $(if $(HARMONY),--harmony)

# tools/supervise.py runs them: a process that dies is started again (with backoff,
# logged), as compose and Kubernetes do; `make serve RESTART=0` leaves it dead (fault
# tests). Ctrl-C (SIGINT) reaches them all, and each drains and exits 0.
RESTART ?= 1
# The ports (`make serve PORT=... HTTP_PORT=...` runs one beside another; the metrics
# ports are the services' defaults unless set).
PORT ?= 50051
HTTP_PORT ?= 8000
SCHEDULER_PORT ?= 50052
EXECUTOR_PORT ?= 50053
ROUTER_METRICS_PORT ?= 8001
SCHEDULER_METRICS_PORT ?= 8002
EXECUTOR_METRICS_PORT ?= 8003
# More flags for one service: `make serve ROUTER_ARGS=--structured-outputs-in-reasoning`.
ROUTER_ARGS ?=
SCHEDULER_ARGS ?=
EXECUTOR_ARGS ?=
# config.json's fields replaced (vLLM's --hf-overrides); ARCH=qwen3_reranker's: serve
# Qwen3-Reranker as a yes/no scorer, as vLLM does (docs/pooling.md).
RERANKER_OVERRIDES := {"architectures":["Qwen3ForSequenceClassification"],"classifier_from_token":["no","yes"],"is_original_qwen3_reranker":true}
HF_OVERRIDES ?= $(if $(filter qwen3_reranker,$(ARCH)),$(RERANKER_OVERRIDES))
EXECUTOR_FLAGS = --model $(MODEL) --tensor-parallel-size $(TP) \
	$(if $(HF_OVERRIDES),--hf-overrides '$(HF_OVERRIDES)') \
	$(if $(filter 1,$(EP)),--expert-parallel) $(if $(SPEC),--speculative-config '$(SPEC)') \
	$(if $(MAX_LORAS),--max-loras $(MAX_LORAS)) $(if $(LORA),--lora-modules '$(LORA)') \
	$(if $(MAX_LORA_RANK),--max-lora-rank $(MAX_LORA_RANK)) \
	$(if $(KV_OFFLOAD_BYTES),--kv-offload-bytes $(KV_OFFLOAD_BYTES))
serve: $(STAMP) $(if $(filter $(MODEL_DIR),$(MODEL)),$(MODEL_DIR)/config.json)
	@echo "router 127.0.0.1:$(PORT) (OpenAI HTTP :$(HTTP_PORT)), scheduler :$(SCHEDULER_PORT), executor :$(EXECUTOR_PORT)" \
		"$(if $(PD),(decode; the prefill replica: scheduler :50054, executor :50055) )on $(MODEL)," \
		"tensor parallel $(TP)$(if $(filter 1,$(EP)), (expert parallel)), $(ROUTERS) router process(es); Ctrl-C stops"
	@$(PY) -m tools.supervise $(if $(filter 0,$(RESTART)),--no-restart) \
	:: executor $(VENV)/bin/flagstop-executor $(EXECUTOR_FLAGS) --port $(EXECUTOR_PORT) \
		--metrics-port $(EXECUTOR_METRICS_PORT) $(EXECUTOR_ARGS) \
		$(if $(PD),--kv-role decode) \
	:: scheduler $(VENV)/bin/flagstop-scheduler --executor 127.0.0.1:$(EXECUTOR_PORT) \
		--port $(SCHEDULER_PORT) --metrics-port $(SCHEDULER_METRICS_PORT) $(SCHEDULER_ARGS) \
	$(if $(PD),:: executor-prefill $(VENV)/bin/flagstop-executor $(EXECUTOR_FLAGS) --port 50055 \
		--metrics-port 8005 --kv-role prefill \
	:: scheduler-prefill $(VENV)/bin/flagstop-scheduler --executor 127.0.0.1:50055 --port 50054 \
		--metrics-port 8004) \
	:: router $(VENV)/bin/flagstop-router --model $(MODEL) --port $(PORT) --http-port $(HTTP_PORT) \
		--metrics-port $(ROUTER_METRICS_PORT) \
		--scheduler 127.0.0.1:$(SCHEDULER_PORT)$(if $(PD),$(comma)127.0.0.1:50054 --pd-threshold $(PD_THRESHOLD)) \
		--processes $(ROUTERS) $(if $(TOOL_CALL_PARSER),--tool-call-parser $(TOOL_CALL_PARSER)) \
		$(if $(REASONING_PARSER),--reasoning-parser $(REASONING_PARSER)) \
		--grpc-server $(GRPC_SERVER) $(ROUTER_ARGS)

up:
	@case "$(REPLICAS)" in 1|2) ;; *) echo "REPLICAS=$(REPLICAS): compose runs 1 or 2" \
		"(more: deploy/k8s)"; exit 2;; esac
	$(COMPOSE) up -d --build

down:
	$(COMPOSE) down

logs:
	$(COMPOSE) logs -f

ps:
	$(COMPOSE) ps

# flagstop's router tier vs sglang-router vs round-robin over two replicas (~4 minutes).
bench-replicas: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) bench/replica_bench.py
	$(PY) bench/report.py

# The default set, about 23 minutes on a 2-core machine; bench/RESULTS.md gathers them.
bench: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) bench/scheduler_bench.py
	$(PY) bench/detokenizer_bench.py
	$(PY) bench/peers.py
	$(PY) bench/serve_bench.py --request-rate 4 8 16 32 inf
	$(PY) bench/serve_bench.py --backend grpc openai grpc openai --request-rate 16 \
		--json bench/results/serve_backends.json --out bench/results/serve_backends.md
	$(PY) bench/tracing_bench.py
	$(PY) bench/overhead_bench.py --variant '1 router process||' \
		--variant '2 router processes||--processes 2'
	$(PY) bench/overhead_bench.py --step-ms 8 --floor grpcio native --front grpc openai \
		--variant 'grpcio server||' --variant 'native server||--grpc-server native' \
		--profile /tmp/flagstop-profile --out bench/results/overhead_router.md
	$(PY) bench/spec_bench.py
	$(PY) bench/spec_bench.py --target trained
	$(PY) bench/overhead_bench.py --streams 64 256 --step-ms 8 --out bench/results/overhead_spec.md \
		--variant 'no speculation|||' \
		--variant 'ngram k=3, acceptance 0.7|||--speculative-config {"method":"ngram","num_speculative_tokens":3} --simulate-acceptance-rate 0.7|--speculative-disable-batch-size 100000'
	$(PY) bench/plots.py
	$(PY) bench/report.py

# Executor step time vs transformers, per batch size and context (dense and MoE
# models), quantized formats against float32, an MoE layer's experts three ways, and one rank vs two tensor-parallel
# ranks (about 15 minutes).
bench-lora: $(STAMP)
	$(PY) bench/lora_bench.py

# Images (docs/multimodal.md): the pixel path by image size, the encoder cache against
# a cache of one image, the encoder budget against none while decodes run.
bench-multimodal: $(STAMP)
	$(PY) bench/multimodal_bench.py
	$(PY) bench/report.py

# Agent sessions beside other traffic (docs/sessions.md): retention against plain LRU,
# by replay, on the executor simulator and on the CPU.
bench-sessions: $(STAMP)
	$(PY) bench/session_bench.py
	$(PY) bench/report.py

# What llm-d reads of a pod and its cost (docs/llm-d.md): KV events in the scheduler's
# step and on a live simulator stack, /metrics at the picker's 20 scrapes a second
# (about 5 minutes).
bench-llm-d: $(STAMP)
	$(PY) bench/llm_d_bench.py
	$(PY) bench/report.py

# Embeddings against sentence-transformers on the same weights, and reranking's shape
# with the prefix cache on and off (docs/pooling.md; about 5 minutes).
bench-pooling: $(STAMP)
	$(PY) bench/pooling_bench.py
	$(PY) bench/report.py

# An EAGLE-3 head for the model, trained on text it generates (docs/speculative.md):
# `make eagle-head` writes $(MODEL_DIR)-eagle3, minutes on the CPU at the tiny size;
# `make serve SPEC='{"method":"eagle3","model":"$(MODEL_DIR)-eagle3"}'` drafts with it.
eagle-head: $(MODEL_DIR)-eagle3/config.json

$(MODEL_DIR)-eagle3/config.json: $(MODEL_DIR)/config.json tools/train_eagle_head.py
	$(PY) -m tools.train_eagle_head --target $(MODEL_DIR) --out $(MODEL_DIR)-eagle3

# The embedded model's random text leaves a head nothing to learn: `make trained-model`
# trains its architecture on docs/*.md (~4 minutes), `make eagle-head-trained` a head
# for that (~3 minutes); bench/spec_bench.py measures drafts on the pair.
TRAINED := models/flagstop-tiny-trained
trained-model: $(TRAINED)/config.json

$(TRAINED)/config.json: $(STAMP) tools/train_tiny_model.py
	test -f models/flagstop-tiny/config.json || $(MAKE) model SIZE=tiny ARCH=llama
	$(PY) -m tools.train_tiny_model --base models/flagstop-tiny --out $(TRAINED)

eagle-head-trained: $(TRAINED)-eagle3/config.json

$(TRAINED)-eagle3/config.json: $(TRAINED)/config.json tools/train_eagle_head.py
	$(PY) -m tools.train_eagle_head --target $(TRAINED) --out $(TRAINED)-eagle3 --prompts docs

# tests/data/eagle3/: heads saved by the speculators library itself (a Llama and a
# Qwen3 layer, its three norm variants, a converted original head; committed: CI does
# not install it) and its own forward of each, made in a venv of its own: speculators 0.9 pins transformers
# <= 5.19 against ours (tools/speculators_heads.py). Its torch is the CPU build on disk
# (--no-deps: its torchvision and torchaudio would pull a CUDA one).
SPECULATORS_VENV := .venv-speculators
SPECULATORS_HEADS := tests/data/eagle3
speculators-heads: $(STAMP)
	test -x $(SPECULATORS_VENV)/bin/python || python3.11 -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/pip install -q torch==2.13.0 transformers==5.19.0 loguru==0.7.3 \
		pydantic pydantic-settings safetensors rich typer click psutil httpx protobuf openai \
		aiohttp "datasets<=5.1.0" huggingface-hub
	$(SPECULATORS_VENV)/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	rm -rf $(SPECULATORS_HEADS) && d=$$(mktemp -d) && \
	$(PY) -m tools.make_eagle_head --small-target $$d/flagstop-tiny-h64 --out $$d/original && \
	cd $$d && $(CURDIR)/$(SPECULATORS_VENV)/bin/python $(CURDIR)/tools/speculators_heads.py \
		--target flagstop-tiny-h64 --original original --out $(CURDIR)/$(SPECULATORS_HEADS)
	rm -f $(SPECULATORS_HEADS)/*/config.py  # the library's own source, named by auto_map

# The host tier on a multi-turn workload that outgrows the pool (the small model on
# the CPU, pool only vs pool + tier), and two colocated replicas against a prefill and a
# decode one (simulator and CPU; about 8 minutes).
bench-kv-tier: $(STAMP)
	$(PY) bench/kv_tier_bench.py
	$(PY) bench/report.py

# KV cache groups at a fixed KV memory: a gpt-oss-shaped model with groups and with
# every layer full, a long-context workload side by side (about 3 minutes).
bench-kv-groups: $(STAMP)
	$(PY) bench/kv_groups_bench.py
	$(PY) bench/report.py

bench-mla: $(STAMP)
	$(PY) bench/mla_bench.py
	$(PY) bench/report.py

bench-recurrent: $(STAMP)
	$(PY) bench/recurrent_bench.py
	$(PY) bench/report.py

bench-executor: $(STAMP)
	$(PY) bench/executor_bench.py
	$(PY) bench/executor_bench.py --sizes tiny-qwen3_moe small-qwen3_moe tiny-mixtral \
		--out bench/results/executor_moe.md
	$(PY) bench/executor_bench.py --quantized --sizes tiny small
	$(PY) bench/moe_bench.py
	$(PY) bench/tp_bench.py
	$(PY) bench/report.py

# Structured outputs: throughput constrained vs not, compile times, and the grammar
# engines side by side (xgrammar comes with the bench extra).
bench-structured: $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) bench/structured_bench.py --engines
	$(PY) bench/report.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
