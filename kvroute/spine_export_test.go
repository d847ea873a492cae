package kvroute

// TurnCalls returns how many times the turn whose record is rec ran the
// retain phase (its retainer's kept) and end: once each a turn
// (spine_test.go).
func TurnCalls(rec *TurnRecord) (retain, end int) { return rec.calls.retain, rec.calls.end }
