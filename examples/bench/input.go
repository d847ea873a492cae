package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
)

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// conversation is one entry of vLLM's multi-turn conversation list:
// {"id": ..., "messages": [{"role": ..., "content": ...}, ...]}. The
// benchmark sends the user messages in turn and replaces each stored
// assistant message with the reply it received.
type conversation struct {
	ID       string    `json:"id"`
	Messages []message `json:"messages"`
	// maxTokens is the per-turn output length from a generation config
	// (0: use --max-tokens).
	maxTokens []int
}

// genConfig is vLLM's generate_conversations input
// (benchmarks/multi_turn/generate_multi_turn.json).
type genConfig struct {
	FileType         string   `json:"filetype"`
	NumConversations int      `json:"num_conversations"`
	TextFiles        []string `json:"text_files"`
	PromptInput      struct {
		NumTurns              *distribution `json:"num_turns"`
		CommonPrefixNumTokens *distribution `json:"common_prefix_num_tokens"`
		PrefixNumTokens       *distribution `json:"prefix_num_tokens"`
		NumTokens             *distribution `json:"num_tokens"`
	} `json:"prompt_input"`
	PromptOutput struct {
		NumTokens *distribution `json:"num_tokens"`
	} `json:"prompt_output"`
}

// distribution is one of vLLM's: constant (value), uniform (min, max),
// lognormal (average or mean/sigma, max), zipf (alpha, max), poisson
// (alpha, max).
type distribution struct {
	Distribution string   `json:"distribution"`
	Value        *float64 `json:"value"`
	Min, Max     *float64
	Average      *float64 `json:"average"`
	Mean         *float64 `json:"mean"`
	Sigma        *float64 `json:"sigma"`
	Alpha        *float64 `json:"alpha"`
}

func (d *distribution) sample(r *rand.Rand) (int, error) {
	if d == nil {
		return 0, nil
	}
	get := func(p *float64, name string) (float64, error) {
		if p == nil {
			return 0, fmt.Errorf("%s distribution needs %q", d.Distribution, name)
		}
		return *p, nil
	}
	capAt := func(v float64) float64 {
		if d.Max != nil {
			v = math.Min(v, *d.Max)
		}
		return math.Max(v, 1)
	}
	switch d.Distribution {
	case "constant":
		v, err := get(d.Value, "value")
		return int(v), err
	case "uniform":
		lo, err := get(d.Min, "min")
		if err != nil {
			return 0, err
		}
		hi, err := get(d.Max, "max")
		if err != nil {
			return 0, err
		}
		return int(lo) + r.IntN(int(hi-lo)+1), nil
	case "lognormal":
		sigma := 0.5
		if d.Sigma != nil {
			sigma = *d.Sigma
		}
		var mu float64
		switch {
		case d.Average != nil: // mean of the distribution
			mu = math.Log(*d.Average) - sigma*sigma/2
		case d.Mean != nil: // mean of the underlying normal
			mu = *d.Mean
		default:
			return 0, errors.New(`lognormal distribution needs "average" or "mean"`)
		}
		return int(capAt(math.Exp(mu + sigma*r.NormFloat64()))), nil
	case "zipf":
		a, err := get(d.Alpha, "alpha")
		if err != nil || a <= 1 {
			return 0, errors.New(`zipf distribution needs "alpha" > 1`)
		}
		// Inverse-transform on the continuous Pareto tail, rounded.
		return int(capAt(math.Floor(math.Pow(1-r.Float64(), -1/(a-1))))), nil
	case "poisson":
		a, err := get(d.Alpha, "alpha")
		if err != nil {
			return 0, err
		}
		l, k, p := math.Exp(-a), 0, 1.0
		for p > l && k < 1<<20 {
			k++
			p *= r.Float64()
		}
		return int(capAt(float64(k - 1))), nil
	}
	return 0, fmt.Errorf("unknown distribution %q", d.Distribution)
}

// loadInput reads a conversation list or a generate_conversations config.
func loadInput(path string, seed uint64) ([]conversation, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	trimmed := strings.TrimSpace(string(raw))
	if strings.HasPrefix(trimmed, "[") {
		var convs []conversation
		if err := json.Unmarshal(raw, &convs); err != nil {
			return nil, fmt.Errorf("%s: conversation list: %w", path, err)
		}
		for i := range convs {
			if convs[i].ID == "" {
				convs[i].ID = fmt.Sprintf("conv-%d", i)
			}
		}
		return convs, nil
	}
	var g genConfig
	if err := json.Unmarshal(raw, &g); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if g.FileType != "generate_conversations" {
		return nil, fmt.Errorf("%s: want a JSON list of conversations or a config with \"filetype\": \"generate_conversations\"", path)
	}
	return generate(g, filepath.Dir(path), seed)
}

// generate builds conversations from a generation config. Token counts are
// approximated by words (the tool has no tokenizer); text comes from the
// config's text files when they exist, otherwise from a fixed vocabulary.
func generate(g genConfig, dir string, seed uint64) ([]conversation, error) {
	r := rand.New(rand.NewPCG(seed, 0x6b76))
	var corpus []string
	for _, f := range g.TextFiles {
		if !filepath.IsAbs(f) {
			f = filepath.Join(dir, f)
		}
		if raw, err := os.ReadFile(f); err == nil {
			corpus = append(corpus, strings.Fields(string(raw))...)
		}
	}
	if len(corpus) == 0 {
		corpus = strings.Fields("the router keeps the decode engine's KV so the next turn pulls it instead of computing the whole history again")
	}
	pos := 0
	text := func(n int) string {
		var b strings.Builder
		for i := 0; i < n; i++ {
			if i > 0 {
				b.WriteByte(' ')
			}
			b.WriteString(corpus[pos%len(corpus)])
			pos++
		}
		return b.String()
	}
	common, err := g.PromptInput.CommonPrefixNumTokens.sample(r)
	if err != nil {
		return nil, err
	}
	commonText := text(common)
	n := max(g.NumConversations, 1)
	convs := make([]conversation, 0, n)
	for i := range n {
		turns, err := g.PromptInput.NumTurns.sample(r)
		if err != nil {
			return nil, err
		}
		turns = max(turns, 1)
		prefix, err := g.PromptInput.PrefixNumTokens.sample(r)
		if err != nil {
			return nil, err
		}
		c := conversation{ID: fmt.Sprintf("CONV_ID_%d", i)}
		for t := range (turns + 1) / 2 { // vLLM counts user and assistant turns
			in, err := g.PromptInput.NumTokens.sample(r)
			if err != nil {
				return nil, err
			}
			content := text(max(in, 1))
			if t == 0 {
				content = strings.TrimSpace(commonText + " " + text(prefix) + " " + content)
			}
			out, err := g.PromptOutput.NumTokens.sample(r)
			if err != nil {
				return nil, err
			}
			c.Messages = append(c.Messages, message{Role: "user", Content: content}, message{Role: "assistant"})
			c.maxTokens = append(c.maxTokens, out)
		}
		convs = append(convs, c)
	}
	return convs, nil
}

// newRand returns the generator used for sampling.
func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x6b76)) }
