package sim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// FuzzScheduler runs random agent sessions through a 1P1D pair with a
// small decode engine on an event clock (holds piling up, requests waiting
// and preempted, decode legs loading and then waiting for a running slot, P's leases renewed while D waits, a client now and then
// giving up while it waits) and checks the oracle: every request ends (no
// stall), every answer not given up is 200 and equals a single engine's
// (the engine's own Reference check, Stats.WrongOutputs), the block
// accounting of both engines holds at the end (CheckPools), only holds
// keep blocks once everyone is done, and nothing is held after the TTL.
func FuzzScheduler(f *testing.F) {
	f.Add(uint64(1), uint8(12), uint8(6), uint8(0))
	f.Add(uint64(7), uint8(0), uint8(7), uint8(3))
	f.Add(uint64(42), uint8(30), uint8(2), uint8(1))
	f.Fuzz(func(t *testing.T, seed uint64, blocks, sessions, cancels uint8) {
		nb := 8 + int(blocks)%40 // 8 to 47 blocks of 16
		ns := 1 + int(sessions)%8
		clk := newEventClock()
		reg := sim.NewRegistry()
		p := start(t, reg, clk, func(c *sim.Config) {
			c.NumBlocks, c.PrefixCaching, c.Profile = 64, false, ms
			c.KVLoadFailurePolicy = sim.PolicyRecompute
		})
		d := start(t, reg, clk, func(c *sim.Config) {
			c.NumBlocks, c.Profile, c.DecoderBlocksTTL = nb, ms, time.Minute
			// reads that take time (decode legs waiting for a running
			// slot once read) and a running cap, by the seed
			c.Profile.TransferFixed = time.Duration(seed%3) * 20 * time.Millisecond
			c.MaxNumSeqs = []int{0, 1, 2, 4}[seed%4]
		})
		limit := nb * 16 // D's max_model_len
		ctx, stop := context.WithTimeout(context.Background(), 30*time.Second)
		defer stop()
		var mu sync.Mutex
		var bad []string
		fail := func(format string, a ...any) {
			mu.Lock()
			defer mu.Unlock()
			bad = append(bad, fmt.Sprintf(format, a...))
		}
		for s := range ns {
			clk.Join()
			go func() {
				defer clk.Leave()
				rng := rand.New(rand.NewPCG(seed, uint64(s)))
				var prompt []int
				var dkv json.RawMessage
				for turn := range 1 + rng.IntN(3) {
					if clk.Sleep(ctx, time.Duration(1+rng.IntN(90_000))*time.Millisecond) != nil {
						return
					}
					gen := 1 + rng.IntN(40)
					grow := 1 + rng.IntN(limit/3)
					if len(prompt)+grow+gen > limit || (dkv == nil && prompt != nil) {
						prompt, dkv = nil, nil // a new conversation
						grow = min(grow, limit-gen)
					}
					prompt = append(prompt, idPrompt(s*10+turn+int(seed%1000)*100, grow)...)
					kv := any(missHandle())
					if dkv != nil {
						var h map[string]any
						_ = json.Unmarshal(dkv, &h)
						h["do_remote_decode"], h["do_remote_prefill"] = true, false
						kv = h
					}
					rctx, cancel := ctx, context.CancelFunc(func() {})
					giveUp := cancels > 0 && rng.IntN(4) < int(cancels%4)
					if giveUp {
						// the client leaves after a random modelled wait:
						// the request may be queued, running or done
						rctx, cancel = context.WithCancel(ctx)
						wait := time.Duration(rng.IntN(5000)) * time.Millisecond
						clk.AfterFunc(wait, cancel)
					}
					// A client that gives up waits until the engine has let
					// its request go (noticed in real time: until then the
					// request still counts as this session's, blocked on the
					// clock), then leaves for good.
					id := fmt.Sprintf("s%d-t%d", s, turn)
					gone := func(e *node) {
						for range 400 {
							if len(e.FinishedRecords(id)) > 0 {
								return
							}
							time.Sleep(5 * time.Millisecond)
						}
					}
					rp := fetchID(rctx, p.url, sim.PathCompletions, id, ids(prompt, 1, kv))
					if rp.Status != http.StatusOK || rp.KV == nil {
						cancel()
						if !giveUp || rctx.Err() == nil {
							fail("session %d turn %d: P %d %s", s, turn, rp.Status, rp.Body)
						}
						gone(p)
						return
					}
					rd := fetchID(rctx, d.url, sim.PathCompletions, id, with(ids(prompt, gen, json.RawMessage(rp.KV)), "return_token_ids", true))
					cancel()
					if rd.Status != http.StatusOK {
						if !giveUp || rctx.Err() == nil {
							fail("session %d turn %d: D %d %s", s, turn, rd.Status, rd.Body)
						}
						gone(d)
						return
					}
					// the next prompt continues this one and its reply, as
					// D's blocks hold them
					dkv = rd.KV
					prompt = append(prompt, rd.TokenIDs...)
				}
			}()
		}
		runCtx, runStop := context.WithTimeout(ctx, 10*time.Second)
		defer runStop()
		if err := clk.Run(runCtx); err != nil {
			t.Logf("blocked %d, next timer %v", clk.Blocked(), func() any { at, ok := clk.Next(); return fmt.Sprint(at, ok) }())
			t.Logf("D %+v\n%s", d.Stats(), d.DebugQueues())
			t.Logf("P %+v", p.Stats())
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			t.Logf("%s", buf[:n])
			t.Fatalf("run: %v (D %+v)", err, d.Stats())
		}
		for _, b := range bad {
			t.Error(b)
		}
		for name, e := range map[string]*node{"P": p, "D": d} {
			// a request whose client gave up notices it in its own time
			for i := 0; i < 2000; i++ {
				if st := e.Stats(); st.Running == 0 && st.Waiting == 0 {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			if err := e.CheckPools(); err != nil {
				t.Errorf("%s: %v", name, err)
			}
			if st := e.Stats(); st.Running != 0 || st.Waiting != 0 || st.UsedBlocks != st.BlocksPinned {
				t.Errorf("%s after the run: %d running, %d waiting, %d used, %d held", name, st.Running, st.Waiting, st.UsedBlocks, st.BlocksPinned)
			}
		}
		if w := d.Stats().WrongOutputs; w != 0 {
			t.Errorf("%d wrong answers (P %+v)", w, p.Stats())
			for _, r := range d.Records() {
				if r.Wrong {
					t.Logf("wrong: %s pull %s pulled %d cached %d queued %s preempted %d aborted %t status %d", r.Role, r.Pull, r.PulledTokens, r.CachedTokens, r.Queued, r.Preemptions, r.Aborted, r.Status)
				}
			}
		}
		for _, e := range []*node{p, d} {
			if st := e.Stats(); st.UsedBlocks != st.BlocksPinned {
				t.Errorf("blocks used %d, held %d", st.UsedBlocks, st.BlocksPinned)
			}
		}
		// nothing is held after the TTL
		probe := make(chan struct{})
		clk.Join()
		go func() {
			defer clk.Leave()
			defer close(probe)
			_ = clk.Sleep(ctx, 2*time.Minute)
		}()
		if err := clk.Run(ctx); err != nil {
			t.Fatalf("run: %v", err)
		}
		<-probe
		if st := d.Stats(); st.BlocksPinned != 0 || st.UsedBlocks != 0 {
			t.Errorf("after the TTL D holds %d blocks, uses %d", st.BlocksPinned, st.UsedBlocks)
		}
	})
}
