package kvroute

import (
	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
)

// completionsAPI is POST /v1/completions. The render answer is a list,
// one object per prompt.
var completionsAPI = &api{
	code:          2,
	kind:          twoLegs,
	path:          PathCompletions,
	prefillSet:    oneTokenLeg,
	prefillDrop:   openAIPrefillDrop,
	render:        PathCompletions + "/render",
	renderList:    true,
	tokenIDs:      true,
	streamHandles: true,
	errors:        openAIErrors{},
	impl:          completions{},
}

type completions struct{}

func (completions) validate(obj jsonraw.Object) error {
	if v, ok := obj.Get("prompt"); !ok || jsonraw.IsNull(v) {
		return badRequest("prompt is required")
	}
	return nil
}

// bodyReply reads choice 0's text.
func (completions) bodyReply(obj jsonraw.Object) *Reply {
	rep, c := choiceReply(obj)
	if c == nil {
		return rep
	}
	if v, ok := jsonraw.Lookup(c, "text"); ok {
		rep.Content, _ = jsonraw.String(v)
	}
	return rep
}

// The members of a completions body that /tokenize takes.
var tokenizeCompletion = []string{"model", "prompt", "add_special_tokens"}

func (completions) tokenizeFields() []string { return tokenizeCompletion }

// tokenizable: /tokenize takes one prompt string.
func (completions) tokenizable(req *Request) bool {
	p, ok := req.Field("prompt")
	return ok && len(p) > 0 && p[0] == '"'
}

// promptIDs reads a prompt given as token ids, or as a list holding one
// list of ids.
func (completions) promptIDs(req *Request) ([]uint32, bool) {
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
