package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// record is one request's stats, as written to --output.
type record struct {
	ConversationID string  `json:"conversation_id"`
	Turn           int     `json:"turn"`
	Start          float64 `json:"start_unix"`
	TTFTMs         float64 `json:"ttft_ms"`
	TPOTMs         float64 `json:"tpot_ms"`
	LatencyMs      float64 `json:"latency_ms"`
	OutputChunks   int     `json:"output_chunks"`
	InputMessages  int     `json:"input_messages"`
	Status         int     `json:"status"`
	Reuse          string  `json:"reuse,omitempty"`
	Error          string  `json:"error,omitempty"`
}

// state is a conversation in progress.
type state struct {
	conv    conversation
	history []message
	next    int // index of the next user message in conv.Messages
	turn    int
}

func runMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	for _, a := range args {
		if a == "--overhead" || a == "-overhead" {
			return runOverhead(ctx, args, stdout, stderr)
		}
		if a == "--attack" || a == "-attack" {
			return runAttack(ctx, args, stdout, stderr)
		}
		if a == "--fleet" || a == "-fleet" {
			return runFleet(ctx, args, stdout, stderr)
		}
		if a == "--replay-trace" || a == "-replay-trace" || strings.HasPrefix(a, "--replay-trace=") {
			return runReplay(ctx, args, stdout, stderr)
		}
	}
	c, err := parseFlags(args, stdout)
	if err != nil {
		return err
	}
	convs, err := loadInput(c.input, c.seed)
	if err != nil {
		return err
	}
	if c.limit > 0 && len(convs) > c.limit {
		convs = convs[:c.limit]
	}
	var count runCount
	start := time.Now()
	stop := every(progressOut(stderr), progressInterval, func() string {
		return fmt.Sprintf("bench: %d turns answered, %d failed, %s", count.ok.Load(), count.failed.Load(),
			time.Since(start).Round(time.Second))
	})
	recs, elapsed := run(ctx, c, convs, http.DefaultTransport, &count)
	stop()
	summarize(recs, elapsed).print(stdout)
	if c.output != "" {
		raw, err := json.MarshalIndent(recs, "", " ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(c.output, raw, 0o644); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "per-request stats: %s\n", c.output)
	}
	return allFailed(recs)
}

// allFailed is the error of a run in which every request failed, naming
// the first failure: such a run measured nothing.
func allFailed(recs []record) error {
	for _, r := range recs {
		if r.Error == "" {
			return nil
		}
	}
	if len(recs) == 0 {
		return nil
	}
	return fmt.Errorf("every request failed (%d of %d); the first: %s", len(recs), len(recs), recs[0].Error)
}

// runCount counts the turns of a run as they end, for its progress lines.
type runCount struct{ ok, failed atomic.Int64 }

// run drives every conversation to its end with c.clients clients over at
// most c.maxActive active conversations, turn by turn.
func run(ctx context.Context, c config, convs []conversation, rt http.RoundTripper, count *runCount) ([]record, time.Duration) {
	client := &http.Client{Transport: rt}
	backlog := make(chan *state, len(convs))
	for _, cv := range convs {
		if st := newState(cv, c.maxTurns); st != nil {
			backlog <- st
		}
	}
	close(backlog)
	ready := make(chan *state, c.maxActive)
	var mu sync.Mutex
	remaining := len(backlog)
	if remaining == 0 {
		return nil, 0
	}
	for range c.maxActive {
		if st, ok := <-backlog; ok {
			ready <- st
		}
	}
	pace := newPacer(c.rate, c.seed)
	var recs []record
	start := time.Now()
	var wg sync.WaitGroup
	for range c.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for st := range ready {
				var rec record
				if err := pace.wait(ctx); err != nil {
					rec = record{ConversationID: st.conv.ID, Turn: st.turn, Error: err.Error()}
				} else {
					rec = sendTurn(ctx, client, c, st)
				}
				if rec.Error == "" {
					count.ok.Add(1)
				} else {
					count.failed.Add(1)
				}
				mu.Lock()
				recs = append(recs, rec)
				mu.Unlock()
				if rec.Error == "" && st.advance() {
					ready <- st
					continue
				}
				if nxt, ok := <-backlog; ok {
					ready <- nxt
				}
				finish(&mu, &remaining, ready)
			}
		}()
	}
	wg.Wait()
	return recs, time.Since(start)
}

// finish counts a conversation done and closes ready after the last.
func finish(mu *sync.Mutex, remaining *int, ready chan *state) {
	mu.Lock()
	defer mu.Unlock()
	*remaining--
	if *remaining == 0 {
		close(ready)
	}
}

func newState(cv conversation, maxTurns int) *state {
	st := &state{conv: cv, next: -1}
	if !st.seek(0) {
		return nil
	}
	if maxTurns > 0 {
		users := 0
		for i, m := range cv.Messages {
			if m.Role == "user" {
				users++
				if users > maxTurns {
					st.conv.Messages = cv.Messages[:i]
					break
				}
			}
		}
	}
	return st
}

// seek moves to the first user message at or after i, adding the messages
// before it (system prompts, stored context) to the history.
func (st *state) seek(i int) bool {
	for ; i < len(st.conv.Messages); i++ {
		m := st.conv.Messages[i]
		if m.Role == "user" {
			st.next = i
			return true
		}
		if m.Role != "assistant" {
			st.history = append(st.history, m)
		}
	}
	return false
}

// advance moves past the turn just sent; false when the conversation ended.
func (st *state) advance() bool {
	st.turn++
	return st.seek(st.next + 1)
}

func sendTurn(ctx context.Context, client *http.Client, c config, st *state) record {
	user := st.conv.Messages[st.next]
	msgs := append(st.history[:len(st.history):len(st.history)], user)
	maxTok := c.maxTokens
	if st.turn < len(st.conv.maxTokens) && st.conv.maxTokens[st.turn] > 0 {
		maxTok = st.conv.maxTokens[st.turn]
	}
	body := map[string]any{
		"model": c.model, "messages": msgs, "stream": true, "max_tokens": maxTok,
		"stream_options": map[string]any{"include_usage": false},
	}
	if c.sendConvID {
		body["conversation_id"] = st.conv.ID
	}
	rec := record{ConversationID: st.conv.ID, Turn: st.turn, InputMessages: len(msgs)}
	raw, err := json.Marshal(body)
	if err != nil {
		rec.Error = err.Error()
		return rec
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url+"/v1/chat/completions", bytes.NewReader(raw))
	if err != nil {
		rec.Error = err.Error()
		return rec
	}
	for k, v := range c.header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	if c.sendConvID {
		req.Header.Set("X-Session-ID", st.conv.ID)
	}
	start := time.Now()
	rec.Start = float64(start.UnixNano()) / 1e9
	text, chunks, first, err := stream(client, req, &rec)
	end := time.Since(start)
	rec.LatencyMs = ms(end)
	if first > 0 {
		rec.TTFTMs = ms(first)
		if chunks > 1 {
			rec.TPOTMs = ms(end-first) / float64(chunks-1)
		}
	}
	rec.OutputChunks = chunks
	if err != nil {
		rec.Error = err.Error()
		return rec
	}
	st.history = append(msgs, message{Role: "assistant", Content: text})
	return rec
}

// stream sends req and reads the SSE reply: the text, the number of chunks
// with content, and the time to the first of them.
func stream(client *http.Client, req *http.Request, rec *record) (string, int, time.Duration, error) {
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return "", 0, 0, err
	}
	defer resp.Body.Close()
	rec.Status = resp.StatusCode
	rec.Reuse = resp.Header.Get("X-Bidikv-Reuse")
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return "", 0, 0, fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	var text strings.Builder
	chunks, first, done := 0, time.Duration(0), false
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data:")
		if !ok {
			continue
		}
		data = strings.TrimSpace(data)
		if data == "[DONE]" {
			done = true
			break
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Error json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ch); err != nil {
			return text.String(), chunks, first, fmt.Errorf("bad chunk: %w", err)
		}
		if len(ch.Error) > 0 && string(ch.Error) != "null" {
			return text.String(), chunks, first, fmt.Errorf("stream error: %s", ch.Error)
		}
		if len(ch.Choices) > 0 && ch.Choices[0].Delta.Content != "" {
			if chunks == 0 {
				first = time.Since(start)
			}
			chunks++
			text.WriteString(ch.Choices[0].Delta.Content)
		}
	}
	if err := sc.Err(); err != nil {
		return text.String(), chunks, first, err
	}
	if !done {
		return text.String(), chunks, first, fmt.Errorf("stream ended without [DONE]")
	}
	return text.String(), chunks, first, nil
}

// pacer spaces requests with exponential gaps at rate per second.
type pacer struct {
	mu   sync.Mutex
	rate float64
	rng  *rand.Rand
	next time.Time
}

func newPacer(rate float64, seed uint64) *pacer {
	return &pacer{rate: rate, rng: rand.New(rand.NewPCG(seed, 0x7061)), next: time.Now()}
}

func (p *pacer) wait(ctx context.Context) error {
	if p.rate <= 0 {
		return ctx.Err()
	}
	p.mu.Lock()
	at := p.next
	p.next = p.next.Add(time.Duration(p.rng.ExpFloat64() / p.rate * float64(time.Second)))
	p.mu.Unlock()
	t := time.NewTimer(time.Until(at))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
