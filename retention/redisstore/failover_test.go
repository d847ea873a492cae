package redisstore_test

import (
	"bytes"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/redisstore"
)

// Bounds of the failover tests. The window is what the documented outage
// behaviour covers: from the kill until the promoted replica serves every
// call, client errors (Take failed: a miss for the turn; Put failed: the
// next turn misses) are allowed and counted. Outside it no call may fail.
const (
	failoverWarmHits = 300              // hits before the kill, so that it lands mid-run
	failoverWindow   = 10 * time.Second // errors must stop this soon after the kill
	failoverQuiet    = time.Second      // no error for this long after the promotion ends the run
	failoverWorkers  = 8
	failoverMaxIters = 200_000 // per worker; the run ends long before
	failoverRecovery = 300 * time.Millisecond
	failoverTimeout  = 500 * time.Millisecond
)

// failoverLedger records every handle put and taken, over every goroutine
// and both Stores, to find a handle taken twice.
type failoverLedger struct {
	mu     sync.Mutex
	puts   []string       // keys of every Put attempted, ok or not (a failed Put may be stored)
	taken  map[string]int // hits per key
	double []string       // keys taken more than once
	wrong  []string       // keys whose value was not theirs
}

func (l *failoverLedger) put(key string) {
	l.mu.Lock()
	l.puts = append(l.puts, key)
	l.mu.Unlock()
}

func (l *failoverLedger) hit(key string, value []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.taken[key]++
	if l.taken[key] == 2 {
		l.double = append(l.double, key)
	}
	if !bytes.Equal(value, []byte(key)) {
		l.wrong = append(l.wrong, key)
	}
}

// failoverResult is what one failover run observed.
type failoverResult struct {
	puts, putErrors, hits, misses, takeErrors, unreplicated int64
	swept                                                   int           // keys taken again after the run
	sweptHits                                               int           // of which hits (handles whose Take had failed)
	doubleTakes, wrongTakes                                 int           // must be 0
	promoted, firstErr, lastErr                             time.Duration // after the kill; errors -1 if none
	outages                                                 int64
}

func (r failoverResult) String() string {
	return fmt.Sprintf("puts=%d put_errors=%d hits=%d misses=%d take_errors=%d unreplicated=%d swept=%d swept_hits=%d double_takes=%d wrong_takes=%d promoted_after=%v errors_from=%v errors_until=%v outages=%d",
		r.puts, r.putErrors, r.hits, r.misses, r.takeErrors, r.unreplicated, r.swept, r.sweptHits, r.doubleTakes, r.wrongTakes,
		r.promoted.Round(time.Millisecond), r.firstErr.Round(time.Millisecond), r.lastErr.Round(time.Millisecond), r.outages)
}

// failoverUnderLoad runs put/take loops on two Stores for the deployment at
// url (two router replicas), each handle put through one and taken through
// the other, plus a re-take of an older handle per iteration; calls kill
// once the loops have hit failoverWarmHits times, and promoted, which
// returns once the deployment has promoted a replica. The loops run until
// no call has failed for failoverQuiet after the promotion. Then every
// handle ever put is taken again, and the run is checked: no handle taken
// twice or with another's value, no error outside [kill, kill +
// failoverWindow], the outage logged once per outage with its end, and
// every call succeeding and hitting afterwards.
func failoverUnderLoad(t *testing.T, url string, opts []redisstore.Option, kill, promoted func()) failoverResult {
	t.Helper()
	opts = append([]redisstore.Option{redisstore.WithTimeout(failoverTimeout), redisstore.WithRecoveryWindow(failoverRecovery)}, opts...)
	var stores [2]*redisstore.Store
	var logs [2]*logRecorder
	for i := range stores {
		logs[i] = &logRecorder{}
		s, err := redisstore.NewFromURL(url, append(opts, redisstore.WithLogger(slog.New(logs[i])))...)
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		stores[i] = s
	}
	ledger := &failoverLedger{taken: map[string]int{}}
	ctx := t.Context()
	var (
		hits     atomic.Int64
		errMu    sync.Mutex
		errTimes []time.Time
		errKinds = map[string]int{}
		stop     = make(chan struct{})
		wg       sync.WaitGroup
	)
	fail := func(err error) {
		// A failed call costs a turn far more than a millisecond in a
		// router; without a pause a refused dial (at once) spins the loop.
		defer time.Sleep(time.Millisecond)
		errMu.Lock()
		errTimes = append(errTimes, time.Now())
		if len(errKinds) < 20 {
			errKinds[err.Error()]++
		}
		errMu.Unlock()
	}
	run := fmt.Sprintf("fo:%d:", time.Now().UnixNano())
	for w := range failoverWorkers {
		wg.Go(func() {
			for i := range failoverMaxIters {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("%s%d:%d", run, w, i)
				put, take := stores[i%2], stores[(i+1)%2]
				ledger.put(key)
				if err := put.Put(ctx, key, []byte(key), time.Minute); err != nil {
					fail(err)
					continue
				}
				v, ok, err := take.Take(ctx, key)
				switch {
				case err != nil:
					fail(err)
				case ok:
					hits.Add(1)
					ledger.hit(key, v)
				}
				if i >= 20 { // a handle this loop took, or whose Take failed, a moment ago
					old := fmt.Sprintf("%s%d:%d", run, w, i-20)
					v, ok, err := put.Take(ctx, old)
					switch {
					case err != nil:
						fail(err)
					case ok:
						ledger.hit(old, v)
					}
				}
			}
		})
	}
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()

	eventually(t, deployBudget, "warm-up hits", func() error {
		if n := hits.Load(); n < failoverWarmHits {
			return fmt.Errorf("%d hits", n)
		}
		return nil
	})
	errMu.Lock()
	before := len(errTimes)
	errMu.Unlock()
	require.Zero(t, before, "calls failed before the kill: %v", errKinds)

	killed := time.Now()
	kill()
	promoted()
	var res failoverResult
	res.promoted = time.Since(killed)
	eventually(t, failoverWindow, "calls succeed again after the failover", func() error {
		errMu.Lock()
		defer errMu.Unlock()
		last := killed
		if n := len(errTimes); n > 0 {
			last = errTimes[n-1]
		}
		if quiet := time.Since(last); quiet < failoverQuiet {
			return fmt.Errorf("last error %v ago: %v", quiet, errKinds)
		}
		return nil
	})
	close(stop)
	wg.Wait()

	errMu.Lock()
	res.firstErr, res.lastErr = -1, -1
	if n := len(errTimes); n > 0 {
		res.firstErr, res.lastErr = errTimes[0].Sub(killed), errTimes[n-1].Sub(killed)
	}
	t.Logf("errors seen: %v", errKinds)
	errMu.Unlock()
	assert.LessOrEqual(t, res.lastErr, failoverWindow, "errors after the failover window")

	// Hits resumed: every call succeeds, every handle put is found.
	for i := range 100 {
		key := fmt.Sprintf("%safter:%d", run, i)
		ledger.put(key)
		require.NoError(t, stores[i%2].Put(ctx, key, []byte(key), time.Minute), "put %d after the failover", i)
		v, ok, err := stores[(i+1)%2].Take(ctx, key)
		require.NoError(t, err, "take %d after the failover", i)
		require.True(t, ok, "take %d after the failover: a miss", i)
		ledger.hit(key, v)
	}

	// Take every handle again: one whose delete the failover undid is
	// taken a second time here.
	ledger.mu.Lock()
	keys := append([]string(nil), ledger.puts...)
	ledger.mu.Unlock()
	var sweepHits atomic.Int64
	var sweep sync.WaitGroup
	for w := range failoverWorkers {
		sweep.Go(func() {
			for i := w; i < len(keys); i += failoverWorkers {
				v, ok, err := stores[i%2].Take(ctx, keys[i])
				if !assert.NoError(t, err, "sweep") {
					return
				}
				if ok {
					sweepHits.Add(1)
					ledger.hit(keys[i], v)
				}
			}
		})
	}
	sweep.Wait()
	res.swept, res.sweptHits = len(keys), int(sweepHits.Load())

	ledger.mu.Lock()
	res.doubleTakes, res.wrongTakes = len(ledger.double), len(ledger.wrong)
	assert.Empty(t, ledger.wrong, "handles taken with another's value")
	ledger.mu.Unlock()

	// The outage is logged once when it starts and once when it ends.
	for i, s := range stores {
		if s.Stats().Outages > 0 {
			untilRecovered(t, s, logs[i])
		}
		st := s.Stats()
		res.puts += st.Puts
		res.putErrors += st.PutErrors
		res.hits += st.Hits
		res.misses += st.Misses
		res.takeErrors += st.TakeErrors
		res.unreplicated += st.Unreplicated
		res.outages += st.Outages
		var warns, infos int64
		for _, m := range logs[i].messages() {
			switch m {
			case "WARN redisstore: redis failing; takes miss and puts are dropped until it answers again":
				warns++
			case "INFO redisstore: redis answering again":
				infos++
			}
		}
		// One failover is one outage, or a few when the deployment flaps
		// while it settles (Sentinel reconfiguring the other replica, a
		// pooled connection to the dead primary failing after the first
		// success): each is still logged once, never once per failed call.
		assert.GreaterOrEqual(t, st.Outages, int64(1), "store %d: the failover is an outage", i)
		assert.LessOrEqual(t, st.Outages, int64(3), "store %d: one failover, at most a few outages", i)
		assert.Equal(t, st.Outages, warns, "store %d: one warning per outage", i)
		assert.Equal(t, st.Outages, infos, "store %d: one recovery record per outage", i)
		assert.Zero(t, st.OutageFailedCalls, "store %d: outage over", i)
	}
	return res
}

// TestUnreplicatedDelete shows the window that asynchronous replication
// leaves, and that WithWaitReplicas closes it. The replica's link to the
// primary is cut (the primary disables the replica's user and drops its
// connection), a handle is taken on the primary, the
// primary dies and the replica is promoted, as Sentinel would: the replica
// still holds the handle. With GETDEL alone the handle was returned before
// the kill and is returned again by the promoted replica; with
// WithWaitReplicas(1) the first Take returns ErrNotReplicated instead, so
// the handle is handed out once.
func TestUnreplicatedDelete(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []redisstore.Option
		want int // times the handle is handed out
	}{
		{"getdel", nil, 2},
		{"wait", []redisstore.Option{redisstore.WithWaitReplicas(1)}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			primary := startServer(t, "--repl-diskless-sync-delay", "0")
			rp := rawClient(t, primary.Addr())
			require.NoError(t, rp.Do(ctx, "acl", "setuser", "repl", "on", ">pw", "+@all", "~*").Err())
			replica := startServer(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.port), "--masteruser", "repl", "--masterauth", "pw")
			rr := rawClient(t, replica.Addr())
			before := newStore(t, primary, append([]redisstore.Option{redisstore.WithTimeout(time.Second)}, tc.opts...)...)
			require.NoError(t, before.Put(ctx, "conv", []byte("handle"), time.Hour))
			eventually(t, deployBudget, "the replica has the handle", func() error {
				return rr.Get(ctx, before.Key("conv")).Err()
			})

			require.NoError(t, rp.Do(ctx, "acl", "setuser", "repl", "off").Err())
			require.NoError(t, rp.Do(ctx, "client", "kill", "type", "replica").Err())
			handed := 0
			v, ok, err := before.Take(ctx, "conv")
			if ok {
				handed++
				assert.Equal(t, []byte("handle"), v)
			}
			if tc.want == 1 {
				require.ErrorIs(t, err, redisstore.ErrNotReplicated)
				assert.Equal(t, int64(1), before.Stats().Unreplicated)
			} else {
				require.NoError(t, err)
			}

			primary.kill()
			require.NoError(t, rr.Do(ctx, "replicaof", "no", "one").Err())
			// Any Store: the question is whether the handle is still there.
			after := newStore(t, replica)
			v, ok, err = after.Take(ctx, "conv")
			require.NoError(t, err)
			if ok {
				handed++
				assert.Equal(t, []byte("handle"), v)
			}
			assert.Equal(t, tc.want, handed, "times the handle was handed out")
		})
	}
}
