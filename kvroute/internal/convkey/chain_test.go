package convkey_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/convkey"
)

var (
	sysMsg  = `{"role":"system","content":"You are terse."}`
	userMsg = `{"role":"user","content":"list the files"}`
	// userSpelled is userMsg spelled otherwise: the same message.
	userSpelled = `{"content":[{"text":"list the \u0066iles","type":"text"}], "role":"user"}`
	replyMsg    = `{"role":"assistant","content":"a.go b.go"}`
)

// chain hashes msgs one after another from prev with c and returns the
// digest after each.
func chain(t *testing.T, c *convkey.Chainer, prev [32]byte, msgs ...string) [][32]byte {
	t.Helper()
	var out [][32]byte
	for _, m := range msgs {
		var err error
		prev, _, err = c.Message(prev, []byte(m), nil)
		require.NoError(t, err)
		out = append(out, prev)
	}
	return out
}

// A conversation's digest is a chain: each message's digest covers the
// digest before it, so it names the whole conversation up to it.
func TestChain(t *testing.T) {
	c := convkey.NewChainer()
	var zero [32]byte
	ab := chain(t, c, zero, sysMsg, userMsg)
	assert.NotEqual(t, ab[0], ab[1])
	assert.Equal(t, ab, chain(t, convkey.NewChainer(), zero, sysMsg, userSpelled), "equal messages, equal chain")
	assert.NotEqual(t, ab[1], chain(t, c, zero, userMsg, sysMsg)[1], "messages in another order")
	assert.NotEqual(t, ab[1], chain(t, c, zero, userMsg)[0], "a message fewer")
	assert.NotEqual(t, ab[1], chain(t, c, zero, sysMsg, sysMsg, userMsg)[2], "a message more")
	// Prefixes: a longer conversation passes through the digests of its
	// shorter ones, and continuing from a prefix's digest is hashing the
	// whole conversation from the start.
	abc := chain(t, c, zero, sysMsg, userMsg, replyMsg)
	assert.Equal(t, ab, abc[:2], "a conversation's prefix has the prefix's digests")
	assert.Equal(t, abc[2], chain(t, c, ab[1], replyMsg)[0], "continued from the prefix's digest")
	assert.NotEqual(t, abc[2], chain(t, c, ab[0], replyMsg)[0], "continued from a shorter prefix")
	other := sum(t, `{"role":"system","content":"tenant b"}`)
	assert.NotEqual(t, chain(t, c, zero, userMsg)[0], chain(t, c, other, userMsg)[0], "another start")
}

// A Chainer keeps nothing of one message into the next: reused, it gives
// what a new one gives.
func TestChainerReuse(t *testing.T) {
	c := convkey.NewChainer()
	withMembers := `{"role":"assistant","content":"caf\u00e9","x":1,"y":"z","tool_calls":[{"id":"c1","function":{"name":"ls","arguments":"{}"}}]}`
	parts := `{"role":"user","content":[{"type":"text","text":"a\u0062"},{"type":"text","text":"c"}]}`
	for _, m := range []string{withMembers, parts, userMsg, replyMsg, withMembers} {
		got, _, err := c.Message([32]byte{}, []byte(m), nil)
		require.NoError(t, err)
		assert.Equal(t, sum(t, m), got, "%s", m)
	}
}

// The anchor is a second chain Message computes from the same pass over a
// message: the conversation's start, hashed from its own origin. These are
// its properties; its digests are not pinned.
func TestChainerAnchor(t *testing.T) {
	var zero [32]byte
	step := func(t *testing.T, prev, anchor [32]byte, m string) (sum, next [32]byte) {
		t.Helper()
		next = anchor
		sum, role, err := convkey.NewChainer().Message(prev, []byte(m), &next)
		require.NoError(t, err)
		_, wantRole, _ := convkey.NewChainer().Message(prev, []byte(m), nil)
		assert.Equal(t, wantRole, role)
		return sum, next
	}
	prev := sum(t, sysMsg)
	t.Run("it leaves the chain as it is", func(t *testing.T) {
		got, _ := step(t, prev, zero, userMsg)
		assert.Equal(t, chain(t, convkey.NewChainer(), prev, userMsg)[0], got)
	})
	t.Run("it moves with each message", func(t *testing.T) {
		_, a1 := step(t, prev, zero, userMsg)
		assert.NotEqual(t, zero, a1)
		_, a2 := step(t, prev, a1, userMsg)
		assert.NotEqual(t, a1, a2)
	})
	// Two steps, from a chain digest and an anchor, over a message: their
	// anchors are equal exactly when the anchor before and the message's
	// meaning are.
	type from struct {
		prev, anchor [32]byte
		m            string
	}
	for _, tc := range []struct {
		name  string
		a, b  from
		equal bool
	}{
		{"it does not depend on the chain", from{prev, zero, userMsg}, from{zero, zero, userMsg}, true},
		{"equal messages, equal anchors", from{prev, zero, userMsg}, from{prev, zero, userSpelled}, true},
		{"other messages, other anchors", from{prev, zero, userMsg}, from{prev, zero, replyMsg}, false},
		{"another origin, another anchor", from{prev, zero, userMsg}, from{prev, prev, userMsg}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, a := step(t, tc.a.prev, tc.a.anchor, tc.a.m)
			_, b := step(t, tc.b.prev, tc.b.anchor, tc.b.m)
			assert.Equal(t, tc.equal, a == b)
		})
	}
	t.Run("order and length of the start", func(t *testing.T) {
		anchorOf := func(msgs ...string) [32]byte {
			a := zero
			for _, m := range msgs {
				_, a = step(t, zero, a, m)
			}
			return a
		}
		assert.Equal(t, anchorOf(sysMsg, userMsg), anchorOf(sysMsg, userSpelled))
		assert.NotEqual(t, anchorOf(sysMsg, userMsg), anchorOf(userMsg, sysMsg))
		assert.NotEqual(t, anchorOf(sysMsg, userMsg), anchorOf(userMsg))
		assert.NotEqual(t, anchorOf(sysMsg, userMsg), anchorOf(sysMsg, userMsg, replyMsg))
	})
	t.Run("a reused Chainer gives the same anchors", func(t *testing.T) {
		c := convkey.NewChainer()
		a, b := zero, zero
		for _, m := range []string{sysMsg, userMsg, replyMsg} {
			_, _, err := c.Message(prev, []byte(m), &a)
			require.NoError(t, err)
			_, b = step(t, prev, b, m)
			assert.Equal(t, b, a, "%s", m)
			// A message hashed without an anchor in between changes none.
			_, _, err = c.Message(prev, []byte(replyMsg), nil)
			require.NoError(t, err)
		}
	})
	t.Run("an error leaves it", func(t *testing.T) {
		a := prev
		_, _, err := convkey.NewChainer().Message(zero, []byte(`{"role":`), &a)
		require.Error(t, err)
		assert.Equal(t, prev, a)
	})
}

// A Scratch hands out digest state to reuse: what it gives hashes as new
// state does.
func TestScratch(t *testing.T) {
	var s convkey.Scratch
	want := func(write func(h *convkey.Hasher)) [32]byte {
		h := convkey.New()
		write(h)
		return h.Sum()
	}
	writeA := func(h *convkey.Hasher) { h.FieldString("v1", "chat"); h.Field("model", []byte(`"m"`)) }
	writeB := func(h *convkey.Hasher) { h.FieldString("tenant", "t") }
	for range 5 { // more rounds than the Scratch keeps hashers
		h1, h2 := s.Hasher(), s.Hasher()
		writeA(h1)
		writeB(h2)
		assert.Equal(t, want(writeA), s.SumPut(h1))
		assert.Equal(t, want(writeB), s.SumPut(h2))
	}
	c := s.Chainer()
	got := chain(t, c, [32]byte{}, sysMsg, userMsg)
	s.PutChainer(c)
	c2 := s.Chainer()
	assert.Same(t, c, c2, "the Chainer given back is reused")
	assert.Equal(t, got, chain(t, c2, [32]byte{}, sysMsg, userMsg))
	assert.NotSame(t, c2, s.Chainer(), "none given back: a new one")
}
