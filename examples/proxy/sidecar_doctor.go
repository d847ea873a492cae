package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/bidikv/bidikv/internal/cli"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/transport"
)

// sidecarDoctorUsage opens `bidikv-proxy doctor --sidecar --help`.
const sidecarDoctorUsage = `Usage: bidikv-proxy doctor --sidecar [--prefiller-host-port H:P,...] [--picker-config FILE] [sidecar flags]

Checks a sidecar setup from inside its decode pod, with the sidecar's own
command line: that the flags are coherent (as the sidecar reads them, with
its warnings), that the local engine of each data-parallel rank answers and
can keep KV for a next turn, that the prefill engines the endpoint picker
names in x-prefiller-host-port are reachable and allowed (with
--enable-ssrf-protection), that the shared store takes and gives back a
handle, and that the picker's configuration reads metrics the sidecar
exports. Each check prints ok, warn or FAIL with the fix. Exit status: 0
every check passed (warnings allowed), 1 a check failed, 2 a bad command line.
`

// sidecarDoctor are doctor --sidecar's own flags.
type sidecarDoctor struct {
	prefillers []string // host:port, as the picker writes them in the header
	picker     string   // an EndpointPickerConfig file
	timeout    time.Duration
}

var sidecarDoctorGroup = cli.Group{Title: "doctor --sidecar", Flags: []string{"sidecar", "prefiller-host-port", "picker-config", "probe-engine-timeout"}}

// extra adds doctor --sidecar's flags.
func (s *sidecarConfig) extra(fs *flag.FlagSet) {
	fs.Bool("sidecar", true, "check a sidecar setup (this mode)")
	fs.Var(&listFlag{vals: &s.doctor.prefillers}, "prefiller-host-port", "prefill engines the endpoint picker may name in x-prefiller-host-port (host:port, as the header carries them)")
	fs.StringVar(&s.doctor.picker, "picker-config", "", "an EndpointPickerConfig file (deploy/llm-d/epp-config.yaml): its customMetrics must name metrics the sidecar exports")
	fs.DurationVar(&s.doctor.timeout, "probe-engine-timeout", capability.DefaultTimeout, "bound on the probe of one engine")
}

// sidecarMetrics are the metrics the sidecar adds to its pod's /metrics
// for the endpoint picker (registerMetrics).
var sidecarMetrics = []string{namespace + "_sidecar_held_tokens", namespace + "_sidecar_reclaimable_ratio",
	namespace + "_sidecar_budget_pressure", namespace + "_sidecar_local_turns_total", namespace + "_sidecar_ssrf_denied_total"}

// check is one line of the sidecar doctor's report.
type check struct {
	level string // ok, warn, FAIL
	what  string
	fix   string
}

// runSidecarDoctor is `bidikv-proxy doctor --sidecar`.
func runSidecarDoctor(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	s, err := parseSidecarCommand("bidikv-proxy doctor --sidecar", sidecarDoctorUsage, &sidecarDoctorGroup, args, getenv, stdout)
	if err != nil {
		return err
	}
	var checks []check
	add := func(level, what, fix string) { checks = append(checks, check{level, what, fix}) }
	add("ok", fmt.Sprintf("flags: the sidecar accepts this command line (local engine %s, header %s)", strings.Join(s.localURLs(), " "), strings.ToLower(headerPrefillHostPort)), "")
	for _, w := range s.warnings {
		add("warn", "flags: "+w, "")
	}
	tr, err := transport.NewTransport(transport.WithTLSConfig(s.clientTLS(stagePrefiller)))
	if err != nil {
		return err
	}
	defer tr.CloseIdleConnections()
	checks = append(checks, s.checkEngines(ctx, tr)...)
	checks = append(checks, s.checkStore(ctx)...)
	checks = append(checks, s.checkPicker()...)
	failed := false
	for _, c := range checks {
		fmt.Fprintf(stdout, "%-4s  %s\n", c.level, c.what)
		if c.fix != "" {
			fmt.Fprintf(stdout, "      fix: %s\n", c.fix)
		}
		failed = failed || c.level == "FAIL"
	}
	if failed {
		return errSidecarDoctor
	}
	return nil
}

// errSidecarDoctor: a check failed (exit status 1).
var errSidecarDoctor = errors.New("doctor --sidecar: a check failed")

// checkEngines probes the local engine's ranks and the prefill engines the
// header may name.
func (s *sidecarConfig) checkEngines(ctx context.Context, rt http.RoundTripper) []check {
	var out []check
	opts := []capability.Option{capability.WithTimeout(s.doctor.timeout)}
	if s.upstreamAPIKey != "" {
		opts = append(opts, capability.WithAPIKey(s.upstreamAPIKey))
	}
	probe := func(u string) *capability.Report {
		ep, err := transport.ParseEndpoint(u)
		if err != nil {
			return &capability.Report{Endpoint: u, Error: err.Error()}
		}
		return capability.Probe(ctx, rt, ep, opts...)
	}
	for _, u := range s.localURLs() {
		rep := probe(u)
		switch {
		case rep.Error != "":
			out = append(out, check{"FAIL", "local engine " + u + ": " + rep.Error,
				"start vLLM on --model-server-port (each data-parallel rank on the next port) and check --local-host (POD_IP) is its address"})
		case rep.Handles.Chat.Is(capability.Absent):
			out = append(out, check{"FAIL", "local engine " + u + ": no KV handles (" + rep.Handles.Chat.Why + ")",
				cmp.Or(rep.Handles.Chat.Fix, "run vLLM with the NixlConnector (docs/protocol.md)")})
		default:
			out = append(out, check{"ok", "local engine " + u + ": answers (model " + rep.Model + ")", ""})
		}
	}
	pools, err := newPools(time.Now, stage(s.enableTLS, stagePrefiller), nil, s.prefillURLs, s.decodeURLs)
	if err != nil {
		return append(out, check{"FAIL", "pools: " + err.Error(), ""})
	}
	allow := newAllowlist(s.ssrf, pools, s.ssrfAllow)
	if len(s.doctor.prefillers) == 0 {
		out = append(out, check{"warn", "header: no --prefiller-host-port given: the prefill engines the picker names are not checked", "give the prefill pods' host:port as the endpoint picker writes them"})
	}
	scheme := "http://"
	if stage(s.enableTLS, stagePrefiller) {
		scheme = "https://"
	}
	for _, hp := range s.doctor.prefillers {
		if !allow.allowed(hp) {
			out = append(out, check{"FAIL", "header: " + hp + " is outside the SSRF allowlist: the sidecar answers 403",
				"add its host to --ssrf-allowlist, or list the prefill pool (--prefill-dns)"})
			continue
		}
		if rep := probe(scheme + hp); rep.Error != "" {
			out = append(out, check{"FAIL", "header: prefill engine " + hp + ": " + rep.Error, "check the prefill pods' address and port, and --enable-tls prefiller"})
		} else {
			out = append(out, check{"ok", "header: prefill engine " + hp + " answers", ""})
		}
	}
	if !s.prefillPool {
		out = append(out, check{"warn", "prefill pool: none given: decode KV held for a conversation is released only by a later turn's prefill or at the engine's TTL",
			"give --prefill-dns (the prefill pods' headless Service)"})
	}
	return out
}

// checkStore writes a probe entry to the shared store and takes it back.
func (s *sidecarConfig) checkStore(ctx context.Context) []check {
	if s.redisURL == "" {
		return []check{{"warn", "store: no --redis-url: each sidecar keeps its own handles", "give every sidecar the same --redis-url for reuse across decode pods"}}
	}
	store, closeStore, err := newStore(s.config, newLogger(s.config, io.Discard))
	if err != nil {
		return []check{{"FAIL", "store: " + err.Error(), ""}}
	}
	defer closeStore()
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	key := "bidikv-doctor-" + newRequestID()
	if err := store.Put(sctx, key, []byte("probe"), 10*time.Second); err != nil {
		return []check{{"FAIL", "store: writing a probe entry: " + err.Error(), "check --redis-url and that Redis is reachable from the pod"}}
	}
	v, ok, err := store.Take(sctx, key)
	if err != nil || !ok || string(v) != "probe" {
		return []check{{"FAIL", fmt.Sprintf("store: reading the probe entry back: found %v, err %v", ok, err), "check --redis-url"}}
	}
	return []check{{"ok", "store: " + redactURL(s.redisURL) + " takes and gives back a handle", ""}}
}

// redactURL drops a URL's credentials for the report.
func redactURL(u string) string {
	if at := strings.LastIndex(u, "@"); at >= 0 {
		if i := strings.Index(u, "://"); i >= 0 && i < at {
			return u[:i+3] + "…" + u[at:]
		}
	}
	return u
}

// checkPicker reads an EndpointPickerConfig: the custom metrics it
// extracts must be metrics the sidecar exports, and its attribute scorers
// must read attributes it extracts.
func (s *sidecarConfig) checkPicker() []check {
	if s.doctor.picker == "" {
		return nil
	}
	b, err := os.ReadFile(s.doctor.picker)
	if err != nil {
		return []check{{"FAIL", "picker config: " + err.Error(), ""}}
	}
	var cfg pickerConfig
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		return []check{{"FAIL", "picker config: " + err.Error(), ""}}
	}
	var out []check
	keys := map[string]bool{}
	for _, p := range cfg.Plugins {
		for _, ec := range p.Parameters.EngineConfigs {
			for _, cm := range ec.CustomMetrics {
				keys[cm.AttributeKey] = true
				name, _, _ := strings.Cut(cm.MetricSpec, "{")
				if strings.HasPrefix(name, namespace+"_") && !slices.Contains(sidecarMetrics, name) {
					out = append(out, check{"FAIL", "picker config: customMetrics " + cm.AttributeKey + " reads " + name + ", which the sidecar does not export",
						"use one of " + strings.Join(sidecarMetrics, ", ")})
				}
			}
		}
	}
	for _, p := range cfg.Plugins {
		if p.Type == "endpoint-attribute-scorer" && !keys[p.Parameters.AttributeKey] && strings.HasPrefix(p.Parameters.AttributeKey, namespace+".") {
			out = append(out, check{"FAIL", "picker config: scorer " + p.Name + " reads attribute " + p.Parameters.AttributeKey + ", which no customMetrics entry extracts", "add it under core-metrics-extractor's customMetrics"})
		}
	}
	if len(keys) == 0 {
		out = append(out, check{"warn", "picker config: no customMetrics: the picker does not read the sidecar's figures", "see deploy/llm-d/epp-config.yaml"})
	}
	if len(out) == 0 {
		out = append(out, check{"ok", "picker config: reads " + plural(len(keys), "sidecar figure"), ""})
	}
	return out
}

// pickerConfig is what doctor --sidecar (and the deploy test) read of an
// llm-d EndpointPickerConfig: its plugins, their custom metrics and the
// attribute each scores.
type pickerConfig struct {
	Plugins []struct {
		Type       string `yaml:"type"`
		Name       string `yaml:"name"`
		Parameters struct {
			EngineConfigs []struct {
				CustomMetrics []struct {
					AttributeKey string `yaml:"attributeKey"`
					MetricSpec   string `yaml:"metricSpec"`
				} `yaml:"customMetrics"`
			} `yaml:"engineConfigs"`
			AttributeKey string `yaml:"attributeKey"`
		} `yaml:"parameters"`
	} `yaml:"plugins"`
}
