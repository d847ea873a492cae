# Every module in the repository: the root and the nested ones (each has its own go.mod).
MODULES := $(shell find . -name go.mod -not -path './.git/*' -exec dirname {} \; | sort)
GO ?= go

.PHONY: test vet race fuzz bench demo

# test is what README and .ci/run use: vet and race-enabled tests in every module.
test: vet race

vet:
	@set -e; for m in $(MODULES); do echo "== go vet $$m"; (cd $$m && $(GO) vet ./...); done

race:
	@set -e; for m in $(MODULES); do echo "== go test -race $$m"; (cd $$m && $(GO) test -race -count=1 -timeout 15m ./...); done

# fuzz runs each fuzz target briefly (FUZZTIME, default 20s).
FUZZTIME ?= 20s
fuzz:
	@set -e; for pkg in ./internal/jsonraw ./sse; do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "== $$pkg $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$pkg; done; done

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

demo:
	$(GO) run ./examples/demo
