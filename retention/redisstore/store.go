package redisstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/bidikv/bidikv/kvroute"
)

var _ kvroute.Store = (*Store)(nil)

// Store is a [kvroute.Store] in Redis. A Store is safe for concurrent use,
// and any number of Stores, in any number of processes, may share one Redis.
type Store struct {
	client    redis.UniversalClient
	owned     bool // Close closes client
	prefix    string
	maxValue  int
	timeout   time.Duration
	log       *slog.Logger
	script    *redis.Script
	useScript atomic.Bool
	replicas  int                  // WithWaitReplicas
	cluster   *redis.ClusterClient // client, when it is one
	health    health
	counters  counters
	closeOnce sync.Once
	closeErr  error
}

// New returns a Store that uses client, which the caller keeps owning:
// [Store.Close] does not close it. New does no network I/O.
//
// For the per-call timeout to bound waits on the network, the client should
// have ContextTimeoutEnabled set (see [WithTimeout]); New logs a warning
// through the injected logger when a go-redis Client, ClusterClient or Ring
// has it off. For calls to fail at once rather than at the timeout when
// Redis is down, set DialerRetries to 1 and MaxRetries to -1, as
// [NewFromURL] does. New fails with an error matching [ErrInvalidConfig]
// when client is nil or an option is invalid.
func New(client redis.UniversalClient, opts ...Option) (*Store, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: New: client is nil", ErrInvalidConfig)
	}
	s, err := newStore(client, false, opts)
	if err != nil {
		return nil, err
	}
	if ignoresContextDeadlines(client) {
		s.log.Warn("redisstore: the client has ContextTimeoutEnabled off, so an unresponsive Redis holds each call for the client's read/write timeout, not the store's timeout",
			slog.Duration("store_timeout", s.timeout))
	}
	return s, nil
}

// ignoresContextDeadlines reports whether client is a go-redis client known
// to leave context deadlines out of its socket reads and writes.
func ignoresContextDeadlines(client redis.UniversalClient) bool {
	switch c := client.(type) {
	case *redis.Client:
		return !c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return !c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return !c.Options().ContextTimeoutEnabled
	}
	return false
}

// NewFromURL returns a Store with its own client for the Redis deployment
// at rawURL. The scheme picks the deployment; the rest of the URL is in the
// form go-redis's parsers read:
//
//   - redis://[[user]:password@]host[:port][/db][?option=value...], or
//     rediss:// for TLS: one Redis (go-redis's ParseURL), optionally a
//     primary whose replicas this client never reads from.
//   - redis-sentinel://[[user]:password@]host:port[/db]?master_name=NAME[&addr=host:port...][&password=...],
//     or rediss-sentinel:// for TLS: the primary that the Sentinels at
//     host:port and every addr monitor as NAME (go-redis's
//     ParseFailoverURL with the scheme redis:// or rediss://). The user
//     information authenticates to the Sentinels; the primary's own
//     credentials are the username and password query parameters.
//   - redis-cluster://[[user]:password@]host:port[?addr=host:port...], or
//     rediss-cluster:// for TLS: a Redis Cluster reached through host:port
//     and every addr as seed nodes (go-redis's ParseClusterURL with the
//     scheme redis:// or rediss://). A cluster has database 0 only.
//
// Query parameters set go-redis options such as dial_timeout or pool_size.
// Every client honours context deadlines, so [WithTimeout] bounds every
// call, and fails fast when a server is down: one dial attempt per call and
// no retries (unless the URL sets max_retries). A cluster client still
// follows MOVED and ASK redirections, and a failed call makes it reload the
// cluster's slot map (see [Store.Take]). [Store.Close] closes the client.
//
// NewFromURL does no network I/O: an unreachable Redis shows up as failed
// calls, not as an error here. It fails with an error matching
// [ErrInvalidConfig] when the URL or an option is invalid (a Sentinel URL
// without master_name, say); the error never contains the password.
func NewFromURL(rawURL string, opts ...Option) (*Store, error) {
	// Validate the options before creating a client that would need closing.
	if _, err := configure(opts); err != nil {
		return nil, err
	}
	client, err := clientFromURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("%w: NewFromURL: %v", ErrInvalidConfig, err)
	}
	s, err := newStore(client, true, opts)
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	return s, nil
}

// URL schemes NewFromURL reads besides go-redis's redis:// and rediss://.
const (
	sentinelSuffix = "-sentinel"
	clusterSuffix  = "-cluster"
)

// clientFromURL returns a client for rawURL (see [NewFromURL]) that honours
// context deadlines and fails fast. Its errors never contain the URL.
func clientFromURL(rawURL string) (redis.UniversalClient, error) {
	scheme, rest, _ := strings.Cut(rawURL, "://")
	scheme = strings.ToLower(scheme)
	if u, err := url.Parse(rawURL); err == nil && strings.Contains(u.Host, ",") {
		// go-redis would take "a:1,b" for a host name and fail every dial.
		return nil, errors.New("one host:port after the scheme; name more with addr=host:port query parameters, not commas")
	}
	// Fail fast when Redis is down: go-redis's defaults (5 dial attempts,
	// 3 retries with backoff) would spend the whole timeout on every call
	// before the turn goes on as a miss. Stale pooled connections are
	// detected before use, so a restarted Redis needs no retry.
	maxRetries := func(set *int) {
		if !hasQuery(rawURL, "max_retries") {
			*set = -1
		}
	}
	switch {
	case strings.HasSuffix(scheme, sentinelSuffix):
		fo, err := redis.ParseFailoverURL(strings.TrimSuffix(scheme, sentinelSuffix) + "://" + rest)
		if err != nil {
			return nil, urlError(err)
		}
		if fo.MasterName == "" {
			return nil, errors.New("a Sentinel URL needs master_name=NAME")
		}
		fo.ContextTimeoutEnabled = true
		fo.DialerRetries = 1
		maxRetries(&fo.MaxRetries)
		return redis.NewFailoverClient(fo), nil
	case strings.HasSuffix(scheme, clusterSuffix):
		co, err := redis.ParseClusterURL(strings.TrimSuffix(scheme, clusterSuffix) + "://" + rest)
		if err != nil {
			return nil, urlError(err)
		}
		if u, _ := url.Parse(rawURL); u.Path != "" && u.Path != "/" && u.Path != "/0" {
			return nil, errors.New("a cluster has database 0 only: no /db path")
		}
		co.ContextTimeoutEnabled = true
		co.DialerRetries = 1
		maxRetries(&co.MaxRetries)
		return redis.NewClusterClient(co), nil
	}
	ro, err := redis.ParseURL(rawURL)
	if err != nil {
		return nil, urlError(err)
	}
	ro.ContextTimeoutEnabled = true
	ro.DialerRetries = 1
	maxRetries(&ro.MaxRetries)
	return redis.NewClient(ro), nil
}

// urlError strips the URL, password included, that a url.Error quotes.
func urlError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// hasQuery reports whether rawURL, which redis.ParseURL accepted, sets
// the query parameter key.
func hasQuery(rawURL, key string) bool {
	u, err := url.Parse(rawURL)
	return err == nil && u.Query().Has(key)
}

func configure(opts []Option) (config, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		if o != nil {
			o.apply(&cfg)
		}
	}
	return cfg, errors.Join(cfg.errs...)
}

func newStore(client redis.UniversalClient, owned bool, opts []Option) (*Store, error) {
	cfg, err := configure(opts)
	if err != nil {
		return nil, err
	}
	if cfg.replicas > 0 {
		switch client.(type) {
		case *redis.Client, *redis.ClusterClient:
		default:
			return nil, fmt.Errorf("%w: WithWaitReplicas(%d) needs a *redis.Client or a *redis.ClusterClient, got %T", ErrInvalidConfig, cfg.replicas, client)
		}
	}
	log := cfg.logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Store{
		client:   client,
		owned:    owned,
		prefix:   cfg.prefix,
		maxValue: cfg.maxValue,
		timeout:  cfg.timeout,
		log:      log,
		script:   redis.NewScript(takeScript),
		replicas: cfg.replicas,
	}
	s.cluster, _ = client.(*redis.ClusterClient)
	s.health.log = log
	s.health.recovery = cfg.recovery
	s.health.now = time.Now
	s.useScript.Store(cfg.scriptTake)
	return s, nil
}

// Key returns the Redis key under which the Store keeps the value for key:
// the prefix followed by key.
func (s *Store) Key(key string) string { return s.prefix + key }

// Close closes the client if the Store created it ([NewFromURL]); a Store
// from [New] leaves its client open. Close is safe to call more than once.
func (s *Store) Close() error {
	s.closeOnce.Do(func() {
		if s.owned {
			s.closeErr = s.client.Close()
		}
	})
	return s.closeErr
}

// Put stores value under key for ttl with SET key value PX ttl, replacing
// any earlier value; ttl is rounded up to a whole millisecond. A ttl <= 0
// fails with [ErrInvalidTTL] and a value over the size bound with
// [ErrValueTooLarge], both without reaching Redis. Any other error means
// the value may or may not be stored.
func (s *Store) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if ttl <= 0 {
		s.counters.rejected.Add(1)
		return fmt.Errorf("%w: got %v", ErrInvalidTTL, ttl)
	}
	if len(value) > s.maxValue {
		s.counters.rejected.Add(1)
		return fmt.Errorf("%w: %d bytes, limit %d", ErrValueTooLarge, len(value), s.maxValue)
	}
	if err := ctx.Err(); err != nil {
		s.counters.canceled.Add(1)
		return fmt.Errorf("redisstore: put: %w", err)
	}
	ms := ttl.Milliseconds()
	if ttl%time.Millisecond != 0 {
		ms++
	}
	cctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	cmd := redis.NewStatusCmd(cctx, "set", s.prefix+key, value, "px", ms)
	if err := s.client.Process(cctx, cmd); err != nil {
		return s.failed(ctx, cctx, opPut, err)
	}
	s.counters.puts.Add(1)
	s.health.ok(ctx)
	return nil
}

// Take removes and returns the value stored under key with GETDEL (or the
// equivalent script), atomically across every Store sharing the Redis.
// ok is false when there is none. On an error the value, if there was one,
// may be gone: one Redis never returns it twice. GETDEL names one key, so
// in a Redis Cluster it runs on the primary that owns the key's slot.
//
// A failover can undo a delete that the failed primary had not yet sent to
// its replicas, and hand the value out again; [WithWaitReplicas] closes
// that window at the cost of a round trip to a replica per hit. A failed
// call to a cluster makes the client reload the slot map, so that calls
// reach the promoted replica as soon as the cluster has promoted one.
func (s *Store) Take(ctx context.Context, key string) (value []byte, ok bool, err error) {
	if err := ctx.Err(); err != nil {
		s.counters.canceled.Add(1)
		return nil, false, fmt.Errorf("redisstore: take: %w", err)
	}
	cctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	v, err := s.take(cctx, s.prefix+key)
	switch {
	case errors.Is(err, redis.Nil):
		s.counters.misses.Add(1)
		s.health.ok(ctx)
		return nil, false, nil
	case err != nil:
		return nil, false, s.failed(ctx, cctx, opTake, err)
	}
	s.counters.hits.Add(1)
	s.health.ok(ctx)
	return v, true, nil
}

// failed counts and wraps a failed call. A call that failed because the
// caller's context ended is the caller's doing, not an outage; a call that
// outlived the per-call timeout always matches context.DeadlineExceeded.
func (s *Store) failed(parent, call context.Context, op string, err error) error {
	if perr := parent.Err(); perr != nil {
		s.counters.canceled.Add(1)
		if !errors.Is(err, perr) {
			return fmt.Errorf("redisstore: %s: %w: %w", op, perr, err)
		}
		return fmt.Errorf("redisstore: %s: %w", op, err)
	}
	if op == opTake {
		s.counters.takeErrors.Add(1)
	} else {
		s.counters.putErrors.Add(1)
	}
	s.health.fail(parent, op, err)
	if s.cluster != nil {
		// go-redis reloads a cluster's slot map on MOVED, not when a
		// primary stops answering: without this, calls for its slots would
		// go to the failed node until the next periodic reload (a minute by
		// default) although a replica took over in seconds. Reloads are
		// coalesced and at most one runs at a time.
		s.cluster.ReloadState(parent)
	}
	if call.Err() != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("redisstore: %s: %w after %v: %w", op, context.DeadlineExceeded, s.timeout, err)
	}
	return fmt.Errorf("redisstore: %s: %w", op, err)
}

const (
	opPut  = "put"
	opTake = "take"
)
