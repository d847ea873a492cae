package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/internal/durflag"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/transport"
)

// errUsage wraps every command-line error, so main can exit with status 2.
var errUsage = errors.New("bidikv-proxy: invalid command line")

// config is the parsed command line.
type config struct {
	memory memoryConfig // decode memory as a managed budget (memory.go)

	host string
	port int
	// debugAddr serves net/http/pprof when set (host:port), on a
	// loopback address unless debugRemote.
	debugAddr   string
	debugRemote bool

	prefillHosts, decodeHosts []string
	prefillPorts, decodePorts []string
	prefillURLs, decodeURLs   []string

	retentionTTL      time.Duration
	decoderBlocksTTL  time.Duration
	recomputeThresh   int
	reuse             bool
	keyMode           string
	verification      string
	blockSize         int
	localFallback     bool
	sessionAffinity   bool
	sessionHeaders    string
	decodeLocal       bool
	bufferStreams     []string // --decode-stream buffered: the paths (decodestream.go)
	bufferedTimeout   time.Duration
	kvBytesPerToken   int64
	restartCheck      time.Duration
	renderTimeout     time.Duration
	redisURL          string
	redisWaitReplicas int
	apiKeys           []string // from --api-key, --api-key-file and BIDIKV_API_KEYS
	apiKeyFile        string
	allowAnonymousIDs bool
	metricsKey        bool
	upstreamAPIKey    string // from OPENAI_API_KEY, never a flag
	maxBodyBytes      int64
	maxObjectMembers  int
	maxHeaderBytes    int
	maxTurns          int
	maxBufferedBytes  int64
	maxConns          int
	maxTransit        int
	maxClientTransit  int
	minBodyRate       int64 // --min-body-rate, bytes per second
	// chargeAnswer is charged the decode answers the router holds: the
	// admission's (run sets it; nil elsewhere).
	chargeAnswer      func(context.Context, int64) bool
	idleConnTimeout   time.Duration
	readBodyTimeout   time.Duration
	writeTimeout      time.Duration
	prefillTimeout    time.Duration
	firstByteTimeout  time.Duration
	idleTimeout       time.Duration
	readHeaderTimeout time.Duration
	shutdownGrace     time.Duration
	healthInterval    time.Duration
	healthTimeout     time.Duration
	logLevel          slog.Level
	logFormat         string

	dns dnsConfig // --prefill-dns, --decode-dns and their options (dns.go)

	// warnings are logged at start-up, once the logger exists.
	warnings []string
}

// envAPIKeys names the environment variable with inbound API keys,
// comma-separated: keys given there stay out of the process list.
const envAPIKeys = "BIDIKV_API_KEYS"

// Defaults of the limits users reason about.
const (
	defaultMaxHeaderBytes   = 64 << 10
	defaultMaxTurns         = 256
	defaultMaxBufferedBytes = 256 << 20
	defaultMaxConns         = 4096
	defaultMaxTransit       = 512
	defaultMaxClientTransit = 32
	defaultMinBodyRate      = 16 << 10
	defaultIdleConnTimeout  = 120 * time.Second
	defaultReadBodyTimeout  = 60 * time.Second
	defaultWriteTimeout     = 60 * time.Second
)

// Key modes for --key-mode.
const (
	keyContent        = "content"
	keyConversationID = "conversation-id"
)

// listFlag collects a flag given once with several values (argparse's
// nargs="+"), several times, or as a comma-separated list.
type listFlag struct {
	vals *[]string
	set  bool // a value was given: the first one replaces the default
}

func (l *listFlag) String() string {
	if l == nil || l.vals == nil {
		return ""
	}
	return strings.Join(*l.vals, ",")
}

// errEmptyValue refuses a flag given with nothing in it: in a deployment
// that is usually an unset environment variable ("--prefill=$PREFILL"),
// and a default in its place (localhost, no authentication) would be
// worse than not starting.
var errEmptyValue = errors.New("empty value (an unset environment variable?): give one, or leave the flag out")

// Set adds the comma-separated values of s; an empty one is an error.
func (l *listFlag) Set(s string) error {
	if !l.set {
		*l.vals = nil
		l.set = true
	}
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v == "" {
			return errEmptyValue
		}
		*l.vals = append(*l.vals, v)
	}
	return nil
}

// notEmpty lists the string flags that, given, must not be empty: an
// empty one would silently mean a default (every interface, no
// authentication, the in-memory store, no DNS discovery: localhost).
var notEmpty = map[string]bool{
	"host": true, "prefill-dns": true, "decode-dns": true, "api-key-file": true, "redis-url": true,
}

// checkEmpty refuses a notEmpty flag given with an empty value.
func checkEmpty(fs *flag.FlagSet) error {
	var err error
	fs.Visit(func(f *flag.Flag) {
		if err == nil && notEmpty[f.Name] && strings.TrimSpace(f.Value.String()) == "" {
			err = fmt.Errorf("%w: --%s: %v", errUsage, f.Name, errEmptyValue)
		}
	})
	return err
}

// isListFlag reports whether a flag takes several values after one name,
// as the reference proxy's argparse nargs="+" does.
func isListFlag(name string) bool {
	switch name {
	case "prefiller-host", "prefiller-hosts", "prefiller-port", "prefiller-ports",
		"decoder-host", "decoder-hosts", "decoder-port", "decoder-ports",
		"prefill", "decode", "api-key":
		return true
	}
	return false
}

// expandLists rewrites "--decoder-ports 8200 8201" into
// "--decoder-ports 8200 --decoder-ports 8201" so that the flag package reads
// the reference proxy's command lines unchanged.
func expandLists(args []string) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		out = append(out, a)
		if a == "--" {
			return append(out, args[i+1:]...)
		}
		name := strings.TrimLeft(a, "-")
		if !strings.HasPrefix(a, "-") || strings.Contains(name, "=") || !isListFlag(name) {
			continue
		}
		// The first value follows as usual; the rest get the name repeated.
		if i+1 < len(args) {
			i++
			out = append(out, args[i])
		}
		for i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			i++
			out = append(out, a, args[i])
		}
	}
	return out
}

// parseConfig reads the command line. getenv is os.Getenv in main; help
// receives --help's text (the error is then flag.ErrHelp). Errors are
// returned, never written: one line, naming the flag.
func parseConfig(args []string, getenv func(string) string, help io.Writer) (*config, error) {
	return parseCommand("bidikv-proxy", synopsis, args, getenv, help, nil)
}

// parseCommand reads the command line of the proxy, or of a subcommand
// that takes the same flags and adds its own (extra); head opens its
// --help.
func parseCommand(name, head string, args []string, getenv func(string) string, help io.Writer, extra func(*flag.FlagSet)) (*config, error) {
	c := &config{
		prefillHosts: []string{"localhost"}, prefillPorts: []string{"8100"},
		decodeHosts: []string{"localhost"}, decodePorts: []string{"8200"},
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.StringVar(&c.host, "host", "127.0.0.1", "address to listen on")
	fs.IntVar(&c.port, "port", 8000, "port to listen on (0: any free port)")

	ph := &listFlag{vals: &c.prefillHosts}
	pp := &listFlag{vals: &c.prefillPorts}
	dh := &listFlag{vals: &c.decodeHosts}
	dp := &listFlag{vals: &c.decodePorts}
	for _, n := range []string{"prefiller-hosts", "prefiller-host"} {
		fs.Var(ph, n, "prefill engine hosts, one or more")
	}
	for _, n := range []string{"prefiller-ports", "prefiller-port"} {
		fs.Var(pp, n, "prefill engine ports, one per host")
	}
	for _, n := range []string{"decoder-hosts", "decoder-host"} {
		fs.Var(dh, n, "decode engine hosts, one or more")
	}
	for _, n := range []string{"decoder-ports", "decoder-port"} {
		fs.Var(dp, n, "decode engine ports, one per host")
	}
	fs.Var(&listFlag{vals: &c.prefillURLs}, "prefill", "prefill engine URLs (http://host:port), replacing --prefiller-hosts/--prefiller-ports")
	fs.Var(&listFlag{vals: &c.decodeURLs}, "decode", "decode engine URLs (http://host:port), replacing --decoder-hosts/--decoder-ports")

	fs.DurationVar(&c.retentionTTL, "retention-ttl", kvroute.Defaults().TTLs.Retention, "how long a decode handle is kept; at least 5s under --decoder-kv-blocks-ttl")
	fs.DurationVar(&c.decoderBlocksTTL, "decoder-kv-blocks-ttl", kvroute.Defaults().TTLs.DecoderBlocks, "the decode engines' decoder_kv_blocks_ttl")
	fs.IntVar(&c.recomputeThresh, "recompute-threshold", 64, "attach a handle only if at least this many tokens can be pulled (the engines' kv_recompute_threshold; 0: always)")
	fs.BoolVar(&c.reuse, "reuse", true, "bidirectional KV reuse; false: plain one-way P→D disaggregation")
	fs.StringVar(&c.keyMode, "key-mode", keyContent, "how turns are matched: content (the conversation itself) or conversation-id (conversation_id body field / X-Session-ID header, as the reference proxy)")
	fs.StringVar(&c.verification, "verification", string(kvroute.VerifyTokens), "how reuse is proven safe: tokens (the engines render the new prompt and the router compares token ids; exact; every API) or content (the history must be resent unchanged; needs no engine support, but cannot see chat-template or tokenizer effects; reuses chat turns, completions turns only at clean token seams, never Responses or Messages)")
	fs.IntVar(&c.blockSize, "block-size", kvroute.Defaults().Verification.BlockSize, "the KV block size of engines whose /metrics report none (vLLM run with --disable-log-stats): the proxy reads each engine's own (vllm:cache_config_info) and checks and cuts its handles at it; an engine that reports another size is used at its own, with a warning (0: none; such engines' handles are then reused whole only, their block counts unchecked)")
	fs.BoolVar(&c.localFallback, "local-prefill-fallback", false, "when P returns no handle, let D prefill locally instead of failing with 502")
	fs.BoolVar(&c.decodeLocal, "decode-local", false, "let a cost model answer a short turn on the decode engine that holds the conversation, as a plain request (needs prefix caching on the decode engines and --verification tokens)")
	fs.Var(decodeStream{&c.bufferStreams}, "decode-stream", "engine: streams pass through as the decode engine sends them; buffered: a streamed chat, completions or Messages turn whose decode engine's streams carry no handle (stock vLLM) decodes non-streaming and is sent as the API's stream once the answer is complete, so that later turns reuse KV: the first token arrives with the last (for headless agents); buffered:API[,API] for some APIs only (chat, completions, messages)")
	fs.DurationVar(&c.renderTimeout, "render-timeout", kvroute.Defaults().Timeouts.Render, "budget of one render call (token verification, and the prompt fingerprint of Responses and Messages turns): a call that runs out opens that engine's render breaker, and turns go on without a render")
	fs.DurationVar(&c.restartCheck, "restart-check", kvroute.Defaults().Health.RestartCheck, "how old the proxy's reading of a decode engine's process_start_time_seconds (GET /metrics) may be when it attaches one of the engine's handles: a handle issued before the engine restarted is never attached (0: no reads; restarts are then noticed only by a new engine id or a failure to reach the engine)")
	fs.Int64Var(&c.kvBytesPerToken, "kv-bytes-per-token", 0, "bytes of KV per token on the decode engines, for the decode_kv_held_bytes gauge (0: unknown)")
	fs.StringVar(&c.redisURL, "redis-url", "", "share retained handles between replicas in Redis: redis://[user:password@]host:port/db, redis-sentinel://sentinel:26379/db?master_name=NAME&addr=sentinel2:26379, or redis-cluster://node:6379?addr=node2:6379; default in memory")
	fs.IntVar(&c.redisWaitReplicas, "redis-wait-replicas", 0, "with Sentinel or Cluster: hand out a handle only once this many replicas acknowledged its delete (WAIT), so that a failover cannot hand it out again; 0: GETDEL alone")
	fs.Var(&listFlag{vals: &c.apiKeys}, "api-key", "accepted inbound API keys (Authorization: Bearer KEY), visible in the process list: prefer --api-key-file or "+envAPIKeys+"; none of the three: no authentication")
	fs.StringVar(&c.apiKeyFile, "api-key-file", "", "file of accepted inbound API keys, one per line (blank lines and lines starting with # ignored)")
	fs.BoolVar(&c.allowAnonymousIDs, "allow-anonymous-conversation-id", false, "allow --key-mode conversation-id without inbound API keys: every client is then one tenant, and any client that knows or guesses a conversation id continues that conversation's KV")
	fs.BoolVar(&c.metricsKey, "metrics-require-key", false, "serve /metrics only with an inbound API key, as the API routes (its labels name the engines' URLs); default: open, for scrapers on a trusted network")
	c.maxBodyBytes = kvroute.Defaults().Limits.Body
	fs.Var(byteSize{&c.maxBodyBytes}, "max-body-bytes", "largest request body accepted (413 above)")
	fs.IntVar(&c.maxObjectMembers, "max-object-members", kvroute.Defaults().Limits.ObjectMembers, "most members of any object in a request body, at any depth (400 above): bounds the memory a body's index takes")
	c.maxHeaderBytes = defaultMaxHeaderBytes
	fs.Var(intBytes{&c.maxHeaderBytes}, "max-header-bytes", "largest request line and headers accepted (431 above)")
	fs.IntVar(&c.maxTurns, "max-concurrent-turns", defaultMaxTurns, "completion requests served at once; more are shed with 503 and Retry-After")
	c.maxBufferedBytes = defaultMaxBufferedBytes
	fs.Var(byteSize{&c.maxBufferedBytes}, "max-buffered-bytes", "request body bytes held at once over all completion requests, charged as they arrive; more are shed with 503 and Retry-After (at least --max-body-bytes)")
	fs.IntVar(&c.maxConns, "max-connections", defaultMaxConns, "client connections open at once; above it the connection waiting longest for a request (1s or more) is closed, else the new one gets 503 and is closed")
	fs.IntVar(&c.maxTransit, "max-bodies-in-transit", defaultMaxTransit, "completion request bodies being received at once; more are shed with 503 and Retry-After (a body in transit holds no turn slot)")
	fs.IntVar(&c.maxClientTransit, "max-client-bodies-in-transit", defaultMaxClientTransit, "completion request bodies being received at once from one client address (IPv6: its /64); more are shed with 503 and Retry-After (0: no bound per address, for a proxy behind a load balancer)")
	c.minBodyRate = defaultMinBodyRate
	fs.Var(byteSize{&c.minBodyRate}, "min-body-rate", "bytes per second a request body must average, from its headers on, to keep its slot when the bodies in transit reach a bound: a new body then takes the slot of the slowest one below it that has been in transit at least 1s, which is answered 408 (0: none; a new body is shed with 503 instead)")
	fs.DurationVar(&c.idleConnTimeout, "idle-conn-timeout", defaultIdleConnTimeout, "how long a client's keep-alive connection may sit idle between requests")
	fs.DurationVar(&c.readBodyTimeout, "read-body-timeout", defaultReadBodyTimeout, "bound on reading a request body, from the end of its headers (408 after it); streams are not limited by it")
	fs.DurationVar(&c.writeTimeout, "client-write-timeout", defaultWriteTimeout, "bound on each write of a completion response to the client (one stream event, or a body): a client that stops reading is cut after it, and its turn freed (0: none)")
	fs.DurationVar(&c.prefillTimeout, "prefill-timeout", kvroute.Defaults().Timeouts.Prefill, "bound on the prefill leg (0: none)")
	fs.DurationVar(&c.firstByteTimeout, "first-byte-timeout", kvroute.Defaults().Timeouts.FirstByte, "bound on the wait for the decode engine's headers (0: none)")
	fs.DurationVar(&c.idleTimeout, "idle-timeout", kvroute.Defaults().Timeouts.Idle, "bound on the gap between two decode stream reads (0: none)")
	fs.DurationVar(&c.bufferedTimeout, "buffered-timeout", kvroute.Defaults().Timeouts.Buffered, "with --decode-stream buffered: bound on a buffered turn's wait for the decode engine's whole answer, in place of --first-byte-timeout (0: none)")
	fs.DurationVar(&c.readHeaderTimeout, "read-header-timeout", 30*time.Second, "bound on reading a client's request headers")
	fs.DurationVar(&c.shutdownGrace, "shutdown-grace", 30*time.Second, "on SIGTERM, how long in-flight streams may run before connections are closed")
	fs.DurationVar(&c.healthInterval, "health-interval", 5*time.Second, "how often engines' /health is polled for metrics and /v1/models")
	fs.DurationVar(&c.healthTimeout, "health-timeout", 2*time.Second, "bound on one engine health probe")
	fs.BoolVar(&c.sessionAffinity, "session-affinity", false, "place each turn that attaches no handle (a conversation's first turn, a turn whose hold was released) on the prefill and decode engines its conversation id or agent session header hashes to (rendezvous hashing; an engine over 64 requests in flight or crowded is passed over), so their prefix caches hold its history; a session id never finds a handle")
	fs.StringVar(&c.sessionHeaders, "session-headers", "", "with --session-affinity: the headers agents name their session in, comma-separated, read in order when a request has no conversation id; none: no header; default: x-claude-code-session-id, session_id, session-id, x-codex-turn-metadata (its session_id, else thread_id), x-session-affinity, x-dynamo-session-id")
	fs.StringVar(&c.debugAddr, "debug-addr", "", "host:port for Go's profiler (net/http/pprof under /debug/pprof/, without cmdline) on a listener of its own, for profiling only: a loopback address such as 127.0.0.1:6060 (default: off)")
	fs.BoolVar(&c.debugRemote, "debug-allow-remote", false, "let --debug-addr listen on an address other than loopback (the profiler has no authentication)")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.logFormat, "log-format", "text", "text or json")
	c.dns.flags(fs)
	c.memory.flags(fs)
	if extra != nil {
		extra(fs)
	}

	args = expandLists(args)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			writeHelp(help, fs, head)
			return nil, err
		}
		return nil, parseError(fs, err)
	}
	if err := durflag.Check(fs, args, positiveDurations...); err != nil {
		return nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	if err := checkEmpty(fs); err != nil {
		return nil, err
	}
	if err := c.level(*level); err != nil {
		return nil, err
	}
	c.upstreamAPIKey = getenv("OPENAI_API_KEY")
	if err := c.inboundKeys(getenv); err != nil {
		return nil, err
	}
	if err := c.dns.check(ph.set || pp.set || len(c.prefillURLs) > 0, dh.set || dp.set || len(c.decodeURLs) > 0); err != nil {
		return nil, err
	}
	if err := c.memory.check(); err != nil {
		return nil, err
	}
	if err := c.endpoints(ph.set || pp.set, dh.set || dp.set); err != nil {
		return nil, err
	}
	if c.dns.decode == "" {
		c.warnings = append(c.warnings, c.memory.tier.unknownPeers(c.decodeURLs)...)
	}
	return c, c.validate()
}

// inboundKeys adds the keys of --api-key-file and BIDIKV_API_KEYS to
// --api-key's.
func (c *config) inboundKeys(getenv func(string) string) error {
	for _, k := range strings.Split(getenv(envAPIKeys), ",") {
		if k = strings.TrimSpace(k); k != "" {
			c.apiKeys = append(c.apiKeys, k)
		}
	}
	if c.apiKeyFile == "" {
		return nil
	}
	b, err := os.ReadFile(c.apiKeyFile)
	if err != nil {
		return fmt.Errorf("%w: --api-key-file: %v", errUsage, err)
	}
	if fi, err := os.Stat(c.apiKeyFile); err == nil && fi.Mode().Perm()&0o006 != 0 {
		c.warnings = append(c.warnings, fmt.Sprintf("--api-key-file %s is readable or writable by every user of the host (mode %04o): chmod 600 it", c.apiKeyFile, fi.Mode().Perm()))
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			c.apiKeys = append(c.apiKeys, l)
			n++
		}
	}
	if n == 0 {
		return fmt.Errorf("%w: --api-key-file %s holds no key", errUsage, c.apiKeyFile)
	}
	return nil
}

func (c *config) level(s string) error {
	if err := c.logLevel.UnmarshalText([]byte(s)); err != nil {
		return fmt.Errorf("%w: --log-level %q: use debug, info, warn or error", errUsage, s)
	}
	return nil
}

// endpoints turns host and port lists into URLs, unless --prefill or
// --decode gave URLs, which cannot be mixed with them.
func (c *config) endpoints(prefillPairs, decodePairs bool) error {
	var err error
	switch {
	case len(c.prefillURLs) > 0 && prefillPairs:
		return fmt.Errorf("%w: use either --prefill or --prefiller-hosts/--prefiller-ports, not both", errUsage)
	case len(c.prefillURLs) == 0:
		if c.prefillURLs, err = pairs("prefiller", c.prefillHosts, c.prefillPorts); err != nil {
			return err
		}
	}
	switch {
	case len(c.decodeURLs) > 0 && decodePairs:
		return fmt.Errorf("%w: use either --decode or --decoder-hosts/--decoder-ports, not both", errUsage)
	case len(c.decodeURLs) == 0:
		if c.decodeURLs, err = pairs("decoder", c.decodeHosts, c.decodePorts); err != nil {
			return err
		}
	}
	if err := canonical("prefill", c.prefillURLs); err != nil {
		return err
	}
	return canonical("decode", c.decodeURLs)
}

// canonical rewrites each engine address of --flag in place as its base
// URL, as the router parses it (transport.ParseEndpoint): host:port means
// http://host:port, a trailing slash goes. Every part of the proxy (the
// router, /ready and the health checks, the doctor, metrics labels) then
// names and reaches an engine by the same URL. An address the router
// cannot use is an error naming the flag.
func canonical(flag string, urls []string) error {
	for i, u := range urls {
		ep, err := transport.ParseEndpoint(u)
		if err != nil {
			return fmt.Errorf("%w: --%s: %v", errUsage, flag, err)
		}
		urls[i] = ep.URL.String()
	}
	return nil
}

// pairs zips hosts and ports into base URLs.
func pairs(role string, hosts, ports []string) ([]string, error) {
	if len(hosts) != len(ports) {
		return nil, fmt.Errorf("%w: %d --%s-hosts but %d --%s-ports: give one port per host",
			errUsage, len(hosts), role, len(ports), role)
	}
	out := make([]string, len(hosts))
	for i, h := range hosts {
		p, err := strconv.Atoi(ports[i])
		if err != nil || p <= 0 || p > 65535 {
			return nil, fmt.Errorf("%w: --%s-ports: %q is not a port", errUsage, role, ports[i])
		}
		out[i] = "http://" + net.JoinHostPort(strings.Trim(h, "[]"), strconv.Itoa(p))
	}
	return out, nil
}

func (c *config) validate() error {
	switch {
	case c.port < 0 || c.port > 65535:
		return fmt.Errorf("%w: --port %d out of range", errUsage, c.port)
	case c.verification != string(kvroute.VerifyTokens) && c.verification != string(kvroute.VerifyContent):
		return fmt.Errorf("%w: --verification %q: use %s or %s", errUsage, c.verification, kvroute.VerifyTokens, kvroute.VerifyContent)
	case c.decodeLocal && c.verification != string(kvroute.VerifyTokens):
		return fmt.Errorf("%w: --decode-local needs --verification tokens: a turn goes decode-local only with a handle verified by tokens, so with --verification %s it never would", errUsage, c.verification)
	case c.blockSize < 0:
		return fmt.Errorf("%w: --block-size %d: must not be negative (0: each engine's own, read from its /metrics)", errUsage, c.blockSize)
	case c.keyMode != keyContent && c.keyMode != keyConversationID:
		return fmt.Errorf("%w: --key-mode %q: use %s or %s", errUsage, c.keyMode, keyContent, keyConversationID)
	case c.logFormat != "text" && c.logFormat != "json":
		return fmt.Errorf("%w: --log-format %q: use text or json", errUsage, c.logFormat)
	case c.maxHeaderBytes < 4096:
		return fmt.Errorf("%w: --max-header-bytes must be at least 4096", errUsage)
	case c.maxTurns <= 0:
		return fmt.Errorf("%w: --max-concurrent-turns must be positive", errUsage)
	case c.maxConns <= 0:
		return fmt.Errorf("%w: --max-connections must be positive", errUsage)
	case c.maxTransit <= 0:
		return fmt.Errorf("%w: --max-bodies-in-transit must be positive", errUsage)
	case c.maxClientTransit < 0 || c.maxClientTransit > c.maxTransit:
		return fmt.Errorf("%w: --max-client-bodies-in-transit %d: use 0 (no bound per client) up to --max-bodies-in-transit %d", errUsage, c.maxClientTransit, c.maxTransit)
	case c.minBodyRate < 0:
		return fmt.Errorf("%w: --min-body-rate must not be negative", errUsage)
	case c.maxBodyBytes <= 0:
		return fmt.Errorf("%w: --max-body-bytes must be positive", errUsage)
	case c.maxObjectMembers <= 0:
		return fmt.Errorf("%w: --max-object-members must be positive", errUsage)
	case c.maxBufferedBytes < c.maxBodyBytes:
		return fmt.Errorf("%w: --max-buffered-bytes %d is below --max-body-bytes %d: a request of the largest size could never be admitted", errUsage, c.maxBufferedBytes, c.maxBodyBytes)
	case c.metricsKey && len(c.apiKeys) == 0:
		return fmt.Errorf("%w: --metrics-require-key needs inbound API keys (--api-key-file, %s or --api-key)", errUsage, envAPIKeys)
	case c.keyMode == keyConversationID && len(c.apiKeys) == 0 && !c.allowAnonymousIDs:
		return fmt.Errorf("%w: --key-mode conversation-id without inbound API keys puts every client in one tenant, "+
			"so anyone who knows a conversation id continues its KV: give --api-key-file (or %s, or --api-key), "+
			"or --allow-anonymous-conversation-id to accept that", errUsage, envAPIKeys)
	}
	return nil
}

// none maps a flag's 0 (none) onto a grouped kvroute option's -1.
func none[T int | time.Duration](v T) T {
	if v == 0 {
		return -1
	}
	return v
}

// decodeMemory is the router's DecodeMemory: decode-local turns, buffered
// streams and the memory management's flags.
func (c *config) decodeMemory() kvroute.DecodeMemory {
	m := c.memory.decodeMemory(c.decodeLocal, c.kvBytesPerToken, c.blockSize)
	m.BufferStreams = c.bufferStreams
	return m
}

// routerOptions maps the configuration onto kvroute options. The store is
// added by the caller.
func (c *config) routerOptions() []kvroute.Option {
	// A flag's 0 means none (a timeout, the restart reads, partial
	// reads), where the grouped options take a negative value.
	opts := []kvroute.Option{
		c.poolOption(rolePrefill),
		c.poolOption(roleDecode),
		kvroute.WithTTLs(kvroute.TTLs{Retention: c.retentionTTL, DecoderBlocks: c.decoderBlocksTTL}),
		kvroute.WithThreshold(c.recomputeThresh),
		kvroute.WithReuse(c.reuse),
		kvroute.WithFailover(kvroute.Failover{LocalPrefill: c.localFallback}),
		kvroute.WithLimits(kvroute.Limits{Body: c.maxBodyBytes, ObjectMembers: c.maxObjectMembers, ChargeAnswer: c.chargeAnswer}),
		kvroute.WithTimeouts(kvroute.Timeouts{Prefill: none(c.prefillTimeout), FirstByte: none(c.firstByteTimeout),
			Idle: none(c.idleTimeout), Render: c.renderTimeout, Buffered: none(c.bufferedTimeout)}),
		kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerificationMode(c.verification), BlockSize: c.blockSize}),
		kvroute.WithHealth(kvroute.Health{RestartCheck: none(c.restartCheck)}),
		kvroute.WithDecodeMemory(c.decodeMemory()),
	}
	if c.upstreamAPIKey != "" {
		opts = append(opts, kvroute.WithUpstreamAPIKey(c.upstreamAPIKey))
	}
	if c.keyMode == keyConversationID {
		opts = append(opts, kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true}))
	}
	if c.sessionAffinity {
		var headers []string // nil: kvroute's list
		if c.sessionHeaders == "none" {
			headers = []string{}
		}
		for h := range strings.SplitSeq(c.sessionHeaders, ",") {
			if h = strings.TrimSpace(h); h != "" && h != "none" {
				headers = append(headers, h)
			}
		}
		// kvroute's default selector (an in-flight limit of 64), with hints.
		opts = append(opts, kvroute.WithSelector(&kvroute.LeastLoaded{MaxInFlight: 64, HashHints: true, SessionHeaders: headers}))
	}
	return opts
}
