#!/bin/sh
# codex.sh runs Codex CLI, unmodified and headless, for TURNS turns
# (default 4: codex exec, then codex exec resume --last three times)
# through a bidikv proxy, then the same turns against one plain engine, and
# compares the final answers turn by turn. Codex talks to the Responses API
# (wire_api "responses") of a custom provider; it sends tool_choice auto
# with its tools, so against engines that answer with tool calls each
# turn is a loop of requests (a function_call, its function_call_output
# back, ...) until a message. Both sessions use the same throw-away
# CODEX_HOME and working directory (Codex's instructions name them).
#
#   sh codex.sh <proxy-base-url> <plain-engine-base-url> [model]
#
# CODEX is the codex binary (default: codex on PATH; npm install
# @openai/codex into a temporary directory gives one). The model
# (default sim-model) must be the engines' served model name. The proxy's
# log (--log-level debug) shows each request's reuse; X-Bidikv-Reuse is in
# every response.
set -eu
proxy=$1 plain=$2 model=${3:-sim-model}
codex=${CODEX:-codex}
turns=${TURNS:-4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/project"
session() { # session BASE OUT
	rm -rf "$tmp/home" && mkdir -p "$tmp/home" "$2"
	cat >"$tmp/home/config.toml" <<TOML
model = "$model"
model_provider = "bench"
[model_providers.bench]
name = "bench"
base_url = "$1/v1"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
TOML
	(
		cd "$tmp/project"
		export CODEX_HOME="$tmp/home" OPENAI_API_KEY=sk-test
		"$codex" exec --skip-git-repo-check --sandbox read-only -o "$2/1.txt" "Turn 1: say hello in one sentence." >/dev/null 2>&1
		for i in $(seq 2 "$turns"); do
			"$codex" exec resume --last --skip-git-repo-check -o "$2/$i.txt" "Turn $i: continue with one more sentence." >/dev/null 2>&1
		done
	)
}
session "$proxy" "$tmp/proxy"
session "$plain" "$tmp/plain"
equal=0
for i in $(seq 1 "$turns"); do
	a=$(cat "$tmp/proxy/$i.txt")
	b=$(cat "$tmp/plain/$i.txt")
	if [ "$a" = "$b" ]; then
		equal=$((equal + 1))
		echo "turn $i: equal: $a"
	else
		echo "turn $i: DIFFERS: proxy $a; plain $b"
	fi
done
echo "$equal of $turns answers equal the plain run's"
[ "$equal" = "$turns" ]
