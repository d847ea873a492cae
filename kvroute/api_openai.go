package kvroute

import "github.com/bidikv/bidikv/internal/jsonraw"

// What the OpenAI-shaped APIs share: reading choice 0 of an answer, and
// building bodies from a request's members.

// choiceZero returns choice 0 of an OpenAI answer's choices, or nil.
func choiceZero(obj jsonraw.Object) []byte {
	choices, _ := obj.Get("choices")
	var c []byte
	_ = jsonraw.Elements(choices, func(v []byte) error { c = v; return errStop })
	if len(c) == 0 || c[0] != '{' {
		return nil
	}
	return c
}

// finishOf fills the finish and stop reasons of an OpenAI choice.
func finishOf(rep *Reply, c []byte) {
	if v, ok := jsonraw.Lookup(c, "finish_reason"); ok {
		rep.FinishReason, _ = jsonraw.String(v)
	}
	if v, ok := jsonraw.Lookup(c, "stop_reason"); ok {
		rep.StopReason = append([]byte(nil), v...)
	}
}

// pickMembers builds a JSON object of the request's members named in
// fields, in that order.
func pickMembers(req *Request, fields []string) []byte {
	set := make([]jsonraw.Member, 0, len(fields))
	for _, f := range fields {
		if v, ok := req.Field(f); ok {
			set = append(set, jsonraw.Member{Key: f, Value: v})
		}
	}
	return (jsonraw.Object{}).Edit(nil, set...)
}

// objectArray checks that member key is a non-empty array of objects.
func objectArray(obj jsonraw.Object, key string) error {
	v, ok := obj.Get(key)
	if !ok || len(v) == 0 || v[0] != '[' {
		return badRequest("%s must be a non-empty array", key)
	}
	n := 0
	if err := jsonraw.Elements(v, func(m []byte) error {
		if len(m) == 0 || m[0] != '{' {
			return badRequest("%s[%d] must be an object", key, n)
		}
		n++
		return nil
	}); err != nil {
		return err
	}
	if n == 0 {
		return badRequest("%s must be a non-empty array", key)
	}
	return nil
}

// choiceReply starts the reply of an OpenAI answer from its choice 0: the
// finish and stop reasons, and the choice itself (nil, with the reply
// marked incomplete, when there is none).
func choiceReply(obj jsonraw.Object) (*Reply, []byte) {
	rep := &Reply{}
	c := choiceZero(obj)
	if c == nil {
		rep.Incomplete = true
		return rep, nil
	}
	finishOf(rep, c)
	return rep, c
}
