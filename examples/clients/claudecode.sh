#!/bin/sh
# claudecode.sh runs Claude Code, unmodified and headless, for TURNS turns
# (default 6: claude -p, then claude -p --continue five times) through a
# bidikv proxy, then the same turns against one plain engine, and compares
# the answers turn by turn. Both sessions use the same throw-away HOME and
# working directory: Claude Code's system prompt names them, so any other
# HOME would be another prompt.
#
#   sh claudecode.sh <proxy-base-url> <plain-engine-base-url> [model]
#
# CLAUDE is the claude binary (default: claude on PATH; npm install
# @anthropic-ai/claude-code into a temporary directory gives one). The
# model (default sim-model) must be the engines' served model name; side
# requests use it too. The proxy's log (--log-level debug) shows each
# turn's reuse; X-Bidikv-Reuse is in every response.
set -eu
proxy=$1 plain=$2 model=${3:-sim-model}
claude=${CLAUDE:-claude}
turns=${TURNS:-6}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/project"
session() { # session BASE OUT
	rm -rf "$tmp/home" && mkdir -p "$tmp/home" "$2"
	(
		cd "$tmp/project"
		export HOME="$tmp/home" ANTHROPIC_BASE_URL="$1" ANTHROPIC_API_KEY=sk-test \
			CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
			ANTHROPIC_DEFAULT_HAIKU_MODEL="$model" ANTHROPIC_SMALL_FAST_MODEL="$model"
		"$claude" -p "Turn 1: say hello in one sentence." --output-format json --model "$model" >"$2/1.json"
		for i in $(seq 2 "$turns"); do
			"$claude" -p "Turn $i: continue with one more sentence." --continue --output-format json --model "$model" >"$2/$i.json"
		done
	)
}
session "$proxy" "$tmp/proxy"
session "$plain" "$tmp/plain"
equal=0
for i in $(seq 1 "$turns"); do
	a=$(node -e "console.log(JSON.parse(require('fs').readFileSync('$tmp/proxy/$i.json')).result)")
	b=$(node -e "console.log(JSON.parse(require('fs').readFileSync('$tmp/plain/$i.json')).result)")
	if [ "$a" = "$b" ]; then
		equal=$((equal + 1))
		echo "turn $i: equal: $a"
	else
		echo "turn $i: DIFFERS: proxy $a; plain $b"
	fi
done
echo "$equal of $turns answers equal the plain run's"
[ "$equal" = "$turns" ]
