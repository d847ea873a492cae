package capability

// State is what a probe learned of one capability.
type State string

// The states of a capability.
const (
	// Unknown: the probe could not tell (the engine did not answer, the
	// answer was not one the probe understands, or the capability cannot
	// be observed without real turns).
	Unknown State = "unknown"
	// Present: the engine has it.
	Present State = "present"
	// Absent: the engine does not have it; Fact.Fix says what gives it.
	Absent State = "absent"
)

// Fact is one capability: its state, why the probe concluded so, and for
// an absent one the change that gives it.
type Fact struct {
	State State `json:"state"`
	// Why names the evidence: the request and its answer
	// ("POST /v1/chat/completions/render: 404"), or the version rule.
	Why string `json:"why,omitempty"`
	// Fix is the change to the engine (or to the router's configuration)
	// that gives an absent capability; "" when there is none to make.
	Fix string `json:"fix,omitempty"`
}

// Is reports whether f is in state s.
func (f Fact) Is(s State) bool { return f.State == s }

func present(why string) Fact       { return Fact{State: Present, Why: why} }
func absent(why, fix string) Fact   { return Fact{State: Absent, Why: why, Fix: fix} }
func unknown(why string) Fact       { return Fact{State: Unknown, Why: why} }
func (f Fact) or(why string) string { return orWhy(f.Why, why) }

func orWhy(why, def string) string {
	if why != "" {
		return why
	}
	return def
}

// API is one of the routes a router serves.
type API string

// The APIs, in the order reports list them.
const (
	Chat        API = "chat"        // POST /v1/chat/completions
	Completions API = "completions" // POST /v1/completions
	Responses   API = "responses"   // POST /v1/responses (OpenAI's Responses API)
	Messages    API = "messages"    // POST /v1/messages (Anthropic's Messages API)
)

// APIs lists every API in report order.
var APIs = []API{Chat, Completions, Responses, Messages}

// Path returns the API's route.
func (a API) Path() string {
	switch a {
	case Chat:
		return "/v1/chat/completions"
	case Completions:
		return "/v1/completions"
	case Responses:
		return "/v1/responses"
	case Messages:
		return "/v1/messages"
	}
	return ""
}

// RenderPath returns the API's render route.
func (a API) RenderPath() string { return a.Path() + "/render" }

// APIFor returns the API served at path, and false for another path.
func APIFor(path string) (API, bool) {
	for _, a := range APIs {
		if a.Path() == path {
			return a, true
		}
	}
	return "", false
}

// PerAPI holds one Fact per API.
type PerAPI struct {
	Chat        Fact `json:"chat"`
	Completions Fact `json:"completions"`
	Responses   Fact `json:"responses"`
	Messages    Fact `json:"messages"`
}

// Get returns a's Fact.
func (p *PerAPI) Get(a API) Fact {
	if f := p.ptr(a); f != nil {
		return *f
	}
	return unknown("unknown API " + string(a))
}

// Set sets a's Fact; an unknown API is ignored.
func (p *PerAPI) Set(a API, f Fact) {
	if ptr := p.ptr(a); ptr != nil {
		*ptr = f
	}
}

func (p *PerAPI) ptr(a API) *Fact {
	switch a {
	case Chat:
		return &p.Chat
	case Completions:
		return &p.Completions
	case Responses:
		return &p.Responses
	case Messages:
		return &p.Messages
	}
	return nil
}
