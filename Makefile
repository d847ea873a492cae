# Every module in the repository: the root and the nested ones (each has its own go.mod).
MODULES := $(shell find . -name go.mod -not -path './.git/*' -exec dirname {} \; | sort)
GO ?= go

.PHONY: test vet race fuzz fuzz-smoke bench demo sidecar-diff

# test is what README and .ci/run use: vet and race-enabled tests in every
# module, then every fuzz target for a few seconds from its seed corpus.
test: vet race fuzz-smoke

vet:
	@set -e; for m in $(MODULES); do echo "== go vet $$m"; (cd $$m && $(GO) vet ./...); done

race:
	@set -e; for m in $(MODULES); do echo "== go test -race $$m"; (cd $$m && $(GO) test -race -tags bidikv_bufcheck -count=1 -timeout 15m ./...); done

# fuzz runs each fuzz target briefly (FUZZTIME, default 20s); fuzz-smoke
# runs each for 30000 executions, as part of test (37 targets, the slowest
# about 700 executions a second: CI stays under 20 minutes). The smoke run
# counts executions rather than time: with a duration, Go 1.26's fuzz coordinator
# can fail a target with a bare "context deadline exceeded" when -fuzztime
# ends while a worker is mid-call on a loaded machine (go.dev/issue/75804,
# fixed in Go 1.27), with no failing input. A real finding always writes
# one under testdata/fuzz.
FUZZTIME ?= 20s
# FUZZMINTIME bounds the minimization of each new interesting input (Go's
# default, 60s each, once made the smoke run of one target take 10 minutes
# on a loaded machine); a failing input is still minimized and written.
FUZZMINTIME ?= 60s
FUZZ_PKGS := ./internal/jsonraw ./kvroute/internal/streamsynth ./sse ./transport ./transport/discovery ./kvroute ./kvroute/internal/kvhandle ./kvroute/internal/fingerprint ./kvroute/internal/entry ./kvroute/internal/capture ./kvroute/internal/convkey ./kvroute/internal/metricspage ./retention/budget
fuzz-smoke:
	@$(MAKE) --no-print-directory fuzz FUZZTIME=30000x FUZZMINTIME=100x
# fuzz runs a target that failed with that bare error and wrote no failing
# input once more (a second such failure, or any finding, fails the run).
fuzz:
	@set -e; log=$$(mktemp); trap 'rm -f $$log' EXIT; for pkg in $(FUZZ_PKGS); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$f"; run="$(GO) test -run ^$$ -fuzz ^$$f$$ -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINTIME) $$pkg"; \
	    if $$run > $$log 2>&1; then cat $$log; continue; fi; cat $$log; \
	    if grep -q 'context deadline exceeded' $$log && ! grep -q 'Failing input written' $$log; then \
	      echo "== $$pkg $$f again: no failing input (go.dev/issue/75804)"; $$run; else exit 1; fi; done; done

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

demo:
	$(GO) run ./examples/demo

# sidecar-diff runs the differential test of `bidikv-proxy sidecar` against
# llm-d's own P/D sidecar (examples/proxy/sidecar_diff_test.go; not part of
# test). It builds llm-d-router's cmd/pd-sidecar into a temporary directory
# from LLMD_ROUTER_SRC, a checkout of llm-d-router (the test was written
# against commit LLMD_ROUTER_COMMIT), or, without it, from a shallow clone
# of LLMD_ROUTER_REPO at that commit in the temporary directory (which needs
# the network). llm-d's dependencies come from the Go module proxy; nothing
# of llm-d's is kept.
LLMD_ROUTER_REPO ?= https://github.com/llm-d/llm-d-router
LLMD_ROUTER_COMMIT ?= ebab687927f5331c1b39defcb579a07951bce56c
LLMD_ROUTER_SRC ?=
sidecar-diff:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	src="$(LLMD_ROUTER_SRC)"; \
	if [ -z "$$src" ]; then \
	  src="$$tmp/llm-d-router"; \
	  echo "== cloning $(LLMD_ROUTER_REPO) at $(LLMD_ROUTER_COMMIT)"; \
	  if ! { git init -q "$$src" && git -C "$$src" fetch -q --depth 1 "$(LLMD_ROUTER_REPO)" "$(LLMD_ROUTER_COMMIT)" && \
	         git -C "$$src" checkout -q FETCH_HEAD; }; then \
	    echo "sidecar-diff: cannot fetch $(LLMD_ROUTER_REPO) at $(LLMD_ROUTER_COMMIT) (offline?): pass a checkout of llm-d-router, e.g. make sidecar-diff LLMD_ROUTER_SRC=/path/to/llm-d-router" >&2; \
	    exit 1; \
	  fi; \
	fi; \
	if [ ! -d "$$src/cmd/pd-sidecar" ]; then \
	  echo "sidecar-diff: $$src has no cmd/pd-sidecar: LLMD_ROUTER_SRC must be a checkout of $(LLMD_ROUTER_REPO)" >&2; exit 1; \
	fi; \
	rev=$$(git -C "$$src" rev-parse HEAD 2>/dev/null || echo "unknown (not a git checkout)"); \
	echo "== building llm-d's cmd/pd-sidecar from $$src at $$rev (the test was written against $(LLMD_ROUTER_COMMIT))"; \
	(cd "$$src" && GOWORK=off $(GO) build -o "$$tmp/pd-sidecar" ./cmd/pd-sidecar); \
	echo "== go test -tags sidecardiff -run TestDifferential (examples/proxy)"; \
	cd examples/proxy && BIDIKV_LLMD_SIDECAR="$$tmp/pd-sidecar" $(GO) test -race -tags 'sidecardiff bidikv_bufcheck' -count=1 -run TestDifferential -v .
