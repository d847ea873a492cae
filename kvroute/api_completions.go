package kvroute

import (
	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
)

// completionsAPI is POST /v1/completions.
type completionsAPI struct{ openAI }

func (completionsAPI) path() string { return PathCompletions }

func (completionsAPI) validate(obj jsonraw.Object) error {
	if v, ok := obj.Get("prompt"); !ok || jsonraw.IsNull(v) {
		return badRequest("prompt is required")
	}
	return nil
}

func (completionsAPI) prefillSet() []jsonraw.Member { return oneTokenLeg }
func (completionsAPI) prefillDrop() []string        { return openAIPrefillDrop }

// bodyReply reads choice 0's text.
func (completionsAPI) bodyReply(obj jsonraw.Object) *Reply {
	rep, c := choiceReply(obj)
	if c == nil {
		return rep
	}
	if v, ok := jsonraw.Lookup(c, "text"); ok {
		rep.Content, _ = jsonraw.String(v)
	}
	return rep
}

// The completions render answer is a list, one object per prompt.
func (completionsAPI) renderPath() (string, bool) { return PathCompletions + "/render", true }

// The members of a completions body that /tokenize takes.
var tokenizeCompletion = []string{"model", "prompt", "add_special_tokens"}

func (completionsAPI) tokenizeFields() []string { return tokenizeCompletion }

// tokenizable: /tokenize takes one prompt string.
func (completionsAPI) tokenizable(req *Request) bool {
	p, ok := req.Field("prompt")
	return ok && len(p) > 0 && p[0] == '"'
}

// promptIDs reads a prompt given as token ids, or as a list holding one
// list of ids.
func (completionsAPI) promptIDs(req *Request) ([]uint32, bool) {
	p, ok := req.Field("prompt")
	if !ok {
		return nil, false
	}
	if ids, ok := capture.AppendTokenIDs(nil, p); ok {
		return ids, true
	}
	var inner []byte
	n := 0
	if jsonraw.Elements(p, func(v []byte) error { inner = v; n++; return nil }) != nil || n != 1 {
		return nil, false
	}
	return capture.AppendTokenIDs(nil, inner)
}
