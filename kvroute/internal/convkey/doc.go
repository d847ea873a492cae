// Package convkey hashes conversations in canonical form for
// ContinuationKeys: messages whose meaning is equal hash equal (content as a
// string or a single text part, tool calls whose members come in another
// order, ...), and anything that renders differently hashes differently.
// Fields are length-prefixed, so no two sequences of fields hash alike.
package convkey
