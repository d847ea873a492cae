package kvroute

import "context"

// read is the turn's first phase: it validates the request and fixes what
// the phases after it read of the client (whether it streams, its
// principal, its tenant, its conversation hint).
func read(ctx context.Context, t *turn) error {
	req := t.req
	if err := req.parse(t.r.cfg.maxMembers); err != nil {
		return err
	}
	t.stream = req.streaming()
	t.rec.Stream = t.stream
	req.setPrincipal(ctx)
	req.tenant = t.r.tenant(req)
	req.hint = conversationHint(req)
	return nil
}
