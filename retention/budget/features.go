package budget

// Features are what the router knows, when a turn ends, that predicts
// whether and when its conversation comes back.
type Features struct {
	// Class groups conversations that pause alike: the tenant and the
	// model, as an opaque string the caller builds. Gaps are learned per
	// class and overall; a class with few observations leans on the
	// overall figures. Empty: the overall figures only.
	Class string
	// Turn is the conversation's turn number: 1 for a first request, 2
	// for the turn after it, and so on. In the Mooncake trace a request
	// that itself continues a conversation is continued within 480 s
	// with probability 0.45, a first request with 0.22. Zero or negative
	// counts as 1.
	Turn int
	// ToolCalls is true when the reply ended in tool calls: the client's
	// next request (the tool results) usually follows within seconds.
	ToolCalls bool
}

// Turn numbers are learned in five groups: 1, 2, 3-4, 5-8, 9 and more
// (turnGroup); firstTurn[g] is group g's first turn number.
const nTurnGroups = 5

var firstTurn = [nTurnGroups + 1]int{1, 2, 3, 5, 9, 0}

// turnGroup is the group of turn t.
func turnGroup(t int) int {
	switch {
	case t <= 1:
		return 0
	case t == 2:
		return 1
	case t <= 4:
		return 2
	case t <= 8:
		return 3
	}
	return 4
}
