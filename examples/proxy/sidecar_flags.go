package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/internal/cli"
)

// sidecarSynopsis opens `bidikv-proxy sidecar --help`.
const sidecarSynopsis = `Usage: bidikv-proxy sidecar [llm-d sidecar flags] [bidikv flags]

Runs in an llm-d decode pod in place of llm-d's P/D sidecar (pd-sidecar, the
routing-proxy container): it takes that sidecar's command line and serves its
contract. POST /v1/chat/completions, /v1/completions, /v1/responses and
/v1/messages run the prefill leg on the engine the endpoint picker names in
x-prefiller-host-port and the decode leg on the local engine; without the
header the local engine serves the request alone, as it serves
/inference/v1/generate (with or without the header: bidikv runs no prefill
leg for that route, and counts it). GET
/health answers 200; GET /metrics is the local engine's, with the sidecar's
figures for the endpoint picker added; every other path goes to the local
engine. Unlike llm-d's sidecar it reuses a conversation's KV across turns:
retained handles live in the shared store (--redis-url), so the next turn's
sidecar on any decode pod attaches them, verified by tokens, once, and never
shown to a client. llm-d's flags are listed first with what bidikv does with
each; the bidikv flags after them work as in the proxy.
`

// llm-d's sidecar headers (llm-d-router pkg/common/routing).
const (
	headerPrefillHostPort = "X-Prefiller-Host-Port"
	headerKVCacheSource   = "X-Kv-Cache-Source-Host-Port"
	headerEncoderHosts    = "X-Encoder-Hosts-Ports"
	headerDataParallel    = "X-Data-Parallel-Host-Port"
)

// llm-d's TLS stages (--enable-tls, --tls-insecure-skip-verify).
const (
	stagePrefiller = "prefiller"
	stageDecoder   = "decoder"
	stageEncoder   = "encoder"
)

// kvConnectors are the values llm-d's --kv-connector takes; bidikv speaks
// the first.
var kvConnectors = []string{"nixlv2", "shared-storage", "sglang", "mooncake", "offloading"}

// sidecarConfig is the sidecar's command line: llm-d's flags, and the
// proxy's (config) for what bidikv adds.
type sidecarConfig struct {
	*config

	modelServerPort, vllmPort int
	dpSize                    int
	kvConnector, ecConnector  string
	secure                    bool
	certPath                  string
	enableTLS, skipVerify     []string
	ssrf                      bool
	inferencePool, poolGroup  string
	ssrfAllow                 []string // bidikv: a static allowlist
	samplePrefill             bool
	prefillRetries            int
	prefillBackoff            time.Duration
	maxIdlePerHost            int
	decodeChunk               int
	mooncakePort, p2pPort     int
	p2pPull                   bool
	metricsPort               int
	tracing                   bool
	inline, file              string
	zap                       zapFlags
	localHost                 string        // bidikv: how other pods name the local engine
	doctor                    sidecarDoctor // doctor --sidecar's own flags
	podIP                     string        // POD_IP, as llm-d's data-parallel handler reads it

	// set names the flags given on the command line.
	set map[string]bool
	// prefillPool, decodePool: the prefill pool and other decode pods were
	// given (--prefill/--prefill-dns, --decode/--decode-dns).
	prefillPool, decodePool bool
}

// zapFlags are controller-runtime's logging flags, which llm-d's sidecar
// takes (the guide passes --zap-log-level).
type zapFlags struct {
	devel                         bool
	encoder, level, stack, timeEn string
}

// moriioFlags are llm-d's MoRI-IO WRITE-mode flags with their defaults:
// bidikv accepts them at their defaults only (WRITE mode is another wire
// protocol: P pushes KV into D's blocks, and D holds none for a next turn).
var moriioFlags = []struct{ name, def string }{
	{"moriio-write-mode", "false"}, {"moriio-parallel-dispatch", "false"},
	{"moriio-decode-notify-port", "61005"}, {"moriio-decode-handshake-port", "6301"},
	{"moriio-prefill-handshake-port", "6301"}, {"moriio-prefill-notify-port", "61005"},
	{"moriio-tp-size", "1"}, {"moriio-dp-size", "1"}, {"moriio-dp-size-local", "0"},
	{"moriio-local-pod-ip", ""}, {"moriio-remote-hosts", ""}, {"moriio-decode-hosts", ""},
	{"moriio-parallel-decode-wait-timeout", "30s"},
}

// sidecarGroups are the groups of `bidikv-proxy sidecar --help`: llm-d's
// flags first, in its order, then bidikv's own and the proxy's.
func sidecarGroups() []cli.Group {
	llmd := []string{"port", "model-server-port", "vllm-port", "data-parallel-size", "kv-connector", "ec-connector",
		"mooncake-bootstrap-port", "p2p-connector-port", "enable-p2p-pull", "secure-proxy", "cert-path",
		"enable-tls", "tls-insecure-skip-verify", "enable-ssrf-protection", "inference-pool", "pool-group",
		"enable-prefiller-sampling", "prefill-max-retries", "prefill-retry-backoff", "max-idle-conns-per-host",
		"decode-chunk-size", "metrics-port", "tracing", "configuration", "configuration-file",
		"zap-log-level", "zap-encoder", "zap-devel", "zap-stacktrace-level", "zap-time-encoding"}
	groups := []cli.Group{
		{Title: "llm-d sidecar flags (pd-sidecar's command line, and what bidikv does with each)", Flags: llmd},
		{Title: "MoRI-IO flags (accepted at their defaults only)", Flags: moriioNames()},
		{Title: "Sidecar (bidikv)", Flags: []string{"local-host", "ssrf-allowlist", "prefill", "prefill-dns", "decode", "decode-dns",
			"dns-refresh", "redis-url", "redis-wait-replicas"}},
	}
	skip := map[string]bool{"Doctor": true}
	for _, g := range helpGroups {
		if skip[g.title] {
			continue
		}
		var fl []string
		for _, f := range g.flags {
			name, _, _ := strings.Cut(f, ",")
			if !slices.Contains(sidecarOwn, name) {
				fl = append(fl, f)
			}
		}
		groups = append(groups, cli.Group{Title: g.title, Flags: fl})
	}
	return groups
}

// sidecarOwn are the proxy flags listed in the sidecar's own groups, or
// refused by it (their place in the proxy's groups is not repeated).
var sidecarOwn = []string{"port", "prefill", "prefill-dns", "decode", "decode-dns", "dns-refresh", "redis-url", "redis-wait-replicas",
	"prefiller-hosts", "prefiller-ports", "decoder-hosts", "decoder-ports", "prefill-dp-size", "decode-dp-size", "decode-local"}

func moriioNames() []string {
	out := make([]string, len(moriioFlags))
	for i, f := range moriioFlags {
		out[i] = f.name
	}
	return out
}

// sidecarFlags adds llm-d's sidecar flags and bidikv's sidecar flags to
// fs (the proxy's flags are there already) and sets the defaults the
// sidecar changes. getenv supplies llm-d's environment defaults
// (INFERENCE_POOL, ENABLE_PREFILLER_SAMPLING, POD_IP).
func (s *sidecarConfig) flags(fs *flag.FlagSet, getenv func(string) string) {
	fs.Lookup("port").Usage = "llm-d: the port the sidecar listens on; with --data-parallel-size N, rank r listens on port+r"
	fs.IntVar(&s.modelServerPort, "model-server-port", 8200, "llm-d: the port of the local vLLM (the decode engine); rank r of --data-parallel-size on port+r")
	fs.IntVar(&s.vllmPort, "vllm-port", 8200, "llm-d: deprecated alias of --model-server-port (which wins when both are given)")
	fs.IntVar(&s.dpSize, "data-parallel-size", 1, "llm-d: the local vLLM's data-parallel size: rank r is a decode engine of its own at --model-server-port+r, served on --port+r")
	fs.StringVar(&s.kvConnector, "kv-connector", "nixlv2", "llm-d: the KV protocol between prefill and decode. bidikv speaks nixlv2 (NixlConnector, pull mode, bidirectional); shared-storage, sglang, mooncake and offloading are refused")
	fs.StringVar(&s.ecConnector, "ec-connector", "", "llm-d: the encoder stage's protocol (ec-example, ec-nixl): refused, bidikv runs no encoder stage")
	fs.IntVar(&s.mooncakePort, "mooncake-bootstrap-port", 8998, "llm-d: used with --kv-connector mooncake only; checked (1 to 65535), no effect with nixlv2, as in llm-d")
	fs.IntVar(&s.p2pPort, "p2p-connector-port", 7777, "llm-d: used with --kv-connector offloading or --enable-p2p-pull only; checked, no effect otherwise, as in llm-d")
	fs.BoolVar(&s.p2pPull, "enable-p2p-pull", false, "llm-d: pulls of a cached prefix from a peer's CPU tier (x-kv-cache-source-host-port): refused, bidikv reuses the decode engine's own KV instead")
	fs.BoolVar(&s.secure, "secure-proxy", true, "llm-d: serve TLS (HTTP/1.1), with the certificate of --cert-path or else a self-signed one made at start")
	fs.StringVar(&s.certPath, "cert-path", "", "llm-d: directory of tls.crt and tls.key for --secure-proxy, read again when they change (cert-manager renewals)")
	fs.Var(&listFlag{vals: &s.enableTLS}, "enable-tls", "llm-d: stages reached over TLS: prefiller (the header's engines), decoder (the local engine and the other decode pods); encoder is accepted and has no effect")
	fs.Var(&listFlag{vals: &s.skipVerify}, "tls-insecure-skip-verify", "llm-d: stages whose TLS certificates are not verified (prefiller, decoder, encoder)")
	fs.BoolVar(&s.ssrf, "enable-ssrf-protection", false, "llm-d: refuse (403) a prefill target outside the allowlist. llm-d watches the InferencePool's pods through the Kubernetes API; bidikv has no Kubernetes client: the allowlist is the hosts of --prefill-dns/--prefill and --decode-dns/--decode, and --ssrf-allowlist")
	fs.StringVar(&s.inferencePool, "inference-pool", getenv("INFERENCE_POOL"), "llm-d: the InferencePool (namespace/name or name) whose pods are the allowlist; bidikv cannot watch it, so with --enable-ssrf-protection it needs another allowlist source and then only checks its format (INFERENCE_POOL)")
	fs.StringVar(&s.poolGroup, "pool-group", "inference.networking.k8s.io", "llm-d: the InferencePool's API group: checked, no effect")
	fs.BoolVar(&s.samplePrefill, "enable-prefiller-sampling", envBool(getenv("ENABLE_PREFILLER_SAMPLING")), "llm-d: with several engines in x-prefiller-host-port, pick one at random instead of the first (ENABLE_PREFILLER_SAMPLING)")
	fs.IntVar(&s.prefillRetries, "prefill-max-retries", 0, "llm-d: retries of a prefill leg that failed with 502, 503, 504 or a connection error, on the same engine; a retry never carries a retained handle again (it is spent)")
	fs.DurationVar(&s.prefillBackoff, "prefill-retry-backoff", 200*time.Millisecond, "llm-d: the wait before each prefill retry (an engine's Retry-After, up to 5s, wins)")
	fs.IntVar(&s.maxIdlePerHost, "max-idle-conns-per-host", 1024, "llm-d: idle keep-alive connections kept per engine")
	fs.IntVar(&s.decodeChunk, "decode-chunk-size", 0, "llm-d: chunked decode (a token budget per chunk): refused above 0")
	fs.IntVar(&s.metricsPort, "metrics-port", 0, "llm-d: port of a listener serving bidikv's own Prometheus registry at /metrics (0: none). The endpoint picker's figures are on --port's /metrics, after the local engine's")
	fs.BoolVar(&s.tracing, "tracing", false, "llm-d: OpenTelemetry spans of the turns, exported as the OTEL_* variables say (OTLP over HTTP to OTEL_EXPORTER_OTLP_ENDPOINT; llm-d's sidecar uses gRPC); without it no spans, whatever OTEL_* says")
	fs.StringVar(&s.inline, "configuration", "", "llm-d: the sidecar's configuration as inline YAML (llm-d's keys: port, model-server-port, kv-connector, ...); a flag given on the command line wins")
	fs.StringVar(&s.file, "configuration-file", "", "llm-d: file of that YAML (exclusive with --configuration)")
	fs.StringVar(&s.zap.level, "zap-log-level", "", "llm-d: debug, info or error, or a verbosity from 1 (debug); sets --log-level unless that is given")
	fs.StringVar(&s.zap.encoder, "zap-encoder", "", "llm-d: json or console; sets --log-format (console: text) unless that is given")
	fs.BoolVar(&s.zap.devel, "zap-devel", false, "llm-d: development logging: --log-level debug and --log-format text unless those are given")
	fs.StringVar(&s.zap.stack, "zap-stacktrace-level", "", "llm-d: accepted, no effect (bidikv logs carry no stack traces)")
	fs.StringVar(&s.zap.timeEn, "zap-time-encoding", "", "llm-d: accepted, no effect (bidikv logs RFC 3339 times)")
	for _, m := range moriioFlags {
		usage := "llm-d: MoRI-IO WRITE mode (P pushes KV into D): refused at any value but its default"
		if m.def == "false" {
			fs.Bool(m.name, false, usage) // llm-d's booleans: --moriio-write-mode alone sets it
			continue
		}
		fs.String(m.name, m.def, usage)
	}
	fs.StringVar(&s.localHost, "local-host", getenv("POD_IP"), "the local engine's host as the other pods reach it (POD_IP, from the downward API): retained handles name their decode engine by it, so another pod's sidecar can attach them; default localhost when POD_IP is unset (one pod only)")
	fs.Var(&listFlag{vals: &s.ssrfAllow}, "ssrf-allowlist", "with --enable-ssrf-protection: hosts (names or IP addresses) and CIDR ranges the header may name, besides the pools' hosts")
	fs.Lookup("prefill").Usage = "the prefill pool as fixed URLs: background releases of decode holds (turns without the header included) go there, and with --enable-ssrf-protection its hosts are allowed"
	fs.Lookup("prefill-dns").Usage = "the prefill pool in DNS (its headless Service, host:port or _port._tcp.name), re-resolved every --dns-refresh: as --prefill"
	fs.Lookup("decode").Usage = "the other decode pods' engines as fixed URLs (http://IP:8200): a turn attaches a handle only of a decode engine it knows, so list every decode pod for reuse across pods"
	fs.Lookup("decode-dns").Usage = "the decode pods' engines in DNS (a headless Service at --model-server-port): as --decode; the local engine is always in"
	// The sidecar's own defaults: every interface (llm-d listens on
	// ":port"), and the local prefill when P gives no handle (llm-d sends
	// D the request with null kv_transfer_params).
	fs.Lookup("host").DefValue = ""
	_ = fs.Lookup("host").Value.Set("")
	fs.Lookup("host").Usage = "address to listen on (default: every interface, as llm-d's sidecar)"
	fs.Lookup("local-prefill-fallback").DefValue = "true"
	_ = fs.Lookup("local-prefill-fallback").Value.Set("true")
}

// envBool reads a boolean environment value as llm-d does
// (strconv.ParseBool; anything else is false).
func envBool(v string) bool {
	b, err := strconv.ParseBool(v)
	return err == nil && b
}

// parseSidecar reads the sidecar's command line.
func parseSidecar(args []string, getenv func(string) string, help io.Writer) (*sidecarConfig, error) {
	return parseSidecarCommand("bidikv-proxy sidecar", sidecarSynopsis, nil, args, getenv, help)
}

// parseSidecarCommand reads the command line of the sidecar, or of a
// command that takes its flags and adds its own (extra, listed first in
// --help under group): `doctor --sidecar`.
func parseSidecarCommand(name, head string, group *cli.Group, args []string, getenv func(string) string, help io.Writer) (*sidecarConfig, error) {
	s := &sidecarConfig{set: map[string]bool{}, podIP: getenv("POD_IP")}
	var fs *flag.FlagSet
	cfg, err := parseCommand(name, head, args, getenv, io.Discard, func(f *flag.FlagSet) {
		fs = f
		s.flags(f, getenv)
		if group != nil {
			s.extra(f)
		}
	})
	if errors.Is(err, flag.ErrHelp) {
		groups := sidecarGroups()
		if group != nil {
			groups = append([]cli.Group{*group}, groups...)
		}
		cli.WriteHelp(help, fs, head, groups, flagValue)
		return nil, err
	}
	if err != nil {
		return nil, err
	}
	s.config = cfg
	fs.Visit(func(f *flag.Flag) { s.set[f.Name] = true })
	if err := s.configuration(); err != nil {
		return nil, err
	}
	for _, m := range moriioFlags {
		if v := fs.Lookup(m.name).Value.String(); s.set[m.name] && v != m.def {
			return nil, fmt.Errorf("%w: --%s %s: MoRI-IO WRITE mode is another wire protocol (P pushes KV into the decode engine, which keeps none for a next turn): bidikv's sidecar speaks NixlConnector's pull mode only; leave the MoRI-IO flags out, or run llm-d's sidecar", errUsage, m.name, v)
		}
	}
	if err := s.complete(); err != nil {
		return nil, err
	}
	return s, s.validate()
}

// complete derives what the flags imply: the local engine's port and URLs,
// the pools, the logging of the zap flags.
func (s *sidecarConfig) complete() error {
	// llm-d's precedence: --model-server-port, else --vllm-port, each from
	// the command line before the configuration.
	msGiven := s.set["model-server-port"] || s.set["model-server-port@yaml"]
	if s.set["vllm-port"] && !s.set["model-server-port"] || !msGiven {
		s.modelServerPort = s.vllmPort
	}
	if s.set["vllm-port"] {
		s.warnings = append(s.warnings, "--vllm-port is deprecated (as in llm-d): use --model-server-port")
	}
	if err := s.zapLogging(); err != nil {
		return err
	}
	if s.localHost == "" {
		s.localHost = "localhost"
	}
	s.prefillPool = s.set["prefill"] || s.set["prefiller-hosts"] || s.set["prefiller-host"] || s.set["prefiller-ports"] ||
		s.set["prefiller-port"] || s.dns.prefill != ""
	s.decodePool = s.set["decode"] || s.set["decoder-hosts"] || s.set["decoder-host"] || s.set["decoder-ports"] ||
		s.set["decoder-port"] || s.dns.decode != ""
	if !s.prefillPool {
		s.prefillURLs = nil
	}
	if !s.decodePool {
		s.decodeURLs = nil
	}
	if s.maxIdlePerHost <= 0 {
		s.maxIdlePerHost = 1024 // llm-d's default for a value <= 0
	}
	return nil
}

// zapLogging maps controller-runtime's logging flags onto --log-level and
// --log-format, unless those are given.
func (s *sidecarConfig) zapLogging() error {
	if s.zap.devel {
		if !s.set["log-level"] {
			s.logLevel = slog.LevelDebug
		}
		if !s.set["log-format"] {
			s.logFormat = "text"
		}
	}
	if s.zap.level != "" && !s.set["log-level"] {
		switch lv := strings.ToLower(s.zap.level); lv {
		case "debug":
			s.logLevel = slog.LevelDebug
		case "info":
			s.logLevel = slog.LevelInfo
		case "error", "panic", "dpanic", "fatal":
			s.logLevel = slog.LevelError
		default:
			n, err := strconv.Atoi(lv)
			if err != nil || n < 1 {
				return fmt.Errorf("%w: --zap-log-level %q: use debug, info or error, or a verbosity of 1 or more", errUsage, s.zap.level)
			}
			s.logLevel = slog.LevelDebug
		}
	}
	switch s.zap.encoder {
	case "":
	case "json", "console":
		if !s.set["log-format"] {
			s.logFormat = map[string]string{"json": "json", "console": "text"}[s.zap.encoder]
		}
	default:
		return fmt.Errorf("%w: --zap-encoder %q: use json or console", errUsage, s.zap.encoder)
	}
	return nil
}

// validate checks the sidecar's flags: llm-d's checks first, with its
// words, then what bidikv refuses because ignoring it would change what a
// request does.
func (s *sidecarConfig) validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{errUsage}, a...)...)
	}
	if err := s.llmdChecks(); err != nil {
		return err
	}
	switch {
	case s.kvConnector != "nixlv2":
		return bad("--kv-connector %s: bidikv's sidecar speaks NixlConnector's pull protocol (nixlv2) only, which bidirectional reuse needs; run llm-d's sidecar for %s", s.kvConnector, s.kvConnector)
	case s.ecConnector != "":
		return bad("--ec-connector %s: bidikv's sidecar runs no encoder stage (requests with x-encoder-hosts-ports would skip it); leave it out, or run llm-d's sidecar", s.ecConnector)
	case s.p2pPull:
		return bad("--enable-p2p-pull: bidikv's sidecar does not pull cached prefixes from a peer's CPU tier (x-kv-cache-source-host-port); it reuses the decode engine's own KV, kept from the turn before; leave it out")
	case s.decodeChunk > 0:
		return bad("--decode-chunk-size %d: bidikv's sidecar does not decode in chunks; leave it out (or 0)", s.decodeChunk)
	case s.decodeLocal:
		return bad("--decode-local: in the sidecar the decode engine is the local one, and a decode-local turn would go to whichever engine holds the conversation; a turn without x-prefiller-host-port is served by the local engine alone already")
	case s.ssrf && len(s.ssrfAllow) == 0 && !s.prefillPool:
		return bad("--enable-ssrf-protection: llm-d's sidecar watches the InferencePool %q through the Kubernetes API, which bidikv's does not: give the prefill pool (--prefill-dns, its headless Service; its members are allowed) or --ssrf-allowlist, or both", s.inferencePool)
	case s.metricsPort < 0 || s.metricsPort > 65535:
		return bad("--metrics-port %d out of range", s.metricsPort)
	case s.port == 0 && s.dpSize > 1:
		return bad("--port 0 (any free port) with --data-parallel-size %d: the ranks listen on consecutive ports; give the first", s.dpSize)
	case s.prefillRetries < 0:
		return bad("--prefill-max-retries %d: must not be negative", s.prefillRetries)
	}
	for _, a := range s.ssrfAllow {
		if _, _, err := net.ParseCIDR(a); err != nil && strings.ContainsAny(a, "/:") && net.ParseIP(a) == nil {
			return bad("--ssrf-allowlist %q: give a host name, an IP address or a CIDR range (no port: the check is on hosts, as llm-d's)", a)
		}
	}
	if s.certPath != "" && s.secure {
		if _, err := loadCertificate(s.certPath); err != nil {
			return bad("--cert-path: %v", err)
		}
	}
	if s.ssrf && s.inferencePool != "" && (len(s.ssrfAllow) > 0 || s.prefillPool) {
		s.warnings = append(s.warnings, fmt.Sprintf("--inference-pool %s is not watched (bidikv has no Kubernetes client): the SSRF allowlist is the prefill and decode pools' hosts and --ssrf-allowlist", s.inferencePool))
	}
	if s.zap.stack != "" || s.zap.timeEn != "" {
		s.warnings = append(s.warnings, "--zap-stacktrace-level and --zap-time-encoding have no effect in bidikv's sidecar")
	}
	if s.redisURL == "" {
		s.warnings = append(s.warnings, "no --redis-url: retained handles stay in this sidecar's memory, so a conversation reuses KV only while the endpoint picker sends it back to this pod")
	} else if s.localHost == "localhost" {
		s.warnings = append(s.warnings, "--local-host is localhost (POD_IP unset): other pods' sidecars cannot attach this pod's handles; set POD_IP from the downward API (status.podIP)")
	}
	return nil
}

// llmdChecks are the checks llm-d's sidecar makes (Options.Validate), with
// its words.
func (s *sidecarConfig) llmdChecks() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{errUsage}, a...)...)
	}
	if s.dpSize < 1 {
		return bad("--data-parallel-size must be a positive integer, got %d", s.dpSize)
	}
	if s.port != 0 || s.dpSize > 1 {
		if err := portRange(s.port, s.dpSize); err != nil {
			return bad("--port %v", err)
		}
	}
	if err := portRange(s.modelServerPort, s.dpSize); err != nil {
		return bad("--model-server-port %v", err)
	}
	if !slices.Contains(kvConnectors, s.kvConnector) {
		return bad("--kv-connector must be one of: %s", strings.Join(kvConnectors, ", "))
	}
	if s.ecConnector != "" && s.ecConnector != "ec-example" && s.ecConnector != "ec-nixl" {
		return bad("--ec-connector must be one of: ec-example, ec-nixl")
	}
	for _, st := range []struct {
		name   string
		stages []string
	}{{"--enable-tls", s.enableTLS}, {"--tls-insecure-skip-verify", s.skipVerify}} {
		for _, v := range st.stages {
			if v != stagePrefiller && v != stageDecoder && v != stageEncoder {
				return bad("%s stages must be one of: prefiller, decoder, encoder", st.name)
			}
		}
	}
	if p := s.inferencePool; p != "" {
		if strings.Count(p, "/") > 1 {
			return bad("--inference-pool must be in format 'namespace/name' or 'name', not multiple slashes")
		}
		for _, part := range strings.Split(p, "/") {
			if part == "" {
				return bad("--inference-pool cannot have empty namespace or name")
			}
		}
	}
	switch {
	case s.prefillRetries > 0 && s.prefillBackoff <= 0:
		return bad("--prefill-retry-backoff must be positive when --prefill-max-retries > 0, got %v", s.prefillBackoff)
	case s.decodeChunk < 0:
		return bad("--decode-chunk-size must be a non-negative integer (0 disables chunked decode), got %d", s.decodeChunk)
	case s.mooncakePort < 1 || s.mooncakePort > math.MaxUint16:
		return bad("--mooncake-bootstrap-port must be between 1 and 65535, got %d", s.mooncakePort)
	case s.p2pPort < 1 || s.p2pPort > math.MaxUint16:
		return bad("--p2p-connector-port must be between 1 and 65535, got %d", s.p2pPort)
	case s.dpSize > 1 && s.p2pPort+s.dpSize-1 > math.MaxUint16:
		return bad("--p2p-connector-port %d plus data-parallel rank %d exceeds 65535", s.p2pPort, s.dpSize-1)
	case s.p2pPull && s.kvConnector != "nixlv2":
		return bad("--enable-p2p-pull requires --kv-connector=nixlv2 (got %q)", s.kvConnector)
	case s.ssrf && s.inferencePool == "":
		return bad("--inference-pool flag or INFERENCE_POOL environment variable is required when --enable-ssrf-protection is true")
	}
	return nil
}

// portRange checks that start and the rangeSize-1 ports after it are
// ports, as llm-d's validatePortRange.
func portRange(start, size int) error {
	switch {
	case start < 1 || start > math.MaxUint16:
		return fmt.Errorf("start port %d is out of valid range [1, %d]", start, math.MaxUint16)
	case start+size-1 > math.MaxUint16:
		return fmt.Errorf("port range [%d, %d] exceeds maximum port value", start, start+size-1)
	}
	return nil
}

// stage reports whether a TLS stage list names stage.
func stage(list []string, name string) bool { return slices.Contains(list, name) }

// localURLs are the local engine's ranks, as the other pods reach them.
func (s *sidecarConfig) localURLs() []string {
	scheme := "http://"
	if stage(s.enableTLS, stageDecoder) {
		scheme = "https://"
	}
	out := make([]string, s.dpSize)
	for r := range s.dpSize {
		out[r] = scheme + net.JoinHostPort(strings.Trim(s.localHost, "[]"), strconv.Itoa(s.modelServerPort+r))
	}
	return out
}
