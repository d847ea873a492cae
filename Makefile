# Every module in the repository: the root and the nested ones (each has its own go.mod).
MODULES := $(shell find . -name go.mod -not -path './.git/*' -exec dirname {} \; | sort)
GO ?= go

.PHONY: test vet race fuzz fuzz-smoke bench demo

# test is what README and .ci/run use: vet and race-enabled tests in every
# module, then every fuzz target for a few seconds from its seed corpus.
test: vet race fuzz-smoke

vet:
	@set -e; for m in $(MODULES); do echo "== go vet $$m"; (cd $$m && $(GO) vet ./...); done

race:
	@set -e; for m in $(MODULES); do echo "== go test -race $$m"; (cd $$m && $(GO) test -race -tags bidikv_bufcheck -count=1 -timeout 15m ./...); done

# fuzz runs each fuzz target briefly (FUZZTIME, default 20s); fuzz-smoke
# runs each for 30000 executions, as part of test (23 targets, the slowest
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
fuzz:
	@set -e; for pkg in $(FUZZ_PKGS); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINTIME) $$pkg; done; done

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

demo:
	$(GO) run ./examples/demo
